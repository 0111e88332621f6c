"""A Run as a PyTorch memory snapshot: the dict `torch.cuda.memory._snapshot()` returns, which
PyTorch's memory_viz viewer (pytorch.org/memory_viz, `python -m torch.cuda._memory_viz`) opens.

What the format has room for carries memdoctor's view: every allocation's `category` (the
viewer colours the Active Memory Timeline by it), its frames (the innermost two name
memdoctor's category, tensor, phase, step and module; then the user's line where it is
known), and `user_metadata` with the same in words. Addresses are memdoctor's own layout:
one segment in which a freed block's address is taken again by the next block of its size,
so the segment's size is near the peak; a CUDA run's real addresses are not reproduced.

The file is a pickle, because that is what the viewer reads (protocol 4: its unpickler reads
2 to 4). memdoctor writes it and never reads one back.
"""
from __future__ import annotations

import pickle
from typing import Any

from memdoctor.run import Action, Run, write_atomic

PROTOCOL = 4
ALIGN = 512                 # the CUDA caching allocator's rounding
BASE_ADDRESS = 1 << 40      # where the one segment starts: far from 0, as device addresses are
UNKNOWN = "unknown"         # the viewer's name for memory of no category


def _rounded(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class _Layout:
    """Addresses for blocks in one segment: a freed address is reused by the next block of
    the same rounded size, else the segment grows at its end."""

    def __init__(self) -> None:
        self.end = 0
        self.free: dict[int, list[int]] = {}

    def take(self, size: int) -> int:
        spare = self.free.get(size)
        if spare:
            return spare.pop()
        offset, self.end = self.end, self.end + size
        return BASE_ADDRESS + offset

    def give(self, address: int, size: int) -> None:
        self.free.setdefault(size, []).append(address)


def snapshot_of(run: Run) -> dict[str, Any]:
    """The snapshot dict of `run`: a device trace of every alloc, free and OOM in order, and
    the one segment's blocks as they stand at the end of the run."""
    layout = _Layout()
    addresses: dict[int, int] = {}
    frames_of: dict[int, list] = {}
    ooms = {o.seq: o for o in run.ooms}
    marks, m = run.marks, 0
    trace: list[dict[str, Any]] = []
    for seq, action, block_id, nbytes in run.events():
        while m + 1 < len(marks) and marks[m + 1].seq <= seq:
            m += 1
        time_us = int(marks[m].time * 1e6) if marks else 0
        if action == Action.OOM:
            trace.append(_oom_entry(run, ooms.get(seq), nbytes, time_us))
            continue
        block = run.blocks.get(block_id)
        if block is None:
            continue
        size = _rounded(block.nbytes)
        if action == Action.ALLOC:
            addresses[block_id] = address = layout.take(size)
            frames = frames_of[block_id] = _frames(run, block)
            trace.append({"action": "alloc", "addr": address, "size": size, "stream": 0, "frames": frames,
                          "category": block.category, "user_metadata": _metadata(block), "time_us": time_us})
        elif action == Action.FREE and block_id in addresses:
            address = addresses.pop(block_id)
            layout.give(address, size)
            frames = frames_of.pop(block_id)
            for kind in ("free_requested", "free_completed"):
                trace.append({"action": kind, "addr": address, "size": size, "stream": 0, "frames": frames,
                              "category": block.category, "time_us": time_us})
    # the snapshot is taken here, as torch records it; "unknown" in the categories keeps
    # viewers that add it themselves from failing
    trace.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": [], "category": UNKNOWN,
                  "time_us": int(marks[-1].time * 1e6) if marks else 0})
    live = sorted((address, block_id) for block_id, address in addresses.items())
    return {"segments": [_segment(run, live, layout.end, frames_of)] if layout.end else [],
            "device_traces": [trace],
            "allocator_settings": {"memdoctor_source": run.source}}


def write_memory_viz(run: Run, path: str) -> None:
    """Write `run` as a snapshot file the memory_viz viewer opens (atomically)."""
    write_atomic(path, pickle.dumps(snapshot_of(run), protocol=PROTOCOL))


def _segment(run: Run, live: list[tuple[int, int]], total: int, frames_of: dict[int, list]) -> dict[str, Any]:
    """The one segment at the end: its live blocks, and the gaps between them as inactive."""
    blocks, at, allocated, requested = [], BASE_ADDRESS, 0, 0
    for address, block_id in live:
        if address > at:
            blocks.append({"address": at, "size": address - at, "requested_size": 0, "state": "inactive",
                           "frames": []})
        block = run.blocks[block_id]
        size = _rounded(block.nbytes)
        blocks.append({"address": address, "size": size, "requested_size": block.nbytes,
                       "state": "active_allocated", "frames": frames_of[block_id]})
        at = address + size
        allocated += size
        requested += block.nbytes
    if BASE_ADDRESS + total > at:
        blocks.append({"address": at, "size": BASE_ADDRESS + total - at, "requested_size": 0, "state": "inactive",
                       "frames": []})
    return {"device": 0, "address": BASE_ADDRESS, "total_size": total, "allocated_size": allocated,
            "active_size": allocated, "requested_size": requested, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}


def _frames(run: Run, block) -> list[dict[str, Any]]:
    """Innermost first: what the tensor is, where in the run it was made, then the user's line."""
    shape = "x".join(map(str, block.shape))
    what = " ".join(p for p in (block.category, block.name, f"{block.dtype}[{shape}]" if block.dtype else "") if p)
    where = f"{block.phase}, step {block.step}" + (f", in {block.module}" if block.module else "")
    frames = [{"filename": "memdoctor", "line": 0, "name": what},
              {"filename": "memdoctor", "line": 0, "name": where}]
    source = run.source_at(block.source)
    if source is not None:
        frames.append({"filename": source.file, "line": source.line, "name": source.function or "<module>"})
    return frames


def _metadata(block) -> str:
    return (f"memdoctor category={block.category} phase={block.phase} step={block.step}"
            + (f" module={block.module}" if block.module else ""))


def _oom_entry(run: Run, oom, requested: int, time_us: int) -> dict[str, Any]:
    free = 0
    if oom is not None and run.budget_bytes is not None and oom.live_bytes is not None:
        free = max(run.budget_bytes - oom.live_bytes, 0)
    frames = []
    source = run.source_at(oom.source) if oom is not None else None
    if source is not None:
        frames.append({"filename": source.file, "line": source.line, "name": source.function or "<module>"})
    return {"action": "oom", "size": int(requested), "device_free": free, "stream": 0, "frames": frames,
            "time_us": time_us}
