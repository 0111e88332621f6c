"""fragmentation: reserved but unallocated memory that the request cannot use.

What it detects
    When the OOM struck, the caching allocator held at least as much reserved-but-free
    memory as was requested, but in pieces none of which was large enough.
Preconditions
    - an OOM of the caching allocator whose message's numbers agree with each other;
    - reserved-but-unallocated memory is at least twice the request and at least 10% of
      what PyTorch reserved.
Why it runs out of memory
    Tensors whose sizes change from step to step (growing sequences, varying batches)
    leave holes in the allocator's segments; a new, larger request fits in none of them,
    and the device has no room for another segment.
Example
    bad:  sequences 2048, 2560, 3072, ... tokens, with tensors kept between steps
    good: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py
Fix
    Set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (segments grow in place), pad
    shapes to a few fixed buckets, or free what is kept between steps.
Known limits
    The message does not say how large the largest free piece was; a request that failed
    for another reason beside large holes is named fragmentation too.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits
from memdoctor.diagnosis.facts import Facts

ID = "fragmentation"
RATIO = 2.0
SHARE = 0.1


def check(f: Facts) -> Finding | None:
    a = f.allocator
    free_reserved = a.get("reserved_unallocated_bytes")
    request = f.requested_bytes
    if not f.oom or not free_reserved or not request:
        return None
    allocated = a.get("allocated_by_pytorch_bytes")
    reserved = a.get("reserved_total_bytes") or (free_reserved + (allocated or 0))
    # holes several times the request, and a real share of what the allocator holds
    if free_reserved < RATIO * request or free_reserved < SHARE * reserved:
        return None
    evidence = [f"{format_bytes(free_reserved)} reserved by PyTorch but unallocated, "
                f"{free_reserved / request:.1f}x the {format_bytes(request)} requested, yet no free piece was large enough"]
    if allocated is not None:
        evidence.append(f"{format_bytes(allocated)} allocated by PyTorch")
    predicted = (allocated or 0) + request if allocated is not None else None
    remedies = [Remedy("expandable segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: segments grow "
                       "in place instead of leaving holes", predicted, "alloc=expandable_segments")]
    return Finding(ID, f"fragmentation: {format_bytes(free_reserved)} reserved but unusable for a "
                       f"{format_bytes(request)} request", free_reserved, evidence, remedies,
                   free_fix_tier(f, predicted), fits(f, predicted))
