"""Where F.linear adds its bias in place on real tensors and out of place on fake ones.

ATen's `linear` (aten/src/ATen/native/Linear.cpp) runs a fused addmm for a 2-D input and
for a contiguous one (flattened to 2-D); any other input with a bias (a transposed or
permuted activation: SegFormer's decode head projects `hidden.flatten(2).transpose(1, 2)`)
takes `output = at::matmul(input, weight.t())` and then `output.add_(bias)`, in place,
unless the bias is subclass-like (`isTensorSubclassLike`, for composite compliance), when
it calls `at::add(output, bias)`. A FakeTensor is subclass-like, so the fake run allocates
a second output-sized block and frees the matmul's, where the GPU has one block (the H200's
trace of SegFormer in bf16: one 64 MiB block per projection where the fake run has two,
which moves a 64 MiB block into a 1.2 GiB segment the loss then cannot use).

`linear_calls()` counts the F.linear calls in progress while the fake step runs (a patched
function, so that checkpoint's recompute sees it too); KernelWatch notes each such add
inside one (memdoctor.predict.kernel_watch), and memdoctor.predict.grad_sums merges the two
blocks into one, as the in-place add has it.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["linear_calls", "in_linear", "adds_bias_apart"]

_DEPTH = [0]        # F.linear calls in progress (nested: a linear inside a linear's hooks)


def in_linear() -> bool:
    """Whether an op runs inside F.linear (within linear_calls())."""
    return _DEPTH[0] > 0


def adds_bias_apart(input: torch.Tensor, bias) -> bool:
    """Whether ATen's linear takes its matmul path (the bias added after the product) for
    this input: a bias, and an input neither 2-D nor contiguous in 3-D (or with a 1-D bias)."""
    if bias is None or not isinstance(input, torch.Tensor) or input.dim() in (0, 2):
        return False
    try:
        contiguous = input.is_contiguous()
    except Exception:
        return False
    return not (contiguous and (input.dim() == 3 or getattr(bias, "dim", lambda: 0)() == 1))


@contextlib.contextmanager
def linear_calls():
    """Count F.linear's calls in progress until the block ends (entered again inside, it
    changes nothing)."""
    original = F.linear
    if getattr(original, "counted", False):
        yield
        return

    def linear(input, weight, bias=None):
        if not adds_bias_apart(input, bias):
            return original(input, weight, bias)
        _DEPTH[0] += 1
        try:
            return original(input, weight, bias)
        finally:
            _DEPTH[0] -= 1

    linear.counted = True
    F.linear = linear
    try:
        yield
    finally:
        F.linear = original
