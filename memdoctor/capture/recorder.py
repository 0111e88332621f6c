"""The Recorder: the state a trace builds up, turned into a Run at the end.

Both sources feed it: the dispatch mode reports storages as ops create them, the hooks
report who owns a storage (parameter, gradient, optimizer state, saved for backward,
input) and where the run is (phase, step, module). Every storage is one block, counted
once, freed when its last tensor dies (a weakref callback on the storage object, which
PyTorch keeps alive exactly as long as the storage itself).

A long run records millions of these, and the garbage collector walks every container
object that stays alive: blocks are therefore kept as columns while recording
(memdoctor.capture.block_columns) and become the Run's Block objects when the trace stops;
marks are plain tuples (which the collector stops walking) until `finish_marks` makes them
Mark objects, before anything reads them; blocks of one shape share one shape list (never
changed in place). The methods that count a storage return its block's id.
"""
from __future__ import annotations

import bisect
import logging
import sys
import time
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memdoctor.capture.block_columns import BlockColumns
from memdoctor.collector import paused_gc
from memdoctor.capture.frames import model_being_built
from memdoctor.run import OOM, Action, Category, Mark, Phase, Run, stronger

log = logging.getLogger("memdoctor")


_PLAIN = (torch.Tensor, torch.nn.Parameter)    # the types that hold their own storage
_TEMP, _WEIGHTS = Category.TEMPORARIES.value, Category.WEIGHTS.value
_FORWARD, _OPTIMIZER, _OTHER = Phase.FORWARD.value, Phase.OPTIMIZER.value, Phase.OTHER.value
_ALLOC = Action.ALLOC
_now = time.perf_counter
_WRAPPERS: dict[type, bool] = {}                # tensor subclass -> holds its memory in inner tensors


class _StorageRef(weakref.ref):
    """The weak reference to a live storage, which also says which block it is (`id`): one
    object per live storage (not a closure, a tuple and a plain weakref), so fewer objects
    for the garbage collector to walk while a long run records."""
    __slots__ = ("key", "id")


