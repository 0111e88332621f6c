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
    training passes of one model, called from one line (a loop over micro-batches), wait for
    one backward (their losses summed first), back-propagate each; passes called from
    different lines (a triplet loss over three calls, chained generators) share one loss, and
    passes of different models called once each (two towers, a GAN's generator and
    discriminator) are no such case.
    Where the loss compares the batch's samples with one another (a contrastive loss's
    batch x batch scores), micro-batches would change it: gradient caching is offered in
    their place (memdoctor.diagnosis.in_batch; seen only once the loss has run).
    Where one module saves at least 80% (a recurrent layer over a long sequence), no
    checkpointing is offered: recomputing that module brings its saved tensors back whole;
    where most of it is saved in 16 bits already (autocast on), or in float64 (which autocast
    leaves alone), no bf16 autocast; where backward recomputed modules, or blocks ran inside
    torch.utils.checkpoint (checkpointing on already), no checkpointing.
    An OOM in block k of n repeated blocks of a training forward: the blocks after it are
    counted as saving what the largest finished one saved, in every predicted peak.
Known limits
    Predictions for checkpointing assume repeated blocks named with an index
    (`layers.3`); a flat stack is predicted as one block.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import STRUCTURAL, Finding, Remedy, fits
from memdoctor.diagnosis.facts import Facts
from memdoctor.diagnosis.rules.large_logits import asks_for_logits

