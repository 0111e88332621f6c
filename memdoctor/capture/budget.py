"""A memory budget that makes a big machine behave like a small GPU.

Off a GPU (the dispatch source on the CPU) memdoctor raises the OOM itself, in the format of
PyTorch's own message (marked simulated), the moment live tensor bytes would pass the
budget. On a GPU the real allocator is capped with `set_per_process_memory_fraction` under
either source, so the OOM is real and comes where the GPU's would.
"""
from __future__ import annotations

import logging

import torch

from memdoctor.units import format_bytes
from memdoctor.capture.recorder import Recorder

log = logging.getLogger("memdoctor")


def simulated_message(requested: int, live: int, budget: int, device: str) -> str:
    free = max(budget - live, 0)
    return (f"{device.upper() if device == 'cpu' else 'CUDA'} out of memory (memdoctor budget, simulated). "
            f"Tried to allocate {format_bytes(requested)}. Budget of {format_bytes(budget)} "
            f"of which {format_bytes(free)} is free. Of the allocated memory {format_bytes(live)} "
            f"is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")


class SimulatedBudget:
    """Raise torch.OutOfMemoryError when a new storage would take live bytes past `limit`."""

    def __init__(self, recorder: Recorder, limit: int, device: str = "cpu"):
        self.recorder = recorder
        self.limit = limit
        self.device = device

    def __call__(self, nbytes: int, live: int) -> None:
        if live + nbytes <= self.limit:
            return
        message = simulated_message(nbytes, live, self.limit, self.device)
        self.recorder.record_oom(nbytes, message, simulated=True)
        raise torch.OutOfMemoryError(message)


def cap_cuda(limit: int, device: int | None = None) -> float:
    """Cap the caching allocator of `device` at `limit` bytes; returns the fraction set.

    The allocator checks the fraction only when it asks the driver for a new segment: blocks
    it already caches are handed out past the cap. So the cached, unused segments are
    released first, and what the process reserves from here on is what the cap allows (a
    notebook that trained a bigger model before would otherwise never meet the budget)."""
    index = torch.cuda.current_device() if device is None else device
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(max(limit / total, 0.0), 1.0)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    with torch.cuda.device(index):
        torch.cuda.empty_cache()
    note = held_past_budget_note(torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index), limit)
    if note:
        log.warning("memdoctor: %s", note)
    return fraction


def held_past_budget_note(reserved: int, allocated: int, limit: int) -> str:
    """What to tell a user whose process already reserves more than the budget once its
    free cached segments are released: a segment with any live tensor in it stays (a new
    model's weights carved out of a bigger model's cached segment pin all of it), and the
    cap counts it, so the run meets the budget's OOM earlier than a GPU of that size would."""
    if reserved <= limit:
        return ""
    return (f"this process already reserves {format_bytes(reserved)} of GPU memory ({format_bytes(allocated)} of it "
            f"in live tensors, the rest free space in their segments), more than the budget of "
            f"{format_bytes(limit)}: the budget's OOM comes at the first new segment; run in a fresh process "
            "for a budget that behaves like a GPU of that size")
