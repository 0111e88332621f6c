"""Random draws on fake tensors: the ops that draw, which comparisons of a draw are decided
by its range, and the steps an estimate runs to vary the branches draws decide.

A LayerDrop reads `torch.rand([]) < p` to skip a layer: on a GPU each step draws anew, so
one step runs a layer its neighbours skip (memdoctor.predict.data_dependent answers such a
branch 0 / False and memdoctor.predict.estimate runs extra steps taking it otherwise). A
comparison that the draw's range decides (`rand < 0.0`, Whisper's draw with a layerdrop of
0.0) is no such branch.
"""
from __future__ import annotations

__all__ = ["COMPARISONS", "MAX_DRAW_VARIANTS", "RANDOM_DRAWS", "UNIFORM_DRAWS", "compare_range", "draw_variants",
           "span"]

# random draws of floating values: unknown during the step, so that a branch on one (LayerDrop's
# `torch.rand([]) < layerdrop`, stochastic depth) takes the path that runs the layer, not the
# luck of this process's CPU generator
RANDOM_DRAWS = {"rand", "randn", "rand_like", "randn_like", "normal", "uniform", "bernoulli", "exponential",
                "cauchy", "log_normal", "geometric"}

# draws of known range [low, high) (rand: [0, 1); uniform(from, to)): a comparison of one
# with a constant outside that range is decided, no branch (Whisper draws LayerDrop's number
# with a layerdrop of 0.0: `torch.rand([]) < 0.0` never skips a layer)
UNIFORM_DRAWS = {"rand", "rand_like", "uniform"}
COMPARISONS = {"lt", "le", "gt", "ge"}
# steps run with branches decided by random draws varied, at most (each flips one branch, or
# every MAX_DRAW_VARIANTS-th one when there are more)
MAX_DRAW_VARIANTS = 8


def draw_variants(branches: int) -> list[frozenset[int]]:
    """The steps to run after the plain ones when `branches` branches of a step are decided
    by random draws: each flips one of them (a layer LayerDrop skips), or past
    MAX_DRAW_VARIANTS, every MAX_DRAW_VARIANTS-th one."""
    n = min(branches, MAX_DRAW_VARIANTS)
    return [frozenset(range(v, branches, n)) for v in range(n)]


def span(name: str, args) -> tuple[float, float]:
    """The range [low, high) of a uniform draw's values."""
    if name == "uniform":
        low = args[1] if len(args) > 1 else 0.0
        high = args[2] if len(args) > 2 else 1.0
        return float(low), float(high)
    return 0.0, 1.0


def compare_range(name: str, low: float, high: float, c: float) -> bool | None:
    """`x <name> c` for every x in [low, high), or None where it depends on x."""
    if high <= c:                           # every x is below c
        return name in ("lt", "le")
    if (name in ("gt", "le") and low > c) or (name in ("ge", "lt") and low >= c):
        return name in ("gt", "ge")         # every x is above c (or at it, for >= and <)
    return None
