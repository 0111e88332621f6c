"""An OOM part-way through a training step: what the step would still make and hold.

The tensors alive at such an OOM are only part of the step's working set: the repeated
blocks after the OOM's have not run, and what a finished block holds (saved for backward,
or kept where no saved-tensor hook sees it) says what each of them would hold. A fix
predicted from the OOM's tensors alone is told "fits" where the rest of the forward runs out.
The functions read a diagnosis' Facts (`f`), which are built with them.
"""
from __future__ import annotations

from memdoctor.run import Category, Phase, Run
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
