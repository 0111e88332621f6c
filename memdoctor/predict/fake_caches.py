"""Function caches the user's code fills while the estimate runs it on fake tensors.

Models memoise tensors with functools.lru_cache: transformers' BEiT its relative position
index (`generate_relative_position_index`), and nearly thirty more of its model files some
table or mask. Filled while the estimate builds and steps the model, such a cache holds a
FakeTensor, and the user's real training later in the same process computes with it: the
op on it runs under the fake tensor's mode, its output and everything after it are fake,
the step allocates no memory for them and its loss has no value. So every lru_cache whose
function computed anything while the estimate ran (its misses rose, or it was made then)
is cleared when the estimate ends, whether it succeeded or not. A cleared entry is computed
again on its next call, as on a first call.
"""
from __future__ import annotations

import contextlib
import functools
import gc
from typing import Iterator

__all__ = ["clear_caches_filled", "lru_caches"]

_LRU_WRAPPER = type(functools.lru_cache(maxsize=1)(lambda: None))


def lru_caches() -> list:
    """Every functools.lru_cache / functools.cache wrapper alive in this process."""
    return [o for o in gc.get_objects() if type(o) is _LRU_WRAPPER]


@contextlib.contextmanager
def clear_caches_filled() -> Iterator[None]:
    """Clear, on exit, the lru caches whose functions were called to compute something in
    the block (the fake step's values would stay in them)."""
    misses = {cache: cache.cache_info().misses for cache in lru_caches()}     # keyed by identity
    try:
        yield
    finally:
        for cache in lru_caches():
            if cache.cache_info().misses > misses.get(cache, -1):
                cache.cache_clear()
