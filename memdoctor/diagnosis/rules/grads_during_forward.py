"""grads-during-forward: gradients kept allocated through the next forward.

What it detects
    Gradients made by an earlier step are still allocated while this step's forward (or
    the start of its backward) holds its activations, at the peak or the OOM.
Preconditions
    - the focus (the OOM, else the peak) is in a training forward pass or in backward (not
      in a forward under no_grad or without backward: nothing piles up beside them there);
    - the gradients alive there were made in an earlier step: gradients this step's own
      backward made, or ones accumulated over micro-batches of one optimizer step, never
      count;
    - they take at least 10% of live memory, or without them the request that failed would
      have fitted;
    - steps are optimizer steps (before an optimizer's first step, steps are backward calls:
      gradients accumulating over micro-batches), each with one backward pass (with
      micro-batches accumulating, every one after the first uses the gradients anyway);
    - gradients of parameters no optimizer holds are left to grads-never-stepped.
Why it runs out of memory
    `zero_grad(set_to_none=False)`, or `zero_grad()` called after the forward, keeps a
    whole copy of the parameters' size allocated exactly when activations pile up.
Example
    bad:  loss = model(x).mean(); optimizer.zero_grad(set_to_none=False); loss.backward()
    good: optimizer.zero_grad(set_to_none=True)   # before the forward
          loss = model(x).mean(); loss.backward()
Fix
    Call `optimizer.zero_grad(set_to_none=True)` right after `optimizer.step()`, or apply
    the optimizer inside backward (Plan(optimizer="in-backward")). Lightning's automatic
    optimization zeroes them after `training_step`'s forward, before its backward: there the
    fix is a LightningModule `optimizer_step` that zeroes them right after stepping.
Known limits
    Gradients kept on purpose across optimizer steps (a gradient-statistics tool, or
    accumulation steered by hand without an optimizer) look the same.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits, tipped
from memdoctor.diagnosis.facts import Facts
from memdoctor.diagnosis.forward_cut import previous_step_peak
from memdoctor.diagnosis.rules.model_states import in_backward_applies
from memdoctor.run import Phase

ID = "grads-during-forward"
SHARE = 0.1


def check(f: Facts) -> Finding | None:
    if not f.under_pressure or f.source != "run":
        return None
    grads = f.grads_in_forward - _never_stepped(f)      # grads-never-stepped names those
    live = f.focus_bytes
    if not grads or (grads < SHARE * live and not tipped(f, grads)):
        return None
    phase = f.oom_phase if f.oom else f.focus.phase
    if phase == Phase.FORWARD_NO_BACKWARD.value or (f.oom and f.oom_grad_enabled is False):
        return None             # an evaluation under no_grad: no activations pile up beside them
    if f.steps_from == "backward" and f.optimizer:
        return None             # steps are backward calls before an optimizer's first step: accumulation
    if _accumulating(f):
        return None             # accumulating: the step's own backward filled them, freeing them earlier gains nothing
    evidence = [f"{format_bytes(grads)} of gradients from earlier steps alive during the {phase} of step "
                f"{f.focus.step}, {100 * grads / live:.0f}% of {format_bytes(live)}"]
    # the rest of the step (its backward) still runs as the step before ran it, old gradients gone
    before = previous_step_peak(f, f.run, lambda b: b.category == "gradients" and b.step < f.focus.step - 1)
    predicted = max(live - grads, before or 0)
    remedies = [Remedy("free gradients before the forward",
                       "optimizer.zero_grad(set_to_none=True) right after optimizer.step()" if f.optimizer else
                       "model.zero_grad(set_to_none=True) right after the parameters are updated", predicted,
                       in_framework=_LIGHTNING if _under_lightning(f) else None)]
    if in_backward_applies(f):
        remedies.append(Remedy("optimizer step in backward", "Plan(optimizer='in-backward')", predicted,
                               "opt=in-backward"))
    return Finding(ID, f"gradients kept from the last step take {format_bytes(grads)} while activations pile up",
                   grads, evidence, remedies, free_fix_tier(f, predicted), fits(f, predicted))


_LIGHTNING = ("lightning: its automatic optimization zeroes them after training_step's forward; "
              "in the LightningModule: def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure): "
              "optimizer.step(closure=optimizer_closure); optimizer.zero_grad(set_to_none=True)")


def _under_lightning(f: Facts) -> bool:
    return f.run is not None and "lightning" in (f.run.meta.get("frameworks") or [])


def _never_stepped(f: Facts) -> int:
    names = set((f.run.meta.get("unstepped_grads") or []) if f.run else [])
    return sum(b.nbytes for b in f.focus_blocks if b.category == "gradients" and b.step < f.focus.step
               and b.name.removesuffix(".grad") in names)


def _accumulating(f: Facts) -> bool:
    """Micro-batches accumulate gradients into each optimizer step: a step ran two backward
    passes or more, or this one ran one before the focus. In every micro-batch after the
    first the gradients are in use whatever zero_grad did, so freeing them earlier gains
    nothing at the peak."""
    if f.run is None or f.steps_from != "optimizer":
        return False
    passes: dict[int, int] = {}         # backward passes that ended before the focus, by step
    previous = None
    for m in f.run.marks:
        if m.seq > f.focus.seq:
            break
        if previous is not None and previous.phase == Phase.BACKWARD.value and m.phase != Phase.BACKWARD.value:
            passes[previous.step] = passes.get(previous.step, 0) + 1
        previous = m
    return passes.get(f.focus.step, 0) >= 1 or any(n >= 2 for n in passes.values())