ID = "activations"
SHARE = 0.35
ONE_SAVER = 0.8     # one module saving this share of it: checkpointing cannot split it
HALF = ("bfloat16", "float16")
AUTOCAST_SEEN = 10  # a tenth of the saved bytes in 16 bits: autocast is on
STATISTIC = 64      # a saved tensor this many times smaller than a block's largest is no output of it
FP32_OPS = frozenset((      # aten ops whose outputs CUDA autocast keeps in fp32, leading "_" dropped
    "softmax", "log_softmax", "native_layer_norm", "layer_norm", "rms_norm", "fused_rms_norm", "native_group_norm",
    "group_norm", "exp", "expm1", "log", "log1p", "log2", "log10", "pow", "rsqrt", "reciprocal", "softplus",
    "logsumexp", "sum", "cumsum", "prod", "norm", "linalg_vector_norm", "nll_loss", "nll_loss2d", "mse_loss",
    "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "cosine_similarity"))


def check(f: Facts) -> Finding | None:
    if not f.under_pressure or f.source != "run":
        return None
    acts = f.step_activations
    if f.oom and f.oom_phase == "forward" and f.oom_grad_enabled is not False and not asks_for_logits(f):
        acts += f.requested_bytes or 0      # what a forward with grad mode on asks for is about to be saved
    live = f.focus_bytes
    if not live or acts + f.step_held_bytes < SHARE * live:
        return None
    # the forward's working set: saved tensors plus this step's temporaries scale with the batch
    scaling = acts + _step_temporaries(f) + (f.requested_bytes or 0 if f.oom and f.oom_phase != "forward" else 0)
    fixed = max(live - scaling, 0)
    scaling += f.forward_rest_bytes         # the blocks an OOM in the forward left unrun save as much again
    if f.oom_in_training_forward:
        # backward starts at the head, making the gradients of its ops' outputs and inputs while
        # all that was saved is alive: twice the largest tensor saved (or asked for) outside the
        # repeated blocks (a head's logits); inside them, backward frees as it makes
        scaling += 2 * _largest_outside_blocks(f)
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
    # checkpointing never keeps more than the run as written (single layers keep their inputs)
    ckpt_full = min(_full_checkpointing_peak(f, fixed, scaling), fixed + scaling)
    remedies = [
        Remedy("activation checkpointing per block", "Plan(checkpointing='full'): keep block inputs only, recompute in backward",
               ckpt_full, "ckpt=full"),
        Remedy("selective checkpointing", "Plan(checkpointing='selective'): keep matmul outputs, recompute pointwise ops",
               max(fixed + scaling // 2, ckpt_full), "ckpt=selective"),      # it keeps more than full does
        Remedy("micro-batches of a quarter", "Plan(micro_batch='auto') with gradient accumulation: same effective batch",
               fixed + scaling // 4, "micro=auto"),
        Remedy("bf16 autocast", "Plan(precision='bf16'): activations in 16 bits",
               fixed + int(scaling * (1 + _kept_in_fp32(f)) / 2), "bf16"),
    ]
    if ckpt_full >= fixed + scaling:    # no gain: the fixes that gain come first
        remedies = remedies[2:] + remedies[:2]
    saved = [b for b in f.focus_blocks if b.category == "activations" and _this_step(f, b)]
    half = sum(b.nbytes for b in saved if b.dtype in HALF)
    if saved and AUTOCAST_SEEN * half >= sum(b.nbytes for b in saved):
        # autocast is on already: much of what is saved is in 16 bits (the rest is what autocast
        # keeps in fp32: a loss's log-softmax over a vocabulary can be most of it)
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
    in_checkpoint = (f.run.meta.get("checkpointed_in_forward") or []) if f.run else []
    if recomputed or in_checkpoint:
        # checkpointing is on already: what is left is fewer rows at a time (or 16 bits)
        evidence.append(f"checkpointed already: backward recomputed {_names(recomputed)}" if recomputed else
                        f"checkpointed already: {_names(in_checkpoint)} ran inside torch.utils.checkpoint")
        remedies = [r for r in remedies if not (r.plan or "").startswith("ckpt")]
    if modules and modules[0][1] >= ONE_SAVER * acts:
        # one module (a recurrent layer over a long sequence, a loss outside any module) saves
        # nearly all: recomputing it in backward brings all of its saved tensors back at once
        evidence.append(f"{modules[0][0]} alone saves {100 * modules[0][1] / acts:.0f}% of it: checkpointing "
                        f"would recompute it whole in backward, so fewer rows (or shorter sequences) at a time it is")
        remedies = [r for r in remedies if not (r.plan or "").startswith("ckpt")]
    if f.pending_passes >= 2 and f.pending_activations * 2 >= acts and not f.pending_from_one_line:
        # one model called from several lines, one loss over their outputs (a triplet or siamese
        # loss, CycleGAN's chained generators): no pass has a loss of its own to back-propagate
        evidence.append(f"{f.pending_passes} training passes of one model, called from different lines, ran since "
                        f"the last backward and all their graphs wait for it")
    elif f.pending_passes >= 2 and f.pending_activations * 2 >= acts:
        # many passes' graphs wait for one backward: gradient accumulation done by summing losses
        evidence.append(f"{f.pending_passes} training passes of one model, called from one line, ran since the last "
                        f"backward and all their graphs wait for one (losses summed before `.backward()`)")
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


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _step_temporaries(f: Facts) -> int:
    return sum(b.nbytes for b in f.focus_blocks
               if b.category == "temporaries" and b.step == f.focus.step and b.phase in ("forward", "backward"))


def _this_step(f: Facts, b) -> bool:
    """Saved by this step's forward, or by the training passes still awaiting their backward."""
    return b.step == f.focus.step or (f.pending_from_seq is not None and b.alloc_seq >= f.pending_from_seq)


def _block_of(module: str | None) -> str | None:
    """The repeated block a module is in: its path up to the first index ("blocks.3.attn" ->
    "blocks.3"), None outside any."""
    parts = (module or "").split(".")
    cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return None if cut is None else ".".join(parts[:cut + 1])


def _kept_in_fp32(f: Facts) -> float:
    """The share of this step's saved and in-flight bytes that autocast leaves in fp32: the
    outputs (and gradients) of softmax, normalizations, exp/log/pow and the losses, which CUDA
    autocast runs in fp32 (memdoctor.predict.cuda_autocast lists them)."""
    kept = total = 0
    for b in f.focus_blocks:
        if b.category in ("activations", "temporaries") and b.step == f.focus.step and b.phase in ("forward", "backward"):
            total += b.nbytes
            op = b.name.removeprefix("aten.").split(".")[0].lstrip("_")
            if op.removesuffix("_backward_data").removesuffix("_backward").removesuffix("_forward") in FP32_OPS:
                kept += b.nbytes
    return kept / total if total else 0.0


def _in_blocks(f: Facts, module: str | None) -> str | None:
    """The repeated block `module` is in (a list the run recorded, where it did), or None."""
    counts = (f.run.meta.get("block_counts") or {}) if f.run else {}
    key = _block_of(module)
    return None if key is None or (counts and key.rpartition(".")[0] not in counts) else key


def _largest_outside_blocks(f: Facts) -> int:
    saved = max((b.nbytes for b in f.focus_blocks if b.category == "activations" and _this_step(f, b)
                 and _in_blocks(f, b.module) is None), default=0)
    asked = f.requested_bytes or 0 if f.oom and _in_blocks(f, f.oom_module) is None else 0
    return max(saved, asked)


def _full_checkpointing_peak(f: Facts, fixed: int, scaling: int) -> int:
    """The peak with each repeated block checkpointed. The forward keeps each block's input
    (`_block_output` of the block before) and what is saved outside the blocks (a head, a
    loss); backward first runs back through those, with their gradients (what is in flight
    there, or twice the largest of them where backward has not run yet), then recomputes one
    block at a time, last to first, with the inputs of the blocks before it still kept and,
    going back through it, holds its saved tensors and, at the op that made the largest of
    them, the gradients of that op's output and input (a softmax over an attention matrix).
    Blocks that shrink (a ResNet's stages) peak at the first, blocks alike at the last.
    With fewer than two blocks, run or in a list the run recorded: no gain (a flat stack's
    segments keep what its layers saved)."""
    counts = (f.run.meta.get("block_counts") or {}) if f.run else {}
    saved: dict[str, list] = {}
    outside, outside_largest = 0, 0
    kept = {"forward": 0, "backward": 0}         # made outside the blocks, not saved: outputs, gradients
    for b in f.focus_blocks:
        key = _in_blocks(f, b.module)
        if b.category == "activations" and _this_step(f, b):
            if key is None:
                outside += b.nbytes
                outside_largest = max(outside_largest, b.nbytes)
            else:
                saved.setdefault(key, []).append(b)
        elif key is None and b.category == "temporaries" and b.step == f.focus.step and b.phase in kept:
            kept[b.phase] += b.nbytes
    if len(saved) < 2 and not any(counts.get(key.rpartition(".")[0], 0) >= 2 for key in saved):
        return fixed + scaling          # nothing to split: no gain can be shown
    request = f.requested_bytes or 0 if f.oom and _in_blocks(f, f.oom_module) is None else 0
    if f.oom_phase == "forward":
        kept["forward"] += request      # the output asked for: saved, or handed on
        outside_largest = max(outside_largest, request)
    else:
        kept["backward"] += request
    # going back through the head: what it keeps, and the gradients in flight there (at least
    # those of its largest saved tensor's output and input, where backward has not got that far)
    outside_work = kept["forward"] + max(kept["backward"], 2 * outside_largest)
    order = sorted(saved, key=lambda key: min(b.alloc_seq for b in saved[key]))
    kept_and_work = [(_block_output(saved[key]), sum(b.nbytes for b in saved[key]) + 2 * max(b.nbytes for b in saved[key]))
                     for key in order]
    for c in {key.rpartition(".")[0] for key in saved}:
        ran = [i for i, key in enumerate(order) if key.rpartition(".")[0] == c]
        most = kept_and_work[max(ran, key=lambda i: sum(b.nbytes for b in saved[order[i]]))]
        if f.oom and f.oom_phase == "forward":
            kept_and_work[ran[-1]] = most        # the block the OOM cut short: as its list's fullest
        kept_and_work += [most] * (counts.get(c, 0) - len(ran))     # and those it left unrun
    # backward recomputes the blocks last to first, each with the inputs of those before it kept
    inputs, through_blocks = 0, 0
    for block_input, work in kept_and_work:
        inputs += block_input
        through_blocks = max(through_blocks, inputs + work)
    return fixed + outside + max(inputs + outside_work, through_blocks)


def _block_output(saved: list) -> int:
    """What a checkpointed block keeps for the next: the size of the tensor it makes last that
    something saves (its output, the next block's input); not a batch norm's statistics, saved
    after it."""
    largest = max(b.nbytes for b in saved)
    return max((b for b in saved if b.nbytes * STATISTIC >= largest), key=lambda b: b.alloc_seq).nbytes


def _top_modules(f: Facts, limit: int = 4) -> list[tuple[str, int]]:
    by: dict[str, int] = {}
    for b in f.focus_blocks:
        if b.category == "activations" and _this_step(f, b):
            by[b.module or "(outside modules)"] = by.get(b.module or "(outside modules)", 0) + b.nbytes
    return sorted(by.items(), key=lambda kv: -kv[1])[:limit]
