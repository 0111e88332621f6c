"""leak: memory grows step over step because tensors of earlier steps stay alive.

What it detects
    Tensors made in earlier steps (not weights, gradients or optimizer state) are still
    alive at the OOM (or the peak), and the bytes carried over from earlier steps grow
    with every step; or, within one step, the outputs of many passes that no backward
    takes are kept (an evaluation collecting its predictions on the device).
Preconditions
    - steps are recognised from what the script repeats: optimizer steps, else the ends
      of `backward()` calls (a hand-written update such as `p.data.add_(p.grad, alpha=-lr)`),
      else calls of the model; at least 4 steps were seen; or, with an OOM in the third or
      fourth optimizer step (or backward call), tensors one line made alike in every
      earlier step, the oldest two or more steps back, are all still alive; or, with an OOM
      in the second, the first step's tensors a container holds that a line of the script
      adds to (`history.append(recon)`);
    - the bytes alive at the end of each complete step that earlier steps made grow by a
      positive slope (optimizer state, made once in step 0, is never part of it), and
      that growth accounts for a real part of what is kept;
    - the tensors kept from at least two steps back take at least 10% of live memory (in
      the second to fourth step: or without them the request that failed would fit);
    - or, within one step: what at least 4 finished calls of one model that no backward
      takes (under no_grad, or in eval mode) made, not saved for backward, is alive at the
      OOM (or a peak under pressure) and takes at least 10% of live memory (an evaluation
      loop gathering each batch's outputs on the device, no optimizer step between them).
Why it runs out of memory
    Keeping a tensor that is part of the autograd graph (a loss, an embedding, an output)
    in a list keeps its memory, and often its whole graph, alive: a few MiB a step is an
    OOM an hour later.
Example
    bad:  history.append(loss)          embeddings.append(emb)
    good: history.append(loss.item())   embeddings.append(emb.detach().cpu())
Fix
    Keep plain numbers (`.item()`), or `.detach()` (and `.cpu()`) what you keep. Data
    kept step after step (a cache filled as batches are read, made outside the model and
    never saved for backward) has no graph: keep it on the host, or bound the container.
Known limits
    A cache that fills on purpose (a replay buffer, a memory bank before it is full) grows
    the same way. Tensors set up before the first step (a dataset) never count as kept.
"""
from __future__ import annotations

from collections import Counter

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits, plural, tipped
from memdoctor.diagnosis.facts import Facts

ID = "leak"
MIN_STEPS = 4
SHARE = 0.1
GROWING = 0.25      # the growth over the steps kept accounts for this much of what is kept
_STATES = ("weights", "gradients", "optimizer_state")     # live for the run by design
STEP_WORDS = {"optimizer": "optimizer steps", "backward": "backward() calls", "forward": "model calls"}


def check(f: Facts) -> Finding | None:
    if f.source != "run":
        return None
    return _across_steps(f) or _over_few_steps(f) or _gathered_in_step(f)


def _gathered_in_step(f: Facts) -> Finding | None:
    """Outputs of many passes no backward takes, kept within one step (an evaluation loop
    collecting its predictions on the device): the steps do not advance, the memory grows."""
    if not f.gathered or not f.under_pressure:
        return None
    kept = sum(b.nbytes for b in f.gathered)
    live = f.focus_bytes
    if kept < SHARE * live:
        return None
    n = f.gathered_passes
    kinds = Counter((b.name, tuple(b.shape), b.dtype) for b in f.gathered)
    (name, shape, dtype), count = kinds.most_common(1)[0]
    evidence = [f"{format_bytes(kept)} made by {n} earlier passes of one model that no backward takes (under "
                f"no_grad or in eval mode) is still alive in step {f.focus.step}: {format_bytes(kept // n)} a pass, "
                f"{100 * kept / live:.0f}% of {format_bytes(live)}",
                f"most common: {count} x {name} {'x'.join(map(str, shape))} {dtype}"]
    predicted = live - kept
    remedies = [Remedy("move each pass's outputs off the device",
                       "keep `.cpu()` copies of what the loop collects, or reduce them as it goes (a running "
                       "count, `.item()`), instead of the outputs on the device", predicted)]
    if f.run is not None and "transformers" in (f.run.meta.get("frameworks") or []):
        # the Trainer's evaluation loop gathers the predictions itself
        remedies.insert(0, Remedy("gather the Trainer's predictions on the host",
                                  "TrainingArguments(eval_accumulation_steps=N) moves what evaluation gathered to "
                                  "the CPU every N steps; preprocess_logits_for_metrics (an argmax) shrinks the logits "
                                  "before they are gathered", predicted))
    return Finding(ID, f"outputs of {n} passes kept on the device take {format_bytes(kept)}", kept, evidence,
                   remedies, free_fix_tier(f, predicted), fits(f, predicted),
                   {"passes": n, "steps_from": "model calls"}, blocks=list(f.gathered))


