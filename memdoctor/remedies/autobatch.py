"""OOM-proof steps: on out-of-memory, halve the micro-batch and redo the step.

Unlike a batch-size finder, the batch itself stays whole: only the micro-batch shrinks, so
the effective batch size and the training result do not change. The retry runs before the
optimizer step, and gradients, buffers (BatchNorm's running statistics) and the random
number generators are put back to what they were before the step (memdoctor.remedies.
rollback), so a failed attempt leaves no partial or doubled update and the retry trains
exactly as a run at the smaller micro-batch would.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from memdoctor.remedies.microbatch import LossFn, accumulate_gradients, batch_size
from memdoctor.remedies.rollback import Checkpoint

log = logging.getLogger("memdoctor")


class AutoMicroBatch:
    """The micro-batch size that last fitted (None: the whole batch), kept across steps."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size
        self._logged: set[int] = set()

    def remember(self, size: int, total: int) -> None:
        self.size = size
        if size not in self._logged:
            self._logged.add(size)
            log.info("memdoctor: micro-batch of %d samples fits (batch of %d); later steps start there", size, total)


def _snapshot_grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Copies of existing gradients (None stays None, costing nothing: the usual case after
    zero_grad(set_to_none=True))."""
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _restore_grads(params: list[torch.Tensor], saved: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, saved):
        p.grad = None if g is None else g.clone()


def _free_cached_memory(params: list[torch.Tensor]) -> None:
    gc.collect()
    if torch.cuda.is_available() and any(p.is_cuda for p in params):
        torch.cuda.empty_cache()


def oom_proof_accumulate(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    state: AutoMicroBatch,
    *,
    params: Iterable[torch.Tensor] | None = None,
    context: Callable[[], ContextManager] = contextlib.nullcontext,
    backward: Callable[[torch.Tensor], None] | None = None,
    checkpoint: Checkpoint | None = None,
) -> float:
    """`accumulate_gradients` that survives torch.OutOfMemoryError by halving the micro-batch.

    Starts from `state.size` (the whole batch the first time). On OOM: gradients of `params`
    (default: the model's trainable parameters), the model's buffers and the RNG states go
    back to what they were before the call (`checkpoint`, taken here unless given), the
    CUDA cache is emptied, the micro-batch halves and the whole batch is redone. Re-raises,
    with all of that put back, when a micro-batch of one sample does not fit. Does not step
    the optimizer.
    """
    params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    total = batch_size(batch)
    size = start = min(state.size or total, total)
    saved = _snapshot_grads(params)
    checkpoint = checkpoint or Checkpoint(model)
    while True:
        try:
            loss = accumulate_gradients(model, batch, loss_fn, size, context=context, backward=backward)
            break
        except torch.OutOfMemoryError as exc:
            if size <= 1:
                _restore_grads(params, saved)
                checkpoint.restore()
                raise
            reason = str(exc).strip().split("\n")[0][:300]  # a string: the exception holds frames
        # out of the except block, so the traceback and the activations it holds are gone
        _restore_grads(params, saved)
        checkpoint.restore()
        _free_cached_memory(params)
        log.debug("memdoctor: %s with micro-batch %d; retrying with %d", reason, size, size // 2)
        size //= 2
    if size < start:  # a small last batch fitting says nothing about the size to keep
        state.remember(size, total)
    return loss
