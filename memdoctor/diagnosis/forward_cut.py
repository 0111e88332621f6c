"""An OOM part-way through a training step: what the step would still make and hold.

The tensors alive at such an OOM are only part of the step's working set: the repeated
blocks after the OOM's have not run, and what a finished block holds (saved for backward,
or kept where no saved-tensor hook sees it) says what each of them would hold. A fix
predicted from the OOM's tensors alone is told "fits" where the rest of the forward runs out.
The functions read a diagnosis' Facts (`f`), which are built with them.
"""
from __future__ import annotations

import numpy as np

from memdoctor.attribution import live_blocks, live_curve, peak
from memdoctor.run import Action, Category, Phase, Run
from memdoctor.units import format_bytes

ACT, TMP = Category.ACTIVATIONS.value, Category.TEMPORARIES.value


def step_held(f) -> int:
    """An OOM in a training step's forward or backward: what this step's passes made and still
    hold without a saved-tensor hook seeing it saved (kept by a checkpoint's policy or a custom
    Function's ctx, recomputed by checkpointing in backward, gradients of activations, the op in
    flight in backward). It grows with the batch as saved activations do. The block running at
    an OOM in the forward is left out: its tensors are its ops' working set, freed as it ends
    where nothing saves them (a frozen or no_grad backbone)."""
    passes = (Phase.FORWARD.value, Phase.BACKWARD.value)
    if f.oom_phase not in passes:
        return 0
    running = None
    if f.oom_phase == Phase.FORWARD.value:
        if not f.oom_in_training_forward or f.run is None:
            return 0
        running = oom_block(f, f.run.meta.get("block_counts") or {})
    return sum(b.nbytes for b in f.focus_blocks if b.category == TMP and b.step == f.focus.step
               and b.phase in passes and not (running and running[0] is not None
                                              and block_index(b.module, running[0]) == running[1]))


def forward_rest(f, run: Run) -> tuple[int, str | None]:
    """An OOM inside block k of a training forward's n repeated blocks (`blocks.k`): blocks
    k+1..n-1 have not run, and would each hold about what the largest finished block of the
    list holds (less its output, the running block's input), or where none had finished, what
    the OOM's own block saved so far and the request. A block that saved nothing (frozen, or
    under no_grad) makes nothing that outlives it."""
    if not f.oom_in_training_forward:
        return 0, None
    forward = Phase.FORWARD.value
    counts = run.meta.get("block_counts") or {}
    container, at = oom_block(f, counts)
    total = counts.get(container, 0) if container is not None else 0
    if total < 2 or at >= total:
        return 0, None
    held: dict[int, int] = {}
    saved: dict[int, int] = {}
    last: dict[int, object] = {}
    for b in f.focus_blocks:
        index = block_index(b.module, container)
        if index is None or b.category not in (ACT, TMP) or b.step != f.focus.step or b.phase != forward:
            continue
        held[index] = held.get(index, 0) + b.nbytes
        if b.category == ACT:
            saved[index] = saved.get(index, 0) + b.nbytes
        if index not in last or b.alloc_seq > last[index].alloc_seq:
            last[index] = b
    if at >= 1 and at - 1 in last and last[at - 1].category == TMP:
        held[at - 1] -= last[at - 1].nbytes     # the previous block's output: the running block's input
    own = held.get(at, 0) + (f.requested_bytes or 0) if saved.get(at) else 0
    largest = max((i for i in range(at) if held.get(i)), key=held.__getitem__, default=None)
    per_block = held[largest] if largest is not None else own
    rest = max(per_block - own, 0) + per_block * (total - at - 1)
    if not rest:
        return 0, None

    def block(i: int) -> str:
        return f"{container}.{i}" if container else f"the model's child {i}"
    return rest, (f"the OOM came in {block(at)}, block {at + 1} of {total}: the rest of the forward would "
                  f"save about {format_bytes(rest)} more ({format_bytes(per_block)} a block, as "
                  f"{block(largest if largest is not None else at)} saved"
                  + (" so far" if largest is None else "") + "), counted in the predicted peaks")


def oom_block(f, counts: dict[str, int]) -> tuple[str | None, int]:
    """The list of blocks and the block the OOM came in: named by the OOM's module where it is
    one of them (the dispatch source knows the innermost module), else the block that made the
    latest of this forward's tensors still alive (the allocator source knows the outermost)."""
    parts = (f.oom_module or "").split(".")
    cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if cut is not None and ".".join(parts[:cut]) in counts:
        return ".".join(parts[:cut]), int(parts[cut])
    latest, found = -1, (None, 0)
    for b in f.focus_blocks:
        if b.step != f.focus.step or b.phase != Phase.FORWARD.value or b.alloc_seq <= latest:
            continue
        for container in counts:
            index = block_index(b.module, container)
            if index is not None:
                latest, found = b.alloc_seq, (container, index)
    return found


def block_index(module: str | None, container: str) -> int | None:
    """Which block of the list at `container` ("" for the root) `module` is in, if any."""
    if not module or (container and not module.startswith(container + ".")):
        return None
    first = module[len(container) + 1:].split(".")[0] if container else module.split(".")[0]
    return int(first) if first.isdigit() else None


