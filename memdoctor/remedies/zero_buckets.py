"""The flat ZeRO-1/2 bucket layout: which parameters share a bucket, each parameter as a
view of its bucket and each rank's slice of it as the parameter the optimizer steps, and
optimizer state cut to those slices and gathered back from them."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from memdoctor.remedies.zero_masters import split_masters
from memdoctor.remedies.zero_ranks import all_gather, source_rank

ALIGN = 16          # elements: parameter views and shard boundaries start 64-byte aligned in fp32


@dataclass
class Bucket:
    index: int
    group_index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int                      # padded, divisible by world size * ALIGN
    shard_numel: int
    flat: torch.Tensor              # the parameters' storage
    shard: nn.Parameter             # this rank's slice of `flat`, what the optimizer steps
    direct: bool = False            # one parameter, no padding: reduce its own gradient
    grad: torch.Tensor | None = None
    filled: set = field(default_factory=set)
    launched: bool = False
    low: torch.Tensor | None = None       # master weights: this rank's low-precision slice of `flat`
    low_grad: torch.Tensor | None = None  # master weights: the reduced gradient shard, low precision

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_buckets(groups: list[list[nn.Parameter]], model_order: dict[int, int],
                 bucket_bytes: int) -> list[tuple[int, list[nn.Parameter]]]:
    """(param_group index, params) per bucket, in the order backward finishes gradients:
    the model's parameter order reversed. A bucket holds one group, dtype and device, and
    consecutive parameters only, so that buckets fill in the order they are launched. A
    parameter of half a bucket or more gets a bucket of its own (its gradient can then be
    reduced where it lies, without a copy)."""
    tagged = [(gi, p) for gi, params in enumerate(groups) for p in params]
    tagged.sort(key=lambda gp: -model_order[id(gp[1])])
    buckets: list[tuple[int, list[nn.Parameter]]] = []
    key, size = None, 0
    for gi, p in tagged:
        nbytes = p.numel() * p.element_size()
        big = nbytes * 2 >= bucket_bytes
        if big or (gi, p.dtype, p.device) != key or size + nbytes > bucket_bytes:
            buckets.append((gi, []))
            key, size = (gi, p.dtype, p.device), 0
        buckets[-1][1].append(p)
        size += nbytes
        if big:
            key = None          # nothing joins it
    return buckets


@torch.no_grad()
def make_bucket(index: int, gi: int, params: list[nn.Parameter], group, rank: int, world_size: int,
                masters: bool, low_dtype: torch.dtype) -> Bucket:
    """The bucket of `params`, with rank 0's values on every rank; the parameters become
    views of it (their old storage is freed). With `masters`, the bucket is in `low_dtype`
    and the shard the optimizer steps is an fp32 copy of this rank's slice."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total = _round_up(total + p.numel(), ALIGN)
    numel = _round_up(max(total, 1), world_size * ALIGN)
    first = params[0]
    flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
    for p, off in zip(params, offsets):
        flat[off:off + p.numel()].view_as(p).copy_(p.detach())
    dist.broadcast(flat, src=source_rank(group), group=group)
    shard_numel = numel // world_size
    start = rank * shard_numel
    if masters:        # fp32 masters from the exact values, then the weights in bf16
        master, flat = split_masters(flat, start, shard_numel, low_dtype)
    for p, off in zip(params, offsets):
        p.data = flat[off:off + p.numel()].view_as(p)     # the old storage is freed here
        p.grad = None
    low = flat[start:start + shard_numel]
    shard = nn.Parameter(master if masters else low, requires_grad=True)
    return Bucket(index, gi, params, offsets, numel, shard_numel, flat, shard,
                  direct=len(params) == 1 and params[0].numel() == numel,
                  low=low if masters else None)


@torch.no_grad()
def shard_state(buckets: list[Bucket], old_state: dict, rank: int) -> dict[nn.Parameter, dict]:
    """The user's optimizer state (a run already under way), cut to this rank's shards:
    {bucket shard: state}."""
    sharded = {}
    for b in buckets:
        states = [old_state.get(p) for p in b.params]
        if all(s is None for s in states):
            continue
        keys = next(s for s in states if s is not None).keys()
        lo, hi = b.shard_range(rank)
        new = {}
        for key in keys:
            values = [None if s is None else s.get(key) for s in states]
            sample = next(v for v in values if v is not None)
            if isinstance(sample, torch.Tensor) and all(
                    v is None or (isinstance(v, torch.Tensor) and v.numel() == p.numel() and v.dim() > 0)
                    for v, p in zip(values, b.params)) and any(v is not None and v.dim() > 0 for v in values):
                flat = torch.zeros(b.numel, dtype=sample.dtype, device=sample.device)
                for v, p, off in zip(values, b.params, b.offsets):
                    if v is not None:
                        flat[off:off + p.numel()].copy_(v.reshape(-1))
                new[key] = flat[lo:hi].clone()
            elif isinstance(sample, torch.Tensor):
                new[key] = sample.clone()
            else:
                new[key] = sample
        sharded[b.shard] = new
    return sharded


@torch.no_grad()
def unshard_state(b: Bucket, state: dict, group, restored: dict) -> None:
    """A bucket shard's optimizer state gathered from every rank and cut back into
    per-parameter state, added to `restored` ({parameter: state}). Collective."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == b.shard_numel:
            full = torch.empty(b.numel, dtype=value.dtype, device=value.device)
            all_gather(full, value.contiguous(), group=group)
            for p, off in zip(b.params, b.offsets):
                restored.setdefault(p, {})[key] = full[off:off + p.numel()].view_as(p).clone()
            del full
        else:
            for p in b.params:
                restored.setdefault(p, {})[key] = (
                    value.clone() if isinstance(value, torch.Tensor) else value)
