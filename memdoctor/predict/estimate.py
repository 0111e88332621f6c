"""Predict the GPU memory of a training configuration without running it.

    est = estimate(model_fn, optimizer_fn, batch_fn, loss_fn, plan="bf16,ckpt=full")
    est.peak_allocated_bytes, est.peak_reserved_bytes, est.breakdown

How: the model, optimizer and batch are built under FakeTensorMode (tensors with shapes,
dtypes and devices but no data, so a 1.5B-parameter model costs nothing), on fake CUDA
tensors where this torch build has CUDA, else on fake CPU tensors standing in for them
(memdoctor.predict.cpu_standin). One full training step (memdoctor.predict.fake_step) runs
twice under memdoctor's dispatch tracer, so optimizer state created lazily in the first step
is counted and the second step sees it. The cuBLAS workspaces a GPU would allocate through
the caching allocator at the first matmul of each thread are inserted into the Run, and so
is the scratch memory CUDA kernels take and give back inside one call (reduction staging
buffers, attention and embedding backward workspaces: memdoctor.cuda.kernel_scratch; cuDNN's
convolution workspaces, measured on the local GPU where there is one:
memdoctor.predict.op_probe), both noted while the step runs (memdoctor.predict.kernel_watch);
the gradient sums autograd makes in place on a GPU become one block each
(memdoctor.predict.grad_sums). The Run's allocations and frees are replayed through a model of
the CUDA caching allocator (memdoctor.cuda.allocator_model) to predict
`max_memory_allocated()` and `max_memory_reserved()`, with the last step repeated in the
replay until the allocator's layout settles: a training run takes many steps, and its cached
blocks can split differently in the third step than in the second (memdoctor.predict.replay).
The CUDA context and what the libraries map outside the allocator (cuBLAS's and cuDNN's
handles, kernel code: memdoctor.cuda.library_memory) are reported apart: device memory the
allocator's counters never include. The driver maps the handles among the segments, so the
replay places them where the step first calls each library.

What the estimate cannot see (noted in Estimate.notes where it applies): flash-attention
backward's accumulators, cuDNN's convolution workspaces without a GPU to measure them on,
NCCL buffers, and other processes.

Plans (memdoctor.remedies.prepare) on fake tensors: precision (bf16/fp16 autocast,
bf16-true master weights), checkpointing (full, selective, N blocks), micro-batches and the
fused-optimizer swap run as they would on a GPU. What cannot run on fake tensors, and what
the estimate does instead:
- Prepared.step returns the loss as a float (`.item()`, data a fake tensor does not have):
  memdoctor.predict.fake_step.train_step runs the same step without reading it;
- fp16's GradScaler.step reads its inf check with `.item()`: estimated as a step that did
  not overflow (unscale_, step, update);
- micro=auto halves the micro-batch on a real OOM: estimated with the whole batch;
- zero=N needs a process group: applied in the replay (a rank's shards:
  memdoctor.predict.distributed);
- FusedAdamW makes only its state on fake tensors: the device tables its fused steps keep are
  added (memdoctor.predict.fused_tables);
- optimizer swaps whose kernels are Triton or CUDA code that cannot take fake tensors fail
  with an EstimateError naming the plan.

What a model's step does that fake tensors cannot: data-dependent ops (`.item()`, masks read
or selected by value, `nonzero`, MoE routing) get the values the build made where it made
them, else an assumption or an upper bound, noted (memdoctor.predict.data_dependent); a
branch a random draw decides (LayerDrop) runs every layer, and the steps run again with the
draws varied, a layer skipped in the first step and another in each later one: a GPU's steps
differ so, and the cache one leaves can reserve more (wav2vec2 on an H200: 15%), so the
estimate reports the higher peaks of the two runs;
cuDNN's fused RNNs allocate as cuDNN does, reserve space and workspaces measured on this
machine's GPU or bounded (memdoctor.predict.fused_rnn); libraries that switch paths on seeing
a fake tensor (transformers' is_tracing) run the path a GPU runs
(memdoctor.predict.eager_libraries).
"""
from __future__ import annotations

import bisect
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from memdoctor.attribution import breakdown_at, live_blocks
from memdoctor.cuda.allocator_model import AllocatorConfig, CachingAllocatorModel, placements
from memdoctor.cuda.kernel_scratch import Gpu
from memdoctor.cuda.library_memory import (CUBLAS_THREAD_BYTES, CUDA_CONTEXT_BYTES, CUDNN_THREAD_BYTES,
                                           LibraryMemory)
