"""other-processes: other processes hold the device's memory.

What it detects
    Memory on the device that this process does not hold: another training run, a
    forgotten notebook kernel, a second process per GPU. Read from the OOM message
    (total minus free minus this process) or from NVML's process list.
Preconditions
    - the numbers agree: what this process has ("Including non-PyTorch memory, this
      process has ...") is at least what PyTorch reserved; a smaller one (0 bytes, where
      NVML cannot see the process in a container) is not trusted, and only processes
      named with their memory (in the message or by NVML) count then;
    - others hold at least 30% of the device.
Why it runs out of memory
    CUDA memory is not shared: whatever another process holds, this one cannot get, so
    a job that fits an empty card fails on a busy one.
Example
    bad:  a Jupyter kernel with a model still on cuda:0, then `python train.py`
    good: nvidia-smi --query-compute-apps=pid,used_memory --format=csv; end that process,
          or CUDA_VISIBLE_DEVICES=1 python train.py
Fix
    End or move the other process, or pick a free device.
Known limits
    Memory this process holds outside PyTorch (the CUDA context, NCCL, cuBLAS workspaces)
    counts as "this process" only where the message or NVML says so.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import FREE_FIX, Finding, Remedy, fits
from memdoctor.diagnosis.facts import Facts

ID = "other-processes"
SHARE = 0.3


def check(f: Facts) -> Finding | None:
    others = f.other_process_bytes
    total = f.capacity_bytes
    if not others or not total or others < SHARE * total:
        return None
    evidence = [f"other processes hold {format_bytes(others)} of the device's {format_bytes(total)} "
                f"({100 * others / total:.0f}%)"]
    named = [p for p in f.other_processes if p.get("pid") is not None]
    if named:
        evidence.append("processes: " + ", ".join(f"pid {p['pid']} {format_bytes(p.get('bytes'))}" for p in named[:5]))
    mine = f.allocator.get("process_in_use_bytes") if f.allocator else None
    if mine is not None:
        evidence.append(f"this process holds {format_bytes(mine)}")
    elif "process_in_use_bytes" in f.untrusted:
        evidence.append("the message's figure for this process is below what PyTorch reserved: not trusted")
    predicted = (mine or 0) + (f.requested_bytes or 0) if f.oom else None
    remedies = [Remedy("free the device", "end the other process (nvidia-smi lists it) or run on another GPU "
                       "with CUDA_VISIBLE_DEVICES", predicted)]
    return Finding(ID, f"other processes hold {format_bytes(others)} of the device", others, evidence,
                   remedies, FREE_FIX, fits(f, predicted) if predicted is not None and f.limit_bytes else None)
