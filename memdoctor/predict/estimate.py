"""Predict the GPU memory of a training configuration without running it.

    est = estimate(model_fn, optimizer_fn, batch_fn, loss_fn, plan="bf16,ckpt=full")
    est.peak_allocated_bytes, est.peak_reserved_bytes, est.breakdown

How: the model, optimizer and batch are built under FakeTensorMode (tensors with shapes,
dtypes and devices but no data, so a 1.5B-parameter model costs nothing), on fake CUDA
tensors where this torch build has CUDA, else on fake CPU tensors standing in for them.
One full training step (forward, backward, optimizer step, zero_grad(set_to_none=True))
runs twice under memdoctor's dispatch tracer, so optimizer state created lazily in the
first step is counted and the second step sees it. The cuBLAS workspaces a GPU would
allocate through the caching allocator at the first matmul of each thread are inserted
into the Run, and so is the scratch memory CUDA kernels take and give back inside one call
(reduction staging buffers, attention and embedding backward workspaces:
memdoctor.cuda.kernel_scratch; cuDNN's convolution workspaces, measured on the local GPU
where there is one: memdoctor.predict.op_probe);
the Run's allocations and frees are replayed through a model of the CUDA caching allocator
(memdoctor.cuda.allocator_model) to predict `max_memory_allocated()` and `max_memory_reserved()`,
with the last step repeated in the replay until the allocator's layout settles: a training
run takes many steps, and its cached blocks can split differently in the third step than in
the second (_steady_step).
The CUDA context is reported apart: it is device memory, but the allocator's counters never
include it.

What the estimate cannot see (noted in Estimate.notes where it applies): flash-attention
backward's accumulators, cuDNN's convolution workspaces without a GPU to measure them on,
NCCL buffers, and other processes.

Plans (memdoctor.remedies.prepare) on fake tensors: precision (bf16/fp16 autocast,
bf16-true master weights), checkpointing (full, selective, N blocks), micro-batches and the
fused-optimizer swap run as they would on a GPU. What cannot run on fake tensors, and what
the estimate does instead:
- Prepared.step returns the loss as a float (`.item()`, data a fake tensor does not have):
  `train_step` below runs the same step without reading it;
- fp16's GradScaler.step reads its inf check with `.item()`: estimated as a step that did
  not overflow (unscale_, step, update);
- micro=auto halves the micro-batch on a real OOM: estimated with the whole batch;
- zero=N needs a process group: applied in the replay (a rank's shards, see _distributed);
- optimizer swaps whose kernels are Triton or CUDA code that cannot take fake tensors fail
  with an EstimateError naming the plan.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memdoctor.cuda.allocator_model import AllocatorConfig, CachingAllocatorModel, ModelOOM, MiB
from memdoctor.predict import cpu_standin
from memdoctor.cuda.kernel_scratch import Gpu, scratch_for
from memdoctor.predict.op_probe import ConvProbe
from memdoctor.attribution import breakdown_at, live_blocks
from memdoctor.remedies.plan import Plan
from memdoctor.predict.step_time import WorkCounter, fused_adamw_work
from memdoctor.run import Action, Block, CATEGORIES, Category, Run, stronger

__all__ = ["Estimate", "EstimateError", "estimate", "estimate_built", "train_step", "CUDA_CONTEXT_BYTES",
           "cublas_workspace_bytes", "CUBLASLT_WORKSPACE_BYTES"]

# The CUDA context (driver state, kernel images of the loaded modules, cuBLAS/cuDNN handles'
# own state) on an H100/H200 with CUDA 12/13 and lazy module loading (CUDA_MODULE_LOADING=LAZY,
# the default since CUDA 11.7 / torch 2.x): nvidia-smi shows ~500 MiB for a process that has
# only created its context and run a matmul. It is outside the allocator's counters, so it
# is reported apart and never added to the predicted peak.
CUDA_CONTEXT_BYTES = 500 * MiB

# cuBLAS workspace per (cuBLAS handle, stream), allocated through the caching allocator at the
# first cuBLAS call of a thread and kept for the process's life (aten/src/ATen/cuda/
# CublasHandlePool.cpp, parseChosenWorkspaceSize): CUBLAS_WORKSPACE_CONFIG if set, else
# ":4096:8" = 32 MiB on sm90 (H100/H200) and ":4096:2:16:8" = 8 MiB + 128 KiB elsewhere.
# Handles are per thread, and autograd runs CUDA backward on its own device thread, so a
# training step has two: the main thread's (forward) and the backward thread's.
CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
# cuBLASLt workspace (same file, parseCUDABlasLtWorkspaceSize): CUBLASLT_WORKSPACE_SIZE KiB,
# default 1024 KiB, one per (handle, stream), taken at the first cuBLASLt call: addmm with a
# 1-D bias (nn.Linear with bias) and _scaled_mm.
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024

_BLAS_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
             "_addmm_activation", "_scaled_mm", "_int_mm", "addr")
_LT_OPS = ("_addmm_activation", "_scaled_mm")


def cublas_workspace_bytes(sm90: bool = True) -> int:
    """The cuBLAS workspace per handle and stream, as parseChosenWorkspaceSize computes it."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        found = re.findall(r":([0-9]+):([0-9]+)", config)
        if found:
            return sum(int(size) * 1024 * int(count) for size, count in found)
    return CUBLAS_WORKSPACE_SM90 if sm90 else CUBLAS_WORKSPACE_DEFAULT


def cublaslt_workspace_bytes() -> int:
    value = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    try:
        return int(value) * 1024 if value else CUBLASLT_WORKSPACE_BYTES
    except ValueError:
        return CUBLASLT_WORKSPACE_BYTES


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


