"""A CPU-only torch standing in for CUDA in the estimate: explicit CUDA devices sent to the CPU
(CpuForCuda), and, where the CPU would run other kernels than a GPU, CUDA's run instead, on
fake tensors.

- scaled_dot_product_attention: the CPU picks its flash kernel; a GPU picks by dtype, mask,
  head layout, grouped-query heads and sequence lengths (memdoctor.cuda.sdpa_backend: on an
  H100/H200 with torch 2.11, cuDNN attention for fp16/bf16, memory-efficient for fp32, the
  math fallback that keeps the softmax for fp32 grouped-query attention). The fake run calls
  the chosen kernel's own op (the math fallback's ops: memdoctor.predict.math_attention),
  whose outputs, saved tensors and scratch
  (memdoctor.cuda.kernel_scratch) are CUDA's, with a boolean mask made additive as the
  dispatcher makes it.
- dropout: the fused `native_dropout` CUDA runs (a boolean mask saved), where the CPU
  saves a noise tensor of the input's dtype (memdoctor.predict.cuda_dropout).
- autocast: CUDA autocast's casting rules instead of the CPU's (memdoctor.predict.
  cuda_autocast: softmax, layer norm, pow, the losses in fp32; cross_entropy's
  log_softmax in the logits' dtype, cast to fp32 for nll_loss; cat without copies).

`cuda_kernels()` swaps attention and dropout into torch.nn.functional while the fake step
runs: a function mode would not see checkpoint's recompute in backward, which would then save
other tensors than the forward did.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from memdoctor.predict.cuda_autocast import cuda_autocast
from memdoctor.predict.cuda_dropout import fused
from memdoctor.predict.math_attention import math_attention

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)

NOTE = (
    "this torch has no CUDA, so the step ran on fake CPU tensors standing in for CUDA ones; attention runs "
    "the kernel CUDA's dispatcher picks (memdoctor.cuda.sdpa_backend, as on an H100/H200 with torch 2.11), "
    "autocast casts as CUDA autocast does, dropout and nn.LSTM/GRU/RNN run CUDA's fused kernels; what "
    "still differs: batch norm (CUDA uses cuDNN and saves an extra reserve buffer), cuDNN's convolution "
    "and RNN workspaces (measured only on a GPU), "
    "optimizer step counters (on the CPU on a GPU too, left out here), fused optimizer kernels (CPU has "
    "fewer). Against an H200, transformers without attention masks estimate to the MiB here "
    "(benchmarks/results/estimate_accuracy_cpu2_2026-11-30.json)")


def cuda_built() -> bool:
    """Whether this torch has CUDA; without it the CPU stands in for a CUDA estimate."""
    try:
        return torch.backends.cuda.is_built() and torch.version.cuda is not None
    except Exception:
        return False


class CpuForCuda(torch.overrides.TorchFunctionMode):
    """On a torch without CUDA, fake CUDA tensors would abort the process in the first
    kernel; this sends every explicit CUDA device (device=, .to, .cuda) to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda,):
            return args[0].to("cpu") if args and isinstance(args[0], torch.Tensor) else args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return False


def attention_as_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    """F.scaled_dot_product_attention through the kernel CUDA would pick (memdoctor.cuda.
    sdpa_backend: cuDNN, flash, memory-efficient or math), with the mask prepared as CUDA's
    dispatcher prepares it for that kernel; None to keep the CPU's for what is not plain
    tensors of 4 dimensions."""
    from memdoctor.cuda.sdpa_backend import choose
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or any(t.is_nested for t in tensors):
        return None
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        return None
    autocast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if autocast else query.dtype
    if dtype not in (torch.float32, *_HALF, torch.float64):
        return None

    def cast(t):            # CUDA autocast casts attention's floating inputs, a float mask too
        return t.to(dtype) if autocast and t is not None and t.is_floating_point() and t.dtype != dtype else t
    query, key, value, attn_mask = cast(query), cast(key), cast(value), cast(attn_mask)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    backend = choose(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, requires_grad=grad)
    with torch.autocast("cpu", enabled=False):
        if backend == "cudnn":
            mask = _boolean_mask_as_additive(attn_mask, query.dtype, -65504.0)
            return aten._scaled_dot_product_cudnn_attention(query, key, value, mask, grad, dropout_p, is_causal,
                                                            False, scale=scale)[0]
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        mask = _boolean_mask_as_additive(attn_mask, query.dtype, float("-inf"))
        if backend == "efficient":
            if mask is not None:
                mask = _aligned_mask(mask).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return aten._scaled_dot_product_efficient_attention(query, key, value, mask, grad, dropout_p,
                                                                is_causal, scale=scale)[0]
        return math_attention(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)


def _boolean_mask_as_additive(mask, dtype, fill: float):
    """A boolean mask as the additive one the dispatcher makes of it (a new tensor of the
    mask's shape: 0 where attended, `fill` elsewhere); other masks as they are."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), fill, torch.zeros((), dtype=dtype, device=mask.device))


def _aligned_mask(mask, alignment: int = 8):
    """The memory-efficient kernel's bias: strides multiples of 8 elements
    (mem_eff_alignment), else a copy padded by `alignment - last % alignment` columns and
    sliced back to its size (attention.cpp, preprocess_mask and pad_bias). The H200's trace
    of Swin in fp32 has its 49 x 49 window masks padded to 56 columns."""
    if mask.stride()[-1] == 1 and all(st % alignment == 0 for st in mask.stride()[:-1]):
        return mask
    last = mask.shape[-1]
    pad = alignment - last % alignment
    return F.pad(mask, (0, pad))[..., :last]


def dropout_as_on_cuda(input, p=0.5, training=True, inplace=False):
    """F.dropout as CUDA runs it (the fused kernel), or None where CUDA runs what the CPU runs."""
    if inplace or not fused(input, p, training):
        return None
    return aten.native_dropout(input, p, True)[0]


def standing_in_for_cuda() -> bool:
    """Whether a fake step runs here for CUDA (inside cuda_kernels())."""
    return getattr(F.scaled_dot_product_attention, "cuda_way", False)


@contextlib.contextmanager
def cuda_kernels():
    """torch.nn.functional's attention and dropout, and autocast's casts, the CUDA way, until
    the block ends (entered again inside, it changes nothing)."""
    attention0, dropout0 = F.scaled_dot_product_attention, F.dropout
    if getattr(attention0, "cuda_way", False):
        yield
        return

    def attention(*args, **kwargs):
        out = attention_as_on_cuda(*args, **kwargs)
        return attention0(*args, **kwargs) if out is None else out

    def dropout(*args, **kwargs):
        out = dropout_as_on_cuda(*args, **kwargs)
        return dropout0(*args, **kwargs) if out is None else out

    attention.cuda_way = dropout.cuda_way = True
    F.scaled_dot_product_attention, F.dropout = attention, dropout
    try:
        with cuda_autocast():
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout = attention0, dropout0
