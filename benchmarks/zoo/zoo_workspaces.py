"""The H200's cuDNN convolution workspaces in a CPU-only estimate's requests, to compare it
with the H200 like for like.

A CPU-only estimate has no GPU to measure cuDNN's workspaces on, and a convolutional
network's reserved peak can hinge on them (wav2vec2's feature encoder asks for 760 MiB in
one call). The estimate the H200 ran (benchmarks/zoo/zoo_traces.py, its "predicted"
requests) measured them: `workspace_groups` takes from it each workspace with the allocation
it followed (its anchor: name, module, phase, shape, dtype), and `with_workspaces` puts them
after the same anchors in a local estimate's requests, the n-th occurrence of an anchor
getting the n-th group (the last one past the H200's count: the steady step's).
"""
from __future__ import annotations

WORKSPACE = "cuDNN convolution workspace"


def workspace_groups(predicted: dict) -> dict[str, list[list[list]]]:
    """anchor label -> per occurrence, the workspace requests after it: [1, bytes, slot] for
    an allocation, [0, 0, slot] for a free; a slot ("anchor|occurrence|index") names one
    allocation, which a later group may free."""
    labels = predicted["labels"]
    groups: dict[str, list[list[list]]] = {}
    slot_of: dict[int, str] = {}
    anchor, current = None, None
    for action, n, size in predicted["events"]:
        if action == 1:
            if labels[n].startswith(WORKSPACE) and current is not None:
                slot = f"{anchor}|{len(groups[anchor]) - 1}|{len(current)}"
                slot_of[n] = slot
                current.append([1, size, slot])
            else:
                anchor, current = labels[n], []
                groups.setdefault(anchor, []).append(current)
        elif n in slot_of and current is not None:
            current.append([0, 0, slot_of.pop(n)])
    return {k: v for k, v in groups.items() if any(v)}


def with_workspaces(events: list, labels: list[str], groups: dict[str, list[list[list]]]) -> list[list[int]]:
    """A local estimate's [action, n, bytes] requests with the workspace groups inserted."""
    seen: dict[str, int] = {}
    live: dict[str, int] = {}
    out: list[list[int]] = []
    number = len(labels)
    for action, n, size in events:
        out.append([action, n, size])
        if action != 1 or labels[n] not in groups:
            continue
        occurrences = groups[labels[n]]
        k = seen.get(labels[n], 0)
        seen[labels[n]] = k + 1
        for kind, nbytes, slot in occurrences[min(k, len(occurrences) - 1)]:
            if kind == 1:
                live[slot] = number
                out.append([1, number, nbytes])
                number += 1
            elif slot in live:
                out.append([0, live.pop(slot), 0])
    return out
