"""Edits to the fake step's Run before its replay: allocations and frees inserted (workspaces,
kernel scratch, DDP's buckets) with every later event index shifted, an op's output
allocations put in the order its CUDA kernel makes them, and the batch told apart from the
other tensors the tracer calls inputs."""
from __future__ import annotations

import bisect
from typing import Callable

import torch

from memdoctor.run import Action, Block, Category, Run

__all__ = ["insert_events", "reorder_allocations", "shift_seqs", "batch_blocks", "inputs_are_the_batch"]


def insert_events(run: Run, events: list[tuple], device_type: str) -> None:
    """Insert allocations and frees into the Run, shifting every later event index. Each
    event is (position before event `pos`, "alloc" or "free", key, bytes, name, category);
    a free names the key of an inserted allocation; an allocation with key None is never
    freed. Events at one position keep their order."""
    if not events:
        return
    device = "cuda:0" if device_type == "cuda" else device_type
    for b in run.blocks.values():
        if b.device.startswith(device_type):
            device = b.device
            break
    events = sorted(events, key=lambda e: e[0])         # stable: same-position order kept
    next_id = max(run.blocks, default=-1) + 1
    positions = [e[0] for e in events]

    def shift(seq: int) -> int:
        return seq + bisect.bisect_right(positions, seq)

    actions, blocks_col, bytes_col = [], [], []
    j = 0
    new_blocks = []
    ids: dict = {}
    for seq in range(len(run.actions) + 1):
        while j < len(events) and events[j][0] == seq:
            _, kind, key, nbytes, name, category = events[j]
            if kind == "alloc":
                blk = Block(next_id, nbytes, category, name, [nbytes], "uint8", device, None,
                            "other", 0, len(actions))
                new_blocks.append(blk)
                if key is not None:
                    ids[key] = blk
                actions.append(Action.ALLOC)
                blocks_col.append(next_id)
                bytes_col.append(nbytes)
                next_id += 1
            else:
                blk = ids.pop(key)
                blk.free_seq = len(actions)
                actions.append(Action.FREE)
                blocks_col.append(blk.id)
                bytes_col.append(blk.nbytes)
            j += 1
        if seq < len(run.actions):
            actions.append(run.actions[seq])
            blocks_col.append(run.event_blocks[seq])
            bytes_col.append(run.event_bytes[seq])
    for b in run.blocks.values():
        b.alloc_seq = shift(b.alloc_seq)
        if b.free_seq is not None:
            b.free_seq = shift(b.free_seq)
    for blk in new_blocks:
        run.blocks[blk.id] = blk
    shift_seqs(run, shift)
    run.actions, run.event_blocks, run.event_bytes = actions, blocks_col, bytes_col
    for blk in new_blocks:
        mark = run.mark_at(blk.alloc_seq)
        if mark is not None:
            blk.phase, blk.step = mark.phase, mark.step


def reorder_allocations(run: Run, spans: list[tuple[int, int, list[int]]]) -> int:
    """Within each span (first event index, end index, blocks), give the blocks' allocations
    the span's allocation slots in the blocks' order: an op whose kernel allocates its outputs
    in another order than it returns them. A span whose allocations are not those blocks' is
    left as it is. Returns how many spans were reordered."""
    done = 0
    for first, end, blocks in spans:
        wanted = set(blocks)
        slots = [seq for seq in range(first, min(end, len(run.actions)))
                 if run.actions[seq] == Action.ALLOC and run.event_blocks[seq] in wanted]
        if len(slots) != len(blocks):
            continue
        nbytes = {run.event_blocks[seq]: run.event_bytes[seq] for seq in slots}
        for seq, bid in zip(slots, blocks):
            run.event_blocks[seq] = bid
            run.event_bytes[seq] = nbytes[bid]
            run.blocks[bid].alloc_seq = seq
        done += 1
    return done


def shift_seqs(run: Run, shift: Callable[[int], int]) -> None:
    """Move the marks, OOMs and samples with the events they point at, after events were
    inserted or removed (an insert at a mark's position lands under the previous mark)."""
    for item in (*run.marks, *run.ooms, *run.samples):
        item.seq = shift(item.seq)


def batch_blocks(recorder, batch) -> set[int]:
    """The blocks of the batch's tensors (counted now if the build made them untraced)."""
    from torch.utils._pytree import tree_leaves
    ids = set()
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            block = recorder.add(t, "", Category.INPUTS.value)
            if block is not None:
                ids.add(block)
    return ids


def inputs_are_the_batch(run: Run, batch_ids: set[int]) -> None:
    """The tracer calls 'inputs' whatever enters an outermost module call; a checkpointed
    block recomputed in backward is such a call, so the hidden states checkpointing saves
    would count as inputs. In an estimate the inputs are the batch: the rest are activations."""
    for b in run.blocks.values():
        if b.category == Category.INPUTS.value and b.id not in batch_ids:
            b.category = Category.ACTIVATIONS.value
