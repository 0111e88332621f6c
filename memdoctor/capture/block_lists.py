"""A model's lists of repeated blocks (`blocks.0` .. `blocks.11`, a root nn.Sequential of
like layers): an OOM in block k of n leaves the blocks after it unrun, and the diagnosis
counts what they would save (memdoctor.diagnosis.facts)."""
from __future__ import annotations


def block_lists(root) -> dict[str, int]:
    """Container path ("" for the root itself) -> its number of indexed children, for the
    outermost containers whose children are all of one class (a flat stack of different
    layers is no list of blocks)."""
    kinds: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for name, module in root.named_modules():
        container, _, index = name.rpartition(".")
        if name and index.isdigit() and not any(p.isdigit() for p in container.split(".") if p):
            kinds.setdefault(container, set()).add(type(module).__name__)
            counts[container] = max(counts.get(container, 0), int(index) + 1)
    return {c: n for c, n in counts.items() if n >= 2 and len(kinds[c]) == 1}
