"""What a rule returns: a Finding with its evidence in numbers and the remedies for it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Tiers, first fixed first: a specific cause with a free fix that alone makes the run fit;
# a specific part of a structural cause; the structural causes; specific causes whose fix
# alone would not make the run fit.
FREE_FIX, SPECIFIC_PART, STRUCTURAL, PARTIAL = 0, 1, 2, 3


@dataclass
class Remedy:
    """One way out. `plan` is a memdoctor.remedies Plan string where memdoctor can apply
    it (`bf16,ckpt=full`), None for a change the user makes in their own code."""
    title: str
    how: str
    predicted_peak_bytes: int | None = None
    plan: str | None = None
    in_framework: str | None = None     # the plan in the settings of the framework driving the run

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Finding:
    rule: str
    title: str
    accounts_for_bytes: int
    evidence: list[str] = field(default_factory=list)
    remedies: list[Remedy] = field(default_factory=list)
    tier: int = STRUCTURAL
    fits_after_fix: bool | None = None
    details: dict = field(default_factory=dict)
    # the user's line: file, line, function, label ("train.py:25"), text, role; set by
    # diagnosis.sources from `blocks` (the blocks the finding accounts for, if the rule names them)
    source: dict | None = None
    blocks: list = field(default_factory=list, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {"rule": self.rule, "title": self.title, "accounts_for_bytes": int(self.accounts_for_bytes),
                "evidence": self.evidence, "remedies": [r.to_dict() for r in self.remedies],
                "fits_after_fix": self.fits_after_fix, "details": self.details, "source": self.source}


def plural(n: int, word: str, many: str | None = None) -> str:
    """"1 tensor", "3 tensors", "1 such pass", "2 such passes"."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def fits(facts, predicted_peak: int | None) -> bool | None:
    if predicted_peak is None or not facts.limit_bytes:
        return None
    return predicted_peak <= facts.limit_bytes


def free_fix_tier(facts, predicted_peak: int | None) -> int:
    """FREE_FIX when removing the cause alone makes the run fit (or nothing says otherwise)."""
    ok = fits(facts, predicted_peak)
    return FREE_FIX if ok in (True, None) else PARTIAL


def tipped(facts, cause_bytes: int) -> bool:
    """Without `cause_bytes` the request that failed would have fitted: a cause that is a
    small share of live memory (a leak one step old, a model's gradients, beside a large
    model) can still be what ran out."""
    over = facts.focus_bytes - (facts.limit_bytes or 0)       # the live bytes hold the request
    return bool(facts.limit_bytes and facts.requested_bytes) and 0 < over <= cause_bytes
