"""A memory budget that makes a big machine behave like a small GPU.

Off a GPU (the dispatch source on the CPU) memdoctor raises the OOM itself, in the format of
PyTorch's own message (marked simulated), the moment live tensor bytes would pass the
budget. On a GPU the real allocator is capped with `set_per_process_memory_fraction` under
either source, so the OOM is real and comes where the GPU's would.
"""
from __future__ import annotations

import torch

from memdoctor.units import format_bytes
from memdoctor.capture.recorder import Recorder


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
    return fraction