# ----------------------------------------------------------------------- the result
@dataclass
class Estimate:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    peak_step: int
    cuda_context_bytes: int
    workspace_bytes: int
    notes: list[str]
    run: Run
    device: str = "cuda"
    simulated_on: str = "cuda"
    peak_seq: int = 0
    live_peak_bytes: int = 0
    category_peaks: dict[str, int] = field(default_factory=dict)
    category_peaks_raw: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)
    params: int = 0
    param_bytes: int = 0
    plan: str = "none"
    world_size: int = 1
    budget_bytes: int | None = None
    fits: bool | None = None
    oom: dict | None = None
    budget_peak_reserved_bytes: int | None = None   # max_memory_reserved() with the allocator capped at the budget
    allocator: dict = field(default_factory=dict)
    anchors: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    config: dict = field(default_factory=dict)
    work: dict = field(default_factory=dict)

    @property
    def device_bytes_needed(self) -> int:
        """What the device must hold: the reserved peak plus the CUDA context."""
        return self.peak_reserved_bytes + (self.cuda_context_bytes if self.device == "cuda" else 0)

    def text_lines(self) -> list[str]:
        """The estimate for people: the two peaks, the context apart, the breakdown at the
        peak, the budget verdict, the anchors and the notes."""
        from memdoctor.units import format_bytes as fb
        cfg = self.config
        what = cfg.get("model") or os.path.basename(cfg.get("script") or "") or "model"
        shape = [f"batch {cfg['batch']}"] if cfg.get("batch") else []
        if cfg.get("seq"):
            shape.append(f"seq {cfg['seq']}")
        if cfg.get("image_size"):
            shape.append(f"{cfg['image_size']}px")
        if cfg.get("optimizer"):
            shape.append(cfg["optimizer"])
        shape.append(f"plan {self.plan}")
        if self.world_size > 1:
            shape.append(f"world size {self.world_size}")
        lines = [f"estimate for {what} ({', '.join(shape)}); {self.params / 1e6:,.1f}M parameters; "
                 f"{self.device}, simulated on {self.simulated_on}", ""]
        lines.append(f"  predicted peak allocated  {fb(self.peak_allocated_bytes):>12}   "
                     "(torch.cuda.max_memory_allocated)")
        lines.append(f"  predicted peak reserved   {fb(self.peak_reserved_bytes):>12}   "
                     "(torch.cuda.max_memory_reserved)")
        if self.device == "cuda":
            lines.append(f"  CUDA context, apart       {fb(self.cuda_context_bytes):>12}   "
                         f"(not in either peak; the device needs about {fb(self.device_bytes_needed)})")
        lines.append(f"  peak during the {self.peak_phase} phase of step {self.peak_step + 1}")
        lines.append("")
        lines.append("  at the peak           bytes   share")
        total = max(sum(self.breakdown.values()), 1)
        for cat, n in sorted(self.breakdown.items(), key=lambda kv: -kv[1]):
            if n:
                lines.append(f"    {cat:<16}{fb(n):>11}   {100 * n / total:4.0f}%")
        if self.budget_bytes is not None:
            lines.append("")
            if self.fits:
                lines.append(f"  budget {fb(self.budget_bytes)}: fits (the allocator's limit, as trace --budget; "
                             f"headroom {fb(self.budget_bytes - self.peak_reserved_bytes)} over the reserved peak)"
                             if self.budget_bytes >= self.peak_reserved_bytes else
                             f"  budget {fb(self.budget_bytes)}: fits, once cached blocks are released near the limit "
                             f"(reserved peak under it {fb(self.budget_peak_reserved_bytes)})")
            else:
                where = self.oom or {}
                lines.append(f"  budget {fb(self.budget_bytes)}: does NOT fit: the allocator would run out "
                             f"allocating {fb(where.get('requested_bytes'))} in the {where.get('phase', '?')} phase "
                             f"of step {where.get('step', 0) + 1}"
                             + (f" ({where['tensor']})" if where.get("tensor") else ""))
        if self.anchors:
            lines.append("")
            lines.append("  what other rules say")
            labels = {"memtracker_peak_bytes": "torch MemTracker (FakeTensorMode)",
                      "deepspeed_zero2_model_states_bytes": "DeepSpeed ZeRO-2 model states",
                      "accelerate_adam_x4_bytes": "accelerate: model size x 4 (Adam)",
                      "model_states_16_bytes_per_param": "16 bytes a parameter"}
            for key, label in labels.items():
                if key in self.anchors:
                    value = self.anchors[key]
                    lines.append(f"    {label:<36}{fb(value) if value is not None else 'failed':>12}")
            if self.anchors.get("memtracker_error"):
                lines.append(f"    (MemTracker: {self.anchors['memtracker_error']})")
        if self.notes:
            lines.append("")
            lines.append("  notes")
            for note in self.notes:
                lines.append(f"    - {note}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "breakdown": self.breakdown,
            "peak_phase": self.peak_phase,
            "peak_step": self.peak_step,
            "cuda_context_bytes": self.cuda_context_bytes,
            "workspace_bytes": self.workspace_bytes,
            "device_bytes_needed": self.device_bytes_needed,
            "live_peak_bytes": self.live_peak_bytes,
            "category_peaks": self.category_peaks,
            "category_peaks_raw": self.category_peaks_raw,
            "by_module": self.by_module,
            "params": self.params,
            "param_bytes": self.param_bytes,
            "plan": self.plan,
            "world_size": self.world_size,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "oom": self.oom,
            "budget_peak_reserved_bytes": self.budget_peak_reserved_bytes,
            "device": self.device,
            "simulated_on": self.simulated_on,
            "allocator": self.allocator,
            "anchors": self.anchors,
            "config": self.config,
            "notes": self.notes,
            "work": self.work,
            "elapsed_s": round(self.elapsed_s, 3),
        }


# ----------------------------------------------------------------------- the step
def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: Callable,
               prepared=None, fake: bool = False) -> None:
    """One full training step: forward, backward, optimizer step, zero_grad(set_to_none=True).

    With `prepared` (memdoctor.remedies.prepare's result) the step is Prepared.step's:
    zero_grad, forward under the plan's precision context and backward per micro-batch
    (each loss weighted by its share of the batch), the precision's optimizer step; then
    zero_grad. It is written out here rather than calling Prepared.step because that
    returns the loss as a Python float, which a fake tensor cannot give. `fake=True` also
    steps an fp16 loss scaler without reading its inf check (`.item()`), as if no step
    overflowed. The estimate and the GPU validation both run this function.
    """
    if prepared is None:
        loss = loss_fn(model, batch)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    from memdoctor.remedies.microbatch import batch_size, split_batch
    opt = prepared.optimizer
    opt.zero_grad(set_to_none=True)
    prepared.model.zero_grad(set_to_none=True)
    micro = prepared.plan.micro_batch
    total = batch_size(batch)
    size = total if micro in (None, "auto") else min(int(micro), total)
    parts = [batch] if size >= total else split_batch(batch, size)
    precision = prepared.precision
    for part in parts:
        share = batch_size(part) / total
        with precision.context():
            loss = loss_fn(prepared.model, part)
        weighted = loss if share == 1.0 else loss * share
        precision.backward(weighted)
        del loss, weighted
    scaler = precision.scaler
    if fake and scaler is not None:
        scaler.unscale_(opt)
        opt.step()
        scaler.update()
    else:
        precision.step(opt)
    opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------- fake building
def _cuda_built() -> bool:
    try:
        return torch.backends.cuda.is_built() and torch.version.cuda is not None
    except Exception:
        return False


def _local_gpu_is_sm90() -> bool:
    """Whether cuBLAS would take Hopper's workspace here: this machine's GPU is sm_90, or
    there is no GPU (the estimate then speaks for an H100/H200)."""
    try:
        if torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability()) == (9, 0)
    except Exception:
        pass
    return True


