"""Rules: facts derived once, one file per cause, an explicit registry, a ranking engine."""
from memdoctor.diagnosis.base import Finding, Remedy
from memdoctor.diagnosis.engine import diagnose, rank
from memdoctor.diagnosis.facts import Facts, facts_from_oom, facts_from_run
from memdoctor.diagnosis.registry import RULES, all_ids, explain

__all__ = ["Finding", "Remedy", "Facts", "diagnose", "rank", "facts_from_run", "facts_from_oom",
           "RULES", "all_ids", "explain"]
