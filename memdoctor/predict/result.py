"""The estimate's result: the predicted peaks, what holds the memory at the peak, the budget
verdict and the notes, as a dataclass and as the dict `--json` prints."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memdoctor.run import Run

__all__ = ["Estimate"]


@dataclass
class Estimate:
    """One configuration's predicted `max_memory_allocated()` and `max_memory_reserved()`, the
    CUDA context and the libraries' own device memory apart (memdoctor.cuda.library_memory),
    and the fake step's Run they were replayed from."""
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    peak_step: int
    cuda_context_bytes: int
    workspace_bytes: int
    notes: list[str]
    run: Run
    device: str = "cuda"
    simulated_on: str = "cuda"
    peak_seq: int = 0
    live_peak_bytes: int = 0
    category_peaks: dict[str, int] = field(default_factory=dict)
    category_peaks_raw: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)
    params: int = 0
    param_bytes: int = 0
    plan: str = "none"
    world_size: int = 1
    budget_bytes: int | None = None
    fits: bool | None = None
    oom: dict | None = None
    budget_peak_reserved_bytes: int | None = None   # max_memory_reserved() with the allocator capped at the budget
    allocator: dict = field(default_factory=dict)
    anchors: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    config: dict = field(default_factory=dict)
    work: dict = field(default_factory=dict)
    library_bytes: int = 0          # what cuBLAS, cuDNN and the kernels' code map outside the allocator

    @property
    def device_bytes_needed(self) -> int:
        """What the device must hold: the reserved peak, the CUDA context and the libraries'
        own memory."""
        if self.device != "cuda":
            return self.peak_reserved_bytes
        return self.peak_reserved_bytes + self.cuda_context_bytes + self.library_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "breakdown": self.breakdown,
            "peak_phase": self.peak_phase,
            "peak_step": self.peak_step,
            "cuda_context_bytes": self.cuda_context_bytes,
            "library_bytes": self.library_bytes,
            "workspace_bytes": self.workspace_bytes,
            "device_bytes_needed": self.device_bytes_needed,
            "live_peak_bytes": self.live_peak_bytes,
            "category_peaks": self.category_peaks,
            "category_peaks_raw": self.category_peaks_raw,
            "by_module": self.by_module,
            "params": self.params,
            "param_bytes": self.param_bytes,
            "plan": self.plan,
            "world_size": self.world_size,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "oom": self.oom,
            "budget_peak_reserved_bytes": self.budget_peak_reserved_bytes,
            "device": self.device,
            "simulated_on": self.simulated_on,
            "allocator": self.allocator,
            "anchors": self.anchors,
            "config": self.config,
            "notes": self.notes,
            "work": self.work,
            "elapsed_s": round(self.elapsed_s, 3),
        }
