"""device-full: this process's own tensors fill the device (what a message alone can say).

What it detects
    An OOM message with no more specific cause in it: PyTorch's own allocations take
    most of the device, or a library (cuBLAS, cuDNN, NCCL, the driver) could not get
    memory because the device was already full.
Preconditions
    - a log (no trace) with an OOM message, and no other rule named a cause.
Why it runs out of memory
    The model, its states, its activations and temporaries together need more than the
    device has; the message cannot say which of them is to blame.
Example
    bad:  a log line: CUDA out of memory. Tried to allocate 2.00 GiB ...
    good: memdoctor diagnose train.py --budget 24GiB   # traces and names the part
Fix
    Run the script under `memdoctor diagnose` to split the memory into weights,
    gradients, optimizer state and activations, then apply the remedy it names.
Known limits
    A message says nothing about what the memory holds: this is a pointer to tracing.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import STRUCTURAL, Finding, Remedy
from memdoctor.diagnosis.facts import Facts

ID = "device-full"


def check(f: Facts) -> Finding | None:
    if f.source != "log" or not f.oom:
        return None
    a = f.allocator
    allocated = a.get("allocated_by_pytorch_bytes") or a.get("process_in_use_bytes") or 0
    evidence = [f"{a.get('kind', 'an allocator')} could not get {format_bytes(f.requested_bytes)}"
                if f.requested_bytes else f"{a.get('kind', 'an allocator')} ran out of memory"]
    if allocated and f.capacity_bytes:
        evidence.append(f"PyTorch had {format_bytes(allocated)} allocated of {format_bytes(f.capacity_bytes)}")
    remedies = [Remedy("trace the script", "memdoctor diagnose SCRIPT --budget SIZE names which part fills it", None)]
    return Finding(ID, "this process's own memory fills the device", allocated or (f.requested_bytes or 0),
                   evidence, remedies, STRUCTURAL, None)
