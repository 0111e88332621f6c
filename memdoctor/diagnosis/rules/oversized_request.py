"""oversized-request: one request larger than the device or the budget.

What it detects
    A single allocation asks for more memory than the whole device (or the allowed
    budget) has: no amount of freeing could satisfy it.
Preconditions
    - an OOM whose request is known and larger than the limit (the budget, the allowed
      memory, or the device's capacity);
    - the request is not a whole number of rows over the vocabulary the model projects to
      (logits for too many tokens at once: the large-logits rule's).
Why it runs out of memory
    Usually a shape bug: a broadcast that was not meant (N x 1 against 1 x N), a
    flattened dimension in the wrong place, an attention matrix over an unpadded corpus.
Example
    bad:  (pred - target) with pred (N, 1) and target (N,)  -> an N x N tensor
    good: (pred.squeeze(-1) - target)
Fix
    Find the op in the traceback and check its input shapes.
Known limits
    Another request that is large on purpose (an attention matrix over a long sequence) is
    named here too: the shapes are right, the batch is not.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import FREE_FIX, Finding, Remedy
from memdoctor.diagnosis.facts import Facts
from memdoctor.diagnosis.rules.large_logits import asks_for_logits

ID = "oversized-request"


def check(f: Facts) -> Finding | None:
    request, limit = f.requested_bytes, f.limit_bytes
    if not f.oom or not request or not limit or request <= limit:
        return None
    if asks_for_logits(f):
        return None             # logits over the model's vocabulary: right shapes, too many rows (large-logits)
    evidence = [f"one request of {format_bytes(request)} is {request / limit:.1f}x the "
                f"{format_bytes(limit)} the process may use"]
    if f.oom_phase:
        evidence.append(f"asked for in {f.oom_phase} of step {f.oom_step}"
                        + (f" in module {f.oom_module}" if f.oom_module else ""))
    remedies = [Remedy("check the shapes", "find the op in the traceback; an unintended broadcast or a "
                       "wrong reshape makes tensors this large", None)]
    return Finding(ID, f"a single {format_bytes(request)} request exceeds the {format_bytes(limit)} limit",
                   request, evidence, remedies, FREE_FIX, None)
