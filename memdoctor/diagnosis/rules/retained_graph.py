"""retained-graph: the last step's autograd graph, back-propagated already, still alive.

What it detects
    Tensors the previous step's forward saved for backward are alive in this step, though
    that step's backward ran: backward was told to keep the graph (`retain_graph=True`) and
    something still refers to it (the last loss or output, a hidden state carried on).
Preconditions
    - steps are optimizer steps or backward() calls, the focus (the OOM, else a peak under
      pressure) is in the second step or later, and a backward ran in the step before, told
      to keep its graph (`retain_graph=True`, `create_graph=True`; the trace notes those
      calls): without one, what outlived that step is the script's own (an output still
      bound to a variable), not a graph;
    - what that step's forward saved, still alive and held by no container the script adds
      to (a list of losses is a leak) nor by passes awaiting their backward, takes at least
      10% of live memory.
Why it runs out of memory
    Backward frees the tensors a graph saved as it goes, unless told to retain them. A graph
    retained and still referenced keeps a whole step's activations through the optimizer
    step and the next forward: twice the activations at the peak.
Example
    bad:  loss.backward(retain_graph=True)          # added to silence "backward through the graph a second time"
    good: loss.backward()                           # and detach what is carried between steps:
          hidden = hidden.detach()
Fix
    Drop `retain_graph=True`; where it was added because a tensor carried between steps (an
    RNN's hidden state) links the graphs, detach that tensor at each step instead.
Known limits
    A graph kept on purpose for a second backward in the next step looks the same.
"""
from __future__ import annotations

from memdoctor.units import format_bytes
from memdoctor.diagnosis.base import Finding, Remedy, free_fix_tier, fits
from memdoctor.diagnosis.facts import Facts
from memdoctor.diagnosis.forward_cut import freed_by_backward, previous_step_peak
from memdoctor.run import Phase

ID = "retained-graph"
SHARE = 0.1


def check(f: Facts) -> Finding | None:
    if f.source != "run" or not f.run or not (f.oom or f.under_pressure) or f.focus is None:
        return None
    current = f.focus.step
    if current < 1 or f.steps_from not in ("optimizer", "backward") or not _backward_ran(f, current - 1) \
            or not _retained_in(f, current - 1):
        return None
    held = f.held_by_containers
    repeated = _repeated_calls(f, current)
    kept = [b for b in f.focus_blocks if b.category == "activations" and b.step == current - 1
            and b.phase == Phase.FORWARD.value and b.id not in held
            and not (f.pending_from_seq is not None and b.alloc_seq >= f.pending_from_seq)
            and any(start <= b.alloc_seq <= end for start, end in repeated)]
    kept_bytes, live = sum(b.nbytes for b in kept), f.focus_bytes
    if not live or kept_bytes < SHARE * live:
        return None
    evidence = [f"{format_bytes(kept_bytes)} that step {current - 1}'s forward saved for backward is alive in step "
                f"{current}, {100 * kept_bytes / live:.0f}% of {format_bytes(live)}, though its backward ran: the "
                "graph was retained (`retain_graph=True`) and is still referred to (the last loss or output, a carried "
                "hidden state)"]
    predicted = live - kept_bytes
    # from an OOM in the forward: the step before ran the whole step, less the older graph it
    # kept and what a backward that frees as it goes would have freed by its peak
    before = previous_step_peak(f, f.run, lambda b: b.category == "activations" and b.step < current - 1
                                and b.phase == Phase.FORWARD.value and b.id not in held, freed_by_backward)
    predicted = max(predicted, before or 0)
    remedies = [Remedy("let backward free the graph", "drop `retain_graph=True` from `backward()`; where a tensor "
                       "carried between steps (an RNN's hidden state) links the graphs, `.detach()` it each step "
                       "instead", predicted)]
    return Finding(ID, f"the last step's graph is kept: {format_bytes(kept_bytes)} saved for a backward that ran",
                   kept_bytes, evidence, remedies, free_fix_tier(f, predicted), fits(f, predicted),
                   {"step": current - 1}, blocks=kept)


def _retained_in(f: Facts, step: int) -> bool:
    """Whether a backward of `step` was told to keep its graph (runs traced before such calls
    were noted say nothing: then any)."""
    calls = f.run.meta.get("retaining_backwards")
    if calls is None:
        return True
    marks = f.run.marks
    return any(isinstance(c, dict) and 0 <= c.get("mark", -1) < len(marks) and marks[c["mark"]].step == step
               for c in calls)


def _backward_ran(f: Facts, step: int) -> bool:
    return any(m.phase == Phase.BACKWARD.value and m.step == step for m in f.run.marks)


def _repeated_calls(f: Facts, current: int) -> list[tuple[int, int]]:
    """The event spans of the step before's model calls made from a line that calls again in
    this step: the training step's passes, not a pass made once before training (a style
    image's features computed up front, in the first step's numbering)."""
    calls = [c for c in f.run.meta.get("forward_calls") or [] if isinstance(c, dict) and c.get("site")]
    marks = f.run.marks

    def step_of(c) -> int:
        return marks[c["mark_start"]].step if 0 <= c.get("mark_start", -1) < len(marks) else -1
    now = {tuple(c["site"]) for c in calls if step_of(c) == current}
    return [(c["seq_start"], c["seq_end"] if c.get("seq_end") is not None else f.focus.seq)
            for c in calls if step_of(c) == current - 1 and tuple(c["site"]) in now]

