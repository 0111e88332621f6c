"""CUDA's math attention, the dispatcher's fallback (fp32 grouped-query heads without
`enable_gqa`, for instance), as the ops a GPU runs, for fake tensors.

`aten._scaled_dot_product_attention_math` adds the mask to the scores in place on plain
tensors and out of place on tensor subclasses (attention.cpp asks
`at::areAnyTensorSubclassLike`). Fake tensors are subclasses: on them it makes one more
batch x heads x queries x keys tensor and frees the scores before the softmax, where a GPU
keeps them through it. The same ops written here with the in-place add make the GPU's
allocations in the GPU's order (the H200's trace of a Llama in fp32 with checkpointing,
tests/fixtures/zoo_traces/llama_ckpt_b4.json.gz); `_safe_softmax`'s own temporaries come
from memdoctor.cuda.kernel_scratch.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from memdoctor.predict.cuda_dropout import cuda_dropout

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def math_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False):
    """attention.cpp's `_scaled_dot_product_attention_math` (torch 2.11), first output, with
    the dispatcher's conversion of a boolean mask (in the inputs' dtype) before it. Unless
    `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`, fp16/bf16 inputs are
    computed in fp32: the scores and their softmax take twice the bytes, and the kernel also
    returns the softmax cast back (made and freed at once).

    The kernel's locals live until it returns (the scaled query through both matmuls, as the
    H200's traces of T5 and Llama show) and are destroyed in the reverse order of their
    making; then the dispatcher drops the second output and its converted mask."""
    origin = query.dtype
    converted = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = converted = _additive(attn_mask, origin)
    query_acc, key_acc, value_acc = query, key, value
    if origin in _HALF and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        query_acc, key_acc, value_acc = (t.float() if t.dtype in _HALF else t for t in (query, key, value))
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(query_acc.size(-1)))
    q = query_acc * (-factor if negative else factor)
    if is_causal:
        causal = torch.ones(query_acc.size(-2), key_acc.size(-2), dtype=torch.bool, device=query.device).tril()
        attn_mask = _additive(causal, q.dtype)
        del causal
    key_expanded, value_expanded = key_acc, value_acc
    if enable_gqa and query_acc.dim() >= 3 and key_acc.size(-3) != query_acc.size(-3):
        repeat = query_acc.size(-3) // key_acc.size(-3)
        key_expanded, value_expanded = key_acc.repeat_interleave(repeat, -3), value_acc.repeat_interleave(repeat, -3)
    attn = torch.matmul(q, key_expanded.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = cuda_dropout(attn, dropout_p, True)      # at::dropout on a CUDA tensor: native_dropout
    second = attn.to(origin)            # the kernel's second output; C++ makes it first
    out = torch.matmul(attn, value_expanded).to(origin)
    del attn                            # the kernel's locals, last made first
    del key_expanded, value_expanded
    del q
    del attn_mask
    del value_acc, key_acc, query_acc
    del second                          # the dispatcher drops the second output,
    del converted                       # then its converted mask
    return out


def _additive(mask, dtype):
    """A boolean mask as attention.cpp's convert_boolean_attn_mask makes it: 0 where True,
    -inf where False."""
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    minus_inf = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, minus_inf)


def attention_on_cuda(original, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    """On a torch with CUDA: F.scaled_dot_product_attention (`original`) on fake CUDA tensors,
    run as above where the dispatcher picks the math fallback (memdoctor.cuda.sdpa_backend,
    after autocast's cast, made once as a GPU makes it), else by `original`."""
    from memdoctor.cuda.sdpa_backend import choose
    tensors = (query, key, value)
    plain = all(isinstance(t, torch.Tensor) and not t.is_nested and t.dim() == 4 and t.device.type == "cuda"
                for t in tensors) and (attn_mask is None or isinstance(attn_mask, torch.Tensor))
    if not plain:
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value, attn_mask = (t.to(dtype) if t is not None and t.is_floating_point() else t
                                        for t in (query, key, value, attn_mask))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if choose(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, requires_grad=grad) != "math":
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
    with torch.autocast("cuda", enabled=False):
        return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@contextlib.contextmanager
def cuda_math_attention():
    """F.scaled_dot_product_attention's math fallback as a GPU runs it, until the block ends
    (a patched function, not a function mode, so that checkpoint's recompute sees it too)."""
    original = F.scaled_dot_product_attention
    if getattr(original, "math_way", False) or getattr(original, "cuda_way", False):
        yield
        return

    def attention(*args, **kwargs):
        return attention_on_cuda(original, *args, **kwargs)

    attention.math_way = True
    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
