"""The planner: which combination of remedies fits a memory budget at the least cost.

    cands = plan_for_budget("gpt2-1.5b", batch=8, seq=1024, budget_bytes=32 * GiB)
    cands[0].plan, cands[0].fits, cands[0].cost

How it searches (fast enough for GPT-2 1.5B on a CPU, where one estimate takes seconds):
- the structural variants (precision x checkpointing x ZeRO) are estimated with
  memdoctor.predict.estimate at the full batch, in order of a prior guess of their cost, at most
  `max_estimates`; for a known model on a machine with more than two cores they are
  estimated all at once in worker processes (one core each), otherwise lazily, one by one;
  the direct estimates that verify the first fitting plans (below) then run in the same
  workers, all at once;
- from each such estimate a per-phase profile is taken (the live bytes of every category
  at the peak of each phase: forward, backward, optimizer, ...), and the micro-batch and
  optimizer variants are derived from it arithmetically:
    * micro-batch m of batch B: activations, temporaries and inputs outside the optimizer
      step scale
      by m/B; gradients count whole (earlier micro-batches' gradients are kept);
    * adamw-bf16 / adamw-8bit: optimizer state of 8 bytes a parameter (fp32 AdamW) becomes
      4 / 2.03125 (memdoctor.cuda.kernels.adamw_math); their fused step drops the foreach
      step's temporaries;
    * in-backward (and in-backward-8bit, with the 8-bit state as well): the gradients are
      never all alive: in backward only the largest parameter's gradient counts, and the
      optimizer step (a no-op) costs nothing;
  the derived peak is the largest phase peak, scaled by the estimate's own
  allocated/profile and reserved/allocated ratios;
- a combination is skipped when a fitting candidate with a subset of its remedies, as fast
  or faster, is already known;
- the first `verify` fitting choices are then verified with a real estimate of their whole
  plan (the optimizer swaps make their states on fake tensors exactly as on the GPU); a
  choice that no longer fits drops out of the lead and the next is verified. The derived
  allocated peak is close (within 1%), the derived reserved peak less so (the base's
  fragmentation does not carry over: +24% for GPT-2 774M with checkpointing, micro-batch 2
  and 8-bit states), so plans cheaper than the first choice whose allocated peak fits are
  verified too, up to `verify` a round and 3 * `verify` in all.
Activations scale with the micro-batch but copies of the weights do not: tensors shaped like
a parameter (autocast's bf16 weight copies) made outside the optimizer step and outside the
weights, gradients and optimizer state are kept apart as "weight_copies" and never scaled.

The cost of a plan is its predicted step time against the plain plan's (1.0), from the
work its estimate counted (memdoctor.predict.step_time: ops issued by the CPU against FLOPs and bytes
run by the GPU, with constants fitted to step times measured on an H200):
- the structural variants' work is counted in their own estimates: bf16's 16-bit matmuls and
  casts, the recomputed forward of checkpointing, selective checkpointing's per-op policy;
- micro-batch m of batch B issues the full-batch step's ops B/m times for the same FLOPs, and
  sums the gradients B/m - 1 times: free while the GPU's share of the step is the larger,
  nearly double a halving once the CPU's is (GPT-2 1.5B bf16 on the H200: micro 4, 2 and 1 of
  batch 8 took +9%, +30% and +138%);
- an optimizer swap replaces the step's work by memdoctor's fused kernel (each parameter
  written with its moments, one launch, or one per parameter stepped in backward); blockwise
  8-bit states cost x1.05 more: GPT-2 1.5B stepped 9-18% slower with them than with bf16
  states at micro-batch 2, and as fast with full checkpointing (on the H200,
  benchmarks/results/plan_apply_h200_2026-11-30.json); bf16 states also keep more
  precision. Ties go to the lower peak;
- ZeRO-2: x(1 + 0.05 * log2(world_size)) (reduce-scatter and all-gather over the ranks).
The structural variants are estimated in the order of a prior guess of their cost
(PRIOR_COST). A directly verified plan takes the cost of its own counted work.
The plain plan, when it fits, is always the first choice: nothing needs to change (bf16,
although cheaper, changes the numerics).
"""
from __future__ import annotations