def _across_steps(f: Facts) -> Finding | None:
    if len(f.steps) < MIN_STEPS or f.growth_per_step <= 0 or not f.leaked:
        return None
    leaked = sum(b.nbytes for b in f.leaked)
    live = f.focus_bytes
    if leaked < SHARE * live:
        return None
    steps = sorted({b.step for b in f.leaked})
    span = f.focus.step - steps[0]
    if f.growth_per_step * max(span, 1) < GROWING * leaked:
        return None             # kept, but not growing: a fixed cost, not a leak
    name, common = _most_common(f.leaked)
    evidence = [
        f"tensors kept from earlier steps grow {format_bytes(f.growth_per_step)} a step over "
        f"{len(f.steps)} steps (steps: {STEP_WORDS.get(f.steps_from, f.steps_from)})",
        f"{format_bytes(leaked)} at the {'OOM' if f.oom else 'peak'} was made in steps {steps[0]}..{steps[-1]} "
        f"and is still alive ({plural(len(f.leaked), 'tensor')})",
        common,
    ]
    predicted = live - leaked
    if _without_graph(f.leaked):
        # plain data kept step after step (a cache filled as the data is read): no graph to detach
        evidence.append("made outside the model and never saved for backward: plain data a container "
                        "(a cache, a list) keeps adding to")
        remedies = [Remedy("keep the kept data on the host, or bound it",
                           f"what keeps the {name} tensors across steps (a cache filled as batches are read) "
                           "holds them on the device: keep them on the host (`.cpu()`, pinned), or cap "
                           "or clear the container", predicted)]
    else:
        remedies = [_detached(name, predicted)]
    return Finding(ID, f"memory leaks across steps: {format_bytes(f.growth_per_step)} a step, "
                       f"{format_bytes(leaked)} kept from earlier steps",
                   leaked, evidence, remedies, free_fix_tier(f, predicted), fits(f, predicted),
                   {"growth_per_step": f.growth_per_step, "steps": steps[-1] - steps[0] + 1,
                    "steps_from": f.steps_from})


def _over_few_steps(f: Facts) -> Finding | None:
    """An OOM in the second, third or fourth step, too few steps for a slope: tensors one line
    made alike (name, shape, dtype) in every earlier training step still alive. The last
    step's alone may be in use still (its outputs, its loss): a copy from each of two or more
    steps is what a list keeps; with one step before, only those a container the script adds
    to (`history.append(x)`) holds count."""
    current = f.focus.step if f.focus else 0
    if not f.oom or current not in (1, 2, 3) or f.steps_from not in ("optimizer", "backward"):
        return None
    calls = [c["seq_start"] for c in (f.run.meta.get("forward_calls") or []) if isinstance(c, dict)] if f.run else []
    training_from = min(calls, default=0)       # what was made before the first model call is set-up (data)
    held = f.held_by_containers
    groups: dict[tuple, list] = {}
    for b in f.focus_blocks:
        if b.category in _STATES or b.step >= current or b.alloc_seq < training_from:
            continue
        if f.pending_from_seq is not None and b.alloc_seq >= f.pending_from_seq:
            continue            # passes still awaiting their backward
        if current == 1 and b.id not in held:
            continue            # the first step's outputs and loss are in use until the second's replace them
        groups.setdefault((b.source, b.name, tuple(b.shape), b.dtype), []).append(b)
    leaked = [b for blocks in groups.values() if {b.step for b in blocks} == set(range(current)) for b in blocks]
    kept = sum(b.nbytes for b in leaked)
    live = f.focus_bytes
    if not kept or (kept < SHARE * live and not tipped(f, kept)):
        return None
    name, common = _most_common(leaked)
    made = (f"made alike in each of the {current} steps before the OOM's" if current > 1 else
            "made in the step before the OOM's and held by a container the script adds to")
    evidence = [f"{format_bytes(kept)} {made} is still alive "
                f"({plural(len(leaked), 'tensor')}; steps: {STEP_WORDS[f.steps_from]}), "
                f"{100 * kept / live:.0f}% of {format_bytes(live)}",
                common]
    predicted = live - kept
    remedies = [_detached(name, predicted)]
    return Finding(ID, f"memory leaks across steps: {format_bytes(kept // current)} a step, "
                       f"{format_bytes(kept)} kept from earlier steps",
                   kept, evidence, remedies, free_fix_tier(f, predicted), fits(f, predicted),
                   {"growth_per_step": kept / current, "steps": current, "steps_from": f.steps_from},
                   blocks=leaked)


def _most_common(blocks) -> tuple[str, str]:
    """The op name of the kind of tensor kept most often, and a line of evidence saying so."""
    (name, shape, dtype, module), count = Counter((b.name, tuple(b.shape), b.dtype, b.module)
                                                  for b in blocks).most_common(1)[0]
    return name, (f"most common: {count} x {name} {'x'.join(map(str, shape))} {dtype}"
                  + (f" from module {module}" if module else ""))


def _detached(name: str, predicted: int) -> Remedy:
    return Remedy("keep detached copies or numbers", f"what keeps the {name} outputs alive across steps: store "
                  "`.item()` or `.detach().cpu()` instead of the live tensor", predicted)


def _without_graph(blocks) -> bool:
    """Most of the bytes were made outside any forward, backward or optimizer step and
    never saved for backward: data, not model outputs holding a graph."""
    plain = sum(b.nbytes for b in blocks if b.phase == "other" and b.category in ("temporaries", "inputs", "other"))
    return 2 * plain > sum(b.nbytes for b in blocks)