class _CpuForCuda(torch.overrides.TorchFunctionMode):
    """On a torch without CUDA, fake CUDA tensors would abort the process in the first
    kernel; this sends every explicit CUDA device (device=, .to, .cuda) to the CPU (and
    memdoctor.predict.cpu_standin runs attention and autocast's cross-entropy as CUDA does)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda,):
            return args[0].to("cpu") if args and isinstance(args[0], torch.Tensor) else args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return False


class _KernelWatch(TorchDispatchMode):
    """Note where the first cuBLAS (and cuBLASLt) call of each thread happens (the event
    index just after the op's outputs were allocated), and, with a `gpu`, the scratch
    memory each op's CUDA kernel would take (memdoctor.cuda.kernel_scratch) with the event
    indices before and after the op; with a `conv_probe`, the convolutions to measure; and
    the gradient sums autograd makes in place outside a dispatch mode (_sums_in_place)."""

    def __init__(self, recorder, gpu=None, conv_probe=None):
        super().__init__()
        self.recorder = recorder
        self.run = recorder.run
        self.gpu = gpu
        self.conv_probe = conv_probe
        self.blas: dict[str, int] = {}
        self.lt: dict[str, int] = {}
        self.scratch: list[tuple[int, int, list]] = []
        self.accumulations: list[tuple[int, int, tuple[int, ...], int]] = []
        self._node = None
        self._node_start = 0
        self.work = WorkCounter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.run.actions)
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            self._note_backward_op(func, args, kwargs, out, before)
        self.work.note(func, args, kwargs, out, self.recorder.step,
                       "backward" if in_backward else self.recorder.phase)
        if packet in BLAS_OPS:
            thread = "backward" if in_backward else "forward"
            if thread not in self.blas:
                self.blas[thread] = len(self.run.actions)
            if thread not in self.lt and (packet in LT_OPS or (packet in _ADDMM and _bias_1d(args, kwargs))):
                self.lt[thread] = len(self.run.actions)
        if self.gpu is not None:
            scratch = scratch_for(func, args, kwargs, self.gpu)
            if scratch:
                self.scratch.append((before, len(self.run.actions), scratch))
        if self.conv_probe is not None:
            self.conv_probe.note(func, args, kwargs, before, len(self.run.actions))
        return out

    def _note_backward_op(self, func, args, kwargs, out, before: int) -> None:
        """Note where each autograd node begins, and the additions that look like the
        engine summing two gradients for one input: operands alike, the first made by an
        earlier node (the gradient already buffered), with the dense ones it could sum into
        (_sums_in_place)."""
        node = torch._C._current_autograd_node()
        if node is not self._node:
            self._node, self._node_start = node, before
        if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2 or torch.is_grad_enabled():
            return
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(out, torch.Tensor)):
            return
        if a.shape != b.shape or a.dtype != b.dtype:
            return
        blocks = [self._block_of(t) for t in (a, b, out)]
        if None in blocks or self.run.blocks[blocks[0]].alloc_seq >= self._node_start:
            return
        # the engine sums into the buffered gradient (the first operand) if it holds its
        # storage alone: dense, and not a view, whose base holds the storage too
        if _dense(a) and not a._is_view():
            self.accumulations.append((before, len(self.run.actions), (blocks[0],), blocks[2]))

    def _block_of(self, t: torch.Tensor) -> int | None:
        try:
            entry = self.recorder.live.get(t.untyped_storage()._cdata)
        except Exception:
            return None
        return entry.block.id if entry is not None else None


def _dense(t: torch.Tensor) -> bool:
    """Whether the elements fill the storage span without gaps or overlaps, in any order
    of dimensions (TensorImpl::is_non_overlapping_and_dense)."""
    expected = 1
    for stride, size in sorted((int(st), int(n)) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _sums_in_place(run: Run, accumulations: list) -> list[tuple[int, int]]:
    """The gradient sums autograd's engine makes in place on real tensors: (sum, operand)
    block pairs.

    The engine adds a gradient into the one already buffered for the same input in place
    when it holds the last reference to either (`InputBuffer::accumulate`), but never while
    a Python dispatch mode is active (`isTensorSubclassLike`), so the fake run allocated a
    new sum and then freed the operand. Measured on the H200 (pass 12): the same
    configurations under a dispatch mode reserve up to 300 MiB less or more than plain, and
    the plain traces have no allocation where the fake run has the sum. A sum counts when
    the operand's free follows it at once: the engine held the operand's last reference.
    The engine sums only into the buffered gradient, and only if it is not a view: a tied
    head's fp32 gradient (a transpose's view) is summed anew with the embedding's, while
    under autocast (a cast's fresh output) it is summed in place (the H200's plain traces:
    GPT-2 774M fp32, pass 13; Llama 1B bf16, pass 27)."""
    pairs = []
    for before, after, into, out in accumulations:
        if after != before + 1 or run.actions[before] != Action.ALLOC or run.event_blocks[before] != out:
            continue
        freed = set()           # what the engine let go right after the sum: its operands
        seq = after
        while seq < len(run.actions) and seq <= after + 1 and run.actions[seq] == Action.FREE:
            freed.add(run.event_blocks[seq])
            seq += 1
        for operand in into:
            if operand in freed and run.blocks[operand].nbytes == run.blocks[out].nbytes:
                pairs.append((out, operand))
                break
    return pairs


def _merge_in_place(run: Run, pairs: list[tuple[int, int]]) -> int:
    """Make each (sum, operand) pair one block: the sum's allocation and the operand's free,
    still apart by nothing but the other operand's free, leave the run, and the operand's
    block lives on as the sum (its category the stronger of the two). Returns how many merged."""
    survivor: dict[int, int] = {}
    drop: set[int] = set()
    for out, operand in pairs:
        b_out, b_op = run.blocks.get(out), run.blocks.get(operand)
        if b_out is None or b_op is None or b_op.free_seq is None or \
                not 0 < b_op.free_seq - b_out.alloc_seq <= 2 or \
                any(a != Action.FREE for a in run.actions[b_out.alloc_seq + 1:b_op.free_seq]):
            continue
        keep = survivor.get(operand, operand)
        survivor[out] = keep
        drop.update((b_out.alloc_seq, b_op.free_seq))
        kept = run.blocks[keep]
        kept.category = stronger(b_out.category, kept.category)
        if b_out.shape and not kept.shape:
            kept.shape, kept.dtype = b_out.shape, b_out.dtype
    if not drop:
        return 0
    removed = sorted(drop)
    actions, blocks_col, bytes_col = [], [], []
    for seq, (a, bid, n) in enumerate(zip(run.actions, run.event_blocks, run.event_bytes)):
        if seq not in drop:
            actions.append(a)
            blocks_col.append(survivor.get(bid, bid))
            bytes_col.append(n)
    run.actions, run.event_blocks, run.event_bytes = actions, blocks_col, bytes_col
    for bid in survivor:
        del run.blocks[bid]
    for b in run.blocks.values():
        b.free_seq = None
    for seq, (a, bid) in enumerate(zip(actions, blocks_col)):
        b = run.blocks.get(bid)
        if b is None:
            continue
        if a == Action.ALLOC:
            b.alloc_seq = seq
        elif a == Action.FREE:
            b.free_seq = seq
    _shift_seqs(run, lambda seq: seq - bisect.bisect_left(removed, seq))
    return len(survivor)


def _shift_seqs(run: Run, shift: Callable[[int], int]) -> None:
    """Move the marks, OOMs and samples with the events they point at, after events were
    inserted or removed (an insert at a mark's position lands under the previous mark)."""
    for item in (*run.marks, *run.ooms, *run.samples):
        item.seq = shift(item.seq)


def _bias_1d(args, kwargs) -> bool:
    bias = args[0] if args else None
    beta = (kwargs or {}).get("beta", 1)
    return isinstance(bias, torch.Tensor) and bias.dim() == 1 and beta == 1


def _fakeify(batch, fake_mode, device):
    """A batch of real tensors as fake ones on `device` (other leaves unchanged)."""
    from torch.utils._pytree import tree_map

    def conv(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.fake_tensor.FakeTensor):
            return fake_mode.from_tensor(x).to(device)
        if isinstance(x, torch.Tensor):
            return x.to(device)
        return x
    return tree_map(conv, batch)


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def _force_cuda_default_foreach(optimizer) -> bool:
    """On a real GPU an optimizer left at foreach=None steps with the multi-tensor (foreach)
    kernels; torch picks that by `type(p) in (Tensor, Parameter)`, which a fake parameter
    fails, so under FakeTensorMode it would silently take the per-tensor loop (fewer
    temporaries). Make the choice the GPU would make."""
    changed = False
    for group in optimizer.param_groups:
        if "foreach" in group and group.get("foreach") is None and not group.get("fused") \
                and not group.get("differentiable", False):
            group["foreach"] = True
            changed = True
    return changed


# ----------------------------------------------------------------------- the estimate
def estimate(model_fn: Callable[[], nn.Module],
             optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] | None,
             batch_fn_or_batch: Any,
             loss_fn: Callable[[nn.Module, Any], torch.Tensor],
             plan: Plan | str | None = None,
             device: str = "cuda",
             **options) -> Estimate:
    """Predict the peak memory of training `model_fn()` with `optimizer_fn(model)` on a batch.

    model_fn: builds the model (called under FakeTensorMode with `device` as default device).
    optimizer_fn: builds the optimizer from the model (default: AdamW, lr 1e-4).
    batch_fn_or_batch: a function returning the batch, or the batch itself (real tensors are
      turned into fake ones on `device`).
    loss_fn(model, batch): the mean loss of a batch.
    plan: a memdoctor Plan (or its string, "bf16,ckpt=full,micro=2"), applied with
      memdoctor.remedies.prepare to the fake model; zero=N is applied in the replay (one
      rank's shards).
    Options: world_size (ranks: DDP buckets, or ZeRO shards with plan zero=N), budget
      (bytes: the allocator's limit, as `memdoctor trace --budget`; the CUDA context is
      outside it), steps (default 2), settle (default True: the peaks of a long run, the
      last step repeated until the allocator's layout settles; False: of `steps` steps
      alone, as a measurement of that many steps sees them), cuda_context_bytes (default CUDA_CONTEXT_BYTES),
      sm90 (Hopper's 32 MiB cuBLAS workspace; default: this machine's GPU if it has one,
      else True), allocator_conf (a PYTORCH_CUDA_ALLOC_CONF string; default the
      environment's), anchors (also compute what other tools say: slower), probe_gpu
      (measure cuDNN's convolution workspaces on this machine's GPU, one convolution at a
      time; default: when there is a GPU; False: use no GPU memory at all).
    """
    if isinstance(model_fn, nn.Module):
        raise TypeError("estimate() needs a function that builds the model (model_fn), not a built "
                        "model: the model is built again from fake tensors")
    if not callable(model_fn):
        raise TypeError("model_fn must be a function returning an nn.Module")
    optimizer_fn = optimizer_fn or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))

    def build(fake_mode, dev):
        model = model_fn()
        optimizer = optimizer_fn(model)
        if callable(batch_fn_or_batch):
            batch = batch_fn_or_batch()
        else:
            batch = _fakeify(batch_fn_or_batch, fake_mode, dev)
        return model, optimizer, batch, loss_fn

    return estimate_built(build, plan=plan, device=device, **options)


