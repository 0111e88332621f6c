"""Gradient accumulation over micro-batches.

Activations scale with the samples in flight, so running a batch as micro-batches cuts
activation memory by the split factor. Each micro-batch's mean loss is weighted by its share
of the batch, so the accumulated gradient is the full batch's, also when the last
micro-batch is smaller.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch import nn

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def batch_size(batch: Any) -> int:
    """The samples in a batch: the shared dim 0 of its tensors."""
    sizes = {t.shape[0] if t.dim() else None for t in _tensors(batch)}
    if not sizes:
        raise ValueError("the batch holds no tensors to split")
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"the batch's tensors must share dim 0 to be split; sizes seen: {sorted(map(str, sizes))}")
    return sizes.pop()


def _take(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return type(batch)((k, _take(v, start, stop)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, start, stop) for v in batch)
    return batch  # non-tensor leaves go to every micro-batch unchanged


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Views of the batch, `micro_batch_size` samples each; the last one may be smaller."""
    if not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1, not {micro_batch_size!r}")
    total = batch_size(batch)
    return [_take(batch, start, min(start + micro_batch_size, total)) for start in range(0, total, micro_batch_size)]


def accumulate_gradients(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int | None,
    *,
    context: Callable[[], ContextManager] = contextlib.nullcontext,
    backward: Callable[[torch.Tensor], None] | None = None,
) -> float:
    """Forward and backward over the batch in micro-batches; returns the full-batch mean loss.

    `loss_fn(model, micro_batch)` returns the micro-batch's mean loss. `context()` wraps each
    forward (autocast); `backward(loss)` replaces `loss.backward()` (a loss scaler). Under
    DDP (a model with `no_sync`) gradients are all-reduced only on the last micro-batch.
    None as the size runs the whole batch at once.
    """
    total = batch_size(batch)
    size = total if micro_batch_size is None else min(micro_batch_size, total)
    parts = [batch] if size >= total else split_batch(batch, size)
    no_sync = getattr(model, "no_sync", None)
    backward = backward or (lambda loss: loss.backward())
    loss_sum = None
    for index, part in enumerate(parts):
        share = batch_size(part) / total
        last = index == len(parts) - 1
        with (contextlib.nullcontext() if last or no_sync is None else no_sync()):
            with context():
                loss = loss_fn(model, part)
            weighted = loss if share == 1.0 else loss * share
            backward(weighted)
        value = weighted.detach().float()
        loss_sum = value if loss_sum is None else loss_sum + value
    return float(loss_sum)
