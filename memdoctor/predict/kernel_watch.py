"""What the fake step's kernels would take on a GPU beyond their outputs, noted while it runs:
the cuBLAS and cuBLASLt workspaces each thread allocates at its first matmul, the scratch
each op's CUDA kernel takes and gives back inside the call (memdoctor.cuda.kernel_scratch),
the convolutions to measure (memdoctor.predict.op_probe), the work counted for the step
time, and the gradient sums autograd would make in place, and F.linear's bias added and the indexing
backward's accumulation made in place (memdoctor.predict.grad_sums);
the outputs a CUDA kernel allocates in another order than the op returns them
(memdoctor.cuda.output_order); and those workspaces and scratch as events to insert into
the Run."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memdoctor.capture.lean_mode import DEVICE_QUERY, LeanDispatchMode, device_query
from memdoctor.cuda.blas_workspaces import (  # noqa: F401  (re-exported: the estimate's notes)
    CUBLASLT_WORKSPACE_BYTES, cublas_workspace_bytes, cublaslt_workspace_bytes, local_gpu_is_sm90)
from memdoctor.cuda.kernel_scratch import scratch_for
from memdoctor.cuda.library_memory import CUDNN_OPS
from memdoctor.cuda.output_order import cuda_output_order
from memdoctor.predict.linear_bias import in_linear
from memdoctor.predict.step_time import WorkCounter
from memdoctor.run import Action, Category

__all__ = ["KernelWatch", "CUBLASLT_WORKSPACE_BYTES", "cublas_workspace_bytes", "cublaslt_workspace_bytes",
           "local_gpu_is_sm90", "workspace_events", "scratch_events", "note_cudnn_call"]

_BLAS_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
             "_addmm_activation", "_scaled_mm", "_int_mm", "addr")
_LT_OPS = ("_addmm_activation", "_scaled_mm")


def _ops(names) -> frozenset:
    found = []
    for name in names:
        try:
            found.append(getattr(torch.ops.aten, name))
        except (AttributeError, RuntimeError):
            pass
    return frozenset(found)


BLAS_OPS = _ops(_BLAS_OPS)
LT_OPS = _ops(_LT_OPS)
_ADDMM = _ops(["addmm"])
DNN_OPS = _ops(sorted(CUDNN_OPS))


class KernelWatch(LeanDispatchMode):
    """Note where the first cuBLAS (and cuBLASLt) and cuDNN call of each thread happens (the
    event index just after the op's outputs were allocated), and, with a `gpu`, the scratch
    memory each op's CUDA kernel would take (memdoctor.cuda.kernel_scratch) with the event
    indices before and after the op, and the ops whose kernels allocate their outputs in
    another order (the op's event span and its output blocks in the kernel's order); with a `conv_probe`, the convolutions to measure; and
    the gradient sums autograd makes in place outside a dispatch mode
    (memdoctor.predict.grad_sums)."""

    def __init__(self, recorder, gpu=None, conv_probe=None, fast_view=None):
        super().__init__()
        self.fast_view = fast_view      # (func, args, kwargs) -> a view made without dispatch, or None
        self.recorder = recorder
        self.run = recorder.run
        self.gpu = gpu
        self.conv_probe = conv_probe
        self.blas: dict[str, int] = {}
        self.lt: dict[str, int] = {}
        self.dnn: dict[str, int] = {}   # thread -> the event index just after its first cuDNN op
        self.dnn_threads: set[str] = set()      # the threads that call cuDNN, fused RNNs' included
        self.scratch: list[tuple[int, int, list]] = []
        self.reorders: list[tuple[int, int, list[int]]] = []
        self.accumulations: list[tuple[int, int, tuple[int, ...], int]] = []
        self._node = None
        self._node_start = 0
        self.work = WorkCounter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:        # no kernel, no memory (memdoctor.capture.lean_mode)
            return device_query(args)
        in_backward = torch._C._current_graph_task_id() != -1
        if self.fast_view is not None:
            out = self.fast_view(func, args, kwargs or {})
            if out is not None:         # no memory, no kernel: counted as an op, no mode below sees it
                self.work.note(func, args, kwargs, out, self.recorder.step,
                               "backward" if in_backward else self.recorder.phase)
                return out
        before = len(self.run.actions)
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if in_backward:
            self._note_backward_op(func, args, kwargs, out, before)
        if func is torch.ops.aten.add.Tensor and in_linear():
            self._note_bias_add(args, kwargs, out, before)
        self.work.note(func, args, kwargs, out, self.recorder.step,
                       "backward" if in_backward else self.recorder.phase)
        if packet in BLAS_OPS:
            thread = "backward" if in_backward else "forward"
            if thread not in self.blas:
                self.blas[thread] = len(self.run.actions)
            if thread not in self.lt and (packet in LT_OPS or (packet in _ADDMM and _bias_1d(args, kwargs))):
                self.lt[thread] = len(self.run.actions)
        elif packet in DNN_OPS:
            thread = "backward" if in_backward else "forward"
            self.dnn.setdefault(thread, len(self.run.actions))
            self.dnn_threads.add(thread)
        if self.gpu is not None:
            scratch = scratch_for(func, args, kwargs, self.gpu)
            if scratch:
                self.scratch.append((before, len(self.run.actions), scratch))
            order = cuda_output_order(func, args, kwargs)
            if order is not None:
                self._note_order(order, out, before)
        if self.conv_probe is not None:
            self.conv_probe.note(func, args, kwargs, before, len(self.run.actions))
        return out

    def _note_backward_op(self, func, args, kwargs, out, before: int) -> None:
        """Note where each autograd node begins, and the additions that look like the
        engine summing two gradients for one input: operands alike, the first made by an
        earlier node (the gradient already buffered), with the dense ones it could sum into
        (memdoctor.predict.grad_sums)."""
        node = torch._C._current_autograd_node()
        if node is not self._node:
            self._node, self._node_start = node, before
        if func is torch.ops.aten.index_put.default:
            self._note_index_backward(args, kwargs, out, before)
            return
        if func is torch.ops.aten.index_add.default:
            self._note_index_select_backward(args, out, before)
            return
        if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2 or torch.is_grad_enabled() or \
                in_linear():
            return
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(out, torch.Tensor)):
            return
        if a.shape != b.shape or a.dtype != b.dtype:
            return
        blocks = [self._block_of(t) for t in (a, b, out)]
        if None in blocks or self.recorder.blocks.alloc_seq[blocks[0]] >= self._node_start:
            return
        # the engine sums into the buffered gradient (the first operand) if it holds its
        # storage alone: dense, and not a view, whose base holds the storage too
        if _dense(a) and not a._is_view():
            self.accumulations.append((before, len(self.run.actions), (blocks[0],), blocks[2]))

    def _note_bias_add(self, args, kwargs, out, before: int) -> None:
        """Note F.linear's bias added after its matmul: in place on real tensors, out of
        place on fake ones (memdoctor.predict.linear_bias); the product counts when it is
        the last block allocated before the add, dense and not a view."""
        if kwargs or len(args) != 2 or not all(isinstance(t, torch.Tensor) for t in (*args, out)):
            return
        product = args[0]
        if product.shape != out.shape or product.dtype != out.dtype or product._is_view() or not _dense(product):
            return
        blocks = [self._block_of(product), self._block_of(out)]
        if None in blocks:
            return
        seq = before - 1
        actions = self.run.actions
        while seq >= 0 and actions[seq] != Action.ALLOC:
            seq -= 1
        if seq < 0 or self.run.event_blocks[seq] != blocks[0]:
            return
        self.accumulations.append((before, len(self.run.actions), (blocks[0],), blocks[1]))

    def _note_index_backward(self, args, kwargs, out, before: int) -> None:
        """Note an indexing's backward: autograd's `index_backward` (FunctionsManual.cpp)
        accumulates the gradient into fresh zeros in place, `_index_put_impl_(zeros, indices,
        grad, accumulate=true)`, on real tensors, and calls the out-of-place `index_put` only
        when a tensor is subclass-like, as under a dispatch mode; so the fake run has a copy
        of the zeros the GPU never makes (the H200's trace of Mixtral's expert routing: one
        block where the fake run has two). The zeros count when this node made them and
        they are dense and not a view; memdoctor.predict.grad_sums merges the copy into them
        when the zeros' free follows at once."""
        accumulate = args[3] if len(args) > 3 else (kwargs or {}).get("accumulate", False)
        if accumulate is not True or not args or not isinstance(out, torch.Tensor):
            return
        self._note_into_zeros(args[0], out, before)

    def _note_index_select_backward(self, args, out, before: int) -> None:
        """Note index_select's backward: `index_select_backward` (FunctionsManual.cpp) adds the
        gradient into fresh zeros in place, `new_zeros(sizes).index_add_(dim, index, grad)`,
        on real tensors and with the out-of-place `index_add` when one is subclass-like (the
        H200's trace of an unsorted pack_padded_sequence, which index_selects its input: one
        block where the fake run has two); merged as the indexing backward's."""
        if args and isinstance(out, torch.Tensor):
            self._note_into_zeros(args[0], out, before)

    def _note_into_zeros(self, zeros, out: torch.Tensor, before: int) -> None:
        """The zeros count when this node made them and they are dense and not a view."""
        if not isinstance(zeros, torch.Tensor) or zeros._is_view() or not _dense(zeros) or zeros.shape != out.shape:
            return
        blocks = [self._block_of(zeros), self._block_of(out)]
        if None in blocks or self.recorder.blocks.alloc_seq[blocks[0]] < self._node_start:
            return
        self.accumulations.append((before, len(self.run.actions), (blocks[0],), blocks[1]))

    def _note_order(self, order: tuple[int, ...], out, before: int) -> None:
        """Note the op's new output blocks in the order its CUDA kernel allocates them."""
        if not isinstance(out, (tuple, list)) or max(order) >= len(out):
            return
        blocks = [self._block_of(out[i]) if isinstance(out[i], torch.Tensor) else None for i in order]
        if None in blocks or len(set(blocks)) != len(blocks):
            return
        if all(self.recorder.blocks.alloc_seq[b] >= before for b in blocks):
            self.reorders.append((before, len(self.run.actions), blocks))

    def _block_of(self, t: torch.Tensor) -> int | None:
        try:
            entry = self.recorder.live.get(t.untyped_storage()._cdata)
        except Exception:
            return None
        return entry.id if entry is not None else None


def note_cudnn_call() -> None:
    """A cuDNN call that dispatches no aten op of its own (the estimate's fused RNNs on fake
    tensors): counted for the calling thread in the active KernelWatch, for its handle's memory.
    Not placed among the segments: on a GPU nn.RNNBase flattens its weights with cuDNN while the
    model is built, so the forward thread's handle comes before the step."""
    thread = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, KernelWatch):
            mode.dnn_threads.add(thread)


