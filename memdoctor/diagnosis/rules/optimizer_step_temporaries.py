"""optimizer-step-temporaries: multi-tensor optimizer intermediates spike the step.

What it detects
    The peak (or the OOM) is inside `optimizer.step()`, and much of it is scratch tensors
    the step made and will free: the foreach implementation computes each intermediate
    for all parameters at once.
Preconditions
    - the run is under pressure and an optimizer was seen;
    - scratch tensors made inside `optimizer.step()` (plus a failed request there) are
      more than 4 times the largest parameter (what a one-tensor-at-a-time step needs)
      and at least 8% of live memory; at an OOM in a foreach step (asked for, or the
      default on CUDA), the scratch is at least one list as large as the parameters, which
      its op makes at once however few of its outputs the OOM let it make;
    - weights, gradients and the optimizer's whole state fit the limit by themselves: when
      they do not (an OOM in the first step, while the state is being made), no step
      implementation makes them fit, and that is model-states.
Why it runs out of memory
    `torch.optim.Adam(foreach=True)` (the default on CUDA) makes whole-model copies for its
    intermediates, so for a moment the step needs a multiple of the parameter bytes on top
    of weights, gradients and state.
Example
    bad:  torch.optim.Adam(model.parameters(), foreach=True)
    good: torch.optim.Adam(model.parameters(), fused=True)      # one kernel, no copies
          torch.optim.Adam(model.parameters(), foreach=False)   # one tensor at a time
Fix
    Use the fused implementation (or memdoctor's fused optimizer), or foreach=False.
Known limits
    Only steps seen through `torch.optim`'s step hooks: a hand-written update is never
    an optimizer step.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits
from memdoctor.diagnosis.facts import Facts

ID = "optimizer-step-temporaries"


def check(f: Facts) -> Finding | None:
    if not f.under_pressure or f.source != "run" or not f.optimizer:
        return None
    seen = temps = f.optimizer_temporaries
    live = f.focus_bytes
    largest = f.optimizer.get("largest_param_bytes", 0)
    if f.oom and f.oom_phase == "optimizer" and _multi_tensor(f):
        # a foreach op makes its outputs for every parameter at once: a list as large as the
        # parameters (AdamW's sqrt of the second moments), however few the OOM let it make
        temps = max(temps, f.optimizer.get("param_bytes", 0))
    # a one-tensor-at-a-time step needs a few of the largest parameter's size at most
    if temps <= 4 * largest or temps < 0.08 * live:
        return None
    if f.limit_bytes and f.model_state_bytes >= f.limit_bytes:
        return None
    opt = f.optimizer
    impl = "fused" if opt.get("fused") else "foreach" if opt.get("foreach") else "default (foreach on CUDA)" \
        if opt.get("foreach") is None else "for-loop"
    evidence = [f"{format_bytes(temps)} of scratch tensors live in {opt['class']}.step() ({impl}), "
                f"{temps / max(opt['param_bytes'], 1):.2f}x the {format_bytes(opt['param_bytes'])} of parameters"]
    if f.oom and f.oom_phase == "optimizer":
        evidence.append(f"ran out in the optimizer step of step {f.oom_step} asking for {format_bytes(f.requested_bytes)}")
    predicted = live - seen + 2 * largest
    takes = opt.get("implementations", ["foreach", "fused"])   # runs saved before it was noted: both
    remedies = []
    if "fused" in takes:
        remedies.append(Remedy("fused optimizer", f"{opt['class']}(..., fused=True), or Plan(optimizer='fused')",
                               predicted, "opt=fused"))
    if "foreach" in takes:
        remedies.append(Remedy("for-loop optimizer", f"{opt['class']}(..., foreach=False): slower, no whole-model "
                               "copies", predicted))
    if not remedies:        # an optimizer with one implementation (LBFGS): its scratch is its own
        return None
    return Finding(ID, f"the optimizer step's scratch tensors take {format_bytes(temps)}", temps, evidence,
                   remedies, free_fix_tier(f, predicted), fits(f, predicted))


def _multi_tensor(f: Facts) -> bool:
    """The step runs foreach ops: asked for, or left to the default, which is foreach on CUDA."""
    foreach = f.optimizer.get("foreach")
    return bool(foreach) or (foreach is None and f.device == "cuda"
                             and "foreach" in f.optimizer.get("implementations", ["foreach"]))
