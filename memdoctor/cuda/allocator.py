"""The allocator source (CUDA): PyTorch's own allocation history, joined to owners.

`torch.cuda.memory._record_memory_history` records every alloc and free of the caching
allocator in C++ (cheap, no per-op Python). memdoctor's hooks only note, per phase mark,
which storages are weights, gradients, optimizer state, saved for backward or inputs, by
address. Each mark stamps the allocator's user metadata with its index, so every traced
allocation says which phase, step and module it belongs to; after the run the snapshot
becomes a Run and the owners are joined by address within their mark.
"""
from __future__ import annotations

import bisect
import time

import torch

from ..run import Category, Mark, Phase, Run, Sample
from ..trace.budget import cap_cuda
from ..trace.recorder import Recorder, log
from .snapshot import snapshot_to_run

MAX_ENTRIES = 2_000_000
_PREFIX = "memdoctor:"


class AllocatorSource:
    def __init__(self, recorder: Recorder, budget: int | None = None, device: int | None = None):
        self.rec = recorder
        self.budget = budget
        self.device = torch.cuda.current_device() if device is None else device
        self.samples: list[tuple[int, int, int]] = []      # (mark index, allocated, reserved)
        self._metadata = hasattr(torch._C, "_cuda_setMemoryMetadata")
        self._old_fraction = None

    def start(self) -> None:
        if self.budget is not None:
            cap_cuda(self.budget, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        self.rec.claims = []
        self.rec.on_mark = self._stamp
        self._stamp(len(self.rec.run.marks) - 1)

    def _stamp(self, index: int, module: str | None = None) -> None:
        """Tag what the allocator does from now on with the mark index (and module)."""
        if self._metadata:
            torch._C._cuda_setMemoryMetadata(f"{_PREFIX}{index}:{module or ''}")
        if module is None:
            self.samples.append((index, torch.cuda.memory_allocated(self.device),
                                 torch.cuda.memory_reserved(self.device)))

    def stop(self, message: str | None = None) -> Run:
        """Build the Run from the snapshot and join the recorded owners into it."""
        rec = self.rec
        rec.on_mark = None
        if self._metadata:
            torch._C._cuda_setMemoryMetadata("")
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        run = snapshot_to_run(snapshot, self.device)
        marks = rec.run.marks
        run.source, run.device = "allocator", {**rec.run.device, **run.device}
        run.budget_bytes, run.torch_version = rec.run.budget_bytes, rec.run.torch_version
        run.meta.update(rec.run.meta)
        run.meta["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
        run.meta["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
        mark_of_block = _mark_per_block(run, marks, rec.t0_unix)
        run.marks = _place_marks(run, marks, mark_of_block)
        _label_blocks(run, marks, mark_of_block)
        _join_owners(run, rec.claims or [], run.marks)
        by_index = {i: m.seq for i, m in enumerate(run.marks)}
        phase_samples = [Sample(max(by_index.get(i, 0) - 1, 0), a, r) for i, a, r in self.samples]
        run.meta["phase_samples"] = [s.__dict__ for s in phase_samples]
        for o in run.ooms:
            mark = run.mark_at(o.seq)
            if mark is not None:
                o.phase, o.step, o.module = mark.phase, mark.step, mark.module
            if message:
                o.message = message
        if message and not run.ooms:
            from ..trace.session import requested_from_message
            rec_oom = rec.record_oom(requested_from_message(message), message, simulated=False)
            rec_oom.seq = run.num_events
            run.ooms.append(rec_oom)
        return run


def _mark_per_block(run: Run, marks: list[Mark], t0_unix: float) -> dict[int, tuple[int, str | None]]:
    """Block id -> (mark index, module), from the allocator's user metadata; blocks without
    it are placed by their time stamp among the marks' times."""
    out: dict[int, tuple[int, str | None]] = {}
    for block_id, _ctx, meta in run.meta.get("snapshot", {}).get("block_context", []):
        if meta.startswith(_PREFIX):
            index, _, module = meta[len(_PREFIX):].partition(":")
            out[block_id] = (int(index), module or None)
    return out


def _place_marks(run: Run, marks: list[Mark], mark_of_block) -> list[Mark]:
    """Give each mark the event index where its first allocation happened."""
    first: dict[int, int] = {}
    for block_id, (index, _m) in mark_of_block.items():
        seq = run.blocks[block_id].alloc_seq
        if seq < first.get(index, 1 << 62):
            first[index] = seq
    placed, last = [], 0
    following = run.num_events
    seqs = [0] * len(marks)
    for i in range(len(marks) - 1, -1, -1):
        following = min(following, first.get(i, following))
        seqs[i] = following
    for i, m in enumerate(marks):
        seq = max(seqs[i], last)
        last = seq
        placed.append(Mark(seq, m.phase, m.step, m.module, m.time))
    return placed


def _label_blocks(run: Run, marks: list[Mark], mark_of_block) -> None:
    temps = Category.TEMPORARIES.value
    for block_id, (index, module) in mark_of_block.items():
        b = run.blocks[block_id]
        if index < len(marks):
            m = marks[index]
            b.phase, b.step = m.phase, m.step
            b.module = module or m.module
            if m.phase != Phase.OTHER.value:
                b.category = temps


def _join_owners(run: Run, claims: list, marks: list[Mark]) -> None:
    """Each claim (mark index, address, category, name, shape, dtype) names the block that
    was at that address during its mark: the last one allocated there before the next mark."""
    from ..run import stronger
    by_addr: dict[int, list[tuple[int, int]]] = {}
    for b in run.blocks.values():
        if b.address is not None:
            by_addr.setdefault(b.address, []).append((b.alloc_seq, b.id))
    for entries in by_addr.values():
        entries.sort()
    ends = [m.seq for m in marks[1:]] + [run.num_events]
    for index, addr, category, name, shape, dtype in claims:
        entries = by_addr.get(addr)
        if not entries:
            continue
        end = ends[index] if index < len(ends) else run.num_events
        pos = bisect.bisect_right(entries, (end, 1 << 62)) - 1
        if pos < 0:
            pos = 0
        b = run.blocks[entries[pos][1]]
        b.category = category if b.category in (Category.TEMPORARIES.value, Category.OTHER.value) \
            else stronger(category, b.category)
        if name and (not b.name or category in (Category.WEIGHTS.value, Category.GRADIENTS.value,
                                                 Category.OPTIMIZER_STATE.value)):
            b.name = name
        if shape and not b.shape:
            b.shape, b.dtype = shape, dtype


def now_unix() -> float:
    return time.time()
