"""The handle apply_zero returns, whichever implementation shards, and the loss scaler that
agrees on skipped steps across ranks (fp16 with ZeRO)."""
from __future__ import annotations

import contextlib

import torch

from memdoctor.remedies._handle import Handle
from memdoctor.remedies.zero_ranks import require_group


class ZeroHandle(Handle):
    """What apply_zero changed. `.optimizer` is the user's optimizer (stepping shards now);
    `.stage`, `.impl`, `.world_size`, `.rank`; `.local_param_bytes` / `.total_param_bytes`:
    the parameter bytes this rank's optimizer steps, of all trained ones."""

    stage: int
    impl: str
    world_size: int
    rank: int
    optimizer: torch.optim.Optimizer
    local_param_bytes: int = 0
    total_param_bytes: int = 0

    def no_sync(self):
        """A context in which backward keeps full gradients and reduces nothing; the first
        backward after it reduces them. A no-op context where the implementation has none."""
        return contextlib.nullcontext()

    def sharded_grad_scaler(self, scaler):
        """`scaler` as a ShardedGradScaler over this handle's ranks (fp16 with ZeRO)."""
        return sharded_grad_scaler(scaler, self.group)


def sharded_grad_scaler(scaler, process_group=None):
    """torch's ShardedGradScaler with `scaler`'s settings and current scale: it all-reduces
    the inf check, so that every rank skips (or takes) the same steps when each rank sees
    only its shard of the gradients. None and a ShardedGradScaler come back unchanged."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return scaler
    scale = scaler._init_scale
    if scaler.is_enabled() and getattr(scaler, "_scale", None) is not None:
        scale = scaler.get_scale()
    return ShardedGradScaler(
        device=getattr(scaler, "_device", "cuda"),
        init_scale=scale,
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
        process_group=require_group(process_group),
    )
