"""One diagnosis for several ranks: `memdoctor diagnose --run r0 r1 ...` diagnoses each
rank's Run and merges the findings: one line per cause, with the ranks it was found on,
its evidence from the rank where it weighs most, and which rank ran out of memory first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memdoctor.diagnosis.engine import rank as rank_findings


@dataclass
class RankedFinding:
    """One cause across ranks: the finding from the rank where it accounts for the most."""
    finding: Any
    ranks: list[int]
    worst_rank: int
    bytes_by_rank: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = self.finding.to_dict()
        out.update(ranks=self.ranks, worst_rank=self.worst_rank,
                   accounts_for_bytes_by_rank={str(r): int(b) for r, b in sorted(self.bytes_by_rank.items())})
        return out


def merge_findings(per_rank: list[tuple[int, list]]) -> list[RankedFinding]:
    """Findings of every rank, one per rule, in the engine's order of what to fix first."""
    by_rule: dict[str, RankedFinding] = {}
    for rank, findings in per_rank:
        for f in findings:
            entry = by_rule.get(f.rule)
            if entry is None:
                by_rule[f.rule] = RankedFinding(f, [rank], rank, {rank: f.accounts_for_bytes})
                continue
            entry.ranks.append(rank)
            entry.bytes_by_rank[rank] = f.accounts_for_bytes
            if f.accounts_for_bytes > entry.finding.accounts_for_bytes:
                entry.finding, entry.worst_rank = f, rank
    ordered = rank_findings([e.finding for e in by_rule.values()])
    by_finding = {id(e.finding): e for e in by_rule.values()}
    out = [by_finding[id(f)] for f in ordered]
    for e in out:
        e.ranks.sort()
    return out


def first_oom(runs: list[tuple[int, Any]]) -> tuple[int, Any] | None:
    """(rank, OOM) of the rank that ran out of memory first: the earliest step, then the
    earliest time into its run (torchrun starts the ranks together)."""
    best = None
    for rank, run in runs:
        if not run.ooms:
            continue
        oom = run.ooms[0]
        mark = run.mark_at(oom.seq)
        when = (oom.step, mark.time if mark is not None else float("inf"))
        if best is None or when < best[0]:
            best = (when, rank, oom)
    return None if best is None else (best[1], best[2])
