"""eval-without-no-grad: forward passes that are never back-propagated keep their saved tensors.

What it detects
    Forward passes (typically validation, with the model in eval mode) run with autograd
    on: their outputs are never back-propagated, yet every layer saved its inputs.
Why it runs out of memory
    Without `torch.no_grad()` each forward builds a graph and keeps what backward would
    need; a validation batch larger than the training batch then needs more memory than
    training itself.
Example
    bad:  model.eval(); preds = model(x_val)
    good: model.eval()
          with torch.no_grad():      # or torch.inference_mode()
              preds = model(x_val)
Fix
    Wrap evaluation in `torch.no_grad()` or `torch.inference_mode()`.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits
from memdoctor.diagnosis.facts import Facts

ID = "eval-without-no-grad"


def check(f: Facts) -> Finding | None:
    if f.source != "run":
        return None
    held = f.no_backward_activation_bytes
    request = f.requested_bytes or 0 if f.oom_phase == "forward-without-backward" else 0
    held += request
    live = f.focus_bytes
    if not held or held < 0.15 * live:
        return None
    evidence = [f"{format_bytes(held)} made by forward passes that are never back-propagated "
                f"({f.no_backward_calls} such passes), {100 * held / live:.0f}% of {format_bytes(live)}"]
    if f.oom_phase == "forward-without-backward":
        evidence.append(f"ran out inside one of them (module {f.oom_module or '?'}, step {f.oom_step}) "
                        f"asking for {format_bytes(f.requested_bytes)}")
    # under no_grad only the current layer's output and input live at a time
    predicted = live - held + _largest(f)
    remedies = [Remedy("evaluate under torch.no_grad()", "wrap the evaluation loop in `with torch.no_grad():` "
                       "(or torch.inference_mode())", predicted)]
    return Finding(ID, f"forward passes without backward keep {format_bytes(held)} for nothing",
                   held, evidence, remedies, free_fix_tier(f, predicted), fits(f, predicted))


def _largest(f: Facts) -> int:
    sizes = [b.nbytes for b in f.focus_blocks if b.phase == "forward-without-backward"]
    return max(sizes, default=0) * 2