from memdoctor.predict import cpu_standin
from memdoctor.predict.math_attention import cuda_math_attention
from memdoctor.predict.data_dependent import DataDependent
from memdoctor.predict.random_draws import draw_variants
from memdoctor.predict.eager_libraries import eager
from memdoctor.predict.fused_rnn import cudnn_rnns
from memdoctor.predict.anchors import compute_anchors
from memdoctor.predict.distributed import one_rank
from memdoctor.predict.events import batch_blocks, insert_events, inputs_are_the_batch, reorder_allocations
from memdoctor.predict.cpu_packed_rnn import cpu_packed_rnns
from memdoctor.predict.fake_build import call_build, deepcopy_keeps_fake_mode, fakeify
from memdoctor.predict.fake_caches import clear_caches_filled
from memdoctor.predict.fake_step import force_cuda_default_foreach, train_step
from memdoctor.predict.fused_tables import FusedTables
from memdoctor.predict.grad_sums import merge_in_place, sums_in_place
from memdoctor.predict.kernel_layouts import KernelLayouts
from memdoctor.predict.linear_bias import linear_calls
from memdoctor.predict.packed_sequences import packed_sequences
from memdoctor.predict.kernel_watch import (
    KernelWatch,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    local_gpu_is_sm90,
    scratch_events,
    workspace_events,
)
from memdoctor.predict.op_probe import ConvProbe, short_memory_note
from memdoctor.predict.replay import Replay, check_budget, counted_blocks, replay
from memdoctor.predict.result import Estimate
from memdoctor.predict.step_time import fused_adamw_work
from memdoctor.remedies.plan import Plan
from memdoctor.run import CATEGORIES, Action, Category, Run
from memdoctor.units import format_bytes

__all__ = ["Estimate", "EstimateError", "estimate", "estimate_built", "CUDA_CONTEXT_BYTES"]


