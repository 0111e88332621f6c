"""fp32 master weights of one rank's shard for the flat ZeRO-1/2 (`master_weights=True`,
what `Plan("bf16-true,zero=2")` asks for): the ZeRO paper's mixed precision.

The trained parameters become bf16 views of bf16 buckets and each rank keeps fp32 masters
for its shard only, made from the parameters' own values before the cast. Gradients are
reduced in the parameters' dtype into a low-precision gradient shard; before the step it
becomes the masters' fp32 `.grad` (freed after the step), the optimizer steps the masters,
and they are rounded into this rank's slice of the bucket before the all-gather. Between
backward and the step a rank then holds 2Ψ of weights, 2Ψ/N of gradients and 4Ψ/N + 8Ψ/N
of masters and Adam state: the paper's 2Ψ + 14Ψ/N. Undo gives the parameters back their
own storage in the low precision.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def split_masters(flat: torch.Tensor, start: int, shard_numel: int,
                  low_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 masters of flat[start:start + shard_numel], the whole bucket in `low_dtype`):
    the masters copy the exact values before the cast."""
    master = flat[start:start + shard_numel].to(torch.float32, copy=True)
    return master, flat.to(low_dtype)


@torch.no_grad()
def grads_to_masters(buckets) -> None:
    """Before the step: each bucket's low-precision gradient shard becomes its masters' fp32 .grad."""
    for b in buckets:
        if b.low_grad is not None:
            b.shard.grad = b.low_grad.float()
            b.low_grad = None


@torch.no_grad()
def masters_to_weights(buckets) -> None:
    """After the step: the stepped masters rounded into this rank's slice of each bucket;
    their fp32 gradients go."""
    for b in buckets:
        b.low.copy_(b.shard)
        b.shard.grad = None