def estimate_built(build: Callable, plan: Plan | str | None = None, device: str = "cuda", *,
                   world_size: int = 1, budget: int | None = None, steps: int = 2, settle: bool = True,
                   cuda_context_bytes: int | None = None, sm90: bool | None = None,
                   allocator_conf: str | None = None, anchors: bool = False,
                   probe_gpu: bool | None = None) -> Estimate:
    """estimate() for a `build(fake_mode, device)` returning (model, optimizer, batch, loss_fn),
    or a dict with those keys; a build() taking no arguments is called without them.
    probe_gpu: measure the cuDNN convolution workspaces on this machine's GPU
    (memdoctor.predict.op_probe; default: when there is one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memdoctor.capture.session import Tracer

    t0 = time.perf_counter()
    plan = Plan.parse(plan) if isinstance(plan, str) else (plan or Plan())
    target = torch.device(device).type
    if target not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
    notes: list[str] = []
    if sm90 is None:
        sm90 = _local_gpu_is_sm90()
    on_cpu_for_cuda = target == "cuda" and not _cuda_built()
    sim = "cpu" if on_cpu_for_cuda else target
    can_probe = target == "cuda" and not on_cpu_for_cuda and torch.cuda.is_available()
    conv_probe = ConvProbe() if can_probe and probe_gpu is not False else None
    if on_cpu_for_cuda:
        notes.append(_CPU_STANDIN_NOTE)
    zero = plan.zero
    run_plan = Plan(plan.precision, plan.checkpointing, plan.micro_batch, plan.optimizer, None)
    if plan.micro_batch == "auto":
        notes.append("micro=auto starts with the whole batch and halves only on a real OOM; the estimate "
                     "is for the whole batch (if it does not fit, estimate micro=N instead)")
    if plan.precision == "fp16":
        notes.append("fp16: the loss scaler's inf check (.item()) cannot run on fake tensors; the step "
                     "is estimated as one that did not overflow")

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    redirect = _CpuForCuda() if on_cpu_for_cuda else contextlib.nullcontext()
    cuda_kernels = cpu_standin.cuda_kernels() if on_cpu_for_cuda else contextlib.nullcontext()
    tracer = Tracer(source="dispatch")
    forced_foreach = False
    stage = "building the model, optimizer and batch"
    try:
        with fake_mode, redirect, cuda_kernels:
            with tracer:
                watch = _KernelWatch(tracer.recorder, Gpu.local() if target == "cuda" else None, conv_probe)
                with watch:
                    with torch.device(sim):
                        built = _call_build(build, fake_mode, sim)
                    model, optimizer, batch, loss_fn = built
                    batch_blocks = _block_ids(tracer.recorder, batch)
                    params = _unique_params(model)
                    n_params = sum(p.numel() for p in params)
                    param_bytes = sum(p.numel() * p.element_size() for p in params)
                    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
                    prepared = None
                    if not run_plan.is_empty():
                        stage = f"applying the plan {run_plan}"
                        from memdoctor.remedies import prepare
                        prepared = prepare(model, optimizer, run_plan, device_type=sim)
                        optimizer = prepared.optimizer
                    if target == "cuda":
                        forced_foreach = _force_cuda_default_foreach(optimizer)
                    stage = "running the training step"
                    for _ in range(steps):
                        train_step(model, optimizer, batch, loss_fn, prepared, fake=True)
                    del built, batch, prepared
    except EstimateError:
        raise
    except Exception as exc:
        raise EstimateError(f"{stage} on fake tensors failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    fused = fused_adamw_work(optimizer)
    if fused is not None:
        for step in range(steps):
            watch.work.add(step, *fused)
    run = tracer.run
    _inputs_are_the_batch(run, batch_blocks)
    in_place = _sums_in_place(run, watch.accumulations)
    if forced_foreach:
        notes.append("optimizer foreach=None: stepped with the foreach (multi-tensor) kernels, as torch "
                     "chooses on CUDA")
    workspaces = 0
    conv_note, convs_measured = "", False
    if conv_probe is not None and conv_probe.uses:
        try:
            measured = conv_probe.measure(torch.device("cuda"))
            watch.scratch.extend((before, after, measured[key]) for before, after, key in conv_probe.uses)
            conv_note = (f"convolutions: cuDNN's workspaces measured on this machine's GPU "
                         f"({torch.cuda.get_device_name()}), each of the {len(measured)} distinct convolutions "
                         "run once on uninitialised tensors")
            convs_measured = True
        except Exception as exc:
            conv_note = f"convolutions: measuring cuDNN's workspaces on this GPU failed ({_first_line(exc)})"
    if target == "cuda":
        ws_events = _workspace_events(watch, sm90)
        scratch = _scratch_events(watch)
        _insert_events(run, ws_events + scratch, sim)
        workspaces = sum(e[3] for e in ws_events)
        sizes = [e[3] for e in scratch if e[1] == "alloc"]
        if sizes:
            notes.append(f"kernel scratch: {len(sizes)} allocations CUDA kernels make and free inside one call "
                         f"(reduction staging buffers, attention and embedding backward workspaces; the largest "
                         f"{_fmt(max(sizes))}), sized for a GPU of {watch.gpu.sm_count} SMs")
        notes.append(f"cuBLAS workspaces: {_fmt(cublas_workspace_bytes(sm90))} per thread that runs a matmul "
                     f"(forward and autograd's backward thread), {_fmt(cublaslt_workspace_bytes())} cuBLASLt "
                     f"workspace per thread that runs an addmm with bias; {_fmt(workspaces)} in all, "
                     "counted as 'other' and never freed")
        if conv_note:
            notes.append(conv_note)
        if not convs_measured and any(b.name.startswith(("aten.convolution", "aten.cudnn"))
                                      for b in run.blocks.values()):
            notes.append("convolutions: cuDNN allocates its workspace inside each call and frees it "
                         "before returning; its size is cuDNN's choice per shape, GPU and version, and is "
                         "not in the estimate without a GPU to measure it on (the reserved peak of a "
                         "convolutional network can be 5-13% higher)")
    _merge_in_place(run, in_place)
    conf = AllocatorConfig.parse(allocator_conf if allocator_conf is not None
                                 else os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    if conf.ignored:
        notes.append(f"PYTORCH_CUDA_ALLOC_CONF options not modelled: {', '.join(conf.ignored)}")
    counted = _counted_blocks(run, sim, skip_cpu_scalars=on_cpu_for_cuda)
    sizes_of, dist_note = _distributed(run, counted, world_size, zero, grad_bytes, sim)
    if dist_note:
        notes.append(dist_note)
    replay = _replay(run, counted, CachingAllocatorModel(None, conf), sizes_of=sizes_of,
                     steps=steps if settle else None)
    if replay["peak_reserved"] > replay["peak_reserved_recorded"]:
        step = run.mark_at(replay["peak_reserved_seq"]).step + replay["peak_reserved_repeat"] + 1
        notes.append(f"the allocator's cached blocks settle only after the {steps} steps run: in a longer "
                     f"run the reserved peak is {_fmt(replay['peak_reserved'])}, "
                     f"{_fmt(replay['peak_reserved'] - replay['peak_reserved_recorded'])} more, from step {step}")
    peak_seq = replay["peak_seq"]
    bd = breakdown_at(run, peak_seq, top=0)
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for b in live_blocks(run, peak_seq):
        if b.id in counted:
            breakdown[b.category] = breakdown.get(b.category, 0) + replay["sizes"].get(b.id, 0)
    mark = run.mark_at(peak_seq)
    est = Estimate(
        peak_allocated_bytes=replay["peak_allocated"], peak_reserved_bytes=replay["peak_reserved"],
        breakdown=breakdown, peak_phase=mark.phase if mark else "other",
        peak_step=(mark.step if mark else 0) + replay["peak_repeat"],
        cuda_context_bytes=(CUDA_CONTEXT_BYTES if cuda_context_bytes is None else int(cuda_context_bytes))
        if target == "cuda" else 0,
        workspace_bytes=workspaces, notes=notes, run=run, device=target,
        simulated_on=("cpu (standing in for cuda)" if on_cpu_for_cuda else sim) + " (FakeTensorMode)",
        peak_seq=peak_seq, live_peak_bytes=replay["live_peak"], category_peaks=replay["category_peaks"],
        category_peaks_raw=replay["category_peaks_raw"],
        by_module=bd.by_module, params=n_params, param_bytes=param_bytes, plan=str(plan),
        world_size=world_size, budget_bytes=budget, allocator=replay["stats"],
        work={part: w.to_dict() for part, w in watch.work.of_step(steps - 1).items()})
    if budget is not None:
        est.fits, est.oom, est.budget_peak_reserved_bytes = _check_budget(
            run, counted, conf, budget, sizes_of, steps if settle else None)
    run.meta["estimate"] = {k: v for k, v in est.to_dict().items() if k not in ("anchors", "by_module")}
    if anchors:
        est.anchors = compute_anchors(build, run_plan, device, est, world_size=world_size, steps=steps)
    est.elapsed_s = time.perf_counter() - t0
    return est


class EstimateError(ValueError):
    """The configuration could not be run on fake tensors (what failed, in one line)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


