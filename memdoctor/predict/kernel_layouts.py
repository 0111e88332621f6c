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

Pointwise ops on tensors whose layout is ambiguous (an N x C x 1 x 1 tensor with
channels-last strides is contiguous as well): TensorIterator's fast setup
(TensorIterator.cpp compute_fast_setup_type) gives the output plain contiguous strides when
every operand has the output's shape and is contiguous, checked before channels-last; the
meta kernels (torch._prims_common's elementwise strides) keep the input's channels-last
strides. Without this rule UperNet's pooling branch at scale 1 stays channels-last through
its ReLU, its upsampling and the concatenation after it on fake tensors, where the GPU's are
contiguous, and the estimate measures cuDNN's workspaces for the decode head's convolutions
in a layout the GPU never uses.

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


def _plain_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _pointwise_layout(func, args, kwargs, out):
    """A functional pointwise op's output as TensorIterator's fast setup lays it out: plain
    contiguous strides when every tensor operand has its shape and is contiguous."""
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or tuple(out.stride()) == _plain_strides(out.shape) \
            or func._schema.is_mutable:
        return out
    tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    if not tensors or any(t.shape != out.shape or not t.is_contiguous() for t in tensors):
        return out
    for arg, value in zip(func._schema.arguments, args):
        if str(arg.type) == "Tensor" and not isinstance(value, torch.Tensor):
            return out          # a number in a tensor's place is a 0-d operand: no fast setup
    return torch.empty(out.shape, dtype=out.dtype, device=out.device)


class KernelLayouts(LeanDispatchMode):
    """Give the outputs of the ops in _RULES, and pointwise ops', the layout their device
    kernels give them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:
            return device_query(args)
        out = func(*args, **(kwargs or {}))
        rule = _RULES.get(func)
        if rule is not None:
            return rule(out)
        if torch.Tag.pointwise in func.tags:
            return _pointwise_layout(func, args, kwargs, out)
        return out