def rest_of_step(f, run: Run) -> int | None:
    """An OOM in the forward of a training step after the first: what the rest of the step
    (its forward from the OOM on, and its backward) added to the live bytes in the step
    before, read at the same op of that step's forward (alike steps run alike ops). A fix
    that takes tensors away at the OOM still has the rest of the step to run. None where
    there is no such step to read."""
    if not (f.oom and f.oom_in_training_forward and f.focus is not None and f.focus.step >= 1
            and f.steps_from in ("optimizer", "backward") and run.ooms):
        return None
    step = f.focus.step

    def first(phase, in_step, after=-1):
        return next((m.seq for m in run.marks if m.step == in_step and m.phase == phase and m.seq > after), None)
    now, before = first(Phase.FORWARD.value, step), first(Phase.FORWARD.value, step - 1)
    if now is None or before is None:
        return None
    end = first(Phase.OPTIMIZER.value, step - 1, before) or min((m.seq for m in run.marks if m.step >= step),
                                                               default=run.num_events)
    at = _same_request_before(run, now, before, end, f.requested_bytes)
    if not before <= at < end:
        return None
    curve = live_curve(run)
    # the live bytes hold the request; the step before made its like at `at`
    return max(max(curve[at:end]) - curve[max(at - 1, 0)] - (f.requested_bytes or 0), 0)


def _same_request_before(run: Run, now: int, before: int, end: int, request: int | None) -> int:
    """Where the step before (its forward from `before`) made what the OOM's step (from `now`)
    asked for: its allocation of the same size, as many of them in as at the OOM. Counting
    events alone is thrown off by what only a first step makes (a mask made once and cached)."""
    oom = run.ooms[0].seq
    if request:
        alloc, actions, sizes = Action.ALLOC, run.actions, run.event_bytes
        k = sum(1 for s in range(now, oom) if actions[s] == alloc and sizes[s] == request)
        for s in range(before, end):
            if actions[s] == alloc and sizes[s] == request:
                if k == 0:
                    return s
                k -= 1
    return before + oom - now


def previous_step_peak(f, run: Run, removed, consumed=None) -> int | None:
    """An OOM in the forward of a training step after the first: the peak the step before
    reached in its forward and backward, less what `removed(block)` says a fix takes away of
    what was alive then, plus the optimizer state made after it (a first step's). A fix that
    changes what the step itself saves or makes reaches at least that. None where there is
    no such step. `consumed(seq, alive)`: the ids of blocks also taken away, which the fixed
    step would have freed by then (see `freed_by_backward`)."""
    if not (f.oom and f.oom_in_training_forward and f.focus is not None and f.focus.step >= 1
            and f.steps_from in ("optimizer", "backward")):
        return None
    step = f.focus.step - 1
    start = next((m.seq for m in run.marks if m.step == step and m.phase == Phase.FORWARD.value), None)
    if start is None:
        return None
    end = next((m.seq for m in run.marks if m.seq > start and (m.step > step or m.phase == Phase.OPTIMIZER.value)),
               run.num_events)
    seq, top = peak(run, start, end)
    alive = live_blocks(run, seq)
    used = consumed(seq, alive) if consumed is not None else set()
    taken = sum(b.nbytes for b in alive if removed(b) or b.id in used)
    state_then = sum(b.nbytes for b in alive if b.category == Category.OPTIMIZER_STATE.value)
    return top - taken + max(f.cat(Category.OPTIMIZER_STATE.value) - state_then, 0)


def freed_by_backward(seq: int, alive: list) -> set[int]:
    """Which saved tensors of `alive` a backward that frees what it has used (no
    `retain_graph`) would have freed by event `seq` of a backward that kept everything:
    backward runs the ops in reverse, so where it is making the gradient of a tensor of some
    shape, the tensors the forward saved after the last one of that shape were used already.
    A guess from shapes (gradients have their tensor's shape), from sizes where the allocator
    source knows no shapes; where no gradient made by then is seen, none."""
    grads = [g for g in alive if g.phase == Phase.BACKWARD.value and g.alloc_seq <= seq]
    if not grads:
        return set()
    latest = max(grads, key=lambda g: g.alloc_seq)

    def like(a) -> bool:
        return a.shape == latest.shape if a.shape and latest.shape else a.nbytes == latest.nbytes
    made = [a.alloc_seq for a in alive if a.step == latest.step and a.phase == Phase.FORWARD.value and like(a)]
    if not made:
        return set()
    return {b.id for b in alive if b.category == ACT and b.phase == Phase.FORWARD.value and b.step == latest.step
            and b.alloc_seq > max(made)}


def peak_without(f, run: Run, removed) -> int | None:
    """The highest live total from the start of the step before the focus's (its own, in the
    first step) to the focus, had the blocks `removed(block)` picks never been made, plus the
    optimizer state made since then: a fix that takes those blocks away still reaches it,
    wherever the run as written peaked (a conv's workspace in a later pass can outweigh what
    the fix frees there). None without a training step to read."""
    if f.focus is None or f.steps_from not in ("optimizer", "backward"):
        return None
    step = max(f.focus.step - 1, 0)
    start = next((m.seq for m in run.marks if m.step == step and m.phase == Phase.FORWARD.value), None)
    end = f.focus.seq + 1
    if start is None or start >= end:
        return None
    change = np.zeros(end - start + 1, dtype=np.int64)
    state_now = f.cat(Category.OPTIMIZER_STATE.value)
    change[0] += state_now
    for b in run.blocks.values():
        state = b.category == Category.OPTIMIZER_STATE.value
        if not (state or removed(b)):
            continue
        lo, hi = max(b.alloc_seq, start), min(end if b.free_seq is None else b.free_seq, end)
        if lo < hi:
            change[lo - start] -= b.nbytes
            change[hi - start] += b.nbytes
    curve = np.asarray(live_curve(run)[start:end], dtype=np.int64)
    return int(max((curve + np.cumsum(change)[:-1]).max(), 0))
