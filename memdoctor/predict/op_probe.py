"""Measure, on this machine's GPU, the scratch memory of ops whose size no rule can give.

cuDNN picks a convolution's algorithm, and with it the workspace it asks the caching
allocator for, by its own heuristics per shape, dtype, GPU and cuDNN version (the
workspaces of ResNet-50 on an H200 range from 400 bytes to 6x the input, with no formula
behind them). So the estimate, on a machine with a CUDA GPU, runs each distinct
convolution it met once, forward or backward, on uninitialised tensors of the same
shapes, strides and dtypes, and records the allocator's trace during the call: every
allocation freed before the call returns is scratch. Values do not matter to the
algorithm choice; memory does only when the GPU is nearly full (cuDNN then falls back to
smaller workspaces), which the estimate cannot know either way.

The GPU memory this takes is one op's inputs, outputs and scratch at a time, given back
(empty_cache) before the estimate goes on.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memdoctor.cuda.kernel_scratch import Scratch

aten = torch.ops.aten
PROBED_OPS = frozenset(op for op in (getattr(aten.convolution, "default", None),
                                     getattr(aten.convolution_backward, "default", None)) if op is not None)


def spec_of(args, kwargs) -> tuple:
    """(key, tree): a hashable description of an op's arguments - tensors by shape, stride,
    dtype and offset (never their data), everything else as it is - and their structure."""
    leaves, tree = tree_flatten((args, kwargs or {}))
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(("tensor", tuple(leaf.shape), tuple(leaf.stride()), str(leaf.dtype).replace("torch.", ""),
                        leaf.storage_offset()))
        else:
            try:
                hash(leaf)
            except TypeError:
                leaf = ("unhashable", repr(leaf))     # not in a convolution's arguments
            out.append(("value", leaf))
    return (str(tree), tuple(out)), tree


def _materialize(leaves: tuple, device: torch.device) -> list[Any]:
    values = []
    for kind, *rest in leaves:
        if kind == "tensor":
            shape, stride, dtype, offset = rest
            size = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0
            base = torch.empty(size, dtype=getattr(torch, dtype), device=device)
            values.append(base.as_strided(shape, stride, offset))
        else:
            values.append(rest[0])
    return values


def probe(func, key: tuple, tree, device: str | torch.device = "cuda") -> list[Scratch]:
    """Run `func` once on uninitialised tensors described by `key` (from spec_of) and return
    the allocations it freed before returning, in order, with how long each lived."""
    device = torch.device(device)
    _, leaves = key
    args, kwargs = tree_unflatten(_materialize(leaves, device), tree)

    def call():
        with torch.no_grad():
            return func(*args, **kwargs)

    return scratch_from_trace(recorded_trace(call, device))


def recorded_trace(call, device: str | torch.device | None = None, frames: bool = False) -> list[dict]:
    """The allocator's trace of `call()` on `device` (the current one by default), its output
    freed after the recording; `frames`: each allocation's Python and C++ frames as well."""
    device = torch.device(device if device is not None else "cuda")
    torch.cuda.synchronize(device)
    context, stacks = ("alloc", "all") if frames else (None, "python")
    torch.cuda.memory._record_memory_history(enabled="all", context=context, stacks=stacks, max_entries=100_000)
    try:
        out = call()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del out
    index = device.index if device.index is not None else torch.cuda.current_device()
    return snap["device_traces"][index]


def scratch_from_trace(trace: list[dict]) -> list[Scratch]:
    """The allocations of an allocator trace that were freed within it, in order: those
    made before the first allocation that lived on (an output) are marked before_outputs,
    each says how many of the later ones were made before it was freed (None: all)."""
    allocs: list[list] = []         # [size, made at, freed at]
    live: dict[int, list] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            rec = [e["size"], i, None]
            allocs.append(rec)
            live[e["addr"]] = rec
        elif e["action"] in ("free_requested", "free_completed"):
            rec = live.pop(e["addr"], None)
            if rec is not None:
                rec[2] = i
    first_output = min((made for _, made, freed in allocs if freed is None), default=None)
    freed = [r for r in allocs if r[2] is not None]
    out = []
    for n, (size, made, freed_at) in enumerate(freed):
        later = freed[n + 1:]
        outlives = sum(1 for _, m, _ in later if m < freed_at)
        kept = outlives == len(later) and any(made < m < freed_at for _, m, _ in allocs)
        before = first_output is not None and made < first_output
        out.append(Scratch(size, "cuDNN convolution workspace", before_outputs=before,
                           outlives=None if kept else outlives))
    return out


class ConvProbe:
    """Collects the distinct convolutions of a fake run and measures them on the GPU."""

    def __init__(self):
        self.keys: dict[tuple, Any] = {}        # key -> (func, tree)
        self.uses: list[tuple[int, int, tuple]] = []
        self.free_bytes: int | None = None      # the GPU's free memory as the first new one ran
        self.total_bytes: int | None = None

    def note(self, func, args, kwargs, before: int, after: int) -> None:
        if func not in PROBED_OPS:
            return
        key, tree = spec_of(args, kwargs)
        self.keys.setdefault(key, (func, tree))
        self.uses.append((before, after, key))

    def measure(self, device: str | torch.device = "cuda") -> dict[tuple, list[Scratch]]:
        """Each distinct convolution's scratch; one measured before in this process on the
        same GPU is not run again (the planner estimates the same layers many times)."""
        device = torch.device(device)
        gpu = device.index if device.index is not None else torch.cuda.current_device()
        got = {}
        ran = False
        try:
            for key, (func, tree) in self.keys.items():
                if (gpu, key) not in MEASURED:
                    if not ran:
                        self.free_bytes, self.total_bytes = torch.cuda.mem_get_info(gpu)
                    MEASURED[(gpu, key)] = probe(func, key, tree, device)
                    ran = True
                got[key] = MEASURED[(gpu, key)]
        finally:
            if ran:
                torch.cuda.empty_cache()
        return got


def short_memory_note(free_bytes: int | None, total_bytes: int | None) -> str:
    """A warning when the convolutions were measured on a GPU less than half free: cuDNN
    takes the first algorithm whose workspace it can allocate, so with other processes'
    memory in the way it measures smaller workspaces than an idle GPU's (a speech encoder's
    first convolution asks for 760 MiB in one call on an H200; wav2vec2 fp32 batch 8,
    estimated beside GPU tests that fill the H200 to their budgets, came out 38% under its reserved peak:
    benchmarks/results/zoo_reestimated_h200_2026-12-03_dcfcb40.log)."""
    if free_bytes is None or not total_bytes or free_bytes >= total_bytes // 2:
        return ""
    gib = 1024 ** 3
    return (f"convolutions: measured with {free_bytes / gib:.1f} of the GPU's {total_bytes / gib:.1f} GiB free; "
            "cuDNN takes a smaller workspace when a larger one does not fit, so on an idle GPU the workspaces, "
            "and the reserved peak, can be larger: estimate again with the GPU free")


# (GPU index, spec_of key) -> the scratch measured there, for this process's lifetime
MEASURED: dict[tuple, list[Scratch]] = {}
