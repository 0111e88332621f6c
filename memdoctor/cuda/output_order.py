"""The order a CUDA kernel allocates its outputs in, where it is not the order the op returns
them.

A fake kernel makes its outputs in the order of the op's schema, and that is the order the
estimate's Run records them in. Some CUDA kernels allocate them in another order; the
allocator then places them differently, and a hole left by one freed at once (dropout's
mask in a forward without grad, checkpointing's first pass) lands elsewhere.
`cuda_output_order(func, args, kwargs)` gives, for such an op, the indices of its outputs
in the order the kernel allocates them (None where the schema's order is the kernel's).
Read from the kernels' launch code (PyTorch 2.11) and seen in the H200's allocator traces:

- dropout (`native_dropout` training with 0 < p < 1, `_fused_dropout`): Dropout.cu's
  dropout_cuda allocates the mask, then the output (T5 fp32 batch 16 on the H200: a 4 MiB
  bool mask, then the 16 MiB output, at each of its dropouts). With train=False it clones the
  input, then makes the mask; with p == 1 it makes zeros for the output, then the mask: the
  schema's order.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

__all__ = ["cuda_output_order"]

_MASK_FIRST = (1, 0)


def _native_dropout(args, kwargs):
    """native_dropout(input, p, train): dropout_cuda unless train is False or p == 1."""
    p = args[1] if len(args) > 1 else kwargs.get("p")
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if train is False or p is None or float(p) == 1.0:
        return None
    return _MASK_FIRST


def _fused_dropout(args, kwargs):
    """_fused_dropout(input, p, generator): always dropout_cuda."""
    return _MASK_FIRST


def _rules() -> dict:
    rules = {}
    for name, rule in (("native_dropout", _native_dropout), ("_fused_dropout", _fused_dropout)):
        packet = getattr(aten, name, None)
        if packet is not None:
            rules[packet.default] = rule
    return rules


_RULES = _rules()


def cuda_output_order(func, args, kwargs) -> tuple[int, ...] | None:
    """The indices of `func`'s outputs in the order its CUDA kernel allocates them, or None
    where that is the order the op returns them in."""
    rule = _RULES.get(func)
    if rule is None:
        return None
    try:
        return rule(args, kwargs or {})
    except Exception:
        return None