_CPU_STANDIN_NOTE = (
    "this torch has no CUDA, so the step ran on fake CPU tensors standing in for CUDA ones; attention "
    "without a mask runs CUDA's kernels (cuDNN attention for fp16/bf16, memory-efficient for fp32, as "
    "an H100/H200 picks them) and autocast's cross-entropy runs as on CUDA; what still differs: "
    "attention with a mask (the CPU's kernel; its math path saves the seq x seq attention matrix that "
    "CUDA never does), other autocast ops (CPU autocast's op lists differ from CUDA's), batch norm (CUDA "
    "uses cuDNN and saves an extra reserve buffer), cuDNN's convolution workspaces (measured only on a "
    "GPU), optimizer step counters (on the CPU on a GPU too, left out here), fused optimizer kernels "
    "(CPU has fewer). Against an H200, transformers without attention masks estimate to the MiB here "
    "(benchmarks/results/standin)")


def _call_build(build, fake_mode, device):
    try:
        import inspect
        takes = len(inspect.signature(build).parameters)
    except (TypeError, ValueError):
        takes = 2
    got = build(fake_mode, device) if takes >= 2 else build()
    if isinstance(got, dict):
        missing = [k for k in ("model", "optimizer", "batch", "loss_fn") if k not in got]
        if missing:
            raise ValueError(f"build() returned a dict without {', '.join(missing)}")
        got = (got["model"], got["optimizer"], got["batch"], got["loss_fn"])
    if not (isinstance(got, (tuple, list)) and len(got) == 4):
        raise ValueError("build() must return (model, optimizer, batch, loss_fn) or a dict with those keys")
    model, optimizer, batch, loss_fn = got
    if not isinstance(model, nn.Module):
        raise ValueError(f"build() returned a {type(model).__name__} as the model, not an nn.Module")
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if not callable(loss_fn):
        raise ValueError("build() must return a loss_fn(model, batch)")
    return model, optimizer, batch, loss_fn


