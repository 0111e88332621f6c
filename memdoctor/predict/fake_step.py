"""The training step the estimate runs on fake tensors, as a GPU would run it: forward,
backward, optimizer step, zero_grad(set_to_none=True), with a plan's remedies applied."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from memdoctor.remedies.microbatch import batch_size, split_batch

__all__ = ["train_step", "force_cuda_default_foreach"]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: Callable,
               prepared=None, fake: bool = False) -> None:
    """One full training step: forward, backward, optimizer step, zero_grad(set_to_none=True).

    With `prepared` (memdoctor.remedies.prepare's result) the step is Prepared.step's:
    zero_grad, forward under the plan's precision context and backward per micro-batch
    (each loss weighted by its share of the batch), the precision's optimizer step; then
    zero_grad. `fake=True` also steps an fp16 loss scaler without reading its inf check
    (`.item()`), as if no step overflowed. The estimate and the GPU validation both run
    this function.

    It is not Prepared.step itself: that one returns the loss as a Python float (data a
    fake tensor does not have), keeps each micro-batch's loss and their running sum alive
    into the next micro-batch (scalars this step frees at once, which would change the
    estimate's events and the figures the GPU validation measured with this step), halves
    micro=auto on a real OOM, and zeroes the model's gradients again after the step.
    """
    if prepared is None:
        loss = loss_fn(model, batch)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    opt = prepared.optimizer
    opt.zero_grad(set_to_none=True)
    prepared.model.zero_grad(set_to_none=True)
    micro = prepared.plan.micro_batch
    if micro in (None, "auto"):         # the whole batch: its size is not needed (a detection
        parts, total = [batch], None    # model's list of images and targets has no one dim 0)
    else:
        total = batch_size(batch)
        size = min(int(micro), total)
        parts = [batch] if size >= total else split_batch(batch, size)
    precision = prepared.precision
    for part in parts:
        share = 1.0 if total is None else batch_size(part) / total
        with precision.context():
            loss = loss_fn(prepared.model, part)
        weighted = loss if share == 1.0 else loss * share
        precision.backward(weighted)
        del loss, weighted
    scaler = precision.scaler
    if fake and scaler is not None:
        scaler.unscale_(opt)
        opt.step()
        scaler.update()
    else:
        precision.step(opt)
    opt.zero_grad(set_to_none=True)


def force_cuda_default_foreach(optimizer) -> bool:
    """On a real GPU an optimizer left at foreach=None steps with the multi-tensor (foreach)
    kernels; torch picks that by `type(p) in (Tensor, Parameter)`, which a fake parameter
    fails, so under FakeTensorMode it would silently take the per-tensor loop (fewer
    temporaries). Make the choice the GPU would make."""
    changed = False
    for group in optimizer.param_groups:
        if "foreach" in group and group.get("foreach") is None and not group.get("fused") \
                and not group.get("differentiable", False):
            group["foreach"] = True
            changed = True
    return changed
