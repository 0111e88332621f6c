"""Chunked cross-entropy: the output projection and the loss, a chunk of tokens at a time.

`F.cross_entropy(hidden @ weight.T, targets)` holds tokens x vocabulary floats three times
over: the logits, their log-softmax, and in backward their gradient. Here an autograd
Function projects and reduces one chunk of tokens at a time and keeps only its inputs and
each token's log-sum-exp; its backward makes each chunk's logits again and turns them into
that chunk's gradients at once (softmax minus one-hot): full-vocabulary tensors exist for one
chunk only, at the cost of one more projection matmul.

    loss = chunked_cross_entropy(hidden, model.head.weight, targets, chunks=8)

(An autograd Function rather than torch.utils.checkpoint around each chunk: checkpoint's
early stop ends a recompute by raising through the loss's ops, and on CUDA with torch 2.11,
while the allocator history records Python stacks at frees, that exception is lost in
backward as a SystemError. The Function recomputes nothing but the matmul.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast gives a matmul on `t`'s device now (the tensor's own without it)."""
    kind = t.device.type
    try:
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError, AttributeError):
        pass
    return t.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `F.linear(hidden, weight, bias)` over tokens, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index: int, size: int):
        dtype = _compute_dtype(hidden)
        acc = torch.promote_types(dtype, torch.float32)     # the loss: fp32 at least
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], size):
            h, t = hidden[start:start + size].to(dtype), targets[start:start + size]
            logits = F.linear(h, w, b).to(acc)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((chunk_lse - picked) * (t != ignore_index)).sum()
            lse[start:start + size] = chunk_lse
            del logits, picked
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.ignore_index, ctx.size, ctx.dtype, ctx.acc = ignore_index, size, dtype, acc
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype, size, acc = ctx.dtype, ctx.size, ctx.acc
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for start in range(0, hidden.shape[0], size):
            h, t = hidden[start:start + size].to(dtype), targets[start:start + size]
            g = F.linear(h, w, b).to(acc)
            g.sub_(lse[start:start + size].unsqueeze(1)).exp_()          # softmax
            keep = t != ctx.ignore_index
            rows = torch.arange(t.shape[0], device=t.device)
            g[rows, t.clamp(min=0)] -= 1.0
            g.mul_((keep * grad_total).unsqueeze(1))
            gc = g.to(dtype)
            del g
            if need_h:
                grad_h[start:start + size] = gc @ w
            if need_w and dtype == acc:
                grad_w.addmm_(gc.t(), h)
            elif need_w:                        # a 16-bit matmul, summed over chunks in fp32
                grad_w += (gc.t() @ h).to(acc)
            if need_b:
                grad_b += gc.sum(0, dtype=acc)
            del gc
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)



def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunks: int = 8,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias), targets)` over `chunks` chunks of tokens.

    hidden: (..., dim) features before the head; weight: (vocab, dim), the head's weight;
    targets: (...) class indices, `ignore_index` for tokens that do not count. reduction:
    "mean" (over the counted tokens, as F.cross_entropy) or "sum". The projection runs in
    autocast's dtype when autocast is on; the loss and its softmax in fp32. Gradients reach
    hidden, weight and bias through backward (not twice: no double backward).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, not {chunks!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match a head weight {tuple(weight.shape)} "
                         "of shape (vocab, dim)")
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_targets.shape[0] != flat.shape[0]:
        raise ValueError(f"{flat.shape[0]} tokens of hidden but {flat_targets.shape[0]} targets")
    tokens = flat.shape[0]
    if tokens == 0:         # no tokens at all: what F.cross_entropy gives
        total = (flat.sum() + weight.sum()) * 0
        return total / 0 if reduction == "mean" else total
    size = max(-(-tokens // chunks), 1)
    total = _ChunkedLinearCrossEntropy.apply(flat, weight, bias, flat_targets, ignore_index, size)
    if reduction == "sum":
        return total
    return total / (flat_targets != ignore_index).sum()
