"""Which tensors are logits over a vocabulary: a projection's outputs whose last dimension is
a large weight's rows that no later layer reads, or, where the allocator source knows no
shape, blocks whose size is a whole number of rows over that vocabulary."""
from __future__ import annotations

from memdoctor.cuda.blas_workspaces import WORKSPACE_NAME
from memdoctor.run import Block, Category

W, G, S = Category.WEIGHTS.value, Category.GRADIENTS.value, Category.OPTIMIZER_STATE.value
VOCAB_MIN = 8192        # a last dimension this large on a projection's output is a vocabulary
SOFTMAXED_VOCAB_MIN = 1024      # a narrower head is a vocabulary where the loss or the OOM shows it is one
LOGIT_ROWS = 256        # a shapeless block counts as logits from this many vocabulary rows


def find_logits(blocks: list[Block], request: int, oom_weight: str | None) -> tuple[int | None, list[Block]]:
    """(the vocabulary, the logits over it) among the live `blocks`: outputs of a projection to a
    vocabulary, whose last dim matches a large weight's rows. `request`: what an OOM asked for
    (0 without one); `oom_weight`: the weight of the module it came in."""
    weights = [b for b in blocks if b.category == W and len(b.shape) == 2]
    consumed = {b.shape[1] for b in weights}      # a width some later layer reads is no vocabulary
    softmaxed = {b.shape[-1] for b in blocks if b.shape and "log_softmax" in b.name}   # a loss over it
    softmaxed |= {b.shape[0] for b in weights if b.name == oom_weight}                  # out in the head
    # or out making a second tensor of a live one's
    softmaxed |= {b.shape[-1] for b in blocks if b.category != W and len(b.shape) >= 2 and request
                  and _numel(b) >= b.shape[-1] * LOGIT_ROWS and request in (2 * _numel(b), 4 * _numel(b))}
    vocab_dims = {r for r in (b.shape[0] for b in weights) if r not in consumed
                  and (r >= VOCAB_MIN or r >= SOFTMAXED_VOCAB_MIN and r in softmaxed)}
    if not vocab_dims:
        return None, []
    # the head's weight cast to 16 bits by autocast: a shapeless block of half its size, no logits
    casts = {2 * _numel(b) for b in weights if b.shape[0] in vocab_dims and b.dtype == "float32"}
    return max(vocab_dims), [b for b in blocks if b.category not in (W, G, S) and b.name != WORKSPACE_NAME
                             and (len(b.shape) >= 2 and b.shape[-1] in vocab_dims
                                  or _vocabulary_sized(b, vocab_dims) and b.nbytes not in casts)]


def _numel(b: Block) -> int:
    n = 1
    for d in b.shape:
        n *= d
    return n


def _vocabulary_sized(b: Block, vocab_dims: set[int]) -> bool:
    """A block with no shape (the CUDA allocator's history records none for most) whose size
    is a whole number of rows over a vocabulary (in 16 bits, which any float dtype's row
    divides), at least LOGIT_ROWS of them: a vocabulary of thousands of entries rarely
    divides the size of any other tensor."""
    if b.shape or b.nbytes <= 0:
        return False
    return any(b.nbytes % (2 * v) == 0 and b.nbytes >= 2 * v * LOGIT_ROWS for v in vocab_dims)
