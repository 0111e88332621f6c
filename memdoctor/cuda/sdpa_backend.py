"""Which kernel torch.nn.functional.scaled_dot_product_attention runs on a CUDA GPU, by
PyTorch's own rules (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, sdp_utils_cpp.h),
for a machine that has no GPU to ask.

The kernels differ in what they keep for the backward: cuDNN, flash and memory-efficient
attention keep the output and one value per query (logsumexp); the math fallback keeps the
softmax, batch x heads x queries x keys values, which for fp32 models with long sequences
can be most of the activation memory. The dispatcher tries the backends in priority order
(cuDNN first on Hopper with a recent cuDNN; flash, memory-efficient, math otherwise) and
takes the first whose every constraint holds:

- cuDNN: fp16/bf16; a mask of 2 or 4 dimensions broadcastable to (batch, heads, queries,
  keys), not requiring grad; head dims multiples of 8 up to 256 (cuDNN 9.19, measured on
  an H200); any dropout; key/value heads that divide the query heads only with
  enable_gqa (without it the dispatcher falls back to math, measured on the H200); keys
  longer than one;
- flash: fp16/bf16; no mask; equal head dims up to 256; causal only with as many queries as
  keys; key/value heads different from the query heads only with enable_gqa and dividing them;
- memory-efficient: fp16, bf16 or fp32; any mask (its last dim contiguous); query and key
  head dims equal, head dims multiples of 4 (fp32) or 8 (fp16/bf16), storage offsets
  aligned alike; the same number of heads for query, key and value (no grouped-query
  attention up to PyTorch 2.12; `efficient_gqa` for a release that has it);
- math otherwise: the softmax materialised.

All of them need 4-dimensional query, key and value with the same batch, non-empty
sequences and a contiguous last dimension, and the backends the user left enabled
(torch.backends.cuda.*_sdp_enabled, torch.nn.attention.sdpa_kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SdpaRules", "choose", "BACKENDS"]

BACKENDS = ("cudnn", "flash", "efficient", "math")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaRules:
    """The GPU and the PyTorch/cuDNN release the rules speak for (default: an H100/H200 with
    PyTorch 2.11 and the cuDNN it ships, which prefers cuDNN attention)."""
    sm: tuple[int, int] = (9, 0)
    prefer_cudnn: bool = True
    cudnn_max_head_dim: int = 256
    efficient_gqa: bool = False
    deterministic: bool | None = None    # None: torch.are_deterministic_algorithms_enabled()


def _enabled() -> dict[str, bool]:
    """The backends the user left on (all of them where this torch cannot say)."""
    b = torch.backends.cuda
    out = {}
    for name, getter in (("cudnn", "cudnn_sdp_enabled"), ("flash", "flash_sdp_enabled"),
                         ("efficient", "mem_efficient_sdp_enabled"), ("math", "math_sdp_enabled")):
        try:
            out[name] = bool(getattr(b, getter)())
        except Exception:
            out[name] = True
    return out


def choose(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
           enable_gqa: bool = False, rules: SdpaRules = SdpaRules(), requires_grad: bool | None = None) -> str:
    """The backend ("cudnn", "flash", "efficient" or "math") the dispatcher picks for these
    arguments (tensors, fake tensors or anything with shape, dtype, stride(), storage_offset()
    and requires_grad); `requires_grad`: whether a backward will run (default: whether
    grad mode is on and an input requires grad)."""
    enabled = _enabled()
    order = ("cudnn", "flash", "efficient", "math") if rules.prefer_cudnn else ("flash", "efficient", "math", "cudnn")
    if requires_grad is None:
        requires_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (query, key, value))
    for backend in order:
        if not enabled[backend]:
            continue
        if backend == "math":
            return "math"
        check = {"cudnn": _cudnn_ok, "flash": _flash_ok, "efficient": _efficient_ok}[backend]
        if check(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, rules, requires_grad):
            return backend
    return "math"


# ----------------------------------------------------------------------- shared constraints
def _dense_ok(q, k, v, mask, ignore_singleton: bool) -> bool:
    """4-d, same batch, non-empty sequences, contiguous last dims (the mask's too)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return False
    strides_ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if ignore_singleton:
        strides_ok = strides_ok or q.shape[-1] == 1
    if mask is not None and mask.dim() and mask.stride(-1) != 1:
        return False
    return strides_ok


def _heads_ok(q, k, v, enable_gqa: bool, gqa: bool) -> bool:
    """Same heads everywhere, or (where the backend supports it) key/value heads that divide
    the query heads, with enable_gqa."""
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hq == hk == hv:
        return True
    if gqa and enable_gqa:
        return hk == hv and hk > 0 and hq % hk == 0
    return False


def _mask_shape_ok(q, k, mask) -> bool:
    """cuDNN's masks: (queries or 1, keys or 1), optionally with (batch or 1, heads or 1) in front."""
    if mask is None:
        return True
    if getattr(mask, "requires_grad", False):
        return False
    if mask.shape[-2] not in (q.shape[2], 1) or mask.shape[-1] not in (k.shape[2], 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.shape[0] in (1, q.shape[0]) and mask.shape[1] in (1, q.shape[1])


def _sm_between(sm: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= sm <= high


# ----------------------------------------------------------------------- backends
def _cudnn_ok(q, k, v, mask, dropout, causal, gqa, rules: SdpaRules, grad: bool) -> bool:
    deterministic = torch.are_deterministic_algorithms_enabled() if rules.deterministic is None \
        else rules.deterministic
    if deterministic and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _HALF):
        return False
    if not _sm_between(rules.sm, (8, 0), (12, 1)):
        return False
    if not (_dense_ok(q, k, v, mask, ignore_singleton=True) and _mask_shape_ok(q, k, mask)):
        return False
    if not _heads_ok(q, k, v, gqa, gqa=True):
        return False
    b, h, s_q, d_qk = q.shape
    s_k, d_v = k.shape[2], v.shape[-1]
    if b > 65535 or h > 65535:
        return False
    if d_qk > rules.cudnn_max_head_dim or d_v > rules.cudnn_max_head_dim or d_qk % 8 or d_v % 8:
        return False
    if s_k == 1 or (dropout != 0.0 and s_q == 1):
        return False
    return True


def _flash_ok(q, k, v, mask, dropout, causal, gqa, rules: SdpaRules, grad: bool) -> bool:
    if mask is not None:
        return False
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] <= 256):
        return False
    if not _sm_between(rules.sm, (8, 0), (12, 1)):
        return False
    if causal and q.dim() == 4 and k.dim() == 4 and q.shape[-2] != k.shape[-2]:
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _HALF):
        return False
    return _dense_ok(q, k, v, mask, ignore_singleton=True) and _heads_ok(q, k, v, gqa, gqa=True)


def _efficient_ok(q, k, v, mask, dropout, causal, gqa, rules: SdpaRules, grad: bool) -> bool:
    if not _sm_between(rules.sm, (5, 0), (12, 1)):
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    half = q.dtype in _HALF
    align = 8 if half else 4        # minimum_gemm_alignment on sm80+: 128 bits over the element width, at least 4
    d_q, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    if not (d_q == d_k and d_q % align == 0 and d_q > 0 and d_v % align == 0 and d_v > 0):
        return False
    if rules.sm >= (8, 0) and any(t.storage_offset() % align for t in (q, k, v)):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.float32, torch.bfloat16)):
        return False
    return _dense_ok(q, k, v, mask, ignore_singleton=False) and _heads_ok(q, k, v, gqa, gqa=rules.efficient_gqa)
