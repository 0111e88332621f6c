"""grads-never-stepped: gradients of parameters no optimizer steps.

What it detects
    Parameters of a model the script runs in its training step (a perceptual loss network,
    a teacher, a frozen encoder) still require grad, so every backward fills their
    gradients, though no optimizer holds them: nothing applies or frees them.
Preconditions
    - an optimizer was seen, and at the end of the trace parameters outside every optimizer
      have a gradient;
    - those gradients are alive at the OOM (or a peak under pressure) and, with what passes
      of such a model whose inputs need no gradient saved for backward (a teacher's pass,
      the features of a target), take at least 5% of live memory.
Why it runs out of memory
    A gradient as large as the weights stays allocated for the whole run, and backward also
    keeps what it needs to make it: the network's own activations are saved even where its
    input needs no gradient.
Example
    bad:  vgg = Vgg16()                                  # a loss network, parameters requiring grad
          loss = mse(vgg(model(x)), vgg(x).detach())
    good: vgg = Vgg16().requires_grad_(False).eval()
Fix
    `requires_grad_(False)` on the modules no optimizer trains (gradients still flow through
    them to the model before them).
Known limits
    Gradients kept on purpose for a parameter stepped by hand (outside any optimizer) look
    the same.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits
from memdoctor.diagnosis.facts import Facts
from memdoctor.diagnosis.forward_cut import peak_without
from memdoctor.run import Phase

ID = "grads-never-stepped"
SHARE = 0.05


def check(f: Facts) -> Finding | None:
    if f.source != "run" or not f.run or not (f.oom or f.under_pressure):
        return None
    names = set(f.run.meta.get("unstepped_grads") or [])
    grads = [b for b in f.focus_blocks if b.category == "gradients" and b.name.removesuffix(".grad") in names]
    spans = _spans(f)
    saved = [b for b in f.focus_blocks if b.category == "activations"
             and any(start <= b.alloc_seq <= end for start, end in spans)]
    held, freed = sum(b.nbytes for b in grads), sum(b.nbytes for b in saved)
    live = f.focus_bytes
    if not live or held + freed < SHARE * live:
        return None
    owners = sorted({n.rsplit(".", 2)[0] if n.count(".") >= 2 else n for n in (b.name.removesuffix(".grad")
                                                                               for b in grads)})
    shown = ", ".join(owners[:3]) + (f" and {len(owners) - 3} more" if len(owners) > 3 else "")
    evidence = [f"{format_bytes(held)} of gradients of {len(grads)} parameters that no optimizer holds ({shown}), "
                f"{100 * held / live:.0f}% of {format_bytes(live)}: backward fills them every step and nothing "
                "applies or frees them"] if grads else \
        ["a model with parameters requiring grad, none of which an optimizer holds, runs in the training step: "
         "its gradients come with the first backward"]
    if freed:
        evidence.append(f"{format_bytes(freed)} saved for backward by passes of a model no optimizer trains whose "
                        f"inputs need no gradient (a teacher, a target's features): saved only for those gradients")
    # at least what the run reached elsewhere without them: the step before's whole step, and
    # this one's passes before the focus (another pass's workspace can outweigh what they hold)
    gone = {b.name for b in grads}
    without = peak_without(f, f.run, lambda b: (b.category == "gradients" and b.name in gone) or (
        b.category == "activations" and any(start <= b.alloc_seq <= end for start, end in spans)))
    predicted = max(live - held - freed, without or 0)
    remedies = [Remedy("stop their gradients", "call `.requires_grad_(False)` on the modules no optimizer trains "
                       "(a loss network, a teacher); gradients still flow through them to what is trained before",
                       predicted)]
    title = (f"gradients of parameters no optimizer steps take {format_bytes(held)}"
             + (f", and {format_bytes(freed)} is saved only for them" if freed else "")) if grads else \
        f"a model no optimizer trains saves {format_bytes(freed)} for gradients nothing uses"
    return Finding(ID, title, held + freed,
                   evidence, remedies, free_fix_tier(f, predicted), fits(f, predicted), {"parameters": len(grads)},
                   blocks=grads + saved)


def _spans(f: Facts) -> list[tuple[int, int]]:
    """The event spans of passes of models no optimizer trains whose inputs need no gradient,
    back-propagated or awaiting it (a pass never back-propagated is an evaluation): what they
    save is saved only for those models' gradients."""
    models = set(f.run.meta.get("unstepped_models") or [])
    return [(c["seq_start"], c["seq_end"] if c.get("seq_end") is not None else f.focus.seq)
            for c in f.run.meta.get("forward_calls") or []
            if isinstance(c, dict) and c.get("model") in models and not c.get("input_grad", True)
            and c.get("phase") != Phase.FORWARD_NO_BACKWARD.value]      # those are eval-without-no-grad's
