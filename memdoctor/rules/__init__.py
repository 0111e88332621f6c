"""Rules: facts derived once, one file per cause, an explicit registry, a ranking engine."""
from .base import Finding, Remedy
from .engine import diagnose, rank
from .facts import Facts, facts_from_oom, facts_from_run
from .registry import RULES, all_ids, explain

__all__ = ["Finding", "Remedy", "Facts", "diagnose", "rank", "facts_from_run", "facts_from_oom",
           "RULES", "all_ids", "explain"]
