"""Dropout as CUDA runs it, for fake tensors on another device.

at::dropout (aten/src/ATen/native/Dropout.cpp) takes the fused `native_dropout` kernel for a
CUDA tensor in training with 0 < p < 1: its output and a boolean mask, the mask saved for the
backward. On the CPU it multiplies the input by a noise tensor of the input's dtype, which is
saved instead: four times the mask's bytes in fp32. The in-place form (`dropout_`) and the
feature and alpha dropouts take the noise path on CUDA too.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def fused(input, p: float, train: bool) -> bool:
    """Whether CUDA's at::dropout runs the fused kernel for these arguments."""
    return bool(train) and isinstance(input, torch.Tensor) and not input.is_nested and 0.0 < p < 1.0 \
        and input.numel() > 0


def cuda_dropout(input, p: float, train: bool = True):
    """torch.dropout(input, p, train) as on CUDA."""
    if fused(input, p, train):
        return aten.native_dropout(input, p, True)[0]
    return torch.dropout(input, p, train)