def _fmt(n: int) -> str:
    from memdoctor.units import format_bytes
    return format_bytes(n)


# ----------------------------------------------------------------------- replay
def _workspace_events(watch: _KernelWatch, sm90: bool) -> list[tuple]:
    """The cuBLAS / cuBLASLt workspace allocations, at the first matmul of each thread,
    never freed (events for _insert_events)."""
    events: list[tuple] = []
    for thread, pos in watch.blas.items():
        events.append((pos, "alloc", None, cublas_workspace_bytes(sm90), f"cuBLAS workspace ({thread} thread)",
                       Category.OTHER.value))
    for thread, pos in watch.lt.items():
        events.append((pos, "alloc", None, cublaslt_workspace_bytes(), f"cuBLASLt workspace ({thread} thread)",
                       Category.OTHER.value))
    return events


def _scratch_events(watch: _KernelWatch) -> list[tuple]:
    """Each op's kernel scratch: allocated before or after its outputs, each freed once the
    scratch allocations it outlives are made, or, last first, once the op is done (events
    for _insert_events)."""
    events: list[tuple] = []
    count = 0
    for before, after, scratch in watch.scratch:
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


def _insert_events(run: Run, events: list[tuple], device_type: str) -> None:
    """Insert allocations and frees into the Run, shifting every later event index. Each
    event is (position before event `pos`, "alloc" or "free", key, bytes, name, category);
    a free names the key of an inserted allocation; an allocation with key None is never
    freed. Events at one position keep their order."""
    if not events:
        return
    device = "cuda:0" if device_type == "cuda" else device_type
    for b in run.blocks.values():
        if b.device.startswith(device_type):
            device = b.device
            break
    events = sorted(events, key=lambda e: e[0])         # stable: same-position order kept
    next_id = max(run.blocks, default=-1) + 1
    positions = [e[0] for e in events]

    def shift(seq: int) -> int:
        return seq + bisect.bisect_right(positions, seq)

    actions, blocks_col, bytes_col = [], [], []
    j = 0
    new_blocks = []
    ids: dict = {}
    for seq in range(len(run.actions) + 1):
        while j < len(events) and events[j][0] == seq:
            _, kind, key, nbytes, name, category = events[j]
            if kind == "alloc":
                blk = Block(next_id, nbytes, category, name, [nbytes], "uint8", device, None,
                            "other", 0, len(actions))
                new_blocks.append(blk)
                if key is not None:
                    ids[key] = blk
                actions.append(Action.ALLOC)
                blocks_col.append(next_id)
                bytes_col.append(nbytes)
                next_id += 1
            else:
                blk = ids.pop(key)
                blk.free_seq = len(actions)
                actions.append(Action.FREE)
                blocks_col.append(blk.id)
                bytes_col.append(blk.nbytes)
            j += 1
        if seq < len(run.actions):
            actions.append(run.actions[seq])
            blocks_col.append(run.event_blocks[seq])
            bytes_col.append(run.event_bytes[seq])
    for b in run.blocks.values():
        b.alloc_seq = shift(b.alloc_seq)
        if b.free_seq is not None:
            b.free_seq = shift(b.free_seq)
    for blk in new_blocks:
        run.blocks[blk.id] = blk
    _shift_seqs(run, shift)
    run.actions, run.event_blocks, run.event_bytes = actions, blocks_col, bytes_col
    for blk in new_blocks:
        mark = run.mark_at(blk.alloc_seq)
        if mark is not None:
            blk.phase, blk.step = mark.phase, mark.step


def _block_ids(recorder, batch) -> set[int]:
    """The blocks of the batch's tensors (counted now if the build made them untraced)."""
    from torch.utils._pytree import tree_leaves
    ids = set()
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            block = recorder.add(t, "", Category.INPUTS.value)
            if block is not None:
                ids.add(block.id)
    return ids


def _inputs_are_the_batch(run: Run, batch_blocks: set[int]) -> None:
    """The tracer calls 'inputs' whatever enters an outermost module call; a checkpointed
    block recomputed in backward is such a call, so the hidden states checkpointing saves
    would count as inputs. In an estimate the inputs are the batch: the rest are activations."""
    for b in run.blocks.values():
        if b.category == Category.INPUTS.value and b.id not in batch_blocks:
            b.category = Category.ACTIVATIONS.value


_CPU_RNG_OUTPUTS = frozenset({"aten._scaled_dot_product_efficient_attention", "aten._efficient_attention_forward"})


def _counted_blocks(run: Run, device_type: str, skip_cpu_scalars: bool) -> set[int]:
    """The blocks that live on the simulated device. Standing in for CUDA on the CPU, the
    optimizers' 0-dim step counters are left out: on a GPU they stay on the CPU."""
    out = set()
    for b in run.blocks.values():
        if not b.device.startswith(device_type):
            continue
        if b.name in _CPU_RNG_OUTPUTS and not b.shape and b.nbytes == 8:
            continue        # memory-efficient attention's philox seed and offset: CPU tensors on a GPU
        if skip_cpu_scalars and b.category == Category.OPTIMIZER_STATE.value and not b.shape \
                and b.name.endswith(":step"):
            continue
        out.add(b.id)
    return out


MAX_REPEATS = 8     # steady steps replayed after the recorded ones, at most


def _steady_step(run: Run, counted: set[int], steps: int):
    """The last recorded step as a template for the steps after it: (its end event index,
    its events as (seq, action, bid, carried)), or None if it does not repeat.

    The allocator's layout can take more steps than the recorded ones to settle: Llama 1B
    ran out of memory in its third step on the H200 after two steps at the predicted peak.
    A block the step frees that an earlier step made (last step's gradients) is `carried`:
    in a repeat it is the block of this step with the same name and size."""
    starts: dict[int, int] = {}
    for m in run.marks:
        starts.setdefault(m.step, m.seq)
    last = steps - 1
    if steps < 2 or last not in starts:
        return None
    first, end = starts[last], starts.get(steps, len(run.actions))
    kept: dict[tuple, list[int]] = {}              # made in the step and still live at its end
    for seq in range(first, end):
        bid = run.event_blocks[seq]
        b = run.blocks[bid]
        if run.actions[seq] == Action.ALLOC and bid in counted and (b.free_seq is None or b.free_seq >= end):
            kept.setdefault((b.name, b.nbytes), []).append(bid)
    events = []
    for seq in range(first, end):
        bid = run.event_blocks[seq]
        if bid not in counted:
            continue
        carried = None
        b = run.blocks[bid]
        if run.actions[seq] == Action.FREE and b.alloc_seq < first:
            same = kept.get((b.name, b.nbytes))
            if not same:
                return None                         # frees what no step makes again
            carried = same.pop(0)
        events.append((seq, run.actions[seq], bid, carried))
    if any(kept.values()):
        return None                                 # keeps more each step (a leak): no steady state
    return end, events


