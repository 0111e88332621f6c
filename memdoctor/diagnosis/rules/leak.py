"""leak: live memory grows step over step because tensors of earlier steps stay alive.

What it detects
    The live bytes at the end of each step rise steadily, and at the peak tensors made in
    steps long past (not weights, gradients or optimizer state) are still alive.
Why it runs out of memory
    Keeping a tensor that is part of the autograd graph (a loss, an embedding, an output)
    in a list keeps its memory, and often its whole graph, alive: a few MiB a step is an
    OOM an hour later.
Example
    bad:  history.append(loss)          embeddings.append(emb)
    good: history.append(loss.item())   embeddings.append(emb.detach().cpu())
Fix
    Keep plain numbers (`.item()`), or `.detach()` (and `.cpu()`) what you keep.
"""
from __future__ import annotations

from collections import Counter

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits
from memdoctor.diagnosis.facts import Facts

ID = "leak"
MIN_STEPS = 4


def check(f: Facts) -> Finding | None:
    if f.source != "run" or len(f.steps) < MIN_STEPS or f.growth_per_step <= 0:
        return None
    leaked = sum(b.nbytes for b in f.leaked)
    live = f.focus_bytes
    if not leaked or leaked < 0.1 * live:
        return None
    steps = sorted({b.step for b in f.leaked})
    kinds = Counter((b.name, tuple(b.shape), b.dtype, b.module) for b in f.leaked)
    (name, shape, dtype, module), count = kinds.most_common(1)[0]
    evidence = [
        f"live memory grows {format_bytes(f.growth_per_step)} a step over {len(f.steps)} steps",
        f"{format_bytes(leaked)} at the {'OOM' if f.oom else 'peak'} was made in steps {steps[0]}..{steps[-1]} "
        f"and is still alive ({len(f.leaked)} tensors)",
        f"most common: {count} x {name} {'x'.join(map(str, shape))} {dtype}"
        + (f" from module {module}" if module else ""),
    ]
    predicted = live - leaked
    remedies = [Remedy("keep detached copies or numbers",
                       f"what keeps the {name} outputs alive across steps: store `.item()` or "
                       "`.detach().cpu()` instead of the live tensor", predicted)]
    return Finding(ID, f"memory leaks across steps: {format_bytes(f.growth_per_step)} a step, "
                       f"{format_bytes(leaked)} kept from earlier steps",
                   leaked, evidence, remedies, free_fix_tier(f, predicted), fits(f, predicted),
                   {"growth_per_step": f.growth_per_step, "steps": steps[-1] - steps[0] + 1})
