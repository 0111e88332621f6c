"""The flat ZeRO-1/2's gradient reduction during backward: each finished gradient into its
bucket, each full bucket reduced at once and in bucket order on every rank, and the slice
each rank receives added to its shard's gradient.

A hook on every parameter (`register_post_accumulate_grad_hook`) copies the finished
gradient into its bucket's gradient buffer and frees it (a parameter alone in its bucket is
reduced in its own gradient, without the copy); a full bucket is reduced at once, async,
with one reduction in flight besides the bucket filling (`reduce_scatter_tensor` on NCCL;
on gloo, whose reduce-scatter is slower than its all-reduce and copies, an in-place
all-reduce of which each rank keeps its slice). So between backward and the step a rank
holds 1/N of the gradients, and full gradients only two buckets at a time. Gradients are
divided by N before the sum, as DDP does. Each backward reduces what it produced and adds
it to the shard gradients, which is exact for gradient accumulation (reduction is linear);
with `sync` off, gradients stay whole in `.grad` until the first backward with it on.
"""
from __future__ import annotations

import collections
import logging

import torch
import torch.distributed as dist
from torch import nn

from memdoctor.remedies.zero_buckets import Bucket
from memdoctor.remedies.zero_ranks import reduce_scatter

log = logging.getLogger("memdoctor")

MAX_IN_FLIGHT = 1      # reductions in flight besides the bucket filling; each costs a bucket


class GradientReducer:
    """Reduces the gradients of `buckets` ({id(param): (bucket, index)} in `where`) over
    `group` as backward finishes them; `grad_ready` is the parameters' hook."""

    def __init__(self, buckets: list[Bucket], where: dict[int, tuple[Bucket, int]], group, rank: int,
                 world_size: int, masters: bool, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.buckets, self.where, self.group = buckets, where, group
        self.rank, self.world_size, self.masters = rank, world_size, masters
        self.max_in_flight = max(int(max_in_flight), 1)
        self.all_reduce = "gloo" in str(dist.get_backend(group)).lower()
        self.sync = True
        self._pending: collections.deque = collections.deque()
        self._next = 0
        self._round_open = False
        self._late_warned = False

    @torch.no_grad()
    def grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync or p.grad is None:
            return
        bucket, i = self.where[id(p)]
        if bucket.launched:             # a second gradient in one round (reentrant backward)
            if not self._late_warned:
                self._late_warned = True
                log.warning("memdoctor: ZeRO: a gradient arrived after its bucket was reduced; it is kept "
                            "in .grad and reduced by the next backward")
            return
        if not self._round_open:
            self._round_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if bucket.direct and bucket.grad is None and p.grad.is_contiguous():
            bucket.grad = p.grad.detach().view(-1)     # no copy: the gradient is the bucket
            bucket.filled.add(i)
            p.grad = None
            self._launch_in_order(force=False)
            return
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.numel, dtype=p.dtype, device=p.device)
        off = bucket.offsets[i]
        target = bucket.grad[off:off + p.numel()].view_as(p)
        if i in bucket.filled:
            target.add_(p.grad)
        else:
            target.copy_(p.grad)
            bucket.filled.add(i)
        p.grad = None
        if len(bucket.filled) == len(bucket.params):
            self._launch_in_order(force=False)

    def _launch_in_order(self, force: bool) -> None:
        """Launch reductions strictly in bucket order, so every rank issues the same sequence."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and len(bucket.filled) < len(bucket.params):
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        grad = bucket.grad
        if grad is None:                 # no gradient reached this bucket on this rank
            grad = torch.zeros(bucket.numel, dtype=bucket.flat.dtype, device=bucket.flat.device)
        bucket.grad = None
        bucket.launched = True
        if self.world_size > 1:
            grad.div_(self.world_size)
        if self.all_reduce:            # gloo: its reduce-scatter is slower than all-reduce, and copies
            out = None
            work = dist.all_reduce(grad, group=self.group, async_op=True)
        else:
            out = torch.empty(bucket.shard_numel, dtype=grad.dtype, device=grad.device)
            work = reduce_scatter(out, grad, group=self.group, async_op=True)
        self._pending.append((bucket, grad, out, work))
        while len(self._pending) > self.max_in_flight:
            self._complete(self._pending.popleft())

    @torch.no_grad()
    def _complete(self, item) -> None:
        bucket, grad, out, work = item
        work.wait()
        if out is None:
            lo, hi = bucket.shard_range(self.rank)
            out = grad[lo:hi].clone()
        del grad
        if self.masters:
            if bucket.low_grad is None:
                bucket.low_grad = out
            else:
                bucket.low_grad.add_(out)
            return
        shard = bucket.shard
        if shard.grad is None:
            shard.grad = out
        else:
            shard.grad.add_(out)

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        self._launch_in_order(force=True)
        self.wait()
        for b in self.buckets:
            b.filled.clear()
            b.launched = False
        self._next = 0
        self._round_open = False

    def wait(self) -> None:
        """Finish every reduction in flight."""
        while self._pending:
            self._complete(self._pending.popleft())