def _layout(model: CachingAllocatorModel) -> tuple:
    return (tuple(sorted(model.segments.items())), tuple(model.large_pool.keys), tuple(model.small_pool.keys))


def _events(run: Run, counted: set[int], model: CachingAllocatorModel, steps: int | None):
    """(seq, action, key, bid, repeat) for the Run's events of the `counted` blocks; with
    `steps`, the last step then repeats until the allocator's layout at the end of a step
    stops changing (at most MAX_REPEATS times), before the events after it. A repeat's
    seq is the template's, its key a new block's."""
    steady = _steady_step(run, counted, steps) if steps else None
    end = steady[0] if steady else len(run.actions)
    for seq in range(end):
        bid = run.event_blocks[seq]
        if bid in counted:
            yield seq, run.actions[seq], bid, bid, 0
    if steady:
        template = steady[1]
        before = _layout(model)
        for r in range(1, MAX_REPEATS + 1):
            for seq, action, bid, carried in template:
                if carried is not None:
                    yield seq, action, (carried if r == 1 else (r - 1, carried)), carried, r
                else:
                    yield seq, action, (r, bid), bid, r
            after = _layout(model)
            if after == before:
                break
            before = after
    for seq in range(end, len(run.actions)):
        bid = run.event_blocks[seq]
        if bid in counted:
            yield seq, run.actions[seq], bid, bid, 0


def _replay(run: Run, counted: set[int], model: CachingAllocatorModel, stop_on_oom: bool = False,
            sizes_of: dict[int, int] | None = None, steps: int | None = None) -> dict:
    """Replay the Run's allocations and frees of the `counted` blocks, with `steps` (the
    steps recorded) also the steady steps after them (_events); `sizes_of` overrides the
    bytes of some blocks (a rank's shard under ZeRO)."""
    handles: dict[Any, Any] = {}
    sizes: dict[int, int] = {}
    cat_of = {bid: run.blocks[bid].category for bid in counted}
    cat_live = dict.fromkeys(CATEGORIES, 0)
    cat_peak = dict.fromkeys(CATEGORIES, 0)
    raw_live = dict.fromkeys(CATEGORIES, 0)
    raw_peak = dict.fromkeys(CATEGORIES, 0)
    live = live_peak = 0
    peak_alloc, peak_seq, peak_res_seq, peak_repeat = -1, 0, 0, 0
    oom = None
    reserved_recorded, peak_res_repeat, peak_reserved = None, 0, model.peak_reserved
    ALLOC, FREE = Action.ALLOC, Action.FREE
    event_bytes = run.event_bytes
    for seq, action, key, bid, repeat in _events(run, counted, model, steps):
        if repeat and reserved_recorded is None:
            reserved_recorded = model.peak_reserved         # the recorded steps' own peak
        if action == ALLOC:
            nbytes = event_bytes[seq]
            if sizes_of is not None:
                nbytes = sizes_of.get(bid, nbytes)
            try:
                h = model.malloc(nbytes)
            except ModelOOM as exc:
                oom = {"seq": seq, "repeat": repeat, "requested_bytes": exc.requested,
                       "allocated_bytes": exc.allocated, "reserved_bytes": exc.reserved}
                if stop_on_oom:
                    break
                continue
            if h is None:
                continue
            handles[key] = h
            sizes[bid] = h.size
            cat = cat_of[bid]
            cat_live[cat] += h.size
            if cat_live[cat] > cat_peak[cat]:
                cat_peak[cat] = cat_live[cat]
            raw_live[cat] += nbytes
            if raw_live[cat] > raw_peak[cat]:
                raw_peak[cat] = raw_live[cat]
            live += nbytes
            if live > live_peak:
                live_peak = live
            if model.allocated > peak_alloc:
                peak_alloc, peak_seq, peak_repeat = model.allocated, seq, repeat
            if model.reserved > peak_reserved:      # where the reserved peak was first reached
                peak_reserved, peak_res_seq, peak_res_repeat = model.reserved, seq, repeat
        elif action == FREE:
            h = handles.pop(key, None)
            if h is None:
                continue
            cat_live[cat_of[bid]] -= h.size
            raw_live[cat_of[bid]] -= h.requested
            live -= h.requested
            model.free(h)
    return {"peak_allocated": max(model.peak_allocated, 0), "peak_reserved": model.peak_reserved,
            "peak_seq": peak_seq, "peak_repeat": peak_repeat,
            "peak_reserved_recorded": model.peak_reserved if reserved_recorded is None else reserved_recorded,
            "peak_reserved_repeat": peak_res_repeat,
            "peak_reserved_seq": peak_res_seq, "sizes": sizes,
            "category_peaks": cat_peak, "category_peaks_raw": raw_peak, "live_peak": live_peak, "stats": model.stats(), "oom": oom}


def _check_budget(run: Run, counted: set[int], conf: AllocatorConfig, budget: int,
                  sizes_of: dict[int, int] | None, steps: int | None = None):
    """Replay again with the allocator capped at the budget (cached segments are released
    and the request retried before an OOM, as on a GPU), steady steps included: whether it
    fits, the OOM if not, and the reserved peak under the cap."""
    result = _replay(run, counted, CachingAllocatorModel(budget, conf), stop_on_oom=True, sizes_of=sizes_of,
                     steps=steps)
    oom = result["oom"]
    if oom is None:
        return True, None, result["peak_reserved"]
    mark = run.mark_at(oom["seq"])
    oom.update(phase=mark.phase if mark else "other", step=(mark.step if mark else 0) + oom.pop("repeat"))
    block = run.blocks.get(run.event_blocks[oom["seq"]])
    if block is not None:
        oom.update(tensor=block.name, category=block.category, module=block.module)
    return False, oom, result["peak_reserved"]


DDP_BUCKET_BYTES = 25 * MiB         # DistributedDataParallel's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1 * MiB    # and its first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


