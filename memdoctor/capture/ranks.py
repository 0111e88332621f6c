"""Which rank this process is, and where each rank's files go.

Under torchrun every rank traces itself (`memdoctor.watch`, `memdoctor trace`): the Run
records its rank, and files get the rank in their name (`oom.json` -> `oom.rank1.json`),
so ranks never write over each other (memdoctor.diagnosis.merge joins their findings).
"""
from __future__ import annotations

import os

_SUFFIXES = (".memrun.json.gz", ".json.gz", ".json", ".html", ".gz")


def rank_info() -> tuple[int, int] | None:
    """(rank, world size) when this process is one of several ranks, else None: from
    torch.distributed once initialised, else from torchrun's RANK and WORLD_SIZE."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return (rank, world) if world > 1 and 0 <= rank < world else None


def per_rank_path(path: str, rank: int) -> str:
    """`path` with `.rankN` before its suffix: run.memrun.json.gz -> run.rank1.memrun.json.gz."""
    for suffix in _SUFFIXES:
        if path.endswith(suffix):
            return f"{path[:-len(suffix)]}.rank{rank}{suffix}"
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def path_for(run, path: str) -> str:
    """Where `run`'s file goes: `path`, with the rank in it when the run is one of several."""
    rank = run.meta.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        return per_rank_path(path, rank)
    return path


def rank_of(run, default: int) -> int:
    value = run.meta.get("rank")
    return value if isinstance(value, int) and not isinstance(value, bool) else default
