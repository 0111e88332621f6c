"""`memdoctor estimate`'s text: the predicted peaks, the CUDA context and the libraries' memory
apart, the breakdown at the peak, the budget verdict, what other tools say and the notes."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from memdoctor.units import format_bytes as fb

if TYPE_CHECKING:
    from memdoctor.predict.result import Estimate

__all__ = ["estimate_lines"]

# the anchors' labels, in the order they print
ANCHOR_LABELS = {"memtracker_peak_bytes": "torch MemTracker (FakeTensorMode)",
                 "deepspeed_zero2_model_states_bytes": "DeepSpeed ZeRO-2 model states",
                 "accelerate_adam_x4_bytes": "accelerate: model size x 4 (Adam)",
                 "model_states_16_bytes_per_param": "16 bytes a parameter"}


def estimate_lines(est: Estimate) -> list[str]:
    """The estimate for people: the two peaks, the context apart, the breakdown at the
    peak, the budget verdict, the anchors and the notes."""
    lines = [_title(est), ""] + _peaks(est) + [""] + _breakdown(est)
    for part in (_budget(est), _anchors(est), _notes(est)):
        if part:
            lines += [""] + part
    return lines


def _title(est: Estimate) -> str:
    cfg = est.config
    what = cfg.get("model") or os.path.basename(cfg.get("script") or "") or "model"
    shape = [f"batch {cfg['batch']}"] if cfg.get("batch") else []
    if cfg.get("seq"):
        shape.append(f"seq {cfg['seq']}")
    if cfg.get("image_size"):
        shape.append(f"{cfg['image_size']}px")
    if cfg.get("optimizer"):
        shape.append(cfg["optimizer"])
    shape.append(f"plan {est.plan}")
    if est.world_size > 1:
        shape.append(f"world size {est.world_size}")
    return (f"estimate for {what} ({', '.join(shape)}); {est.params / 1e6:,.1f}M parameters; "
            f"{est.device}, simulated on {est.simulated_on}")


def _peaks(est: Estimate) -> list[str]:
    lines = [f"  predicted peak allocated  {fb(est.peak_allocated_bytes):>12}   (torch.cuda.max_memory_allocated)",
             f"  predicted peak reserved   {fb(est.peak_reserved_bytes):>12}   (torch.cuda.max_memory_reserved)"]
    if est.device == "cuda":
        lines.append(f"  CUDA context, apart       {fb(est.cuda_context_bytes):>12}   (not in either peak)")
        lines.append(f"  libraries' memory, apart  {fb(est.library_bytes):>12}   (cuBLAS, cuDNN, kernel code; "
                     f"the device needs about {fb(est.device_bytes_needed)})")
    lines.append(f"  peak during the {est.peak_phase} phase of step {est.peak_step + 1}")
    return lines


def _breakdown(est: Estimate) -> list[str]:
    lines = ["  at the peak           bytes   share"]
    total = max(sum(est.breakdown.values()), 1)
    for cat, n in sorted(est.breakdown.items(), key=lambda kv: -kv[1]):
        if n:
            lines.append(f"    {cat:<16}{fb(n):>11}   {100 * n / total:4.0f}%")
    return lines


def _budget(est: Estimate) -> list[str]:
    if est.budget_bytes is None:
        return []
    budget = f"  budget {fb(est.budget_bytes)}"
    if not est.fits:
        where = est.oom or {}
        return [f"{budget}: does NOT fit: the allocator would run out allocating "
                f"{fb(where.get('requested_bytes'))} in the {where.get('phase', '?')} phase of step "
                f"{where.get('step', 0) + 1}" + (f" ({where['tensor']})" if where.get("tensor") else "")]
    if est.budget_bytes >= est.peak_reserved_bytes:
        return [f"{budget}: fits (the allocator's limit, as trace --budget; headroom "
                f"{fb(est.budget_bytes - est.peak_reserved_bytes)} over the reserved peak)"]
    return [f"{budget}: fits, once cached blocks are released near the limit (reserved peak under it "
            f"{fb(est.budget_peak_reserved_bytes)})"]


def _anchors(est: Estimate) -> list[str]:
    if not est.anchors:
        return []
    lines = ["  what other rules say"]
    for key, label in ANCHOR_LABELS.items():
        if key in est.anchors:
            value = est.anchors[key]
            lines.append(f"    {label:<36}{fb(value) if value is not None else 'failed':>12}")
    if est.anchors.get("memtracker_error"):
        lines.append(f"    (MemTracker: {est.anchors['memtracker_error']})")
    return lines


def _notes(est: Estimate) -> list[str]:
    return ["  notes"] + [f"    - {note}" for note in est.notes] if est.notes else []
