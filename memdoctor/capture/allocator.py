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
import gc
import itertools
import threading

import torch

from memdoctor.limits import Allowance
from memdoctor.run import Block, Category, Mark, Phase, Run, Sample
from memdoctor.units import MAX_SIZE
from memdoctor.capture.budget import cap_cuda
from memdoctor.capture.frames import SourceTable, user_line_of_thread
from memdoctor.capture.recorder import Recorder
from memdoctor.capture.oomlog import requested_bytes
from memdoctor.capture.snapshot import snapshot_to_run
from memdoctor.cuda.allocator_model import round_size
from memdoctor.cuda.blas_workspaces import (WORKSPACE_NAME, cublas_workspace_bytes, cublaslt_workspace_bytes,
                                            local_gpu_is_sm90)

MAX_ENTRIES = 2_000_000
_PREFIX = "memdoctor:"
STACKED_STEPS = 2     # full mode: steps recorded with Python stacks before they pause


class AllocatorSource:
    """Python stacks are what the history costs most (a few microseconds per allocation,
    on the training thread). Full mode records them for the first STACKED_STEPS steps,
    then pauses them while the run stays below `deepen_at` bytes (90% of the budget, else
    of the device): a repeating step makes its blocks where the stacked steps did, and they
    take those lines (`_lines_from_earlier_steps`). `light=True` records none until that
    threshold. Once the allocated peak passes it, stacks stay on, so the steps that come
    near an OOM carry the user's lines in either mode."""

    def __init__(self, recorder: Recorder, budget: int | None = None, device: int | None = None,
                 light: bool = False):
        self.rec = recorder
        self.budget = budget
        self.light = light
        self.deepened = False
        self.device = torch.cuda.current_device() if device is None else device
        self.samples: list[tuple[int, int, int]] = []      # (mark index, allocated, reserved)
        self._metadata = hasattr(torch._C, "_cuda_setMemoryMetadata")
        # mark index -> the user's line there: for blocks with no Python frame of their own
        # (backward runs on the autograd engine's thread: its line is `loss.backward()`)
        self.mark_lines: dict[int, tuple[str, int, str]] = {}
        self._thread = threading.get_ident()

    def start(self) -> None:
        self._fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        if self.budget is not None:
            cap_cuda(self.budget, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        limit = self.budget or torch.cuda.get_device_properties(self.device).total_memory
        self.deepen_at = int(0.9 * limit)
        self.steps_ended = 0
        self._record(stacks=not self.light)
        self.rec.claims = []
        self.rec.on_mark = self._stamp
        self.rec.on_step_end = self.step_ended
        self._stamp(len(self.rec.run.marks) - 1)

    def _record(self, stacks: bool) -> None:
        """Switch Python stacks on or off; the history recorded so far is kept."""
        # stacks at allocations only: gathering Python frames at frees broke
        # torch.utils.checkpoint's early stop (its exception was lost while tensors were freed)
        if stacks:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context="alloc", stacks="python")
        else:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context=None)
        self.stacks = stacks

    def step_ended(self) -> None:
        """At each step's end: stacks on for good once the allocated peak passes
        `deepen_at`; in full mode, paused after the first STACKED_STEPS steps until then."""
        self.steps_ended += 1
        if self.deepened:
            return
        if _allocator_counts(self.device)[2] >= self.deepen_at:
            self.deepened = True
            if not self.stacks:
                self._record(stacks=True)
        elif self.stacks and self.steps_ended >= STACKED_STEPS:
            self._record(stacks=False)

    def abandon(self) -> None:
        """Undo start(): no more history, no tags, the memory fraction as it was. Safe to
        call again, and after a start() that failed part-way."""
        self.rec.on_mark = self.rec.on_step_end = None
        if self._metadata:
            torch._C._cuda_setMemoryMetadata("")
        torch.cuda.memory._record_memory_history(enabled=None)
        if getattr(self, "_fraction", None) is not None:
            torch.cuda.set_per_process_memory_fraction(self._fraction, self.device)
            self._fraction = None

    def _stamp(self, index: int, module: str | None = None) -> None:
        """Tag what the allocator does from now on with the mark index (and module)."""
        if self._metadata:
            torch._C._cuda_setMemoryMetadata(f"{_PREFIX}{index}:{module or ''}")
        if module is None:
            allocated, reserved, _peak = _allocator_counts(self.device)
            self.samples.append((index, allocated, reserved))
            line = user_line_of_thread(self._thread)
            if line is not None:
                self.mark_lines[index] = line

    def stop(self, message: str | None = None) -> Run:
        """Build the Run from the snapshot and join the recorded owners into it."""
        rec = self.rec
        rec.on_mark = None
        if self._metadata:
            torch._C._cuda_setMemoryMetadata("")
        snapshot = torch.cuda.memory._snapshot()
        self.abandon()
        run = snapshot_to_run(snapshot, self.device, allowance=Allowance("the trace", MAX_SIZE))
        _count_as_allocator(run, snapshot, self.device)
        marks = rec.run.marks
        run.source, run.device = "allocator", {**rec.run.device, **run.device}
        run.budget_bytes, run.torch_version = rec.run.budget_bytes, rec.run.torch_version
        run.meta.update(rec.run.meta)
        run.meta["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
        run.meta["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
        mark_of_block = _mark_per_block(run)
        run.marks = _place_marks(run, marks, mark_of_block, self.samples)
        _label_blocks(run, marks, mark_of_block)
        _lines_from_earlier_steps(run, mark_of_block)
        _lines_from_marks(run, mark_of_block, self.mark_lines)
        _join_owners(run, rec.claims or [], run.marks)
        _blas_workspaces(run)
        _freed_by_backward_are_activations(run)
        _outliving_forward_are_activations(run)
        by_index = {i: m.seq for i, m in enumerate(run.marks)}
        phase_samples = [Sample(by_index.get(i, 0) - 1, a, r) for i, a, r in self.samples]
        run.meta["phase_samples"] = [s.__dict__ for s in phase_samples]
        tagged = _mark_per_oom(run)
        for i, o in enumerate(run.ooms):
            # the mark in force when the request was refused: the allocator's user metadata
            # says it; the event index alone would also take the marks the exception made
            # while it unwound (a forward's end), which share the OOM's index
            index = tagged.get(i)
            mark = run.marks[index] if index is not None and index < len(run.marks) else run.mark_at(o.seq)
            if mark is not None:
                o.phase, o.step, o.module = mark.phase, mark.step, mark.module
            if message:
                o.message = message
        if message and not run.ooms:
            rec_oom = rec.record_oom(requested_bytes(message), message, simulated=False)
            rec_oom.seq = run.num_events
            run.ooms.append(rec_oom)
        return run


def _allocator_counts(device: int) -> tuple[int, int, int]:
    """(allocated, reserved, peak allocated) bytes, read from the allocator's raw stats:
    torch.cuda.memory_allocated() flattens every statistic in Python first, about ten times
    the cost, which a mark on the training loop's path cannot afford."""
    try:
        stats = torch._C._cuda_memoryStats(device)
        allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
        return allocated["current"], reserved["current"], allocated["peak"]
    except Exception:       # another torch's layout: the public, slower reading
        return (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                torch.cuda.max_memory_allocated(device))


SMALL_REQUEST = 1 << 20      # kSmallSize: larger requests come from the large pool


def _count_as_allocator(run: Run, snapshot: dict, device: int) -> None:
    """Trace entries carry the requested size; the allocator counts the block it handed
    out. That is the request rounded up to 512 bytes, except in the large pool where a
    free block is split only if more than 1 MiB would be left: then the whole free block
    is handed out. Replaying the segments' layout (free gaps between live blocks) gives
    each block's real size, so replayed bytes equal `memory_allocated()`."""
    segments: list[tuple[int, int]] = []           # (start, end), sorted
    live: dict[int, int] = {}                       # address -> block end
    starts: list[int] = []                          # sorted live block addresses

    known: set[int] = set()
    exact_end: dict[int, int] = {}                  # blocks alive at the end: their real size

    def add_segment(addr: int, size: int) -> None:
        if addr not in known:
            known.add(addr)
            bisect.insort(segments, (addr, addr + size))

    for seg in snapshot.get("segments") or ():
        if seg.get("device", device) == device and "address" in seg:
            add_segment(seg["address"], seg.get("total_size", 0))
            for blk in seg.get("blocks") or ():
                if blk.get("state") == "active_allocated" and "address" in blk:
                    exact_end[blk["address"]] = blk["size"]
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    for e in trace:
        if e.get("action") in ("segment_alloc", "segment_map"):
            add_segment(e["addr"], e["size"])
    shift = run.meta.get("snapshot", {}).get("blocks_before_trace", 0)
    early = [b for b in run.blocks.values() if b.alloc_seq < shift]
    for b in early:
        b.nbytes = exact_end.get(b.address, round_size(b.nbytes)) if b.free_seq is None else round_size(b.nbytes)
        if b.address is not None:
            live[b.address] = b.address + b.nbytes
            bisect.insort(starts, b.address)
    traced = sorted((b for b in run.blocks.values() if b.alloc_seq >= shift), key=lambda b: b.alloc_seq)
    free_action = run.meta.get("snapshot", {}).get("free_action", "free_completed")
    k = 0
    for e in trace:
        act = e.get("action")
        if act == "alloc" and k < len(traced):
            b = traced[k]
            k += 1
            addr, size = e["addr"], round_size(e["size"])
            if e["size"] > SMALL_REQUEST:
                i = bisect.bisect_right(segments, (addr, 1 << 62)) - 1
                seg_end = segments[i][1] if i >= 0 and segments[i][0] <= addr < segments[i][1] else addr + size
                j = bisect.bisect_right(starts, addr)
                gap_end = min(starts[j] if j < len(starts) else seg_end, seg_end)
                if gap_end - addr - size <= SMALL_REQUEST:
                    size = max(gap_end - addr, size)
            b.nbytes = size
            if addr in live:
                starts.remove(addr)
            live[addr] = addr + size
            bisect.insort(starts, addr)
        elif act == free_action:
            if live.pop(e["addr"], None) is not None:
                i = bisect.bisect_left(starts, e["addr"])
                if i < len(starts) and starts[i] == e["addr"]:
                    starts.pop(i)
        elif act in ("segment_free", "segment_unmap"):
            segments[:] = [sg for sg in segments if sg[0] != e["addr"]]
    run.event_bytes = [run.blocks[i].nbytes if i >= 0 else n for i, n in zip(run.event_blocks, run.event_bytes)]


def _mark_per_block(run: Run) -> dict[int, tuple[int, str | None]]:
    """Block id -> (mark index, module), from the allocator's user metadata. Blocks without
    it (alive before the trace began) keep no phase."""
    out: dict[int, tuple[int, str | None]] = {}
    for block_id, _ctx, meta in run.meta.get("snapshot", {}).get("block_context", []):
        tag = _tag(meta)
        if tag is not None:
            out[block_id] = tag
    return out


def _mark_per_oom(run: Run) -> dict[int, int]:
    """OOM index -> the mark index in the allocator's user metadata when it was refused."""
    out: dict[int, int] = {}
    for i, meta in run.meta.get("snapshot", {}).get("oom_context", []):
        tag = _tag(meta)
        if tag is not None:
            out[i] = tag[0]
    return out


def _tag(meta) -> tuple[int, str | None] | None:
    """(mark index, module) of memdoctor's user metadata on an allocator entry, else None."""
    if not isinstance(meta, str) or not meta.startswith(_PREFIX):
        return None
    index, _, module = meta[len(_PREFIX):].partition(":")
    return (int(index), module or None) if index.isdigit() else None


def _place_marks(run: Run, marks: list[Mark], mark_of_block, samples) -> list[Mark]:
    """Give each mark the event index where it began. Allocations say their mark (user
    metadata); between the last allocation of one mark and the first of the next there
    are only frees, and the allocator's counter read at the mark says how many of them
    came before it."""
    from memdoctor.attribution import live_curve
    last_alloc: dict[int, int] = {}
    first_alloc: dict[int, int] = {}
    for block_id, (index, _m) in mark_of_block.items():
        seq = run.blocks[block_id].alloc_seq
        last_alloc[index] = max(last_alloc.get(index, -1), seq)
        first_alloc[index] = min(first_alloc.get(index, 1 << 62), seq)
    curve = live_curve(run)
    allocated = {i: a for i, a, _r in samples}
    placed: list[Mark] = []
    lo = 0
    for i, m in enumerate(marks):
        later = [first_alloc[j] for j in range(i, min(i + 64, len(marks))) if j in first_alloc]
        hi = min(later) if later else run.num_events
        hi = max(hi, lo)
        seq = hi
        want = allocated.get(i)
        if want is not None:
            for s in range(max(lo - 1, -1), hi):
                if (curve[s] if s >= 0 else 0) == want:
                    seq = s + 1
                    break
        placed.append(Mark(seq, m.phase, m.step, m.module, m.time))
        lo = max(seq, last_alloc.get(i, -1) + 1)
    return placed


def _lines_from_marks(run: Run, mark_of_block, mark_lines: dict) -> None:
    """A block allocated with no user frame of its own (on the autograd engine's thread)
    takes the user's line of its mark: the line the training thread was at."""
    table = SourceTable(run.sources)
    for block_id, (index, _module) in mark_of_block.items():
        b = run.blocks[block_id]
        if b.source < 0 and index in mark_lines:
            b.source = table.index(*mark_lines[index])


def _lines_from_earlier_steps(run: Run, mark_of_block) -> None:
    """A block allocated while stacks were paused takes the name and line of the block made
    at the same place in a step recorded with them: the same phase and module, the same turn
    among its mark's allocations, the same size. A step that repeats makes its blocks in the
    same order, so this is the line its own stack would have named."""
    made_at: dict[tuple, tuple[str, int]] = {}
    unnamed: list[tuple[Block, tuple]] = []
    turns: dict[tuple[int, str | None], int] = {}
    for block_id, (index, module) in sorted(mark_of_block.items(), key=lambda kv: run.blocks[kv[0]].alloc_seq):
        b = run.blocks[block_id]
        turn = turns[index, module] = turns.get((index, module), -1) + 1
        key = (b.phase, b.module, turn, b.nbytes)
        if b.name or b.source >= 0:
            made_at.setdefault(key, (b.name, b.source))
        else:
            unnamed.append((b, key))
    for b, key in unnamed:
        found = made_at.get(key)
        if found is not None:
            b.name, b.source = found


def _label_blocks(run: Run, marks: list[Mark], mark_of_block) -> None:
    """Each block made during the trace takes its mark's phase, step and module, and is a
    temporary until an owner claims it (as under the dispatch source); blocks alive from
    before the trace stay `other`."""
    temps = Category.TEMPORARIES.value
    for block_id, (index, module) in mark_of_block.items():
        b = run.blocks[block_id]
        if index < len(marks):
            m = marks[index]
            b.phase, b.step = m.phase, m.step
            b.module = module or m.module
            b.category = temps


def _live_tensor_addresses() -> set[int]:
    """Where the CUDA tensors Python still refers to keep their data (a list the script keeps
    outputs in, the frames of an OOM's traceback): such a block is no workspace. A walk of
    every object the collector tracks: run once, where a block could be a workspace."""
    found: set[int] = set()
    tensor = torch.Tensor
    for obj in gc.get_objects():
        try:        # the type, not isinstance: that reads `__class__`, which some objects warn on
            if issubclass(type(obj), tensor) and obj.is_cuda:
                found.add(obj.untyped_storage().data_ptr())
        except Exception:       # a tensor subclass or a fake one without storage
            continue
    return found


def _blas_workspaces(run: Run, tensors: set[int] | None = None) -> None:
    """cuBLAS and cuBLASLt take a workspace per thread through the caching allocator at the
    thread's first matmul and keep it for the process's life (memdoctor.cuda.blas_workspaces):
    the main thread's in the first forward, autograd's device thread's in the first backward.
    Per thread (a backward's blocks are autograd's thread's, the others the main thread's),
    the earliest block of exactly such a size that is never freed and that no tensor claims
    (no owner, no shape; the name may be the frame that made it) is its workspace, counted
    as `other`: made in a forward and alive at its end, it would otherwise count as
    activations. A later block of that size in the same thread, or one where a tensor Python
    refers to keeps its data (`tensors`), is a tensor (a [2048, 4096] fp32 output kept in a
    list is 32 MiB too)."""
    sizes = {cublas_workspace_bytes(local_gpu_is_sm90()), cublaslt_workspace_bytes()}
    temps, backward = Category.TEMPORARIES.value, Phase.BACKWARD.value
    candidates = sorted((b for b in run.blocks.values() if b.nbytes in sizes and b.free_seq is None
                         and b.category == temps and not b.shape), key=lambda b: b.alloc_seq)
    if candidates and tensors is None:
        tensors = _live_tensor_addresses()
    seen: set[tuple[bool, int]] = set()
    for b in candidates:
        thread = (b.phase == backward, b.nbytes)
        if b.address not in tensors and thread not in seen:
            seen.add(thread)
            b.category, b.name = Category.OTHER.value, WORKSPACE_NAME


def _outliving_forward_are_activations(run: Run) -> None:
    """The allocator source keeps no saved-tensor hooks (a Python call for every tensor
    autograd saves, and another to unpack it, cost a fast loop more than the rest of the
    attribution): a block made in a forward pass that is still alive when that pass ends is
    what backward needs (saved tensors, outputs), so it counts as activations; one freed
    inside the pass stays a temporary, and so does what outlives a pass under no_grad."""
    marks = run.marks
    if not marks:
        return
    fwd, temps = Phase.FORWARD.value, Category.TEMPORARIES.value
    no_grad = _passes_without_grad(run)
    end_after = [run.num_events] * len(marks)      # mark index -> where its forward pass ends
    next_end = run.num_events
    for i in range(len(marks) - 1, -1, -1):
        end_after[i] = next_end
        if marks[i].phase != fwd:
            next_end = marks[i].seq
    seqs = [m.seq for m in marks]
    for b in run.blocks.values():
        if b.phase != fwd or b.category != temps:
            continue
        i = max(bisect.bisect_right(seqs, b.alloc_seq) - 1, 0)
        if (b.free_seq is None or b.free_seq >= end_after[i]) and not no_grad(b.alloc_seq):
            b.category = Category.ACTIVATIONS.value


def _passes_without_grad(run: Run):
    """Whether an event falls in a model call made with grad mode off (an evaluation under
    no_grad): such a pass saves nothing, and what outlives it is its output."""
    marks, spans = run.marks, []
    for c in run.meta.get("forward_calls") or []:
        if not isinstance(c, dict):
            continue
        start, end = c.get("mark_start", -1), c.get("mark_end")
        if not c.get("grad_enabled", True) and 0 <= start < len(marks):
            spans.append((marks[start].seq, marks[end].seq if end is not None and end < len(marks)
                          else run.num_events))
    spans.sort()
    starts = [a for a, _ in spans]
    reach = list(itertools.accumulate((b for _, b in spans), max))      # spans may nest

    def inside(seq: int) -> bool:
        i = bisect.bisect_right(starts, seq) - 1
        return i >= 0 and seq < reach[i]
    return inside


def _freed_by_backward_are_activations(run: Run) -> None:
    """Blocks made outside any pass after a step's forward began (its loss, computed outside
    the model) and freed inside that step's backward, or alive where an OOM ended the run in
    it, or between that forward and its backward (the loss cut short): saved for it."""
    marks, temps = run.marks, Category.TEMPORARIES.value
    other, fwd, bwd = Phase.OTHER.value, Phase.FORWARD.value, Phase.BACKWARD.value
    seqs = [m.seq for m in marks]

    def backward_of(seq: int) -> int | None:
        at = bisect.bisect_right(seqs, seq) - 1
        return marks[at].step if at >= 0 and marks[at].phase == bwd else None
    forward_began: dict[int, int] = {}
    for m in marks:
        if m.phase == fwd:
            forward_began.setdefault(m.step, m.seq)
    ended_in = backward_of(run.ooms[0].seq) if run.ooms else None
    if run.ooms and ended_in is None:
        at = bisect.bisect_right(seqs, run.ooms[0].seq) - 1
        step = marks[at].step if at >= 0 and marks[at].phase == other else None
        if step in forward_began and not any(m.phase == bwd and m.step == step for m in marks):
            ended_in = step         # out making the loss: what is alive of it awaits the backward
    for b in run.blocks.values():
        if b.phase != other or b.category != temps:
            continue
        began = forward_began.get(b.step)
        if began is None or b.alloc_seq < began:
            continue
        if (backward_of(b.free_seq) if b.free_seq is not None else ended_in) == b.step:
            b.category = Category.ACTIVATIONS.value


def _join_owners(run: Run, claims: list, marks: list[Mark]) -> None:
    """Each claim (mark index, address, category, name, shape, dtype) names the block that
    was at that address during its mark: the last one allocated there before the next mark."""
    from memdoctor.run import stronger
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
        if shape is not None and not b.shape:
            b.shape, b.dtype = list(shape), str(dtype).replace("torch.", "")
