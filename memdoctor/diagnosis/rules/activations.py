"""activations: tensors saved for backward dominate the peak.

What it detects
    At the peak (or the OOM) most live memory is tensors the forward pass saved for the
    backward pass, and they were made in this very step.
Preconditions
    - the run is under pressure (an OOM, or a peak within 20% of the limit);
    - tensors saved for backward by this step's forward (plus, for an OOM in a forward run
      with grad mode on, the request; for an OOM in a training step's forward or backward,
      what they made and still hold) take at least 35% of live memory; a forward under `torch.no_grad()` saves
      nothing.
Why it runs out of memory
    Every layer keeps its inputs (and often more) until backward reaches it. Saved bytes
    grow linearly with batch size and, with plain attention, quadratically with sequence
    length, so a longer sequence or a bigger batch tips a run that fitted.
Example
    bad:  loss = model(batch_of_16384).mean(); loss.backward()
    good: Plan(checkpointing="full")    # recompute each block in backward
          Plan(micro_batch=4096)        # same effective batch, accumulated gradients
Fix
    Checkpoint the repeated blocks, split the batch into micro-batches with gradient
    accumulation (the effective batch stays), or train in bf16 autocast. Where several
    training passes of one model wait for one backward (their losses summed first),
    back-propagate each; passes of different models (two towers, a GAN's generator and
    discriminator) called once each are no such case.
    Where one module saves at least 80% (a recurrent layer over a long sequence), no
    checkpointing is offered: recomputing that module brings its saved tensors back whole;
    where most of it is saved in 16 bits already (autocast on), or in float64 (which autocast
    leaves alone), no bf16 autocast; where backward recomputed modules (checkpointing on
    already), no checkpointing.
    An OOM in block k of n repeated blocks of a training forward: the blocks after it are
    counted as saving what the largest finished one saved, in every predicted peak.
Known limits
    Predictions for checkpointing assume repeated blocks named with an index
    (`layers.3`); a flat stack is predicted as one block.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import STRUCTURAL, Finding, Remedy, fits
from memdoctor.diagnosis.facts import LOGIT_ROWS, Facts

ID = "activations"
SHARE = 0.35
ONE_SAVER = 0.8     # one module saving this share of it: checkpointing cannot split it
HALF = ("bfloat16", "float16")


def check(f: Facts) -> Finding | None:
    if not f.under_pressure or f.source != "run":
        return None
    acts = f.step_activations
    if f.oom and f.oom_phase == "forward" and f.oom_grad_enabled is not False and not _asks_for_logits(f):
        acts += f.requested_bytes or 0      # what a forward with grad mode on asks for is about to be saved
    live = f.focus_bytes
    if not live or acts + f.step_held_bytes < SHARE * live:
        return None
    # the forward's working set: saved tensors plus this step's temporaries scale with the batch
    scaling = acts + _step_temporaries(f) + (f.requested_bytes or 0 if f.oom and f.oom_phase != "forward" else 0)
    fixed = max(live - scaling, 0)
    scaling += f.forward_rest_bytes         # the blocks an OOM in the forward left unrun save as much again
    modules = _top_modules(f)
    evidence = [f"{format_bytes(acts)} saved for backward in step {f.focus.step}, "
                f"{100 * acts / live:.0f}% of {format_bytes(live)}"
                + (f": what was live and the {format_bytes(f.requested_bytes)} asked for in {f.oom_phase}" if f.oom
                   else " live")]
    if acts < SHARE * live:
        evidence.append(f"with {format_bytes(f.step_held_bytes)} more that this step's forward and backward made "
                        "and still hold (kept by a checkpoint's policy or a custom Function, recomputed by "
                        "checkpointing, gradients of activations, in use by the op that ran out)")
    if f.forward_rest_note:
        evidence.append(f.forward_rest_note)
    if modules:
        evidence.append("largest savers: " + ", ".join(f"{m} {format_bytes(n)}" for m, n in modules))
    blocks = _block_activations(f)
    # checkpointed: each block's input stays (and what runs outside the blocks); backward
    # recomputes one block at a time, whose gradients come and go one tensor at a time
    ckpt_full = fixed + max(blocks.values()) + scaling // 8 if len(blocks) >= 2 else fixed + scaling // 4
    remedies = [
        Remedy("activation checkpointing per block", "Plan(checkpointing='full'): keep block inputs only, recompute in backward",
               ckpt_full, "ckpt=full"),
        Remedy("selective checkpointing", "Plan(checkpointing='selective'): keep matmul outputs, recompute pointwise ops",
               max(fixed + scaling // 2, ckpt_full), "ckpt=selective"),      # it keeps more than full does
        Remedy("micro-batches of a quarter", "Plan(micro_batch='auto') with gradient accumulation: same effective batch",
               fixed + scaling // 4, "micro=auto"),
        Remedy("bf16 autocast", "Plan(precision='bf16'): activations in 16 bits",
               fixed + scaling // 2, "bf16"),
    ]
    saved = [b for b in f.focus_blocks if b.category == "activations" and _this_step(f, b)]
    half = sum(b.nbytes for b in saved if b.dtype in HALF)
    if saved and 2 * half >= sum(b.nbytes for b in saved):
        # autocast is on already: most of what is saved is in 16 bits
        evidence.append(f"{100 * half / sum(b.nbytes for b in saved):.0f}% of it is saved in 16 bits already "
                        f"(autocast on)")
        remedies = [r for r in remedies if r.plan != "bf16"]
    double = sum(b.nbytes for b in saved if b.dtype == "float64")
    if saved and 2 * double >= sum(b.nbytes for b in saved):
        # autocast leaves float64 alone: a float64 model keeps its activations as they are
        evidence.append(f"{100 * double / sum(b.nbytes for b in saved):.0f}% of it is float64, which autocast "
                        "does not cast (the model's own dtype, `model.float()`, would halve it)")
        remedies = [r for r in remedies if r.plan != "bf16"]
    recomputed = (f.run.meta.get("recomputed_in_backward") or []) if f.run else []
    if recomputed:
        # checkpointing is on already: what is left is fewer rows at a time (or 16 bits)
        evidence.append(f"checkpointed already: backward recomputed {_names(recomputed)}")
        remedies = [r for r in remedies if not (r.plan or "").startswith("ckpt")]
    if modules and modules[0][1] >= ONE_SAVER * acts:
        # one module (a recurrent layer over a long sequence, a loss outside any module) saves
        # nearly all: recomputing it in backward brings all of its saved tensors back at once
        evidence.append(f"{modules[0][0]} alone saves {100 * modules[0][1] / acts:.0f}% of it: checkpointing "
                        f"would recompute it whole in backward, so fewer rows (or shorter sequences) at a time it is")
        remedies = [r for r in remedies if not (r.plan or "").startswith("ckpt")]
    if f.pending_passes >= 2 and f.pending_activations * 2 >= acts:
        # many passes' graphs wait for one backward: gradient accumulation done by summing losses
        evidence.append(f"{f.pending_passes} training passes of one model ran since the last backward and all "
                        f"their graphs wait for one (losses summed before `.backward()`)")
        pending = f.pending_activations
        remedies.insert(0, Remedy("backward per micro-batch",
                                  "call `(loss / steps).backward()` after each forward instead of summing the "
                                  "losses for one backward: the same gradients, one pass's activations at a time",
                                  live - pending + pending // f.pending_passes, None))
    best = min(r.predicted_peak_bytes for r in remedies)
    title = f"activations saved for backward take {format_bytes(acts)}"
    if acts < SHARE * live:
        acts += f.step_held_bytes
        title = f"tensors this step's passes made and hold take {format_bytes(acts)}"
    if f.forward_rest_bytes:        # what the cause costs is the whole forward's, not the part run
        acts += f.forward_rest_bytes
        title += f", about {format_bytes(acts)} with the blocks not yet run"
    return Finding(ID, title, acts, evidence,
                   remedies, STRUCTURAL, fits(f, best), {"by_module": dict(modules)})


def _asks_for_logits(f: Facts) -> bool:
    """The failed request is a vocabulary's logits (large-logits counts it, not this rule)."""
    request, row = f.requested_bytes or 0, (f.vocab or 0) * 2
    return bool(row and request and request % row == 0 and request >= row * LOGIT_ROWS)


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _step_temporaries(f: Facts) -> int:
    return sum(b.nbytes for b in f.focus_blocks
               if b.category == "temporaries" and b.step == f.focus.step and b.phase in ("forward", "backward"))


def _this_step(f: Facts, b) -> bool:
    """Saved by this step's forward, or by the training passes still awaiting their backward."""
    return b.step == f.focus.step or (f.pending_from_seq is not None and b.alloc_seq >= f.pending_from_seq)


def _block_activations(f: Facts) -> dict[str, int]:
    """Saved bytes per repeated block: modules grouped by their path up to the first index
    ("blocks.3.attn" -> "blocks.3")."""
    by: dict[str, int] = {}
    for b in f.focus_blocks:
        if b.category != "activations" or not _this_step(f, b) or not b.module:
            continue
        parts = b.module.split(".")
        cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if cut is None:
            continue
        key = ".".join(parts[:cut + 1])
        by[key] = by.get(key, 0) + b.nbytes
    return by


def _top_modules(f: Facts, limit: int = 4) -> list[tuple[str, int]]:
    by: dict[str, int] = {}
    for b in f.focus_blocks:
        if b.category == "activations" and _this_step(f, b):
            by[b.module or "(outside modules)"] = by.get(b.module or "(outside modules)", 0) + b.nbytes
    return sorted(by.items(), key=lambda kv: -kv[1])[:limit]
