"""grads-during-forward: gradients kept allocated through the next forward.

What it detects
    Gradients are alive while the forward pass runs, at the peak or the OOM.
Why it runs out of memory
    `zero_grad(set_to_none=False)`, or `zero_grad()` called after the forward, keeps a
    whole copy of the parameters' size allocated exactly when activations pile up.
Example
    bad:  loss = model(x).mean(); optimizer.zero_grad(set_to_none=False); loss.backward()
    good: optimizer.zero_grad(set_to_none=True)   # before the forward
          loss = model(x).mean(); loss.backward()
Fix
    Call `optimizer.zero_grad(set_to_none=True)` right after `optimizer.step()`, or apply
    the optimizer inside backward (Plan(optimizer="in-backward")).
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits
from memdoctor.diagnosis.facts import Facts

ID = "grads-during-forward"


def check(f: Facts) -> Finding | None:
    if not f.under_pressure or f.source != "run":
        return None
    grads = f.grads_in_forward
    live = f.focus_bytes
    if not grads or grads < 0.1 * live:
        return None
    evidence = [f"{format_bytes(grads)} of gradients alive during the forward of step {f.focus.step}, "
                f"{100 * grads / live:.0f}% of {format_bytes(live)}"]
    predicted = live - grads
    remedies = [Remedy("free gradients before the forward",
                       "optimizer.zero_grad(set_to_none=True) right after optimizer.step()", predicted),
                Remedy("optimizer step in backward", "Plan(optimizer='in-backward')", predicted, "opt=in-backward")]
    return Finding(ID, f"gradients take {format_bytes(grads)} during the forward pass", grads, evidence,
                   remedies, free_fix_tier(f, predicted), fits(f, predicted))
