"""Shapes for the allocator source's shapeless blocks, from the tensors the user's frames name
when a trace ends.

The CUDA allocator's history knows an allocation's address and size, not the tensor it
became; the hooks give shapes only to what a model or optimizer owns. A dataset moved to
the GPU at the top of a script (`ids = ids.to(device)`, `TensorDataset(x.cuda(), y.cuda())`
served by a DataLoader) is named by a variable of the script's frame, or held by a dataset
or loader object one is. Joined by address, its block takes the tensor's shape and dtype,
and the variable's name, which the rules read (data-on-device matches a dataset's rows to
its batches by shape and dtype).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from memdoctor.run import Run
from memdoctor.capture.keepers import user_frames

log = logging.getLogger("memdoctor")

ITEMS_CAP = 64          # tensors looked at in one list or tuple


def name_blocks(run: Run, tb=None, frame=None) -> None:
    """Give the run's live shapeless blocks the shape, dtype and name of the tensor a user's
    frame names at their address: the frames of the traceback `tb` and the stack from
    `frame` outwards. Never raises."""
    try:
        _name_blocks(run, tb, frame)
    except Exception as exc:
        log.warning("memdoctor: naming blocks from the script's variables failed: %r", exc)


def _name_blocks(run: Run, tb, frame) -> None:
    at = {b.address: b for b in run.blocks.values()
          if b.free_seq is None and b.address is not None and not b.shape}
    if not at:
        return
    for f in user_frames(tb, frame):
        for name, value in list(f.f_locals.items()):
            if name.startswith("__"):
                continue
            for label, t in _tensors(name, value):
                _join(at, label, t)


def _tensors(name: str, value: Any, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `value` is or holds the way data is held: a tensor, a list or tuple of
    them (or of (inputs, labels) pairs), a dataset's `.tensors` (TensorDataset), a loader's
    `.dataset`."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)) and depth <= 2:
        for i, item in enumerate(value[:ITEMS_CAP]):
            if isinstance(item, torch.Tensor):
                yield f"{name}[{i}]", item
            elif isinstance(item, (list, tuple)) and depth < 2:     # batches as (inputs, labels) pairs
                yield from _tensors(f"{name}[{i}]", item, depth + 1)
    elif depth < 2 and not isinstance(value, (torch.nn.Module, type)):
        attrs = getattr(value, "__dict__", None)        # instance attributes: no property runs
        if isinstance(attrs, dict):
            for attr in ("tensors", "dataset"):
                if attr in attrs:
                    yield from _tensors(f"{name}.{attr}", attrs[attr], depth + 1)


def _join(at: dict, label: str, t: torch.Tensor) -> None:
    try:
        if t.device.type != "cuda" or t.storage_offset() != 0:
            return
        storage = t.untyped_storage()
        block = at.get(storage.data_ptr())
    except Exception:
        return
    if block is None or block.shape or t.numel() * t.element_size() != storage.nbytes():
        return
    block.shape = list(t.shape)
    block.dtype = str(t.dtype).replace("torch.", "")
    if not block.name:
        block.name = label
