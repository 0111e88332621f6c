"""What an op that ran out of memory on the GPU was asking for in all: the bytes of every
output it makes, from the op run again on meta tensors of the same shapes.

The GPU's message names one request, the output the allocator refused, and the outputs the
op had already made are freed as the error unwinds, unseen by the dispatch source (which
sees an op's outputs only when it returns). A multi-tensor op (`_foreach_sqrt` over a
model's parameters in an optimizer step) asks for a whole model's worth of tensors one by
one; its refusal of the seventh says little. Under the dispatch source's simulated budget
on the CPU, the outputs made before the refused one are live and counted; this puts the
GPU's run on the same footing.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map


def _on_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def output_bytes(func, args: tuple, kwargs: dict | None) -> int | None:
    """Bytes of the new tensors `func(*args, **kwargs)` returns, or None where the op has no
    meta kernel or returns no tensor. In-place ops (their outputs are their inputs) give 0."""
    try:
        meta_args, meta_kwargs = tree_map(_on_meta, (tuple(args), dict(kwargs or {})))
        inputs = {id(t) for t in tree_leaves((meta_args, meta_kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*meta_args, **meta_kwargs)
    except Exception:       # no meta kernel, or data-dependent output: the message's request stands
        return None
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not tensors:
        return None
    return sum(t.untyped_storage().nbytes() for t in tensors if id(t) not in inputs)