def _distributed(run: Run, counted: set[int], world_size: int, zero: int | None,
                 grad_bytes: int, device_type: str) -> tuple[dict[int, int] | None, str]:
    """What one rank of `world_size` holds, as changes to the Run before the replay.

    Without ZeRO (DDP): the reducer's flat gradient buckets (gradient_as_bucket_view=False,
    its default: one more copy of the gradients, in 25 MiB buckets) are allocated before
    the first forward and kept. With ZeRO stage s: stage 1 shards the optimizer state and
    the optimizer step's temporaries to 1/N, stage 2 also the gradients, stage 3 also the
    weights; returns the per-block byte overrides and a note."""
    n = max(int(world_size), 1)
    if zero is None:
        if n == 1:
            return None, ""
        start = next((m.seq for m in run.marks if m.phase == "forward"), 0)
        chunks, left, first = [], grad_bytes, True
        while left > 0:
            size = min(left, DDP_FIRST_BUCKET_BYTES if first else DDP_BUCKET_BYTES)
            chunks.append((start, "alloc", None, size, "DDP gradient bucket", Category.OTHER.value))
            left -= size
            first = False
        _insert_events(run, chunks, device_type)
        counted.update(b.id for b in run.blocks.values() if b.name == "DDP gradient bucket")
        return None, (f"world size {n} (DDP): {_fmt(grad_bytes)} of gradient buckets added (one more copy of the "
                      "gradients, in 25 MiB buckets, as DistributedDataParallel's default "
                      "gradient_as_bucket_view=False keeps); NCCL's own buffers are not in the estimate")
    cats = {Category.OPTIMIZER_STATE.value}
    if zero >= 2:
        cats.add(Category.GRADIENTS.value)
    if zero >= 3:
        cats.add(Category.WEIGHTS.value)
    sizes: dict[int, int] = {}
    for bid in counted:
        b = run.blocks[bid]
        if b.category in cats or (b.category == Category.TEMPORARIES.value and b.phase == "optimizer"):
            sizes[bid] = -(-b.nbytes // n)
    shards = ", ".join(sorted(cats)) + ", the optimizer step's temporaries"
    return sizes, (f"ZeRO-{zero} over {n} ranks: {shards} sharded to 1/{n} per rank in the replay; the "
                   "collectives' buffers" + (", the layers ZeRO-3 gathers for forward and backward" if zero >= 3
                                              else "") + " and the full-size gradients before reduce-scatter "
                   "are not in the estimate")


# ----------------------------------------------------------------------- anchors
def deepspeed_zero2_model_states_bytes(params: int, world_size: int = 1) -> int:
    """DeepSpeed's estimate_zero2_model_states_mem_needs without CPU offload, per GPU: fp16
    weights and gradients (2 + 2 bytes a parameter) plus fp32 master weights, momentum and
    variance (and fp32 gradients: 16 bytes) sharded over the GPUs."""
    return 4 * params + int(16 * params / max(world_size, 1))


def accelerate_adam_bytes(param_bytes: int) -> int:
    """accelerate's model-memory rule for training with Adam: four times the model's size."""
    return 4 * param_bytes


def compute_anchors(build: Callable, plan: Plan, device: str, est: Estimate, world_size: int = 1,
                    steps: int = 2) -> dict:
    """What other tools would say about the same configuration."""
    out: dict[str, Any] = {
        "deepspeed_zero2_model_states_bytes": deepspeed_zero2_model_states_bytes(est.params, world_size),
        "accelerate_adam_x4_bytes": accelerate_adam_bytes(est.param_bytes),
        "model_states_16_bytes_per_param": 16 * est.params,
    }
    try:
        out["memtracker_peak_bytes"] = memtracker_peak(build, plan, device, steps)
    except Exception as exc:        # an anchor failing is a fact to report, not an error
        out["memtracker_peak_bytes"] = None
        out["memtracker_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return out


def memtracker_peak(build: Callable, plan: Plan | None, device: str = "cuda", steps: int = 2) -> int:
    """torch.distributed._tools.mem_tracker.MemTracker's peak (all categories, the target
    device) for the same build and steps under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    target = torch.device(device).type
    on_cpu = target == "cuda" and not _cuda_built()
    sim = "cpu" if on_cpu else target
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    redirect = _CpuForCuda() if on_cpu else contextlib.nullcontext()
    with fake_mode, redirect:
        mt = MemTracker()
        with mt:
            with torch.device(sim):
                model, optimizer, batch, loss_fn = _call_build(build, fake_mode, sim)
            prepared = None
            if plan is not None and not plan.is_empty():
                from memdoctor.remedies import prepare
                prepared = prepare(model, optimizer, plan, device_type=sim)
                optimizer = prepared.optimizer
            if target == "cuda":
                _force_cuda_default_foreach(optimizer)
            for _ in range(steps):
                train_step(model, optimizer, batch, loss_fn, prepared, fake=True)
                mt.reset_mod_stats()        # its per-module stats take one iteration at a time
        snap = mt.get_tracker_snapshot("peak")
    best = 0
    for dev, values in snap.items():
        if torch.device(dev).type == sim:
            best = max(best, int(values.get("Total", 0)))
    return best


# ----------------------------------------------------------------------- configurations
def estimate_config(model: str | None = None, script: str | None = None, script_args=(), *, batch: int = 8,
                    seq: int | None = None, image_size: int | None = None, precision: str | None = None,
                    checkpointing: str | int | None = None, micro_batch: str | int | None = None,
                    optimizer: str = "adamw", plan: str | None = None, world_size: int = 1,
                    zero: int | None = None, budget: int | None = None, device: str = "cuda",
                    anchors: bool = False, probe_gpu: bool | None = None, settle: bool = True) -> Estimate:
    """The estimate of a known model (memdoctor.predict.models) or of a script's build(),
    as `memdoctor estimate` takes them; ValueError for a configuration that makes no sense."""
    from memdoctor.remedies.plan import OPTIMIZERS as SWAPS
    if (model is None) == (script is None):
        raise ValueError("give a model (--model NAME) or a SCRIPT exposing build()")
    if batch < 1:
        raise ValueError("--batch must be at least 1")
    if world_size < 1:
        raise ValueError("--world-size must be at least 1")
    swap = None
    base = optimizer
    if optimizer in SWAPS:          # "fused", "adamw-8bit", ...: a plan swap on top of AdamW
        swap, base = optimizer, "adamw"
    fields: dict[str, Any] = {}
    if plan:
        parsed = Plan.parse(plan)
        fields = {k: getattr(parsed, k) for k in ("precision", "checkpointing", "micro_batch", "optimizer", "zero")}
    for key, value in (("precision", precision), ("checkpointing", checkpointing),
                       ("micro_batch", micro_batch), ("optimizer", swap), ("zero", zero)):
        if value is not None:
            if isinstance(value, str) and value.isdigit():
                value = int(value)
            fields[key] = value
    the_plan = Plan(**fields)
    if script is not None:
        build = load_script_build(script, script_args)
        config = {"script": os.path.abspath(script)}
    else:
        from memdoctor.predict.models import get
        try:
            spec = get(model)
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        build = spec.builder(batch=batch, seq=seq, optimizer=base, image_size=image_size)
        config = {"model": spec.name, "batch": batch,
                  "seq": (seq or spec.default_seq) if spec.kind == "lm" else None,
                  "image_size": (image_size or spec.image_size) if spec.kind == "image" else None,
                  "optimizer": base}
    est = estimate_built(build, plan=the_plan, device=device, world_size=world_size, budget=budget,
                         anchors=anchors, probe_gpu=probe_gpu, settle=settle)
    est.run.meta.setdefault("estimate", {})["config"] = config
    est.config = config
    return est


def load_script_build(path: str, args=()) -> Callable:
    """The build() of a script: it must return (model, optimizer, batch, loss_fn), or a
    dict with those keys, and may take no arguments. The script is loaded as a module (not
    as __main__), so its `if __name__ == "__main__":` training loop does not run."""
    import runpy
    import sys
    if not os.path.isfile(path):
        raise ValueError(f"no such script: {path}")
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        namespace = runpy.run_path(path, run_name="__memdoctor_estimate__")
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    build = namespace.get("build")
    if not callable(build):
        raise ValueError(f"{path} has no build() function returning (model, optimizer, batch, loss_fn)")

    def wrapped():
        return build()
    return wrapped
