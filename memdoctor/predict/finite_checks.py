"""Checks for NaN and inf on values the estimate does not have, answered as an ordinary
step's: every value finite.

A training step reads them to decide what runs: I-BERT asserts
`x_max.isnan().sum() == 0`, a loop skips a batch on `not torch.isfinite(loss)`, a loss scaler
looks for inf in the gradients. Taken as 0 / False like other unknown reads (memdoctor.predict.
data_dependent), `isfinite` would say "not finite" and the estimate would run the branch a real
step never takes. `torch.isfinite` reaches the dispatcher as its parts, `x == x` and
`x.abs() != inf`, so those comparisons are answered too.
"""
from __future__ import annotations

import torch

__all__ = ["FINITE_CHECKS", "finite_answer"]

# the ops, and their answer on finite values
FINITE_CHECKS = {"isnan": False, "isinf": False, "isposinf": False, "isneginf": False, "isfinite": True}
_INFINITIES = (float("inf"), float("-inf"))


def finite_answer(name: str, args) -> bool | None:
    """Every element's answer of op `name` on `args` where the values are finite, or None
    when the op is no such check."""
    if name in FINITE_CHECKS:
        return FINITE_CHECKS[name]
    if name not in ("eq", "ne"):
        return None
    a, b = (list(args) + [None, None])[:2]
    if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
        return None
    if b is a:                                          # x == x: false only for NaN
        equal = True
    elif isinstance(b, float) and b in _INFINITIES:     # x == inf
        equal = False
    else:
        return None
    return equal if name == "eq" else not equal