import bisect
import concurrent.futures as cf
import math
import multiprocessing
import os
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable

from memdoctor.cuda.kernels.adamw_math import state_bytes_per_param
from memdoctor.predict.config import estimate_config
from memdoctor.predict.estimate import EstimateError, estimate_built
from memdoctor.predict.step_time import H200, SWAP_STATE, Machine, Work, fused_step_work, step_seconds
from memdoctor.remedies.plan import Plan

__all__ = ["Candidate", "plan_for_budget", "prior_cost", "plan_work", "plan_seconds", "derive", "phase_profile"]

# a prior guess of the structural variants' cost: the order they are estimated in
PRIOR_COST = {"bf16": 0.6, "selective": 0.10, "full": 1.0 / 3.0}
OPT_COST = {"adamw-8bit": 1.05, "in-backward-8bit": 1.05}   # measured, beyond the counted work
ZERO_COST_PER_DOUBLING = 0.05
# optimizer state per parameter, against fp32 AdamW's 8 bytes
STATE_BYTES = {name: state_bytes_per_param(SWAP_STATE[name])
               for name in ("adamw-bf16", "adamw-8bit", "in-backward-8bit")}
IN_BACKWARD = ("in-backward", "in-backward-8bit")

ACT_CATS = ("activations", "temporaries", "inputs")
WEIGHT_COPIES = "weight_copies"
_MODEL_STATES = ("weights", "gradients", "optimizer_state")


@dataclass
class Candidate:
    plan: Plan
    predicted_peak_allocated: int
    predicted_peak_reserved: int
    fits: bool
    cost: float                 # predicted step time against the plain plan's
    note: str = ""
    verified: bool = False
    step_seconds: float = 0.0   # predicted step time on an H200 (memdoctor.predict.step_time)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": str(self.plan), "predicted_peak_allocated": self.predicted_peak_allocated,
                "predicted_peak_reserved": self.predicted_peak_reserved, "fits": self.fits,
                "cost": round(self.cost, 4), "step_seconds_h200": round(self.step_seconds, 4),
                "note": self.note, "verified": self.verified}


def prior_cost(plan: Plan) -> float:
    """A guess of the cost of a structural variant before any estimate: the order the
    planner estimates them in (bf16 x0.6, checkpointing +1/3 or +0.1, more remedies later)."""
    cost = PRIOR_COST["bf16"] if plan.precision == "bf16" else 1.0
    return cost * (1.0 + PRIOR_COST.get(plan.checkpointing, 0.0))


