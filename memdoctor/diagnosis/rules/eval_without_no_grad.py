"""eval-without-no-grad: forward passes that are never back-propagated keep their saved tensors.

What it detects
    Forward passes of a model (typically validation, with the model in eval mode) run with
    autograd on: their outputs are never back-propagated, yet every layer saved its inputs,
    and those saved tensors are still alive at the OOM (or the peak).
Preconditions
    - the pass ran with grad mode on and its output carried a graph (the tracer records
      `grad_enabled` and whether the output has a grad_fn for each outermost call); a
      pass under `torch.no_grad()` or `inference_mode()` never counts;
    - backward never reached that output (a pass cut short by the OOM counts when its
      module was in eval mode with grad on, or in training mode when its line was never
      back-propagated and its model was trained and stepped from another line before it:
      a prediction loop after each training step);
    - the tensors saved for its backward (not its temporaries) are alive at the focus and
      take at least 15% of live memory;
    - passes are counted for models only (modules holding parameters): a per-sample
      transform (torchvision's Normalize) or a loss module builds no model graph.
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
Known limits
    A graph built on purpose and never back-propagated (a gradient penalty computed with
    `autograd.grad`, a forward whose loss is discarded by design) looks the same. Passes
    are outermost module calls: a model called from plain functions only is seen through
    its own modules.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits, plural
from memdoctor.diagnosis.facts import Facts

ID = "eval-without-no-grad"
SHARE = 0.15
NOB = "forward-without-backward"


def check(f: Facts) -> Finding | None:
    if f.source != "run":
        return None
    saved = f.no_backward_activation_bytes
    if not saved:
        return None             # no graph kept alive: nothing no_grad would save
    request = f.requested_bytes or 0 if f.oom_phase == NOB else 0
    held = saved + request
    live = f.focus_bytes
    if held < SHARE * live:
        return None
    evidence = [f"{format_bytes(held)} made by forward passes that are never back-propagated "
                f"({plural(max(f.no_backward_calls, 1), 'such pass', 'such passes')}, run with grad mode on), "
                f"{100 * held / live:.0f}% of {format_bytes(live)}"]
    if f.oom_phase == NOB:
        evidence.append(f"ran out inside one of them (module {f.oom_module or '?'}, step {f.oom_step}) "
                        f"asking for {format_bytes(f.requested_bytes)}")
    # under no_grad only the current layer's output and input live at a time (twice the largest
    # tensor of the passes: high where a Sequential frees each input as it goes, as low as
    # the pass's line keeps its input while two layers run on it); and the
    # training before the first such pass reached its own peak, which the fix leaves as it is
    predicted = max(live - held + _largest(f), f.peak_before_no_backward)
    remedies = [Remedy("evaluate under torch.no_grad()", "wrap the evaluation loop in `with torch.no_grad():` "
                       "(or torch.inference_mode())", predicted)]
    return Finding(ID, f"forward passes without backward keep {format_bytes(held)} for nothing",
                   held, evidence, remedies, free_fix_tier(f, predicted), fits(f, predicted))


def _largest(f: Facts) -> int:
    sizes = [b.nbytes for b in f.focus_blocks if b.phase == NOB]
    return max(sizes, default=0) * 2
