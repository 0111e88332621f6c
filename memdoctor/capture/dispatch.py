"""The dispatch source: a TorchDispatchMode that sees every op's outputs on any device
(cpu, cuda, meta, FakeTensorMode) and hands each new storage to the Recorder once.

The hot path does one dict lookup per output tensor; everything else (names, phases) is
cached or read from the Recorder's current state. A new storage also gets the user's line
(memdoctor.capture.frames): a walk up the Python stack to the first frame of the user's code.

A dispatch mode changes one thing in the run it watches: autograd's engine then sums two
gradients for one input into a new tensor, where a plain run sums into one of them in place
(measured on the H200; docs/measurements.md). A run recorded here holds
those sums; the CUDA allocator source has no dispatch mode and sees the plain run.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from memdoctor.run import Category, Phase
from memdoctor.capture.frames import UserFrames
from memdoctor.capture.lean_mode import DEVICE_QUERY, LeanDispatchMode, device_query
from memdoctor.capture.oomlog import requested_bytes
from memdoctor.capture.op_outputs import output_bytes
from memdoctor.capture.recorder import Recorder, log

_in_backward = torch._C._current_graph_task_id
_TEMP = Category.TEMPORARIES.value
_BACKWARD = Phase.BACKWARD.value
# An op returns a tensor, a flat tuple/list of them, a scalar or None almost always: walking
# those directly saves a pytree flatten (several microseconds) per op; anything else is
# flattened.
_SEQUENCES = (tuple, list)
_SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat)
Tensor = torch.Tensor
_OpOverload = torch._ops.OpOverload
# `zero_grad(set_to_none=False)` zeroes gradients in place: the line that keeps them allocated
_ZEROING = frozenset({"aten.zero_", "aten._foreach_zero_"})
_GRADIENTS = Category.GRADIENTS.value


class DispatchSource(LeanDispatchMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder
        self._names: dict[int, tuple] = {}     # id(op) -> (op, its name): an OpOverload's hash is a Python method
        # id(op) -> (op, its name, its C++ callable), for the ops whose output goes the inline
        # way (plain OpOverloads, all but the zeroing ones); keyed by id: an OpOverload's hash
        # is a Python method
        self._plain: dict[int, tuple] = {}
        self.broken = False
        self._frames = UserFrames(recorder.run.sources)
        self._zeroed: dict[int, set[int]] = {}     # source index -> gradient blocks zeroed there

    def __enter__(self):
        """Push the mode and watch resizes, both or neither."""
        out = super().__enter__()
        try:
            _watch_resizes(self.recorder)
        except BaseException:
            super().__exit__(None, None, None)
            raise
        self._pushed = True
        return out

    def __exit__(self, *exc):
        """Stop watching resizes and pop the mode, each whatever the other does; called
        again after a failure, it does what is left (the mode is popped once)."""
        try:
            _unwatch_resizes(self.recorder)
            if self._zeroed:
                zeroed, self._zeroed = self._zeroed, {}
                self.recorder.run.meta.setdefault("kept_by", []).extend(
                    {"source": source, "holder": "gradients zeroed in place", "blocks": sorted(ids)}
                    for source, ids in zeroed.items() if source >= 0)
        finally:
            if getattr(self, "_pushed", False):
                self._pushed = False
                super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:        # allocates nothing (memdoctor.capture.lean_mode)
            return device_query(args)
        known = self._plain.get(id(func))
        if known is not None and known[0] is not func:
            known = None
        try:
            if known is not None:       # the op's C++ callable, as OpOverload.__call__ calls it
                out = known[2](*args, **kwargs) if kwargs else known[2](*args)
            else:
                out = func(*args, **kwargs) if kwargs else func(*args)
        except torch.OutOfMemoryError as exc:      # the GPU's own, under a capped allocator
            self._real_oom(exc, func, args, kwargs)
            raise
        if self.broken:
            return out
        try:
            # one op's output, a plain tensor, is by far the most common: recorded here inline
            if known is not None and type(out) is Tensor:
                rec = self.recorder
                if (_in_backward() != -1) is not (rec.phase == _BACKWARD):     # entered or left
                    self._follow_backward()
                block = rec.add_output(out, known[1])
                if block is not None:       # a new storage: the user's line (here(2): above this method)
                    rec.blocks.source[block] = self._frames.here(2)
            else:
                self._record(func, out, args)
        except torch.OutOfMemoryError:
            self._oom_source()
            raise
        except Exception as exc:        # memdoctor's failure must not break training
            self.broken = True
            log.warning("memdoctor: dispatch tracing stopped after an internal error: %s", exc)
        return out

    def _follow_backward(self) -> None:
        """Mark where autograd's engine starts and stops running ops."""
        rec = self.recorder
        if _in_backward() != -1:
            if rec.phase != _BACKWARD:
                rec.mark(_BACKWARD)
        elif rec.phase == _BACKWARD:
            rec.mark(rec.outer_phase())

    def _record(self, func, out, args) -> None:
        rec = self.recorder
        known = self._names.get(id(func))
        if known is not None and known[0] is func:
            name = known[1]
        else:
            name = f"aten.{func.overloadpacket.__name__}"
            self._names[id(func)] = (func, name)
            if name not in _ZEROING and type(func) is _OpOverload:
                self._plain[id(func)] = (func, name, func._op)
        if name in _ZEROING:
            self._note_zeroed(args)
        self._follow_backward()
        # a block whose ALLOC comes at or after `seq` is new: it gets the user's line (the
        # stack walk starts above this method and __torch_dispatch__: here(3))
        seq = len(rec.run.actions)
        cols = rec.blocks
        if isinstance(out, Tensor):
            block = rec.add(out, name, _TEMP)
            if block is not None and cols.alloc_seq[block] >= seq:
                cols.source[block] = self._frames.here(3)
        elif isinstance(out, _SEQUENCES):     # (out, mean, rstd), a list of chunks, ...
            source = None
            for t in out:
                if isinstance(t, Tensor):
                    block = rec.add(t, name, _TEMP)
                    if block is not None and cols.alloc_seq[block] >= seq:
                        if source is None:
                            source = self._frames.here(3)
                        cols.source[block] = source
                elif isinstance(t, _SEQUENCES):
                    self._record_leaves(name, t, seq)
        elif out is not None and not isinstance(out, _SCALARS):
            self._record_leaves(name, out, seq)

    def _record_leaves(self, name: str, out, seq: int) -> None:
        cols = self.recorder.blocks
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                block = self.recorder.add(t, name, _TEMP)
                if block is not None and cols.alloc_seq[block] >= seq:
                    cols.source[block] = self._frames.here(4)

    def _note_zeroed(self, args) -> None:
        """Gradients zeroed in place stay allocated: note the user's line that did it."""
        live, categories = self.recorder.live, self.recorder.blocks.category
        ids = []
        for t in tree_leaves(args[:1]):
            if isinstance(t, Tensor):
                entry = live.get(t.untyped_storage()._cdata)
                if entry is not None and categories[entry.id] == _GRADIENTS:
                    ids.append(entry.id)
        if ids:
            self._zeroed.setdefault(self._frames.here(4), set()).update(ids)

    def _real_oom(self, exc: BaseException, func, args, kwargs) -> None:
        """Record a real OOM where it happened: once it unwinds, the forward it broke has
        ended and the phase in force is no longer the one that ran out. The request is what
        the op asked for in all (memdoctor.capture.op_outputs) where that is more than the
        one allocation the GPU refused."""
        try:
            message = str(exc).strip()
            rec = self.recorder
            if not self.broken and rec.active and not any(o.message == message for o in rec.run.ooms):
                refused = requested_bytes(message)
                whole = output_bytes(func, args, kwargs)
                rec.record_oom(max(whole or 0, refused or 0) or refused, message, simulated=False)
                self._oom_source()
        except Exception as err:        # memdoctor's failure must not change the OOM
            log.warning("memdoctor: the OOM was not recorded where it happened: %r", err)

    def _oom_source(self) -> None:
        """An OOM was just recorded (the simulated budget's or the GPU's): note the user's
        line that asked."""
        try:
            ooms = self.recorder.run.ooms
            if ooms and ooms[-1].source < 0:
                ooms[-1].source = self._frames.here(3)
        except Exception as exc:        # memdoctor's failure must not change the OOM
            log.warning("memdoctor: the OOM's source line was not recorded: %r", exc)