def _dense(t: torch.Tensor) -> bool:
    """Whether the elements fill the storage span without gaps or overlaps, in any order
    of dimensions (TensorImpl::is_non_overlapping_and_dense)."""
    expected = 1
    for stride, size in sorted((int(st), int(n)) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _bias_1d(args, kwargs) -> bool:
    bias = args[0] if args else None
    beta = (kwargs or {}).get("beta", 1)
    return isinstance(bias, torch.Tensor) and bias.dim() == 1 and beta == 1


def workspace_events(watch: KernelWatch, sm90: bool) -> list[tuple]:
    """The cuBLAS / cuBLASLt workspace allocations, at the first matmul of each thread,
    never freed (events for memdoctor.predict.events.insert_events)."""
    events: list[tuple] = []
    for thread, pos in watch.blas.items():
        events.append((pos, "alloc", None, cublas_workspace_bytes(sm90), f"cuBLAS workspace ({thread} thread)",
                       Category.OTHER.value))
    for thread, pos in watch.lt.items():
        events.append((pos, "alloc", None, cublaslt_workspace_bytes(), f"cuBLASLt workspace ({thread} thread)",
                       Category.OTHER.value))
    return events


def scratch_events(watch: KernelWatch) -> list[tuple]:
    """Each op's kernel scratch: allocated before or after its outputs, each freed once the
    scratch allocations it outlives are made, or, last first, once the op is done (events
    for memdoctor.predict.events.insert_events). Ops in the order they ran: where one op's
    end is the next one's start, the first op's scratch after its outputs comes before the
    next one's before its outputs (on the H200, Data2Vec-Audio's second convolution takes
    its 760 MiB workspace before the layer norm after it copies its input); the measured
    convolutions join the list last, so it is sorted by where each op began."""
    events: list[tuple] = []
    count = 0
    for before, after, scratch in sorted(watch.scratch, key=lambda entry: entry[0]):
        keys = [("scratch", count + i) for i in range(len(scratch))]
        count += len(scratch)
        for j, s in enumerate(scratch):
            pos = before if s.before_outputs else after
            events.append((pos, "alloc", keys[j], s.nbytes, s.label, Category.TEMPORARIES.value))
            for i in range(j, -1, -1):
                if scratch[i].outlives is not None and i + scratch[i].outlives == j:
                    events.append((pos, "free", keys[i], 0, "", ""))
        for i in range(len(scratch) - 1, -1, -1):
            o = scratch[i].outlives
            if o is None or i + o >= len(scratch):
                events.append((after, "free", keys[i], 0, "", ""))
    return events
