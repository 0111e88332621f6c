"""Losses that compare a batch's samples with one another (CLIP's and SimCLR's contrastive
losses, in-batch hard negatives): a matrix of the batch's rows against its rows, made by a
matmul or a pairwise distance outside any Linear layer. Splitting such a batch into
micro-batches changes the loss (each sample meets fewer negatives), so those fixes are not
offered for it; caching the embeddings' gradients (GradCache) keeps it whole."""
from __future__ import annotations

from memdoctor.run import Block, Run

PAIR_OPS = frozenset(("aten.mm", "aten.bmm", "aten.matmul", "aten._cdist_forward", "aten.cdist"))
MIN_ROWS = 16           # fewer rows: no batch worth splitting
VIEWS = (1, 2)          # SimCLR compares two augmented views of each sample: twice the rows


def pair_matrices(run: Run) -> list[Block]:
    """The matrices of the batch's rows against its rows the run made in training: 2-D (or
    with leading dims of 1) and square, n rows with n a batch's rows (or twice them), made by
    a matmul or a distance outside backward (a weight's gradient can be as square) whose
    module (if any) has no weight (not a Linear layer as wide as the batch)."""
    rows = {b.shape[0] * k for b in run.blocks.values() if b.category == "inputs" and b.shape for k in VIEWS}
    weights = {b.name for b in run.blocks.values() if b.category == "weights"}
    found = []
    for b in run.blocks.values():
        if b.name not in PAIR_OPS or b.phase in ("backward", "optimizer") or len(b.shape) < 2 \
                or any(d != 1 for d in b.shape[:-2]):
            continue
        n, m = b.shape[-2:]
        if n == m and n >= MIN_ROWS and n in rows and not (b.module and f"{b.module}.weight" in weights):
            found.append(b)
    return found


def pair_bytes_at_once(run: Run, pairs: list[Block], step: int) -> int:
    """The most bytes of tensors shaped as those matrices (the scores, their softmax, their
    gradients) alive at one time in `step`: what stays whole when the rest is split."""
    shapes = {tuple(b.shape) for b in pairs}
    events = []
    for b in run.blocks.values():
        if b.step == step and tuple(b.shape) in shapes:
            events.append((b.alloc_seq, b.nbytes))
            if b.free_seq is not None:
                events.append((b.free_seq, -b.nbytes))
    live = most = 0
    for _, delta in sorted(events):
        live += delta
        most = max(most, live)
    return most
