"""working-set: no one cause; the step's tensors and the model's together fill the memory.

What it detects
    A traced run out of memory where no other rule names a cause: the model (weights,
    gradients, optimizer state) and what this step's passes have in flight (outputs of ops
    not saved for any backward, as in a forward under torch.no_grad() or through a frozen
    backbone, and the batch) together pass the limit, neither alone.
Preconditions
    - a traced run (not a log) out of memory in a forward or backward pass (a pass never
      back-propagated too), or between the passes of a step (a model ran in it with grad
      mode on), and no other rule named a cause.
Why it runs out of memory
    Even a forward that saves nothing holds each op's input and output at once; with a
    large batch, wide layers or attention over long sequences, one op's working set plus the
    weights is more than the device has.
Example
    bad:  with torch.no_grad(): features = frozen_backbone(batch_of_8192)
    good: Plan(micro_batch=2048)    # fewer rows at a time
          Plan(precision="bf16")    # ops' outputs in 16 bits
Fix
    Fewer rows at a time (micro-batches with gradient accumulation keep the effective
    batch), bf16 autocast, and for a frozen fp32 base, its weights in bf16.
Known limits
    The batch-dependent part is this step's tensors at the OOM; an op's scratch that
    never shows as a tensor is not in it.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import PARTIAL, Finding, Remedy, fits
from memdoctor.diagnosis.facts import Facts
from memdoctor.diagnosis.rules.model_states import frozen_in_bf16, frozen_weights

ID = "working-set"
_BATCH = ("activations", "temporaries", "inputs")


def check(f: Facts) -> Finding | None:
    if f.source != "run" or not f.oom or f.focus is None or not (
            f.oom_phase in ("forward", "backward", "forward-without-backward")
            or (f.oom_phase == "other" and _in_a_step(f))):
        return None     # outside a step (a dataset filling the device) this says nothing
    live = f.focus_bytes
    # the request, and as much again for the op after it (the activation after a matmul holds
    # its input and its output at once)
    step = sum(b.nbytes for b in f.focus_blocks if b.category in _BATCH and b.step == f.focus.step) \
        + 2 * (f.requested_bytes or 0)
    if not live or not step:
        return None
    fixed = max(live - step + (f.requested_bytes or 0), 0)
    weights = f.cat("weights")
    evidence = [f"{format_bytes(live)} live with the {format_bytes(f.requested_bytes)} asked for in {f.oom_phase}: "
                f"{format_bytes(fixed)} the model and what lives across steps, the rest this step's tensors; with "
                f"the next op's output, {format_bytes(step)}"]
    remedies = [
        Remedy("micro-batches of a quarter", "Plan(micro_batch='auto') with gradient accumulation: same effective batch",
               fixed + step // 4, "micro=auto"),
        Remedy("bf16 autocast", "Plan(precision='bf16'): ops' outputs in 16 bits", fixed + step // 2, "bf16"),
    ]
    frozen = frozen_weights(f)
    if frozen and frozen >= 0.25 * weights:
        evidence.append(f"{format_bytes(frozen)} of the weights get no gradient (frozen)")
        remedies.append(frozen_in_bf16(live - frozen // 2))
    best = min(r.predicted_peak_bytes for r in remedies)
    return Finding(ID, f"no single cause: this step's tensors take {format_bytes(step)} beside "
                   f"{format_bytes(fixed)} of model and more", step, evidence, remedies, PARTIAL, fits(f, best))


def _in_a_step(f: Facts) -> bool:
    """An OOM between the passes of a step (a gradient penalty's interpolation, a loss outside
    any module): a model ran in this step before it, with grad mode on."""
    if f.run is None or not f.run.ooms:
        return False
    marks, seq = f.run.marks, f.run.ooms[0].seq
    return any(c.get("grad_enabled") and c["seq_start"] < seq and 0 <= c.get("mark_start", -1) < len(marks)
               and marks[c["mark_start"]].step == f.focus.step
               for c in f.run.meta.get("forward_calls") or [] if isinstance(c, dict))