class EstimateError(ValueError):
    """The configuration could not be run on fake tensors (what failed, in one line)."""


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
      alone, as a measurement of that many steps sees them), cuda_context_bytes (default
      CUDA_CONTEXT_BYTES), sm90 (Hopper's 32 MiB cuBLAS workspace; default: this machine's
      GPU if it has one, else True), allocator_conf (a PYTORCH_CUDA_ALLOC_CONF string;
      default the environment's), anchors (also compute what other tools say: slower),
      probe_gpu (measure cuDNN's convolution workspaces on this machine's GPU, one
      convolution at a time; default: when there is a GPU; False: use no GPU memory at all).
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
            batch = fakeify(batch_fn_or_batch, fake_mode, dev)
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
    t0 = time.perf_counter()
    plan = Plan.parse(plan) if isinstance(plan, str) else (plan or Plan())
    target = _Target.of(device, sm90)
    conv_probe = ConvProbe() if target.can_probe and probe_gpu is not False else None
    notes = _plan_notes(plan, target)
    run_plan = Plan(plan.precision, plan.checkpointing, plan.micro_batch, plan.optimizer, None)  # zero: in the replay
    fake = _run_fake_steps(build, run_plan, target, steps, conv_probe)
    notes += fake.uncertain
    if fake.forced_foreach:
        notes.append("optimizer foreach=None: stepped with the foreach (multi-tensor) kernels, as torch "
                     "chooses on CUDA")
    conf = _allocator_config(allocator_conf, notes)
    plain = _replayed(fake, target, conv_probe, conf, world_size, plan, settle, notes)
    run, rep = plain.run, plain.rep
    notes += _settle_notes(run, rep, steps)
    varied = None
    if fake.draws:              # LayerDrop and the like: the steps with the random draws varied
        probe = ConvProbe() if conv_probe is not None else None
        try:
            varied = _replayed(_run_fake_steps(build, run_plan, target, steps, probe, vary=fake.draws), target,
                               probe, conf, world_size, plan, settle, [])
            notes.append(_varied_note(rep, varied.rep))
        except EstimateError as exc:
            notes.append(f"random draws varied: the steps could not run so ({exc}); the reserved peak of a GPU's "
                         "steps, which draw anew each step, can be above the estimate's")
    context = CUDA_CONTEXT_BYTES if cuda_context_bytes is None else int(cuda_context_bytes)
    est = _estimate_of(run, rep, plain.counted, fake, target, steps, notes=notes, workspace_bytes=plain.workspaces,
                       cuda_context_bytes=context if target.device == "cuda" else 0,
                       library_bytes=plain.library.nbytes if plain.library else 0, plan=str(plan),
                       world_size=world_size, budget_bytes=budget)
    if varied is not None:
        est.peak_allocated_bytes = max(est.peak_allocated_bytes, varied.rep.peak_allocated)
        est.peak_reserved_bytes = max(est.peak_reserved_bytes, varied.rep.peak_reserved)
    if budget is not None:
        est.fits, est.oom, est.budget_peak_reserved_bytes = plain.check(conf, budget)
        if varied is not None and est.fits:
            fits, oom, peak = varied.check(conf, budget)
            est.fits, est.oom = fits, oom
            est.budget_peak_reserved_bytes = max(est.budget_peak_reserved_bytes, peak)
    run.meta["estimate"] = {k: v for k, v in est.to_dict().items() if k not in ("anchors", "by_module")}
    if anchors:
        est.anchors = compute_anchors(build, run_plan, device, est, world_size=world_size, steps=steps)
    est.elapsed_s = time.perf_counter() - t0
    return est


@dataclass
class _Target:
    """The device the estimate speaks for, and the one its fake tensors are on."""
    device: str             # "cuda" or "cpu"
    sim: str                # the fake tensors' device type
    cpu_for_cuda: bool      # a CPU-only torch standing in for CUDA
    sm90: bool              # Hopper's cuBLAS workspace

    @classmethod
    def of(cls, device: str, sm90: bool | None) -> "_Target":
        target = torch.device(device).type
        if target not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
        sm90 = local_gpu_is_sm90() if sm90 is None else sm90
        cpu_for_cuda = target == "cuda" and not cpu_standin.cuda_built()
        return cls(target, "cpu" if cpu_for_cuda else target, cpu_for_cuda, sm90)

    @property
    def can_probe(self) -> bool:
        """Whether cuDNN's workspaces can be measured here: a CUDA estimate on a GPU."""
        return self.device == "cuda" and not self.cpu_for_cuda and torch.cuda.is_available()

    @property
    def simulated_on(self) -> str:
        return ("cpu (standing in for cuda)" if self.cpu_for_cuda else self.sim) + " (FakeTensorMode)"


@dataclass
class _FakeRun:
    """The traced fake steps: the Run, what the kernel watch noted, the model's sizes, and
    the gradient sums autograd would make in place (block pairs)."""
    run: Run
    watch: KernelWatch
    params: int
    param_bytes: int
    grad_bytes: int
    forced_foreach: bool
    in_place: list[tuple[int, int]]
    uncertain: list[str]        # what was assumed or bounded about values fake tensors lack
    steps: int                  # the steps run
    draws: int                  # branches decided by random draws in the last step


def _plan_notes(plan: Plan, target: _Target) -> list[str]:
    """What the estimate does instead where the plan, or this torch, cannot run as on a GPU."""
    notes = [cpu_standin.NOTE] if target.cpu_for_cuda else []
    if plan.micro_batch == "auto":
        notes.append("micro=auto starts with the whole batch and halves only on a real OOM; the estimate "
                     "is for the whole batch (if it does not fit, estimate micro=N instead)")
    if plan.precision == "fp16":
        notes.append("fp16: the loss scaler's inf check (.item()) cannot run on fake tensors; the step "
                     "is estimated as one that did not overflow")
    return notes


def _run_fake_steps(build: Callable, plan: Plan, target: _Target, steps: int,
                    conv_probe: ConvProbe | None, vary: int = 0) -> _FakeRun:
    """Build the configuration on fake tensors, apply the plan and run `steps` training steps
    under the tracer and the kernel watch; EstimateError saying which stage failed.

    `vary`: the branches per step decided by random draws (a plain run's `draws`); the steps
    then take those branches otherwise, as a GPU's draws do (LayerDrop skipping a layer): the
    first step the first branch (a layer whose optimizer state is made a step later, where
    that step's frees left room), then after the plain steps one step per variant of
    draw_variants, and a plain step last, the one the replay repeats until it settles."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memdoctor.capture.session import Tracer

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = DataDependent()
    rnn_notes: list[str] = []
    if target.device == "cuda":
        rnns = cudnn_rnns(probe=conv_probe is not None, notes=rnn_notes,
                          device_type="cpu" if target.cpu_for_cuda else "cuda")
    else:
        rnns = cpu_packed_rnns() if target.device == "cpu" else contextlib.nullcontext()
    redirect = cpu_standin.CpuForCuda() if target.cpu_for_cuda else contextlib.nullcontext()
    cuda_kernels = cpu_standin.cuda_kernels() if target.cpu_for_cuda else \
        cuda_math_attention() if target.device == "cuda" else contextlib.nullcontext()
    tracer = Tracer(source="dispatch")
    tables = FusedTables(lambda t, name: tracer.recorder.claim(t, Category.OPTIMIZER_STATE.value, name))
    forced_foreach = False
    stage = "building the model, optimizer and batch"
    try:
        with clear_caches_filled(), fake_mode, values, KernelLayouts(), redirect, cuda_kernels, rnns, \
                packed_sequences(rnn_notes), linear_calls(), deepcopy_keeps_fake_mode(), eager() as libraries:
            with tracer:
                tracer.hooks.alias_subclass = values.alias
                watch = KernelWatch(tracer.recorder, Gpu.local() if target.device == "cuda" else None, conv_probe,
                                    fast_view=values.fast_view)
                with watch:
                    values.noting = False        # a rejection sampler's draws at init change no memory
                    with torch.device(target.sim):
                        built = call_build(build, fake_mode, target.sim)
                    values.noting = True
                    model, optimizer, batch, loss_fn = built
                    batch_ids = batch_blocks(tracer.recorder, batch)
                    params = list({id(p): p for p in model.parameters()}.values())    # as built
                    n_params = sum(p.numel() for p in params)
                    param_bytes = sum(p.numel() * p.element_size() for p in params)
                    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
                    prepared = None
                    if not plan.is_empty():
                        stage = f"applying the plan {plan}"
                        from memdoctor.remedies import prepare
                        prepared = prepare(model, optimizer, plan, device_type=target.sim)
                        optimizer = prepared.optimizer
                    if target.device == "cuda":
                        forced_foreach = force_cuda_default_foreach(optimizer)
                    tables.watch(optimizer)
                    stage = "running the training step"
                    libraries.refresh()
                    schedule = [frozenset()] * steps
                    if vary:
                        schedule[0] = frozenset({0})
                        schedule += draw_variants(vary) + [frozenset()]
                    for flips in schedule:
                        values.begin_step(flips)
                        train_step(model, optimizer, batch, loss_fn, prepared, fake=True)
                    steps = len(schedule)
                    del built, batch, prepared
    except EstimateError:
        raise
    except Exception as exc:
        raise EstimateError(f"{stage} on fake tensors failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    finally:
        tables.remove()
    fused = fused_adamw_work(optimizer)
    if fused is not None:
        for step in range(steps):
            watch.work.add(step, *fused)
    run = tracer.run
    inputs_are_the_batch(run, batch_ids)
    return _FakeRun(run, watch, n_params, param_bytes, grad_bytes, forced_foreach,
                    in_place=sums_in_place(run, watch.accumulations), uncertain=values.notes() + rnn_notes,
                    steps=steps, draws=values.branches)


@dataclass
class _Replayed:
    """A fake run made ready for the allocator (kernel memory inserted, gradient sums merged)
    and replayed: what the estimate reads, and what a budget check replays again."""
    run: Run
    counted: set[int]
    sizes_of: dict[int, int] | None
    settled: int | None
    rep: Replay
    workspaces: int
    library: LibraryMemory | None       # what the libraries map outside the allocator (CUDA only)
    maps: dict[int, int]                # block id -> bytes the driver maps just before it
    placement: str                      # the segment placement replayed (allocator_model.placements)

    def check(self, conf: AllocatorConfig, budget: int):
        return check_budget(self.run, self.counted, conf, budget, self.sizes_of, self.settled, self.maps,
                            self.placement)


def _replayed(fake: _FakeRun, target: _Target, conv_probe: ConvProbe | None, conf: AllocatorConfig,
              world_size: int, plan: Plan, settle: bool, notes: list[str]) -> _Replayed:
    run = fake.run
    workspaces, library, maps = (_add_kernel_memory(fake, target, conv_probe, notes) if target.device == "cuda"
                                 else (0, None, {}))
    merge_in_place(run, fake.in_place)
    counted = counted_blocks(run, target.sim, skip_cpu_scalars=target.cpu_for_cuda)
    sizes_of, dist_note = one_rank(run, counted, world_size, plan.zero, fake.grad_bytes, target.sim)
    if dist_note:
        notes.append(dist_note)
    settled = fake.steps if settle else None
    # The driver's segment addresses break ties between equal free blocks: the model places
    # new segments as the H200's driver does (memdoctor.cuda.allocator_model.DriverSpace),
    # among what it maps for the libraries' handles (memdoctor.cuda.library_memory).
    rep = replay(run, counted, CachingAllocatorModel(None, conf), sizes_of=sizes_of, steps=settled, maps=maps)
    placement = "driver"
    if target.device == "cuda":
        slots = replay(run, counted, CachingAllocatorModel(None, conf, placements()["slots"]), sizes_of=sizes_of,
                       steps=settled, maps=maps)
        if slots.peak_reserved > rep.peak_reserved:
            notes.append(_placement_note(rep, slots))
            rep, placement = slots, "slots"
    return _Replayed(run, counted, sizes_of, settled, rep, workspaces, library, maps, placement)


def _placement_note(driver: Replay, slots: Replay) -> str:
    """Why the reserved peak is the one with every segment in its own slot."""
    return (f"segment addresses: which of two equal free blocks a request takes depends on where the driver "
            f"mapped their segments. With the process's first segments in the driver's first 512 MiB of "
            f"addresses the reserved peak is {format_bytes(driver.peak_reserved)}; with every segment in a 32 MiB "
            f"slot of its own, as an H200's driver placed them in some runs (transformers 5.25's DeBERTa-v2), "
            f"{format_bytes(slots.peak_reserved)}. The estimate reports the higher")


def _varied_note(plain: Replay, varied: Replay) -> str:
    """What the steps with random draws varied reserve, next to the plain steps."""
    if varied.peak_reserved > plain.peak_reserved:
        return (f"random draws varied (a layer LayerDrop skips in the first step, then in each later step "
                f"another): the reserved peak is {format_bytes(varied.peak_reserved)}, "
                f"{format_bytes(varied.peak_reserved - plain.peak_reserved)} above the steps with every branch "
                "alike; the estimate reports the higher")
    return (f"random draws varied (a layer LayerDrop skips in the first step, then in each later step another): "
            f"the reserved peak is {format_bytes(varied.peak_reserved)}, no higher than the steps with every "
            "branch alike")


def _add_kernel_memory(fake: _FakeRun, target: _Target, conv_probe: ConvProbe | None,
                       notes: list[str]) -> tuple[int, LibraryMemory, dict[int, int]]:
    """Insert what a GPU's kernels take beyond their outputs into the Run: the cuBLAS
    workspaces, each op's scratch, cuDNN's measured convolution workspaces; and put the
    outputs of ops whose kernels make them in another order in that order. Returns the
    workspaces' bytes, what the libraries map outside the allocator, and where (_library_maps)."""
    run, watch = fake.run, fake.watch
    conv_note, convs_measured, short_memory = "", False, ""
    if conv_probe is not None and conv_probe.uses:
        try:
            measured = conv_probe.measure(torch.device("cuda"))
            watch.scratch.extend((before, after, measured[key]) for before, after, key in conv_probe.uses)
            conv_note = (f"convolutions: cuDNN's workspaces measured on this machine's GPU "
                         f"({torch.cuda.get_device_name()}), each of the {len(measured)} distinct convolutions "
                         "run once on uninitialised tensors")
            convs_measured = True
            short_memory = short_memory_note(conv_probe.free_bytes, conv_probe.total_bytes)
        except Exception as exc:
            conv_note = f"convolutions: measuring cuDNN's workspaces on this GPU failed ({_first_line(exc)})"
    reorder_allocations(run, watch.reorders)        # before the inserts: the spans' indices are the Run's
    ws_events = workspace_events(watch, target.sm90)
    scratch = scratch_events(watch)
    insert_events(run, ws_events + scratch, target.sim)
    library = LibraryMemory(len(watch.blas), len(watch.dnn_threads))
    maps = _library_maps(run, watch, sorted(e[0] for e in ws_events + scratch))
    workspaces = sum(e[3] for e in ws_events)
    sizes = [e[3] for e in scratch if e[1] == "alloc"]
    if sizes:
        notes.append(f"kernel scratch: {len(sizes)} allocations CUDA kernels make and free inside one call "
                     f"(reduction staging buffers, attention and embedding backward workspaces; the largest "
                     f"{format_bytes(max(sizes))}), sized for a GPU of {watch.gpu.sm_count} SMs")
    notes.append(f"cuBLAS workspaces: {format_bytes(cublas_workspace_bytes(target.sm90))} per thread that runs a "
                 f"matmul (forward and autograd's backward thread), {format_bytes(cublaslt_workspace_bytes())} "
                 f"cuBLASLt workspace per thread that runs an addmm with bias; {format_bytes(workspaces)} in all, "
                 "counted as 'other' and never freed")
    if conv_note:
        notes.append(conv_note)
    if short_memory:
        notes.append(short_memory)
    if not convs_measured and any(b.name.startswith(("aten.convolution", "aten.cudnn")) for b in run.blocks.values()):
        notes.append("convolutions: cuDNN allocates its workspace inside each call and frees it "
                     "before returning; its size is cuDNN's choice per shape, GPU and version, and is "
                     "not in the estimate without a GPU to measure it on: the allocated peak can be "
                     "up to 10% higher and the reserved peak up to 40% (the zoo's UNet and wav2vec2 "
                     "on an H200); estimate on the GPU for its bytes")
    notes.append(library.describe())
    return workspaces, library, maps


def _library_maps(run: Run, watch: KernelWatch, inserted: list[int]) -> dict[int, int]:
    """Block id -> the bytes the driver maps for a library just before that block is
    allocated: each thread's handle before the first allocation after its first call of the
    library (for cuBLAS, its workspace, inserted there). `inserted`: the positions, sorted, at
    which events were inserted after the watch noted its indices."""
    maps: dict[int, int] = {}
    firsts = [(pos, CUBLAS_THREAD_BYTES) for pos in watch.blas.values()]
    firsts += [(pos, CUDNN_THREAD_BYTES) for pos in watch.dnn.values()]
    for pos, nbytes in firsts:
        seq = pos + bisect.bisect_left(inserted, pos)
        while seq < len(run.actions) and run.actions[seq] != Action.ALLOC:
            seq += 1
        if seq < len(run.actions):
            bid = run.event_blocks[seq]
            maps[bid] = maps.get(bid, 0) + nbytes
    return maps


def _allocator_config(allocator_conf: str | None, notes: list[str]) -> AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF to model: the one given, else the environment's."""
    conf = AllocatorConfig.parse(allocator_conf if allocator_conf is not None
                                 else os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    if conf.ignored:
        notes.append(f"PYTORCH_CUDA_ALLOC_CONF options not modelled: {', '.join(conf.ignored)}")
    return conf


def _settle_notes(run: Run, rep: Replay, steps: int) -> list[str]:
    """A note when the reserved peak came in a repeat of the steady step, after the steps run."""
    if rep.peak_reserved <= rep.peak_reserved_recorded:
        return []
    step = run.mark_at(rep.peak_reserved_seq).step + rep.peak_reserved_repeat + 1
    return [f"the allocator's cached blocks settle only after the {steps} steps run: in a longer "
            f"run the reserved peak is {format_bytes(rep.peak_reserved)}, "
            f"{format_bytes(rep.peak_reserved - rep.peak_reserved_recorded)} more, from step {step}"]


def _estimate_of(run: Run, rep: Replay, counted: set[int], fake: _FakeRun, target: _Target, steps: int,
                 **fields: Any) -> Estimate:
    """The Estimate from the replay: the peaks, and what held the memory at the allocated peak
    (`fields`: the rest of the Estimate's fields)."""
    peak_seq = rep.peak_seq
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for b in live_blocks(run, peak_seq):
        if b.id in counted:
            breakdown[b.category] = breakdown.get(b.category, 0) + rep.sizes.get(b.id, 0)
    mark = run.mark_at(peak_seq)
    return Estimate(
        peak_allocated_bytes=rep.peak_allocated, peak_reserved_bytes=rep.peak_reserved,
        breakdown=breakdown, peak_phase=mark.phase if mark else "other",
        peak_step=(mark.step if mark else 0) + rep.peak_repeat, run=run, device=target.device,
        simulated_on=target.simulated_on, peak_seq=peak_seq, live_peak_bytes=rep.live_peak,
        category_peaks=rep.category_peaks, category_peaks_raw=rep.category_peaks_raw,
        by_module=breakdown_at(run, peak_seq, top=0).by_module, params=fake.params,
        param_bytes=fake.param_bytes, allocator=rep.stats,
        work={part: w.to_dict() for part, w in fake.watch.work.of_step(steps - 1).items()}, **fields)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
