"""The flat ZeRO-1/2: the user's optimizer steps each rank's 1/N slice of flat buckets
that hold the parameters, and the updated slices are all-gathered after every step.

The trained parameters are laid out in flat buckets (memdoctor.remedies.zero_buckets: up
to 25 MiB each, consecutive parameters in backward order; a parameter of half a bucket or
more alone); each parameter becomes a view into its bucket, so no copy of the weights is
kept. Each rank's optimizer steps only its 1/N slice of every bucket (`nn.Parameter` views
of the buckets replace the parameters in the optimizer's param_groups, hyperparameters
untouched), so a rank holds 1/N of the optimizer state. Backward reduces gradients bucket
by bucket into those slices (memdoctor.remedies.zero_reduce). After the step,
`all_gather_into_tensor` (in place on NCCL) rebuilds the full parameters in every rank's
buckets. `no_sync()` keeps full gradients in `.grad` until the first backward outside it
(less communication, full gradient memory meanwhile). ZeRO-1 is served by the same code:
sharding the gradients too costs no more communication than ZeRO-1's all-reduce. The shards
cut through parameters, so the optimizer must update elementwise. With master weights the
optimizer steps fp32 masters of the slice (memdoctor.remedies.zero_masters).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from memdoctor.remedies.zero_buckets import Bucket, make_bucket, plan_buckets, shard_state, unshard_state
from memdoctor.remedies.zero_handle import ZeroHandle
from memdoctor.remedies.zero_masters import grads_to_masters, masters_to_weights
from memdoctor.remedies.zero_ranks import all_gather, check_same_everywhere, source_rank, trained_params
from memdoctor.remedies.zero_reduce import MAX_IN_FLIGHT, GradientReducer
from memdoctor.units import format_bytes

DEFAULT_BUCKET_BYTES = 25 * 2**20


class FlatZero(ZeroHandle):
    """ZeRO-1/2 over flat buckets (see the module docstring)."""

    impl = "flat"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, stage: int, group,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, max_in_flight: int = MAX_IN_FLIGHT,
                 master_weights: bool = False, low_dtype: torch.dtype = torch.bfloat16) -> None:
        self.model, self.optimizer, self.stage, self.group = model, optimizer, stage, group
        self.masters, self.low_dtype = bool(master_weights), low_dtype
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        groups = trained_params(model, optimizer)
        if self.masters and any(not p.is_floating_point() for ps in groups for p in ps):
            raise ValueError("ZeRO master weights need floating-point parameters")
        check_same_everywhere([len(groups)] + [sum(p.numel() for p in ps) for ps in groups]
                              + [len(ps) for ps in groups], group, "trained parameters")
        order = {id(p): i for i, p in enumerate(model.parameters())}
        self._original_params = [list(g["params"]) for g in optimizer.param_groups]
        old_state = {p: optimizer.state[p] for ps in groups for p in ps if p in optimizer.state}
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, int]] = {}
        self._reducer = GradientReducer(self.buckets, self._where, group, self.rank, self.world_size,
                                        self.masters, max_in_flight)
        self._hooks: list = []
        try:
            for gi, params in plan_buckets(groups, order, bucket_bytes):
                bucket = make_bucket(len(self.buckets), gi, params, group, self.rank, self.world_size,
                                     self.masters, self.low_dtype)
                self.buckets.append(bucket)
                for i, p in enumerate(params):
                    self._where[id(p)] = (bucket, i)
            self._sync_buffers(model)
            # the optimizer steps the shards: same param_groups (hyperparameters untouched)
            for gi, group_dict in enumerate(optimizer.param_groups):
                group_dict["params"] = [b.shard for b in self.buckets if b.group_index == gi]
            for p in list(optimizer.state.keys()):
                del optimizer.state[p]
            if old_state:
                for shard, state in shard_state(self.buckets, old_state, self.rank).items():
                    optimizer.state[shard] = state
            self._hooks += [p.register_post_accumulate_grad_hook(self._reducer.grad_ready)
                            for b in self.buckets for p in b.params]
            self._hooks.append(optimizer.register_step_pre_hook(lambda *a: self._before_step()))
            self._hooks.append(optimizer.register_step_post_hook(lambda *a: self.gather_params()))
        except BaseException:
            self._abandon(old_state)
            raise
        self.total_param_bytes = sum(p.numel() * p.element_size() for b in self.buckets for p in b.params)
        self.local_param_bytes = sum(b.shard.numel() * b.shard.element_size() for b in self.buckets)
        also = " (asked for ZeRO-1: gradients are sharded too, at no extra communication)" if stage == 1 else ""
        if self.masters:
            also += ", fp32 master weights of this rank's shard"
        super().__init__(
            f"ZeRO-{stage} over {self.world_size} ranks ({dist.get_backend(group)}), flat buckets: optimizer state "
            f"and gradients sharded{also}; this rank steps {format_bytes(self.local_param_bytes)} of "
            f"{format_bytes(self.total_param_bytes)} of parameters in {len(self.buckets)} buckets",
            self._undo,
        )

    # ---- setup ---------------------------------------------------------------------
    @torch.no_grad()
    def _abandon(self, old_state: dict) -> None:
        """Put back what a failed setup changed (parameters, param_groups, state, hooks)."""
        for h in self._hooks:
            h.remove()
        for b in self.buckets:
            for p in b.params:
                p.data = p.data.clone()
        for group_dict, params in zip(self.optimizer.param_groups, self._original_params):
            group_dict["params"] = params
        for p in list(self.optimizer.state.keys()):
            del self.optimizer.state[p]
        for p, state in old_state.items():
            self.optimizer.state[p] = state
        self.buckets.clear()
        self._where.clear()

    @torch.no_grad()
    def _sync_buffers(self, model: nn.Module) -> None:
        for b in model.buffers():
            if b.is_floating_point() or b.dtype in (torch.int64, torch.int32):
                dist.broadcast(b, src=source_rank(self.group), group=self.group)

    # ---- around the step ---------------------------------------------------------------
    def wait(self) -> None:
        """Finish every reduction in flight (the step's pre-hook calls it)."""
        self._reducer.wait()

    @torch.no_grad()
    def _before_step(self) -> None:
        self.wait()
        if self.masters:            # the low-precision gradient shards become the masters' fp32 .grad
            grads_to_masters(self.buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._reducer.sync = self._reducer.sync, False
        try:
            yield
        finally:
            self._reducer.sync = previous

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's updated shard into every rank's full parameters (in place)."""
        if self.masters:            # round the stepped masters into this rank's slice; their fp32 grads go
            masters_to_weights(self.buckets)
        if self._reducer.all_reduce:            # gloo: a separate input gathers faster than one inside the output
            for b in self.buckets:
                all_gather(b.flat, self._local(b).clone(), group=self.group)
            return
        works = [all_gather(b.flat, self._local(b), group=self.group, async_op=True) for b in self.buckets]
        for w in works:
            w.wait()

    @staticmethod
    def _local(b: Bucket) -> torch.Tensor:
        """This rank's slice of the bucket, as the all-gather sends it."""
        return b.low if b.low is not None else b.shard.detach()

    # ---- undo -----------------------------------------------------------------------------
    @torch.no_grad()
    def _undo(self) -> None:
        for h in self._hooks:
            h.remove()
        self.wait()
        opt = self.optimizer
        restored_state: dict = {}
        for b in self.buckets:
            state = opt.state.pop(b.shard, None)
            if state:
                unshard_state(b, state, self.group, restored_state)
            for p in b.params:
                p.data = p.data.clone()          # own storage again; the bucket goes
                p.grad = None
            b.shard.grad = None
            b.low = b.low_grad = None
        for group_dict, params in zip(opt.param_groups, self._original_params):
            group_dict["params"] = params
        for p, s in restored_state.items():
            opt.state[p] = s
        self.buckets.clear()
        self._where.clear()
