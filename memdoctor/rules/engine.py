"""Run every rule on the facts, rank the findings: what to fix first comes first."""
from __future__ import annotations

import logging

from .base import Finding
from .facts import Facts
from .registry import FALLBACK, RULES, load

log = logging.getLogger("memdoctor")


def diagnose(facts: Facts, select: list[str] | None = None) -> list[Finding]:
    findings: list[Finding] = []
    for rule_id in select or RULES:
        try:
            found = load(rule_id).check(facts)
        except Exception as exc:        # one broken rule must not hide the others
            log.warning("memdoctor: rule %s failed: %r", rule_id, exc)
            continue
        if found is not None:
            findings.append(found)
    if not findings and select is None:
        for rule_id in FALLBACK:
            found = load(rule_id).check(facts)
            if found is not None:
                findings.append(found)
    return rank(findings)


def rank(findings: list[Finding]) -> list[Finding]:
    """By tier (free fixes that alone make it fit, then specific parts, then structural
    causes, then partial fixes), then by the memory each accounts for."""
    return sorted(findings, key=lambda f: (f.tier, -f.accounts_for_bytes))
