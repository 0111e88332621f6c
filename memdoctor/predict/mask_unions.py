"""Unions of masks made from bounded parts (memdoctor.predict.data_dependent): a mask whose
values the estimate bounded from above (every element selected) may overlap another part where
the real ones are apart, so a union holds at least as many elements as its parts together."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["UNIONS", "mask_elements", "plain_tensors", "union_bound"]

# unions of masks: as many elements as their parts hold together where a part comes from a bound
UNIONS = {"bitwise_or", "logical_or", "__or__", "__ior__", "bitwise_or_", "logical_or_"}


@contextlib.contextmanager
def plain_tensors():
    """Plain tensors: no dispatch mode (FakeTensorMode among them) sees what runs inside."""
    with _disable_current_modes(), torch._C._DisableTorchDispatch(), torch.no_grad():
        yield


def mask_elements(parts) -> int:
    """The elements a union's mask parts hold together, each broadcast to the union's shape,
    counted with overlaps."""
    masks = [p for p in parts if isinstance(p, torch.Tensor) and p.dtype in (torch.bool, torch.uint8)]
    if not masks:
        return 0
    with plain_tensors():
        shape = torch.broadcast_shapes(*(m.shape for m in masks))
        return sum(int(torch.count_nonzero(m.expand(shape))) for m in masks)


def union_bound(union: torch.Tensor, held: int) -> torch.Tensor:
    """The union of masks, at least as many elements as its parts hold together (up to all
    of them): parts made from a bound may overlap where the real ones are apart. Elements
    not yet in the union are added in order."""
    if union.dtype not in (torch.bool, torch.uint8):
        return union
    with plain_tensors():
        missing = min(held, union.numel()) - int(torch.count_nonzero(union))
        if missing <= 0:
            return union
        widened = union.clone().reshape(-1)
        free = (widened == 0).nonzero().reshape(-1)[:missing]
        widened[free] = 1
        return widened.reshape(union.shape)