class Recorder:
    def __init__(self, run: Run):
        self.run = run
        self.blocks = BlockColumns()        # the Run's blocks until `stop` makes them objects
        self._blocks_done = 0               # ids below this are in run.blocks already
        self.active = True
        self.live: dict[int, _StorageRef] = {}
        # storages resized to 0 bytes: their last entry, kept so its weakref still fires
        self._shrunk: dict[int, _StorageRef] = {}
        self._on_free_callback = self._on_free     # one bound method shared by every weakref
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_seq = 0
        self.phase = Phase.OTHER.value
        self.step = 0
        self.module: str | None = None
        self.forward_depth = 0
        self.in_optimizer = False
        self.budget: Callable[[int, int], None] | None = None
        # allocator source: owners noted by address per mark instead of counted here
        self.claims: list | None = None
        self.on_mark: Callable[..., None] | None = None
        self.on_step_end: Callable[[], None] | None = None   # the allocator source's, at each step's end
        self._t0 = time.perf_counter()
        self._dtype_names: dict[Any, str] = {}
        self._device_names: dict[Any, str] = {}
        # devices whose storages are not counted: the host's, in a run on a GPU
        self.skip_devices: frozenset[str] = frozenset()
        self._shapes: dict[torch.Size, list[int]] = {}     # one list per shape, shared by its blocks
        self._marks_done = 0        # run.marks before this index are Mark objects, the rest tuples
        self.mark()

    # ---- where the run is ---------------------------------------------------------
    def mark(self, phase: str | None = None, module: str | None = None) -> None:
        """Note that from the next event on the run is in `phase` (and `module`): a tuple
        until `finish_marks` (the clock's reading, turned into seconds from the start there)."""
        if phase is not None:
            self.phase = phase
        self.module = module
        run = self.run
        marks = run.marks
        # kept even when empty: a fused optimizer step allocates nothing
        marks.append((len(run.actions), self.phase, self.step, module, _now()))
        if self.on_mark is not None:
            self.on_mark(len(marks) - 1)

    def finish_marks(self) -> None:
        """Turn the marks recorded since the last call into Mark objects; the collector is
        paused meanwhile, as nothing but these objects is made."""
        marks, t0 = self.run.marks, self._t0
        if self._marks_done == len(marks):
            return
        with paused_gc():
            marks[self._marks_done:] = [Mark(seq, phase, step, module, round(t - t0, 6))
                                        for seq, phase, step, module, t in marks[self._marks_done:]]
        self._marks_done = len(marks)

    def enter_module(self, name: str | None) -> None:
        self.module = name
        if self.on_mark is not None:
            self.on_mark(len(self.run.marks) - 1, name or "")

    def outer_phase(self) -> str:
        """The phase the hooks say we are in, outside the autograd engine."""
        if self.in_optimizer:
            return _OPTIMIZER
        return _FORWARD if self.forward_depth else _OTHER

    # ---- storages ------------------------------------------------------------------
    def add(self, tensor, name: str, category: str, phase: str | None = None,
            before: bool = False, storage=None) -> int | None:
        """Count `tensor`'s storage if it is new; returns its block's id either way. `before`:
        the storage is no op's output in the trace but existed already (claimed): it counts
        in the live bytes, yet the simulated budget never raises for it: only what the
        traced code allocates can run out of memory."""
        kind = type(tensor)
        if kind not in _PLAIN:
            wrapper = _WRAPPERS.get(kind)
            if wrapper is None:
                wrapper = _WRAPPERS[kind] = is_traceable_wrapper_subclass(tensor)
            if wrapper:
                return self._add_inner(tensor, name, category, phase, before)
        if storage is None:     # runs for every op's output: kept flat
            try:
                storage = tensor.untyped_storage()
            except Exception:
                return None
        return self._count(storage, tensor, name, category, phase, before)[0]

    def add_output(self, tensor: torch.Tensor, name: str) -> int | None:
        """An op's output of type Tensor itself, counted as a temporary: its block's id if
        the storage is new, None if it is counted already (a view, an in-place op) or has none.
        The path of nearly every op: `_count` inline, without `add`'s checks for subclasses."""
        try:
            storage = tensor.untyped_storage()
        except Exception:
            return None
        key = storage._cdata
        entry = self.live.get(key)
        if entry is not None:
            self._strengthen(entry.id, _TEMP)
            return None
        if not storage.resizable() and not storage.is_shared():
            return None         # memory torch did not allocate (torch.from_numpy: numpy's)
        nbytes = storage.nbytes()
        if self.budget is not None:
            self.budget(nbytes, self.live_bytes)
        return self._alloc(storage, key, nbytes, tensor, name, _TEMP, None)

    def _count(self, storage, tensor, name: str, category: str, phase: str | None,
               before: bool) -> tuple[int | None, bool]:
        """The block id of `storage` (its category made the stronger of the two if counted
        already) and whether it is new; `before`: never checked against the budget."""
        key = storage._cdata
        entry = self.live.get(key)
        if entry is not None:
            self._strengthen(entry.id, category)
            return entry.id, False
        if not storage.resizable() and not storage.is_shared() and category != _WEIGHTS:
            # memory torch did not allocate (torch.from_numpy: numpy's); but weights read from a
            # memory-mapped file (transformers' from_pretrained of safetensors on the CPU) are
            # the model's, which a GPU run holds on the device
            return None, False
        nbytes = storage.nbytes()
        if self.budget is not None and not before:
            self.budget(nbytes, self.live_bytes)
        return self._alloc(storage, key, nbytes, tensor, name, category, phase), True

    def _add_inner(self, tensor, name: str, category: str, phase: str | None,
                   before: bool = False) -> int | None:
        """A wrapper subclass (DTensor, ...) holds no memory of its own (its storage reports
        the global size): the tensors inside it do, a rank's local shard for a DTensor."""
        try:
            attrs, _ = tensor.__tensor_flatten__()
        except Exception:
            return None
        first = None
        for attr in attrs:
            inner = getattr(tensor, attr, None)
            if isinstance(inner, torch.Tensor):
                block = self.add(inner, name, category, phase, before)
                first = block if first is None else first
        return first

    def _alloc(self, storage, key, nbytes, tensor, name, category, phase) -> int | None:
        size, dtype, device = tensor.shape, tensor.dtype, tensor.device
        shape = self._shapes.get(size)
        if shape is None:
            shape = self._shapes[size] = list(size)
        dname = self._dtype_names.get(dtype)
        if dname is None:
            dname = self._dtype_names[dtype] = str(dtype).replace("torch.", "")
        devname = self._device_names.get(device)
        if devname is None:
            devname = self._device_names[device] = str(device)
        if devname in self.skip_devices:
            return None
        return self._new_block(storage, key, nbytes, shape, dname, devname, name, category, phase)

    def _new_block(self, storage, key, nbytes, shape, dname, devname, name, category, phase) -> int:
        run = self.run
        seq = len(run.actions)
        block_id = self.blocks.append(nbytes, category, name, shape, dname, devname, self.module,
                                      phase or self.phase, self.step, seq)
        run.actions.append(_ALLOC)
        run.event_blocks.append(block_id)
        run.event_bytes.append(nbytes)
        ref = _StorageRef(storage, self._on_free_callback)
        ref.key, ref.id = key, block_id
        self.live[key] = ref
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_seq = seq
        return block_id

    def _strengthen(self, block_id: int, category: str) -> None:
        """The block's category made the stronger of its own and `category`."""
        categories = self.blocks.category
        if categories[block_id] != category:
            categories[block_id] = stronger(category, categories[block_id])

    def _on_free(self, ref: _StorageRef) -> None:
        try:
            self.free(ref.key)
        except Exception as exc:    # runs inside CPython's weakref machinery: never raise
            self.frees_broken(exc)

    def frees_broken(self, exc: Exception) -> None:
        """Frees can no longer be recorded, so live bytes only grow from here: stop, and drop
        the simulated budget, which would otherwise raise an OOM the training never had."""
        if self.active:
            self.active = False
            self.budget = None
            log.warning("memdoctor: recording frees stopped after an internal error: %r", exc)

    def resizing(self, storage, nbytes: int) -> None:
        """A storage is about to take `nbytes` in place: the simulated budget's say first."""
        if self.budget is not None and self.active:
            entry = self.live.get(storage._cdata)
            grow = nbytes - (self.blocks.nbytes[entry.id] if entry is not None else 0)
            if grow > 0 and (entry is not None or storage._cdata in self._shrunk):
                self.budget(grow, self.live_bytes)

    def resized(self, storage) -> None:
        """A counted storage changed size in place (FSDP2 frees its gathered weights with
        `resize_(0)` and gathers them again into the same storage): the old size's block
        ends there, the new size is a new block with the same owner and name."""
        if not self.active:
            return
        key = storage._cdata
        nbytes = storage.nbytes()
        entry = self.live.get(key)
        shrunk = self._shrunk.get(key)
        if entry is None and shrunk is None:
            return                      # a storage this trace never counted
        cols = self.blocks
        if (cols.nbytes[entry.id] if entry is not None else 0) == nbytes:
            return                      # no change
        template = entry.id if entry is not None else shrunk.id
        if entry is not None:
            self.free(key)
        if nbytes == 0:
            self._shrunk[key] = entry
            return
        self._shrunk.pop(key, None)
        self._new_block(storage, key, nbytes, cols.shape[template], cols.dtype[template],
                        cols.device[template], cols.name[template], cols.category[template], None)

    def free(self, key: int) -> None:
        if not self.active:
            return
        if self._shrunk:
            self._shrunk.pop(key, None)
        entry = self.live.pop(key, None)
        if entry is None:
            return
        block_id = entry.id
        cols = self.blocks
        nbytes = cols.nbytes[block_id]
        run = self.run
        cols.free_seq[block_id] = len(run.actions)
        run.actions.append(Action.FREE)
        run.event_blocks.append(block_id)
        run.event_bytes.append(nbytes)
        self.live_bytes -= nbytes

    def claim_counted(self, tensor, storage, category: str) -> bool:
        """`claim(tensor, category, storage=storage)` for a storage counted already, done
        the short way (a model's inputs are claimed at every outermost call); False where it
        is not counted, or the tensor is a subclass, or owners are joined by address: for
        `claim` to do."""
        if self.claims is not None or type(tensor) not in _PLAIN:
            return False
        entry = self.live.get(storage._cdata)
        if entry is None:
            return False
        self._strengthen(entry.id, category)
        return True

    def claim(self, tensor, category: str, name: str | None = None, storage=None) -> None:
        """Say who owns an existing tensor's storage (counting it first if it is new);
        `storage`: the tensor's untyped storage where the caller has it already."""
        if self.claims is not None:
            try:
                addr = (storage if storage is not None else tensor.untyped_storage()).data_ptr()
            except Exception:
                return
            # shape and dtype kept as torch gives them: turned into text once, at the join
            self.claims.append((len(self.run.marks) - 1, addr, category, name, tensor.shape, tensor.dtype))
            return
        if type(tensor) in _PLAIN:      # what `add` does for a storage counted already, inline:
            if storage is None:         # an optimizer's state and the saved tensors, each step
                try:
                    storage = tensor.untyped_storage()
                except Exception:
                    return
            entry = self.live.get(storage._cdata)
            if entry is not None:
                self._strengthen(entry.id, category)
                if name and self.blocks.category[entry.id] == category:
                    self.blocks.name[entry.id] = name
                return
        block_id = self.add(tensor, name or "", category, before=True, storage=storage)
        if block_id is not None and name and self.blocks.category[block_id] == category:
            self.blocks.name[block_id] = name

    def claim_again(self, tensor, category: str, make_name: Callable[[], str]) -> None:
        """`claim(tensor, category, make_name())` for an owner claimed at every step (an
        optimizer's weights, gradients and state): nothing to do where the storage is counted
        as `category` already, and the name made only where it is needed."""
        if self.claims is None and type(tensor) in _PLAIN:
            try:
                entry = self.live.get(tensor.untyped_storage()._cdata)
            except Exception:
                return
            if entry is not None and self.blocks.category[entry.id] == category:
                return
        self.claim(tensor, category, make_name())

    def renumber_steps(self, starts: list[int]) -> None:
        """Number the steps from what the script repeats: each mark index in `starts` begins
        the next step. Marks, blocks and OOMs take the step of the mark in force when they
        were made (one pass over the marks, a binary search per block). Called before the
        trace stops: the blocks are still columns."""
        self.finish_marks()
        if not starts:
            return
        marks = self.run.marks
        begins = set(starts)
        step = 0
        for i, m in enumerate(marks):
            if i in begins:
                step += 1
            m.step = step
        self.step = step
        seqs = [m.seq for m in marks]
        step_of = [m.step for m in marks]
        cols = self.blocks
        cols.step[:] = [step_of[i] if i >= 0 else 0
                        for i in (bisect.bisect_right(seqs, seq) - 1 for seq in cols.alloc_seq)]
        for o in self.run.ooms:
            i = bisect.bisect_right(seqs, o.seq) - 1
            o.step = marks[i].step if i >= 0 else 0

    def record_oom(self, requested: int | None, message: str, simulated: bool) -> OOM:
        oom = OOM(len(self.run.actions), requested, message, self.phase, self.step, self.module,
                  simulated, self.live_bytes)
        self.run.actions.append(Action.OOM)
        self.run.event_blocks.append(-1)
        self.run.event_bytes.append(requested or 0)
        self.run.ooms.append(oom)
        if len(self.run.ooms) == 1:
            try:
                building = model_being_built(sys._getframe(1))
            except Exception:           # memdoctor's failure must not change the OOM
                building = None
            if building:
                self.run.meta["oom_building"] = building
        return oom

    def close(self) -> Run:
        """Stop listening for frees; what is still alive stays alive in the Run."""
        self.stop()
        self.mark()
        self.finish_marks()
        return self.run

    def stop(self) -> None:
        """Record nothing more: no storage's end reaches the Run from now on (the weak
        references that would tell are dropped, and with them the recorder's reference to
        itself, so that the run is freed as soon as its last user lets go, not at the next
        full collection). Safe to call again."""
        self.active = False
        self.live.clear()
        self._shrunk.clear()
        self._on_free_callback = None
        self.finish_marks()
        self.finish_blocks()

    def finish_blocks(self) -> None:
        """Make the blocks recorded since the last call Block objects of the Run (the
        collector paused meanwhile, as nothing but these objects is made)."""
        start = self._blocks_done
        if start == len(self.blocks):
            return
        with paused_gc():
            self.run.blocks.update(self.blocks.blocks(start))
        self._blocks_done = len(self.blocks)
