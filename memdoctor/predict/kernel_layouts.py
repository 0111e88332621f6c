"""Output layouts the real kernels give where the fake (meta) kernels give others.

A fake kernel's output strides decide whether later ops copy: a reshape of a
non-contiguous tensor clones it, a matmul folds it with a copy. Where the meta kernel
lays an output out unlike the device kernel, the fake step makes copies the GPU never
makes (or misses ones it does). Layer norm: the CUDA and CPU kernels make Y and dX with
`at::native::empty_like(*X, ..., LEGACY_CONTIGUOUS_MEMORY_FORMAT)` (layer_norm_kernel.cu's
layer_norm_cuda / layer_norm_backward_cuda, layer_norm.cpp), contiguous whatever the input's
layout, where the meta kernel gives dX the strides of the output gradient and Y those of
the input. Swin's pooler transposes the final layer norm's output, so the fake dX came out
transposed and the view before it in backward cloned it: 9 MiB blocks the H200's trace
does not have, that left holes its segments never get.

KernelLayouts is a dispatch mode entered just above FakeTensorMode, under the tracer
(which sees only what it returns): it swaps such an output for a contiguous one of the
same shape and dtype before anything records it.
"""
from __future__ import annotations

import torch

from memdoctor.capture.lean_mode import DEVICE_QUERY, LeanDispatchMode, device_query

__all__ = ["KernelLayouts"]

aten = torch.ops.aten


def _contiguous(t):
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _first_contiguous(out):
    if not isinstance(out, tuple) or not out:
        return out
    return (_contiguous(out[0]),) + out[1:]


_RULES = {aten.native_layer_norm.default: _first_contiguous,
          aten.native_layer_norm_backward.default: _first_contiguous}


class KernelLayouts(LeanDispatchMode):
    """Give the outputs of the ops in _RULES the layout their device kernels give them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:
            return device_query(args)
        out = func(*args, **(kwargs or {}))
        rule = _RULES.get(func)
        return out if rule is None else rule(out)
