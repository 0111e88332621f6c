"""The device tables memdoctor's FusedAdamW keeps for its fused steps, made in a shapes-only
step, where the optimizer itself makes only its state.

A real fused step builds, once per bucket of tensors, two int64 tables on the device (8
rows a tensor, 2 a chunk: memdoctor.cuda.kernels.adamw_triton.Bucket) and keeps them as long
as the optimizer. They sit in a large segment's block, so the estimate must hold them too:
on the H200, Llama 1B's 146 tensors took 9,344 and 2,414,096 bytes there, and without them
a plan that fitted two steps ran out of memory in the third (docs/measurements.md). A fake
tensor on a CPU-only torch stands for a CUDA one, which would take the kernel.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from memdoctor.cuda.kernels.adamw import FusedAdamW
from memdoctor.cuda.kernels.adamw_triton import DTYPE_CODE, bucket_table_shapes
from memdoctor.predict.cpu_standin import standing_in_for_cuda

__all__ = ["FusedTables"]


class FusedTables:
    """Before each shapes-only step of a watched FusedAdamW, make what its real step
    allocates, in the same order: group by group, each parameter's state, then its buckets'
    device tables (once per bucket); `claim(tensor, name)` names each table. The step itself
    then finds the state made and allocates nothing."""

    def __init__(self, claim: Callable[[torch.Tensor, str], None] | None = None) -> None:
        self.claim = claim
        self.made: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._hooks: list = []

    def watch(self, optimizer) -> None:
        """Hook the optimizer's steps if it is a FusedAdamW. Call it after the step pre-hooks
        that must run first (bf16-true's gradients moved to the masters) are registered."""
        if isinstance(optimizer, FusedAdamW):
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _before_step(self, optimizer: FusedAdamW, args, kwargs) -> None:
        for index, group in enumerate(optimizer.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if params and is_fake(params[0]):
                for p in params:
                    optimizer.init_state(p)
                self._make(optimizer, index, params)

    def _make(self, optimizer: FusedAdamW, index: int, params: list[torch.Tensor]) -> None:
        on_gpu = [p for p in params if optimizer.backend != "torch" and p.dtype in DTYPE_CODE and p.is_contiguous()
                  and (p.device.type == "cuda" or standing_in_for_cuda())]
        key = (id(optimizer), index, tuple(id(p) for p in on_gpu))
        if not on_gpu or key in self.made:
            return
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for p in on_gpu:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        count = sum(len(pairs) for k, pairs in self.made.items() if k[0] == id(optimizer))
        self.made[key] = []
        for ps in by_key.values():
            table_shape, chunks_shape = bucket_table_shapes([p.numel() for p in ps], optimizer.state_dtype)
            pair = (torch.empty(table_shape, dtype=torch.int64, device=ps[0].device),
                    torch.empty(chunks_shape, dtype=torch.int64, device=ps[0].device))
            self.made[key].append(pair)
            if self.claim is not None:
                self.claim(pair[0], f"FusedAdamW bucket {count}: table")
                self.claim(pair[1], f"FusedAdamW bucket {count}: chunks")
            count += 1
