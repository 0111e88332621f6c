"""Apply a Plan to a model and optimizer, and train one step with it.

The order is fixed: precision first (bf16-true changes the parameters the optimizer holds),
then checkpointing (wraps the blocks' forward, in whatever dtype), then the optimizer swap
(it must see the parameters it will step, masters included), then ZeRO, then micro-batching
(which only changes how the step runs).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memdoctor.remedies._handle import Handle
from memdoctor.remedies.autobatch import AutoMicroBatch, oom_proof_accumulate
from memdoctor.remedies.checkpointing import apply_checkpointing
from memdoctor.remedies.microbatch import LossFn, accumulate_gradients
from memdoctor.remedies.plan import Plan
from memdoctor.remedies.precision import Precision, apply_precision
from memdoctor.remedies.rollback import Checkpoint, OptimizerCheckpoint

log = logging.getLogger("memdoctor")


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


class Prepared:
    """A model and optimizer with a plan applied; `step` trains on one whole batch.

    `handles` are the applied remedies in the order applied, `precision` first.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
                 precision: Precision, handles: list[Handle]) -> None:
        self.model = model
        self.optimizer = optimizer
        self.plan = plan
        self.precision = precision
        self.handles = handles
        self.auto = AutoMicroBatch() if plan.micro_batch == "auto" else None
        self._params = _unique(list(model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]])

    @property
    def scaler(self):
        return self.precision.scaler

    def step(self, batch: Any, loss_fn: LossFn) -> float:
        """zero_grad, forward/backward over micro-batches, optimizer step, zero_grad again;
        the batch's mean loss.

        `loss_fn(model, micro_batch)` returns the mean loss of that micro-batch. The
        gradients are freed after the step (as transformers' Trainer and Lightning do), so
        an evaluation or data loading between steps does not hold a model's worth of them.
        """
        if self.undone:
            raise RuntimeError("this Prepared was undone; prepare the model again")
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        run = dict(context=self.precision.context, backward=self.precision.backward)
        if self.auto is not None:
            loss = self._oom_proof_step(batch, loss_fn, run)
        else:
            loss = accumulate_gradients(self.model, batch, loss_fn, self.plan.micro_batch, **run)
            self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        return loss

    def _oom_proof_step(self, batch: Any, loss_fn: LossFn, run: dict) -> float:
        """All or nothing: an OOM in forward or backward retries at a smaller micro-batch
        from the state before the step; one in the optimizer or the scaler puts back the
        parameters, optimizer state, buffers, RNG and scaler as they were before the step
        (copies kept on the CPU meanwhile) and is raised, the step not taken."""
        before = Checkpoint(self.model)
        loss = oom_proof_accumulate(self.model, batch, loss_fn, self.auto, params=self._params,
                                    checkpoint=before, **run)
        saved = OptimizerCheckpoint(self._params, self.optimizer, self.scaler)
        try:
            self.precision.step(self.optimizer)
        except torch.OutOfMemoryError:
            saved.restore()
            before.restore()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            raise
        return loss

    def undo(self) -> None:
        """Undo every applied remedy, last applied first."""
        _undo_all(self.handles)

    @property
    def undone(self) -> bool:
        return any(h.undone for h in self.handles)


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _undo_all(handles: list[Handle]) -> None:
    for handle in reversed(handles):
        handle.undo()


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan | str,
            *, device_type: str | None = None) -> Prepared:
    """Apply `plan` to the model and optimizer (in place where possible) and return them
    ready to train; `Prepared.optimizer` may be a new object."""
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    device_type = device_type or _device_type(model)
    handles: list[Handle] = []
    try:
        # bf16-true under ZeRO-1/2: the ranks keep fp32 masters of their shards only
        zero_masters = plan.precision == "bf16-true" and plan.zero in (1, 2)
        precision = apply_precision(model, optimizer, plan.precision, device_type, masters_in_zero=zero_masters)
        handles.append(precision)
        if plan.checkpointing is not None:
            handles.append(apply_checkpointing(model, plan.checkpointing))
        if plan.optimizer is not None:     # imported here: the fused kernels import triton
            from memdoctor.remedies.optimizers import swap_optimizer
            optimizer, handle = swap_optimizer(model, optimizer, plan.optimizer, precision=plan.precision,
                                               micro_batch=plan.micro_batch)
            handles.append(handle)
        if plan.zero is not None:          # imported here: torch.distributed
            from memdoctor.remedies.zero import apply_zero
            handles.append(apply_zero(model, optimizer, stage=plan.zero, master_weights=zero_masters))
            optimizer = getattr(handles[-1], "optimizer", optimizer)
            if precision.scaler is not None and hasattr(handles[-1], "sharded_grad_scaler"):
                # each rank checks only its shard for inf: the ranks must agree to skip a step
                precision.scaler = handles[-1].sharded_grad_scaler(precision.scaler)
        if plan.micro_batch is not None:
            how = "halving on out-of-memory" if plan.micro_batch == "auto" else f"of {plan.micro_batch} samples"
            handles.append(Handle(f"micro-batches {how}"))
            log.info("memdoctor: gradient accumulation over micro-batches %s", how)
    except BaseException:
        _undo_all(handles)
        raise
    return Prepared(model, optimizer, plan, precision, handles)
