"""An upper bound on the workspace cuDNN takes for one convolution, for an estimate with no
GPU to measure it on.

cuDNN picks a convolution's algorithm, and with it the workspace, by heuristics per shape,
dtype, GPU and version (memdoctor.predict.op_probe measures it where there is a GPU). Its
workspaces grow with the tensors the algorithm stages: the input and output it unfolds or
converts (bf16 ones in fp32 words), split-K partial sums of the weight gradient, and for
grouped (depthwise) convolutions per-element partials of the weight gradient. The bound has
a term for each, in bytes:

    6 x (input + output elements) + 256 x weight elements + 1 MiB
      + 48 x max(input, output) elements, grouped convolutions only

It is above the workspace of every one of 2,168 distinct convolutions, forward and backward,
of 29 architectures (transformers and torchvision: speech feature encoders, patch
embeddings, ResNets, depthwise ConvNeXt and MobileNet blocks, a UNet's transposed
convolutions, WaveNet's dilated ones) measured on an H200 with torch 2.11 and its cuDNN, at
most 0.82 of the bound (benchmarks/zoo/conv_workspace_sizes.py,
benchmarks/results/conv_workspace_sizes_h200_2026-12-04_c8a17dc.json). Summed over them
it is about 9x (backward) and 14x (forward) the real workspaces, so an estimate that uses
it errs high; another GPU or cuDNN version can choose otherwise.
"""
from __future__ import annotations

import torch

from memdoctor.cuda.kernel_scratch import Scratch

LABEL = "cuDNN convolution workspace (bound)"
MIB = 1 << 20

_aten = torch.ops.aten
FORWARD = getattr(_aten.convolution, "default", None)
BACKWARD = getattr(_aten.convolution_backward, "default", None)


def bound_bytes(input_numel: int, output_numel: int, weight_numel: int, groups: int) -> int:
    """The bound above, for a convolution's tensors' element counts."""
    nbytes = 6 * (input_numel + output_numel) + 256 * weight_numel + MIB
    if groups > 1:
        nbytes += 48 * max(input_numel, output_numel)
    return nbytes


def workspace_bound(func, args, kwargs, out) -> list[Scratch]:
    """The bound as scratch taken after the call's outputs (the later place, which errs high)
    for aten.convolution and aten.convolution_backward; [] for any other op."""
    kwargs = kwargs or {}
    try:
        if func is FORWARD:
            x, w = args[0], args[1]
            groups = args[8] if len(args) > 8 else kwargs.get("groups", 1)
            y = out
        elif func is BACKWARD:
            y, x, w = args[0], args[1], args[2]
            groups = args[9] if len(args) > 9 else kwargs.get("groups", 1)
        else:
            return []
        if not all(isinstance(t, torch.Tensor) for t in (x, w, y)):
            return []
        return [Scratch(bound_bytes(x.numel(), y.numel(), w.numel(), int(groups)), LABEL)]
    except (IndexError, TypeError, ValueError):
        return []