# ---- storages resized in place ----------------------------------------------------------
# `UntypedStorage.resize_` is a storage method, not an op: no dispatch mode sees it. FSDP2
# frees gathered weights and gathers them again that way, so while a trace runs the method
# is wrapped to tell the recorders (once for all nested traces; put back by the last one).
_resize_listeners: list[Recorder] = []
_original_resize = None


def _traced_resize(storage, size):
    for rec in list(_resize_listeners):
        rec.resizing(storage, int(size))        # the simulated budget may raise the OOM here
    out = _original_resize(storage, size)
    for rec in list(_resize_listeners):
        try:
            rec.resized(storage)
        except Exception as exc:                # memdoctor's failure must not break training
            rec.frees_broken(exc)
    return out


def _watch_resizes(rec: Recorder) -> None:
    global _original_resize
    if not _resize_listeners:
        _original_resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = _traced_resize
    _resize_listeners.append(rec)


def _unwatch_resizes(rec: Recorder) -> None:
    global _original_resize
    if rec in _resize_listeners:
        _resize_listeners.remove(rec)
    if not _resize_listeners and _original_resize is not None:
        if torch.UntypedStorage.__dict__.get("resize_") is _traced_resize:
            del torch.UntypedStorage.resize_     # the C method of StorageBase shows through again
        _original_resize = None
