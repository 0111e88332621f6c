"""large-logits: an output projection to a large vocabulary and its loss dominate.

What it detects
    Live tensors whose last dimension is the row count of a large projection weight (a
    language-model head, a classifier over many labels): the logits, their softmax in
    the loss, and their gradient.
Preconditions
    - the run is under pressure (an OOM, or a peak within 20% of the limit);
    - a 2-D weight has at least 8192 rows that no other layer reads as its input width (an
      output projection, not a hidden layer); 1024 where the run shows them a vocabulary: a
      live log-softmax (a cross-entropy's) is over them, the OOM came in that projection, or
      it came asking for a 16- or 32-bit copy of a whole live tensor over those rows;
    - live tensors whose last dimension is that row count (plus a failed request that a
      vocabulary row divides, of at least 256 rows: a forward under no_grad can run out
      asking for the logits themselves) take at least 30% of live memory.
Why it runs out of memory
    batch x sequence x vocabulary floats: 4 x 512 x 32000 in fp32 is 250 MiB for the
    logits alone, and cross-entropy makes one more of the same size, and backward a third.
Example
    bad:  loss = F.cross_entropy(model(ids).reshape(-1, vocab), targets)
    good: a chunked cross-entropy that projects and reduces a few thousand tokens at a
          time, so full-vocabulary tensors exist for one chunk only
Fix
    Compute the head and the loss in chunks (or with a fused linear-cross-entropy kernel),
    or use micro-batches so fewer tokens are in flight; where the logits come from passes
    never back-propagated (an evaluation loop, under no_grad or not), evaluate a smaller
    batch at a time instead: training is untouched. When the run ran out in an evaluation
    before its first training step, the predicted peaks are that evaluation's, and the
    finding says that the training step at the same batch was never measured. A loop of
    the script's own binds each evaluation pass's output, alive through the next pass: the
    smaller batch's peak counts the head's output once more (a framework's evaluation step
    drops it as it returns).
Known limits
    A vocabulary is recognised by its width only: a hidden layer 8192 wide that no other
    layer reads (a final embedding) looks the same.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import SPECIFIC_PART, Finding, Remedy, fits, plural
from memdoctor.diagnosis.facts import Facts, running_call
from memdoctor.diagnosis.logits import LOGIT_ROWS
from memdoctor.attribution import peak
from memdoctor.remedies.framework_terms import framework_of
from memdoctor.run import Phase

NOB = Phase.FORWARD_NO_BACKWARD.value

ID = "large-logits"
_EVAL_BATCH = {"transformers": "transformers: TrainingArguments(per_device_eval_batch_size=a quarter of it)",
               "lightning": "lightning: a quarter of the validation DataLoader's batch_size",
               "accelerate": "accelerate: a quarter of the evaluation DataLoader's batch_size"}
SHARE = 0.3
CHUNKS = 8


def check(f: Facts) -> Finding | None:
    if not f.under_pressure or f.source != "run" or not f.vocab:
        return None
    logit_bytes = sum(b.nbytes for b in f.logits)
    request = f.requested_bytes or 0
    asked = asks_for_logits(f)
    if asked:
        logit_bytes += request
    live = f.focus_bytes
    if not logit_bytes or logit_bytes < SHARE * live:
        return None
    count = len(f.logits) + asked
    evidence = [f"{plural(count, 'tensor')} over the {f.vocab}-entry vocabulary "
                f"{'holds' if count == 1 else 'hold'} {format_bytes(logit_bytes)}, "
                f"{100 * logit_bytes / live:.0f}% of {format_bytes(live)}"
                + (" (the failed request among them)" if asked else "")]
    if f.logits:
        biggest = max(f.logits, key=lambda b: b.nbytes)
        evidence.append(f"largest: {biggest.name or 'a tensor'} "
                        + (f"{'x'.join(map(str, biggest.shape))} {biggest.dtype} " if biggest.shape else "")
                        + f"{format_bytes(biggest.nbytes)} in {biggest.phase}")
    predicted = live - logit_bytes + logit_bytes // CHUNKS
    remedies = [
        Remedy("chunked cross-entropy", f"compute the head and the loss over {CHUNKS} chunks of tokens "
               "(memdoctor.remedies.chunked_cross_entropy)", predicted, None),
    ]
    quarter = live - logit_bytes + logit_bytes // 4
    if asked and not f.logits:
        quarter += request // 4     # out asking for the logits themselves: the loss's log-softmax is still to come
    if f.oom_phase == NOB or (f.oom and f.oom_grad_enabled is False) \
            or (f.logits and all(b.phase == NOB for b in f.logits)):
        framework = framework_of((f.run.meta.get("frameworks") or []) if f.run else [])
        # a loop of the script's own binds each pass's output; a framework's evaluation step
        # (the Trainer's prediction_step, Lightning's validation_step) drops it as it returns
        kept = _kept_into_the_next_pass(f) if framework is None else 0
        remedies.append(Remedy("smaller evaluation batch", "evaluate a quarter of the batch at a time (the "
                               "evaluation loop's own batch size; training is untouched)",
                               max(quarter + kept // 4, _training_peak(f)), None, _EVAL_BATCH.get(framework)))
        if f.oom and f.steps_from in ("forward", "none"):     # no backward, no optimizer step yet
            evidence.append("it ran out before any backward: these peaks are the evaluation's; "
                            "a training step at this batch was never measured")
    else:
        remedies.append(Remedy("smaller micro-batches", "Plan(micro_batch='auto') keeps the effective batch",
                               quarter, "micro=auto"))
    return Finding(ID, f"logits over a {f.vocab}-entry vocabulary take {format_bytes(logit_bytes)}",
                   logit_bytes, evidence, remedies, SPECIFIC_PART, fits(f, predicted),
                   {"vocab": f.vocab})


def _kept_into_the_next_pass(f: Facts) -> int:
    """An evaluation loop binds each pass's output (`logits, loss = model(x, y)`), which stays
    alive through the next pass: where the OOM came in a pass that no earlier pass's logits
    outlive, the head's output (the pass's first logits) is to be kept once more."""
    call = running_call(f.run, f.run.ooms[0].seq) if f.oom and f.run and f.run.ooms else None
    start = call.get("seq_start") if call else None
    if type(start) is not int:
        return 0
    made = sorted((b for b in f.logits if b.alloc_seq >= start), key=lambda b: b.alloc_seq)
    if not made or any(b.alloc_seq < start and b.nbytes * 2 >= made[0].nbytes for b in f.logits):
        return 0
    return made[0].nbytes


def _training_peak(f: Facts) -> int:
    """The run's peak before the passes since its last backward began (an evaluation after
    training): a smaller evaluation batch leaves it as it is."""
    calls = [c for c in (f.run.meta.get("forward_calls") or []) if isinstance(c, dict)] if f.run else []
    last = max((i for i, c in enumerate(calls) if c.get("backward")), default=None)
    if last is None or last + 1 >= len(calls) or type(calls[last + 1].get("seq_start")) is not int:
        return 0
    return peak(f.run, 0, calls[last + 1]["seq_start"])[1]


def asks_for_logits(f: Facts) -> bool:
    """The failed request is logits over the vocabulary: a whole number of rows of it (a row
    in 16 bits divides any float logits tensor), at least LOGIT_ROWS of them."""
    request, row = f.requested_bytes or 0, (f.vocab or 0) * 2
    return bool(f.oom and row and request and request % row == 0 and request >= row * LOGIT_ROWS)
