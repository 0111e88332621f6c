"""A training step's time, predicted from the work an estimate counts: the planner's cost model.

Eager PyTorch issues one call per op from the CPU, and the GPU runs the kernels while the
CPU goes on to the next. So the forward and backward passes take about the larger of two
times: the CPU's, to issue their ops, and the GPU's, to run them (matmul, convolution and
attention FLOPs at the 16-bit or the fp32 rate; the bytes every other op writes at memory
bandwidth). The optimizer step is timed the same way after them.

Micro-batches keep every op and divide the work: k micro-batches issue k times the ops for
the same FLOPs. While the GPU's share is the larger, that is nearly free; past the point
where the CPU's is, each halving nearly doubles the step. Checkpointing adds the recomputed
forward's ops and FLOPs; bf16 autocast moves the matmuls to the 16-bit rate and adds casts.
The two times overlap imperfectly, so they are combined as a smooth maximum (a p-norm).

The machine constants are fitted to step times measured on an H200 with torch 2.11
(benchmarks/step_time_fit.py; the fit and its errors are in benchmarks/results/step_time_fit_*.json).
What the model misses, measured: blockwise 8-bit states stepped 9-18% slower than bf16
states with micro-batches, and as fast with full checkpointing (the planner adds x1.05).
They rank plans; the absolute seconds are a guide for that GPU only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import flop_registry

from memdoctor.cuda.kernels.adamw_math import STATE_DTYPES, state_bytes_per_param
from memdoctor.remedies.checkpointing import POLICY_CALLS

__all__ = ["Work", "WorkCounter", "Machine", "H200", "step_seconds", "part_seconds", "fused_step_work",
           "fused_adamw_work", "SWAP_STATE"]

_HALF = (torch.bfloat16, torch.float16)


@dataclass
class Work:
    """What one part of a step asks of the CPU and the GPU."""
    ops: int = 0              # ops dispatched: each a CPU-side call, most a kernel launch
    launches: int = 0         # kernels launched from Python by memdoctor's fused optimizer steps
    mode_ops: int = 0         # ops that also went through selective checkpointing's Python policy
    flops16: float = 0.0      # matmul/convolution/attention FLOPs with 16-bit outputs
    flops32: float = 0.0      # the same in fp32
    bytes: float = 0.0        # bytes written by ops that are not views

    def __add__(self, other: "Work") -> "Work":
        return Work(self.ops + other.ops, self.launches + other.launches, self.mode_ops + other.mode_ops,
                    self.flops16 + other.flops16, self.flops32 + other.flops32, self.bytes + other.bytes)

    def to_dict(self) -> dict:
        return {"ops": self.ops, "launches": self.launches, "mode_ops": self.mode_ops, "flops16": self.flops16,
                "flops32": self.flops32, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, d: dict) -> "Work":
        return cls(int(d.get("ops", 0)), int(d.get("launches", 0)), int(d.get("mode_ops", 0)),
                   float(d.get("flops16", 0.0)), float(d.get("flops32", 0.0)), float(d.get("bytes", 0.0)))


@dataclass
class WorkCounter:
    """Counts each dispatched op's work, by step, into "compute" (forward, loss, backward,
    recomputation) and "optimizer" (the optimizer step)."""
    by_step: dict[int, dict[str, Work]] = field(default_factory=dict)
    _policy_calls: int = field(default_factory=lambda: POLICY_CALLS.count)

    def note(self, func, args, kwargs, out, step: int, phase: str) -> None:
        part = "optimizer" if phase == "optimizer" else "compute"
        work = self.by_step.setdefault(step, {}).setdefault(part, Work())
        work.ops += 1
        if POLICY_CALLS.count != self._policy_calls:
            work.mode_ops += POLICY_CALLS.count - self._policy_calls
            self._policy_calls = POLICY_CALLS.count
        if getattr(func, "is_view", False):
            return
        count = flop_registry.get(func.overloadpacket)
        if count is not None:
            try:
                flops = float(count(*args, **(kwargs or {}), out_val=out))
            except Exception:
                flops = 0.0
            if _dtype_of(out) in _HALF:
                work.flops16 += flops
            else:
                work.flops32 += flops
        written = out
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable and func.overloadpacket.__name__.endswith("_"):
            written = args[0] if args else None       # in place: what it writes is its first argument
        work.bytes += _bytes_of(written)

    def add(self, step: int, part: str, work: "Work") -> None:
        parts = self.by_step.setdefault(step, {})
        parts[part] = parts.get(part, Work()) + work

    def of_step(self, step: int) -> dict[str, Work]:
        """The work of one step (the last is the steady one: the optimizer state exists;
        what runs after it, zero_grad, counts in the next)."""
        parts = self.by_step.get(step, {})
        return {"compute": parts.get("compute", Work()), "optimizer": parts.get("optimizer", Work())}


SWAP_STATE = {"adamw-bf16": "bf16", "adamw-8bit": "int8", "in-backward": "fp32", "in-backward-8bit": "int8"}


def fused_step_work(state_dtype: str, numel: int, param_bytes: int, tensors: int, dtypes: int,
                    in_backward: bool) -> tuple[str, Work]:
    """The work of memdoctor's FusedAdamW step: each parameter written with its two moments;
    one launch per parameter dtype, or per parameter when it steps in backward (where its
    work then counts)."""
    per_param = state_bytes_per_param(state_dtype) if state_dtype in STATE_DTYPES else 8.0
    written = param_bytes + numel * per_param
    launches = tensors if in_backward else dtypes
    return ("compute" if in_backward else "optimizer"), Work(0, launches, 0, 0.0, 0.0, written)


def fused_adamw_work(optimizer) -> tuple[str, Work] | None:
    """FusedAdamW steps in Triton kernels that fake tensors do not run, so the dispatch never
    sees them: their work, from the parameters and the state format. None for any other
    optimizer."""
    from memdoctor.cuda.kernels.adamw import FusedAdamW
    if not isinstance(optimizer, FusedAdamW):
        return None
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    return fused_step_work(str(optimizer.state_dtype), sum(p.numel() for p in params),
                           sum(p.numel() * p.element_size() for p in params), len(params),
                           len({(p.device, p.dtype) for p in params}), hasattr(optimizer, "remove_hooks"))


def _dtype_of(out):
    if isinstance(out, torch.Tensor):
        return out.dtype
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o.dtype
    return None


def _bytes_of(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_bytes_of(o) for o in out)
    return 0


@dataclass(frozen=True)
class Machine:
    """Rates of one GPU with its host CPU, for eager PyTorch training."""
    name: str
    op_seconds: float         # CPU time to issue one op (dispatcher, autograd, launch)
    launch_seconds: float     # CPU time of one fused-optimizer launch from Python, with its bookkeeping
    mode_op_seconds: float    # CPU time a selective-checkpointing policy call adds to an op
    flops16: float            # achieved FLOP/s of 16-bit matmuls
    flops32: float            # achieved FLOP/s of fp32 matmuls (TF32 off, torch's default)
    bytes_per_s: float        # the rate for the bytes ops write (a proxy for their traffic)
    overlap_p: float          # the smooth maximum's exponent (large: perfect overlap)


# fitted by benchmarks/step_time_fit.py to 22 step times of GPT-2 1.5B plans on an H200
# (median error 5%, worst 22%; benchmarks/results/step_time_fit_cpu2_2026-12-02.json); ops
# are those a GPU runs: a fake tensor's device query is none (memdoctor.capture.lean_mode)
H200 = Machine("H200, torch 2.11", op_seconds=9.65e-6, launch_seconds=231e-6, mode_op_seconds=66e-6,
               flops16=613e12, flops32=49e12, bytes_per_s=1.3e12, overlap_p=3.0)


def _smooth_max(a: float, b: float, p: float) -> float:
    return (a ** p + b ** p) ** (1.0 / p)


def part_seconds(work: Work, machine: Machine = H200) -> float:
    """One part of a step: the CPU's time to issue its ops against the GPU's to run them."""
    cpu = work.ops * machine.op_seconds + work.launches * machine.launch_seconds + \
        work.mode_ops * machine.mode_op_seconds
    gpu = work.flops16 / machine.flops16 + work.flops32 / machine.flops32 + work.bytes / machine.bytes_per_s
    return _smooth_max(cpu, gpu, machine.overlap_p)


def step_seconds(compute: Work, optimizer: Work, machine: Machine = H200) -> float:
    """A step: its forward and backward passes (every micro-batch), then its optimizer step."""
    return part_seconds(compute, machine) + part_seconds(optimizer, machine)
