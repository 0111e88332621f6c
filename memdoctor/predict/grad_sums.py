"""The gradient sums autograd's engine makes in place on a GPU, and the other in-place ops
real tensors get where subclass-like ones (a FakeTensor) get an out-of-place copy: F.linear's
bias added after its matmul (memdoctor.predict.linear_bias) and the indexing and
index_select backwards' accumulation into fresh zeros (KernelWatch._note_index_backward,
_note_index_select_backward); found in the fake step's
Run (which has each as a new allocation and a free) and merged into one block each."""
from __future__ import annotations

import bisect

from memdoctor.predict.events import shift_seqs
from memdoctor.run import Action, Run, stronger

__all__ = ["sums_in_place", "merge_in_place"]


def sums_in_place(run: Run, accumulations: list) -> list[tuple[int, int]]:
    """The gradient sums autograd's engine makes in place on real tensors: (sum, operand)
    block pairs.

    The engine adds a gradient into the one already buffered for the same input in place
    when it holds the last reference to either (`InputBuffer::accumulate`), but never while
    a Python dispatch mode is active (`isTensorSubclassLike`), so the fake run allocated a
    new sum and then freed the operand. Measured on the H200: the same
    configurations under a dispatch mode reserve up to 300 MiB less or more than plain, and
    the plain traces have no allocation where the fake run has the sum. A sum counts when
    the operand's free follows it at once: the engine held the operand's last reference.
    The engine sums only into the buffered gradient, and only if it is not a view: a tied
    head's fp32 gradient (a transpose's view) is summed anew with the embedding's, while
    under autocast (a cast's fresh output) it is summed in place (the H200's plain traces of
    GPT-2 774M fp32 and Llama 1B bf16)."""
    pairs = []
    for before, after, into, out in accumulations:
        if after != before + 1 or run.actions[before] != Action.ALLOC or run.event_blocks[before] != out:
            continue
        freed = set()           # what the engine let go right after the sum: its operands
        seq = after
        while seq < len(run.actions) and seq <= after + 1 and run.actions[seq] == Action.FREE:
            freed.add(run.event_blocks[seq])
            seq += 1
        for operand in into:
            if operand in freed and run.blocks[operand].nbytes == run.blocks[out].nbytes:
                pairs.append((out, operand))
                break
    return pairs


def merge_in_place(run: Run, pairs: list[tuple[int, int]]) -> int:
    """Make each (sum, operand) pair one block: the sum's allocation and the operand's free,
    still apart by nothing but the other operand's free, leave the run, and the operand's
    block lives on as the sum (its category the stronger of the two). Returns how many merged."""
    survivor: dict[int, int] = {}
    drop: set[int] = set()
    for out, operand in pairs:
        b_out, b_op = run.blocks.get(out), run.blocks.get(operand)
        if b_out is None or b_op is None or b_op.free_seq is None or \
                not 0 < b_op.free_seq - b_out.alloc_seq <= 2 or \
                any(a != Action.FREE for a in run.actions[b_out.alloc_seq + 1:b_op.free_seq]):
            continue
        keep = survivor.get(operand, operand)
        survivor[out] = keep
        drop.update((b_out.alloc_seq, b_op.free_seq))
        kept = run.blocks[keep]
        kept.category = stronger(b_out.category, kept.category)
        if b_out.shape and not kept.shape:
            kept.shape, kept.dtype = b_out.shape, b_out.dtype
    if not drop:
        return 0
    removed = sorted(drop)
    actions, blocks_col, bytes_col = [], [], []
    for seq, (a, bid, n) in enumerate(zip(run.actions, run.event_blocks, run.event_bytes)):
        if seq not in drop:
            actions.append(a)
            blocks_col.append(survivor.get(bid, bid))
            bytes_col.append(n)
    run.actions, run.event_blocks, run.event_bytes = actions, blocks_col, bytes_col
    for bid in survivor:
        del run.blocks[bid]
    for b in run.blocks.values():
        b.free_seq = None
    for seq, (a, bid) in enumerate(zip(actions, blocks_col)):
        b = run.blocks.get(bid)
        if b is None:
            continue
        if a == Action.ALLOC:
            b.alloc_seq = seq
        elif a == Action.FREE:
            b.free_seq = seq
    shift_seqs(run, lambda seq: seq - bisect.bisect_left(removed, seq))
    return len(survivor)