def plan_work(base: "_Base", plan: Plan, batch: int) -> tuple[Work, Work]:
    """(compute, optimizer) work of `plan` derived from its structural variant's counted work."""
    compute = Work.from_dict(base.est.work.get("compute", {}))
    optimizer = Work.from_dict(base.est.work.get("optimizer", {}))
    if isinstance(plan.micro_batch, int) and plan.micro_batch < batch:
        k = -(-batch // plan.micro_batch)
        compute = Work(compute.ops * k, compute.launches * k, compute.mode_ops * k, compute.flops16,
                       compute.flops32, compute.bytes + base.grads_total * (k - 1))
    if plan.optimizer in SWAP_STATE or plan.optimizer == "fused":
        part, work = fused_step_work(SWAP_STATE.get(plan.optimizer, "fp32"), base.est.params,
                                     base.est.param_bytes, base.grad_tensors, 1, plan.optimizer in IN_BACKWARD)
        optimizer = Work()
        if part == "compute":
            compute = compute + work
        else:
            optimizer = work
    return compute, optimizer


def plan_seconds(plan: Plan, compute: Work, optimizer: Work, world_size: int = 1,
                 machine: Machine = H200) -> float:
    """The predicted step time of `plan` from its work (memdoctor.predict.step_time; H200 constants by default)."""
    seconds = step_seconds(compute, optimizer, machine) * OPT_COST.get(plan.optimizer, 1.0)
    if plan.zero is not None and world_size > 1:
        seconds *= 1.0 + ZERO_COST_PER_DOUBLING * math.log2(world_size)
    return seconds


def counted_seconds(est, plan: Plan, world_size: int = 1) -> float:
    """The predicted step time of a plan from its own estimate's counted work."""
    return plan_seconds(plan, Work.from_dict(est.work.get("compute", {})),
                        Work.from_dict(est.work.get("optimizer", {})), world_size)


@dataclass
class _Base:
    """A structural variant's estimate and its per-phase profile."""
    est: Any
    phases: dict[str, dict[str, int]]
    grads_total: int
    largest_grad: int
    grad_tensors: int
    world_size: int
    zero: int | None
    profile_peak: int = field(init=False)

    def __post_init__(self) -> None:
        self.profile_peak = max((sum(c.values()) for c in self.phases.values()), default=0) or 1


def phase_profile(est, world_size: int = 1, zero: int | None = None) -> dict[str, dict[str, int]]:
    """For each phase of the estimate's run, the bytes of each category at that phase's
    peak of live bytes (ZeRO's shards applied as the estimate's replay applies them)."""
    run = est.run
    n = max(int(world_size), 1)
    shard = set()
    if zero is not None and n > 1:
        shard = {"optimizer_state"} | ({"gradients"} if zero >= 2 else set()) | ({"weights"} if zero >= 3 else set())
    marks = sorted(run.marks, key=lambda m: m.seq)
    mseqs = [m.seq for m in marks]

    def phase_at(seq: int) -> str:
        i = bisect.bisect_right(mseqs, seq) - 1
        return marks[i].phase if i >= 0 else "other"

    param_shapes = {tuple(b.shape) for b in run.blocks.values() if b.category == "weights" and len(b.shape) >= 2}
    events = []
    for b in run.blocks.values():
        size = b.nbytes
        category = b.category
        if category not in _MODEL_STATES and b.phase != "optimizer" and tuple(b.shape) in param_shapes:
            category = WEIGHT_COPIES
        if category in shard or (shard and category == "temporaries" and b.phase == "optimizer"):
            size = -(-size // n)
        events.append((b.alloc_seq, 1, size, category))
        if b.free_seq is not None:
            events.append((b.free_seq, 0, size, category))
    events.sort(key=lambda e: (e[0], e[1]))
    live: dict[str, int] = {}
    total = 0
    best: dict[str, int] = {}
    snaps: dict[str, dict[str, int]] = {}
    for seq, is_alloc, size, cat in events:
        if is_alloc:
            live[cat] = live.get(cat, 0) + size
            total += size
            ph = phase_at(seq)
            if total > best.get(ph, -1):
                best[ph] = total
                snaps[ph] = dict(live)
        else:
            live[cat] = live.get(cat, 0) - size
            total -= size
    return snaps


def _estimate_job(job: tuple):
    """One estimate of a known model in a worker process (picklable arguments and result)."""
    import torch
    torch.set_num_threads(1)
    name, batch, seq, plan, world_size, config = job
    try:
        return estimate_config(name, batch=batch, seq=seq, plan=plan, world_size=world_size, **config)
    except EstimateError as exc:
        return exc


def _worker_count(jobs: int) -> int:
    """Worker processes for `jobs` estimates: one core each, one core left to this process;
    none (estimate here) on a machine of two cores or fewer."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return 0 if cores <= 2 or jobs <= 1 else min(jobs, cores - 1)


class _Estimates:
    """Direct estimates of plans, each made once: in worker processes when given `job` (a
    plan's picklable description) and cores allow, started as soon as they are asked for
    (`start`), so the planner's checks overlap its first estimates; else one by one here, when
    first needed (`get`)."""

    def __init__(self, run_estimate: Callable, job: Callable | None, workers: int):
        self._run, self._job = run_estimate, job
        self._done: dict[str, Any] = {}
        self._futures: dict[str, cf.Future] = {}
        self._pool = None
        if job is not None and workers:
            try:
                self._pool = cf.ProcessPoolExecutor(max_workers=workers,
                                                    mp_context=multiprocessing.get_context("spawn"))
            except OSError:
                self._pool = None           # no worker processes here: estimate one by one

    def __enter__(self) -> "_Estimates":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:          # speculative estimates nobody asked for are dropped
            self._pool.shutdown(wait=True, cancel_futures=True)

    def start(self, plans: list[Plan]) -> None:
        for plan in plans:
            key = str(plan)
            if self._pool is None or key in self._done or key in self._futures:
                continue
            try:
                self._futures[key] = self._pool.submit(_estimate_job, self._job(plan))
            except (RuntimeError, BrokenProcessPool):
                return                      # the pool is gone: get() estimates here

    def get(self, plan: Plan):
        """The plan's Estimate, or the EstimateError that says why there is none."""
        key = str(plan)
        if key not in self._done:
            future = self._futures.pop(key, None)
            try:
                if future is None:
                    raise LookupError
                self._done[key] = future.result()
            except (LookupError, BrokenProcessPool, cf.CancelledError):
                try:
                    self._done[key] = self._run(plan)
                except EstimateError as exc:
                    self._done[key] = exc
        return self._done[key]


def _grad_sizes(est) -> tuple[int, int, int]:
    """The gradients' total bytes, the largest one's, and how many there are (of one step)."""
    sizes = [b.nbytes for b in est.run.blocks.values() if b.category == "gradients" and b.step == 1] or \
            [b.nbytes for b in est.run.blocks.values() if b.category == "gradients"]
    return sum(sizes), max(sizes, default=0), len(sizes)


def derive(base: _Base, plan: Plan, batch: int) -> tuple[int, int, str]:
    """(allocated, reserved, note) of `plan` derived from the estimate of its structural variant."""
    notes = []
    micro = plan.micro_batch if isinstance(plan.micro_batch, int) and plan.micro_batch < batch else None
    opt = plan.optimizer
    peak = 0
    for ph, cats in base.phases.items():
        c = dict(cats)
        if micro is not None and ph != "optimizer":
            for k in ACT_CATS:
                c[k] = int(c.get(k, 0) * micro / batch)
            grads = base.grads_total
            if base.zero is not None and base.zero >= 2 and base.world_size > 1:
                grads = -(-grads // base.world_size)
            c["gradients"] = max(c.get("gradients", 0), grads)
        if opt in STATE_BYTES:
            c["optimizer_state"] = int(c.get("optimizer_state", 0) * STATE_BYTES[opt] / 8.0)
        if opt is not None and ph == "optimizer":      # every swap's step is fused
            c["temporaries"] = 0
        if opt in IN_BACKWARD:
            if ph == "backward":
                c["gradients"] = min(c.get("gradients", 0), base.largest_grad)
            elif ph == "optimizer":
                c["gradients"] = 0
        peak = max(peak, sum(c.values()))
    est = base.est
    alloc = int(peak * est.peak_allocated_bytes / base.profile_peak)
    reserved = int(alloc * est.peak_reserved_bytes / max(est.peak_allocated_bytes, 1))
    if micro is not None:
        notes.append(f"micro={micro}: activations scaled by {micro}/{batch} from the full-batch estimate")
    if opt in STATE_BYTES:
        notes.append(f"opt={opt}: optimizer state computed as {STATE_BYTES[opt]:g} bytes/param instead of 8")
    if opt in IN_BACKWARD:
        notes.append(f"opt={opt}: all gradients but the largest parameter's subtracted arithmetically")
    return alloc, reserved, "; ".join(notes)


def _subset(a: Plan, b: Plan) -> bool:
    """Every remedy of `a` is also in `b` (same value)."""
    return all(getattr(a, k) is None or getattr(a, k) == getattr(b, k)
               for k in ("precision", "checkpointing", "micro_batch", "optimizer", "zero"))


def _combinations(batch: int, world_size: int, candidates) -> list[Plan]:
    if candidates is not None:
        return [Plan.parse(c) if isinstance(c, str) else c for c in candidates]
    micros: list[int | None] = [None]
    m = batch // 2
    while m >= 1:
        if m not in micros:
            micros.append(m)
        m //= 2
    zeros = [None, 2] if world_size > 1 else [None]
    out = []
    for prec in (None, "bf16"):
        for ckpt in (None, "selective", "full"):
            for micro in micros:
                for opt in (None, "adamw-bf16", "adamw-8bit", "in-backward", "in-backward-8bit"):
                    for zero in zeros:
                        if opt in IN_BACKWARD and (micro is not None or world_size > 1):
                            continue        # it does not combine with accumulation or DDP/ZeRO
                        out.append(Plan(prec, ckpt, micro, opt, zero))
    return out


def plan_for_budget(model_name_or_build: str | Callable, batch: int, seq: int | None, budget_bytes: int,
                    world_size: int = 1, margin: float = 0.05, candidates=None, *,
                    max_estimates: int = 8, verify: int = 4, **config) -> list[Candidate]:
    """Candidates for training at `batch` x `seq` within `budget_bytes` (the allocator's
    limit): the fitting ones first (the plain plan if it fits, then by cost, then by peak),
    then the rest by predicted peak. `model_name_or_build`: a memdoctor.predict.models name,
    or a build() as memdoctor.predict.estimate.estimate_built takes (at `batch`). `config`: more
    memdoctor.predict.config.estimate_config options (image_size, optimizer, device). `candidates`: plans (or their
    strings) to consider instead of the whole search space. `verify`: how many of the first
    fitting plans get a direct estimate (derived figures run up to ~6% high on the reserved
    peak, measured on the H200; the first few are the ones users apply)."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    if world_size < 1:
        raise ValueError("world size must be at least 1")
    if budget_bytes <= 0:
        raise ValueError("the budget must be positive")

    def run_estimate(plan: Plan):
        if isinstance(model_name_or_build, str):
            return estimate_config(model_name_or_build, batch=batch, seq=seq, plan=str(plan),
                                   world_size=world_size, **config)
        return estimate_built(model_name_or_build, plan=plan, world_size=world_size, **config)

    def fits(reserved: int) -> bool:
        return reserved * (1.0 + margin) <= budget_bytes

    def job(plan: Plan) -> tuple:
        return (model_name_or_build, batch, seq, str(plan), world_size, config)

    plans = _combinations(batch, world_size, candidates)
    plans.sort(key=lambda p: (prior_cost(p), len(str(p))))
    keys: list[tuple] = []
    for plan in plans:
        key = (plan.precision, plan.checkpointing, plan.zero)
        if key not in keys:
            keys.append(key)
    keys = keys[:max_estimates]
    bases: dict[tuple, _Base | None] = {}
    known_model = isinstance(model_name_or_build, str)
    estimates = _Estimates(run_estimate, job if known_model else None,
                           _worker_count(len(keys) + verify) if known_model else 0)
    with estimates:
        estimates.start([Plan(k[0], k[1], None, None, k[2]) for k in keys])   # all at once, in parallel

        def base_of(key: tuple) -> _Base | None:
            if key not in bases:
                est = estimates.get(Plan(key[0], key[1], None, None, key[2]))
                if isinstance(est, EstimateError):
                    bases[key] = None
                else:
                    bases[key] = _Base(est, phase_profile(est, world_size, key[2]), *_grad_sizes(est),
                                       world_size, key[2])
            return bases[key]

        return _rank_and_verify(plans, keys, base_of, estimates, fits, batch, world_size, verify)


def _rank_and_verify(plans: list[Plan], keys: list[tuple], base_of: Callable, estimates: _Estimates,
                     fits: Callable, batch: int, world_size: int, verify: int) -> list[Candidate]:
    """The candidates from the structural estimates, ranked by predicted step time; the first
    `verify` fitting ones, and cheaper ones that may fit (to_check), then estimated directly,
    in parallel, a round at a time until the lead holds."""
    # costs are against the plain plan (or, if it could not be estimated, the first that could)
    plain = (None, None, None)
    ref_key = next((k for k in ([plain] if plain in keys else []) + keys if base_of(k) is not None), None)
    if ref_key is None:
        return []
    ref_seconds = counted_seconds(base_of(ref_key).est, Plan(ref_key[0], ref_key[1], None, None, ref_key[2]),
                                  world_size) or 1.0
    out: list[Candidate] = []
    for plan in plans:
        key = (plan.precision, plan.checkpointing, plan.zero)
        base = base_of(key) if key in keys else None
        if base is None:
            continue
        seconds = plan_seconds(plan, *plan_work(base, plan, batch), world_size)
        cost = seconds / ref_seconds
        if any(c.fits and _subset(c.plan, plan) and c.plan != plan and c.cost <= cost for c in out):
            continue            # what it adds buys nothing: a part of it fits, and is as fast
        structural_only = plan.micro_batch is None and plan.optimizer is None
        if structural_only:
            alloc, reserved, note = base.est.peak_allocated_bytes, base.est.peak_reserved_bytes, "estimated"
        else:
            alloc, reserved, note = derive(base, plan, batch)
        out.append(Candidate(plan, alloc, reserved, fits(reserved), cost, note, verified=structural_only,
                             step_seconds=seconds))

    def order(c: Candidate) -> tuple:
        return not c.plan.is_empty(), c.cost, c.predicted_peak_reserved

    def rank(cands: list[Candidate]) -> list[Candidate]:
        good = sorted((c for c in cands if c.fits), key=order)
        bad = sorted((c for c in cands if not c.fits), key=lambda c: c.predicted_peak_reserved)
        return good + bad

    doubts_left = 3 * verify

    def to_check(cands: list[Candidate]) -> list[Candidate]:
        """The first `verify` fitting plans not verified yet; and up to `verify` plans cheaper
        than the first fitting one whose derived allocated peak fits though their derived
        reserved peak does not, cheapest first (derived reserved peaks ran up to 24% high,
        GPT-2 774M with checkpointing, micro-batches and 8-bit states; allocated ones within
        1%), at most 3 * `verify` of those in all."""
        fitting = sorted((c for c in cands if c.fits), key=order)[:verify]
        bar = fitting[0].cost if fitting else math.inf
        doubtful = sorted((c for c in cands if not c.fits and not c.verified and c.cost < bar
                           and fits(c.predicted_peak_allocated)), key=order)
        return [c for c in fitting if not c.verified] + doubtful[:min(verify, doubts_left)]

    while True:
        pending = to_check(out)
        if not pending:
            break
        doubts_left -= sum(not c.fits for c in pending)
        estimates.start([c.plan for c in pending])
        for cand in pending:
            est = estimates.get(cand.plan)
            cand.verified = True
            if isinstance(est, EstimateError):  # nothing more can be checked; keep the derived figures
                cand.note += f"; not verified: {str(est)[:120]}"
                continue
            cand.predicted_peak_allocated, cand.predicted_peak_reserved = \
                est.peak_allocated_bytes, est.peak_reserved_bytes
            cand.step_seconds = counted_seconds(est, cand.plan, world_size)
            cand.cost = cand.step_seconds / ref_seconds
            cand.fits = fits(cand.predicted_peak_reserved)
            cand.note = (cand.note + "; " if cand.note else "") + "verified by a direct estimate"
    return rank(out)
