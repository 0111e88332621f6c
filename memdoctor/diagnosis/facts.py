"""Facts: the numbers every rule reads, derived once from a Run or from an OOM message.

A rule never walks the Run itself; it reads these. That keeps rules short, makes them
work on a pasted log (where only the OOM facts exist), and keeps the cost of a 1,000,000
event run in one place.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from memdoctor.attribution import Breakdown, breakdown_at, live_blocks, peak, per_step
from memdoctor.cuda.blas_workspaces import WORKSPACE_NAME
from memdoctor.diagnosis.forward_cut import forward_rest, rest_of_step, step_held
from memdoctor.diagnosis.in_batch import pair_bytes_at_once, pair_matrices
from memdoctor.diagnosis.logits import find_logits
from memdoctor.run import Block, Category, Phase, Run, backward_cut_short
from memdoctor.units import format_bytes

W, G, S = Category.WEIGHTS.value, Category.GRADIENTS.value, Category.OPTIMIZER_STATE.value
ACT, TMP, INP = Category.ACTIVATIONS.value, Category.TEMPORARIES.value, Category.INPUTS.value
OTHER = Category.OTHER.value
STATE_PER_PARAM_BYTE = {"Adam": 2.0, "AdamW": 2.0, "NAdam": 2.0, "RAdam": 2.0, "Adamax": 2.0,
                        "Adagrad": 1.0, "RMSprop": 1.0, "Adadelta": 2.0, "Adafactor": 0.1}
PRESSURE = 0.8          # a peak this close to the limit is under pressure
DATASET_ROWS = 4        # a dataset holds at least this many batches
SLACK = 1.01            # an OOM message rounds each number to two decimals
_ACTIVE = (Phase.FORWARD.value, Phase.BACKWARD.value, Phase.FORWARD_NO_BACKWARD.value)   # activations pile up


@dataclass
class Facts:
    source: str                                   # "run" or "log"
    limit_bytes: int | None = None                # budget, allowed or capacity: what we must fit
    capacity_bytes: int | None = None
    budget_bytes: int | None = None
    device: str = "cpu"
    oom: bool = False
    requested_bytes: int | None = None
    oom_phase: str | None = None
    oom_step: int | None = None
    oom_module: str | None = None
    oom_grad_enabled: bool | None = None          # grad mode of the outermost forward running at the OOM
    oom_building: dict | None = None              # an OOM building or moving a model: {module, how}
    pending_passes: int = 0                       # training passes since the last backward, at an OOM
    pending_activations: int = 0                  # and what they saved for it
    pending_from_seq: int | None = None           # the event where the first of them began
    pending_from_one_line: bool = False           # all made by one line of code (a loop over micro-batches)
    focus: Breakdown | None = None                # at the OOM, else at the peak
    focus_blocks: list[Block] = field(default_factory=list)
    peak_bytes: int = 0
    peak: Breakdown | None = None
    steps: list[dict] = field(default_factory=list)
    growth_per_step: float = 0.0                  # bytes kept from earlier steps, added a step
    steps_from: str = "optimizer"                 # what the steps are: optimizer, backward, forward, none
    leaked: list[Block] = field(default_factory=list)
    gathered: list[Block] = field(default_factory=list)   # outputs of earlier passes no backward takes, kept
    gathered_passes: int = 0                      # the passes of one model that left them, this step
    no_backward_activation_bytes: int = 0
    no_backward_calls: int = 0
    peak_before_no_backward: int = 0              # the run's peak before its first such pass (training's)
    optimizer: dict[str, Any] | None = None
    state_bytes_full: int = 0                     # optimizer state once every parameter has it
    optimizer_temporaries: int = 0
    grads_in_forward: int = 0                     # gradients of earlier steps alive in forward/backward
    dataset: list[Block] = field(default_factory=list)   # made outside any forward, feeding the inputs
    dataset_batch_rows: int = 0                   # rows of the largest batch taken from it
    dataset_batches: int = 0                      # the data made as that many batches up front (0: one tensor)
    dataset_request: int = 0                      # an OOM making data before any model ran: its request
    logits: list[Block] = field(default_factory=list)
    vocab: int | None = None
    in_batch_pairs: list[Block] = field(default_factory=list)    # the loss compares the batch's samples
    in_batch_pair_bytes: int = 0                  # such matrices alive at once in the focus step
    step_activations: int = 0
    oom_in_training_forward: bool = False
    step_held_bytes: int = 0                      # an OOM in a training step: what its passes made, hold, not seen saved
    forward_rest_bytes: int = 0                   # what the blocks after an OOM in a training forward would save
    forward_rest_note: str | None = None          # how that was counted
    step_rest_bytes: int | None = None            # what the rest of such a step added in the step before
    allocator: dict[str, Any] = field(default_factory=dict)   # OOM message numbers (CUDA)
    other_process_bytes: int | None = None
    other_processes: list[dict] = field(default_factory=list)
    run: Run | None = field(default=None, repr=False)     # for the findings' source lines
    untrusted: list[str] = field(default_factory=list)   # OOM-message numbers that contradict the others

    @property
    def held_by_containers(self) -> set[int]:
        """Blocks a container the script adds to holds (`history.append(x)`), at the trace's end."""
        kept = (self.run.meta.get("kept_by") or []) if self.run is not None else []
        return {i for k in kept for i in k.get("blocks", [])}

    @property
    def focus_bytes(self) -> int:
        """Live bytes the rules argue about: at the OOM (plus the failed request), else the peak."""
        base = self.focus.total_bytes if self.focus else self.peak_bytes
        return base + (self.requested_bytes or 0 if self.oom else 0)

    def cat(self, name: str) -> int:
        return self.focus.by_category.get(name, 0) if self.focus else 0

    @property
    def under_pressure(self) -> bool:
        """An OOM, or a peak within 20% of the limit: when a run fits with room to spare,
        how it spends memory is no finding."""
        if self.oom:
            return True
        return bool(self.limit_bytes) and self.focus_bytes >= PRESSURE * self.limit_bytes

    @property
    def model_state_bytes(self) -> int:
        """Weights + gradients + optimizer state as they are once every step has run."""
        weights = self.cat(W)
        grads = max(self.cat(G), self.param_bytes if self.optimizer else 0)
        return weights + grads + max(self.cat(S), self.state_bytes_full)

    @property
    def pending_state_bytes(self) -> int:
        """Optimizer state not made yet (the run stopped before its first step): every
        later step's peak will carry it, so predictions for a fixed run must too."""
        if self.oom_phase == "optimizer":
            return 0            # the state being made is already in the numbers
        return max(self.state_bytes_full - self.cat(S), 0)

    @property
    def ddp_bucket_bytes(self) -> int:
        """DistributedDataParallel's gradient buckets not shared with the gradients."""
        ddp = (self.run.meta.get("ddp") or []) if self.run is not None else []
        return sum(d.get("param_bytes", 0) for d in ddp if not d.get("gradient_as_bucket_view"))

    @property
    def pending_grad_bytes(self) -> int:
        """Gradients not made yet at an OOM in a training forward or backward, or between them
        (a loss outside the model) with training passes awaiting their backward: the fixed run's
        backward makes them while what it holds is still alive (most of what a forward saved; one
        recomputed block of a checkpointed model, to the last)."""
        between = self.oom_phase == Phase.OTHER.value and self.pending_passes >= 1
        if not (self.oom_in_training_forward or (self.oom and (self.oom_phase == Phase.BACKWARD.value or between))):
            return 0
        return max(self.param_bytes - self.cat(G), 0)

    @property
    def pending_workspace_bytes(self) -> int:
        """CUDA: each thread that runs matmuls keeps cuBLAS workspaces for the process's life, and
        autograd's backward thread takes its own at its first; an OOM in a training forward before
        any backward leaves that to come, as large as the forward thread's."""
        if not self.oom_in_training_forward or self.run is None:
            return 0
        blocks = [b for b in self.run.blocks.values() if b.name == WORKSPACE_NAME]
        if any(b.phase == Phase.BACKWARD.value for b in blocks):
            return 0
        return sum(b.nbytes for b in blocks if b.phase == Phase.FORWARD.value)

    @property
    def param_bytes(self) -> int:
        return (self.optimizer or {}).get("param_bytes", 0)


def _state_per_byte(o: dict) -> float:
    """Bytes of state an optimizer keeps per byte of parameters it steps, once it has stepped."""
    if o["class"] == "SGD":
        return 1.0 if o.get("momentum") else 0.0
    if o["class"] == "LBFGS":       # history_size pairs of flat vectors, and a few more
        return 2.0 * (o.get("history_size") or 100) + 3
    return STATE_PER_PARAM_BYTE.get(o["class"], 0.0)


def _all_optimizers(optimizers: list[dict]) -> dict:
    """The optimizers of a run as one (a GAN's two, an encoder's and a decoder's): the first's
    kind, every one's parameters."""
    if len(optimizers) == 1:
        return optimizers[0]
    merged = dict(optimizers[0])
    classes = sorted({o["class"] for o in optimizers})
    merged["class"] = classes[0] if len(classes) == 1 else " and ".join(classes)
    for key in ("num_params", "param_bytes", "frozen_param_bytes"):
        merged[key] = sum(o.get(key) or 0 for o in optimizers)
    merged["largest_param_bytes"] = max(o.get("largest_param_bytes") or 0 for o in optimizers)
    return merged


def running_call(run: Run, seq: int) -> dict | None:
    """The outermost forward call in progress at event `seq`, if any."""
    if not run.marks:
        return None
    index = bisect.bisect_right([m.seq for m in run.marks], seq) - 1
    running = [c for c in run.meta.get("forward_calls", [])
               if isinstance(c, dict) and type(c.get("mark_start")) is int and c["mark_start"] <= index
               and (c.get("mark_end") is None or (type(c["mark_end"]) is int and c["mark_end"] >= index))]
    return running[-1] if running else None


def _grad_mode_at(run: Run, seq: int) -> bool | None:
    """Whether the outermost forward call in progress at event `seq` ran with grad mode on
    (None: no forward call was): under no_grad nothing it makes is saved for backward."""
    call = running_call(run, seq)
    return bool(call.get("grad_enabled", True)) if call else None


def _peak_before_no_backward(run: Run, state_now: int) -> int:
    """The run's peak before its first model pass never back-propagated: what training alone
    reached, which no fix to the evaluation lowers; with the optimizer state made since (a
    first step peaks before its optimizer makes any: the steps after carry it)."""
    starts = [c["seq_start"] for c in run.meta.get("forward_calls", [])
              if isinstance(c, dict) and c.get("phase") == Phase.FORWARD_NO_BACKWARD.value
              and c.get("params", True) and type(c.get("seq_start")) is int]
    if not starts:
        return 0
    seq, top = peak(run, 0, min(starts))
    state_then = sum(b.nbytes for b in live_blocks(run, seq) if b.category == S)
    return top + max(state_now - state_then, 0)


def _pending_passes(run: Run, cut: tuple[int, int] | None) -> tuple[int, int | None, bool]:
    """At an OOM: the calls of one model in training mode with grad on since the last call
    that was back-propagated (their backward has not come yet; in a backward cut short at
    `cut`, those since the backward before, which it was to reach), of the model called most
    often there, the event where the first of them began, and whether one line of code made
    them all (a loop). Micro-batches whose losses are summed call one model several times;
    separate models called once each (two towers of a contrastive loss, an embedding then a
    recurrent layer) are one pass each."""
    if not run.ooms:
        return 0, None, False
    calls = [c for c in run.meta.get("forward_calls", []) if isinstance(c, dict)]
    if cut is not None:         # out in a backward: the passes since the one before await it
        waiting = [c for c in calls if type(c.get("seq_start")) is int and cut[0] <= c["seq_start"] < cut[1]]
    else:
        waiting = calls[max((i for i, c in enumerate(calls) if c.get("backward")), default=-1) + 1:]
    by_model: dict = {}
    for c in waiting:
        if c.get("training") and c.get("grad_enabled") and c.get("params", True):
            model = c.get("model", -1)      # runs saved before models were told apart: by name
            by_model.setdefault(model if type(model) is int and model >= 0 else c.get("module"), []).append(c)
    pending = max(by_model.values(), key=len, default=[])
    starts = [c["seq_start"] for c in pending if type(c.get("seq_start")) is int]
    sites = {tuple(c["site"]) if isinstance(c.get("site"), list) else None for c in pending}
    return len(pending), (min(starts) if starts else None), len(sites) == 1 and None not in sites


def facts_from_run(run: Run) -> Facts:
    f = Facts(source="run", budget_bytes=run.budget_bytes, device=run.device.get("type", "cpu"))
    f.run = run
    f.capacity_bytes = run.device.get("capacity_bytes")
    f.limit_bytes = run.budget_bytes or f.capacity_bytes
    peak_seq, f.peak_bytes = peak(run)
    f.peak = breakdown_at(run, peak_seq, top=20)
    if run.ooms:
        o = run.ooms[0]
        f.oom, f.requested_bytes = True, o.requested_bytes
        f.oom_phase, f.oom_step, f.oom_module = o.phase, o.step, o.module
        f.oom_grad_enabled = _grad_mode_at(run, o.seq)
        f.oom_building = run.meta.get("oom_building")
        focus_seq = max(o.seq - 1, 0)
        if not o.simulated:
            _allocator_facts(f, o.message)
    else:
        focus_seq = peak_seq
    f.focus = breakdown_at(run, focus_seq, top=20)
    f.focus_blocks = [b for b in run.blocks.values()
                      if b.alloc_seq <= focus_seq and (b.free_seq is None or b.free_seq > focus_seq)]
    current_step = f.focus.step
    f.steps = per_step(run)
    f.steps_from = run.meta.get("steps_from", "optimizer")
    f.growth_per_step = _kept_growth(run, f.steps)
    cut = backward_cut_short(run)       # an OOM in a backward: what it was to reach since the last one
    f.pending_passes, pending_seq, f.pending_from_one_line = _pending_passes(run, cut)
    # what the passes still awaiting their backward saved for it is no leak, whatever the steps
    awaiting = set()
    if f.pending_passes >= 2 and pending_seq is not None:
        f.pending_from_seq = pending_seq
        awaiting = {b.id for b in f.focus_blocks if b.category == ACT and b.alloc_seq >= pending_seq
                    and b.phase == Phase.FORWARD.value}
        f.pending_activations = sum(b.nbytes for b in f.focus_blocks if b.id in awaiting)
    if cut is not None:
        awaiting |= {b.id for b in f.focus_blocks if b.category == ACT and cut[0] <= b.alloc_seq < cut[1]
                     and b.phase == Phase.FORWARD.value}
    f.leaked = [b for b in f.focus_blocks if _kept(b) and b.step < current_step - 1 and b.id not in awaiting]
    f.gathered, f.gathered_passes = _gathered(f, run)
    nob = Phase.FORWARD_NO_BACKWARD.value
    # what a graph nobody back-propagates keeps: the tensors saved for its backward
    f.no_backward_activation_bytes = sum(b.nbytes for b in f.focus_blocks
                                         if b.phase == nob and b.category == ACT)
    f.no_backward_calls = sum(1 for c in run.meta.get("forward_calls", [])
                              if c.get("phase") == nob and c.get("params", True))
    f.peak_before_no_backward = _peak_before_no_backward(run, f.cat(S))
    optimizers = run.meta.get("optimizers") or []
    if optimizers:
        f.optimizer = _all_optimizers(optimizers)
        f.state_bytes_full = int(sum(o["param_bytes"] * _state_per_byte(o) for o in optimizers))
    f.optimizer_temporaries = sum(b.nbytes for b in f.focus_blocks
                                  if b.phase == Phase.OPTIMIZER.value and b.category == TMP)
    if f.oom and f.oom_phase == Phase.OPTIMIZER.value:
        f.optimizer_temporaries += f.requested_bytes or 0
    if (f.oom_phase if f.oom else f.focus.phase) in _ACTIVE:
        # a gradient this step's backward has not made yet was kept from an earlier step
        f.grads_in_forward = sum(b.nbytes for b in f.focus_blocks if b.category == G and b.step < current_step)
    _find_dataset(f, run)
    f.step_activations = max(sum(b.nbytes for b in f.focus_blocks      # training's: a pass never
                                 if b.category == ACT and b.step == current_step and b.phase != nob),  # back-propagated is not
                             f.pending_activations)
    f.vocab, f.logits = find_logits(f.focus_blocks, (f.requested_bytes or 0) if f.oom else 0,
                                     f"{f.oom_module}.weight" if f.oom else None)
    f.in_batch_pairs = pair_matrices(run)
    if f.in_batch_pairs:
        f.in_batch_pair_bytes = pair_bytes_at_once(run, f.in_batch_pairs, current_step)
    if f.oom:
        call = running_call(run, run.ooms[0].seq)
        f.oom_in_training_forward = bool(f.oom_phase == Phase.FORWARD.value and call and call.get("training")
                                         and call.get("grad_enabled"))
        f.forward_rest_bytes, f.forward_rest_note = forward_rest(f, run)
        f.step_held_bytes = step_held(f)
        f.step_rest_bytes = rest_of_step(f, run)
    nvml = run.device.get("nvml_at_oom") or run.device.get("nvml") or {}
    if nvml.get("available"):
        others = [p for p in nvml.get("processes", []) if not p.get("is_self")]
        held = sum(p.get("bytes") or 0 for p in others)
        if held >= (f.other_process_bytes or 0):      # the OOM message may know better
            f.other_processes, f.other_process_bytes = others, held
        f.capacity_bytes = f.capacity_bytes or nvml.get("total_bytes")
    return f


def facts_from_oom(oom) -> Facts:
    """Facts from one parsed OOM message (memdoctor.capture.oomlog.OOMFacts): no Run behind it."""
    f = Facts(source="log", device=oom.kind)
    f.oom = True
    f.requested_bytes = oom.requested_bytes
    f.capacity_bytes = oom.total_capacity_bytes
    f.limit_bytes = oom.allowed_bytes if oom.allowed_bytes and not oom.extra.get("allowed_is_unlimited") \
        else oom.total_capacity_bytes
    f.allocator = oom.expected()
    _other_from_message(f)
    return f


def _allocator_facts(f: Facts, message: str) -> None:
    try:
        from memdoctor.capture.oomlog import parse_text
        found = parse_text(message)
    except Exception:
        return
    if found:
        f.allocator = found[0].expected()
        _other_from_message(f)
        f.capacity_bytes = f.capacity_bytes or f.allocator.get("total_capacity_bytes")


def checked(a: dict) -> tuple[dict, list[str]]:
    """The OOM message's numbers, each checked against the others; one that contradicts
    them is dropped (None) and named. What this process holds includes everything PyTorch
    reserved, so "this process has 0 bytes" beside "20.91 GiB is allocated by PyTorch" is
    a number NVML could not see (a container), not an empty process; free or reserved
    memory larger than the device is not this device's."""
    a, bad = dict(a), []
    total, free = a.get("total_capacity_bytes"), a.get("free_bytes")
    allocated = a.get("allocated_by_pytorch_bytes") or 0
    reserved = max(a.get("reserved_total_bytes") or 0, allocated + (a.get("reserved_unallocated_bytes") or 0))
    if total and free is not None and free > total:
        a["free_bytes"], bad = None, bad + ["free_bytes"]
    if total and reserved > SLACK * total:
        for key in ("allocated_by_pytorch_bytes", "reserved_unallocated_bytes", "reserved_total_bytes"):
            a[key] = None
        bad.append("allocated_by_pytorch_bytes")
        reserved = 0
    mine = a.get("process_in_use_bytes")
    if mine is not None and mine * SLACK < reserved:
        a["process_in_use_bytes"], bad = None, bad + ["process_in_use_bytes"]
    return a, bad



def _other_from_message(f: Facts) -> None:
    """Memory held outside this process: total - free - this process, when all three are
    trusted; else the processes the message lists by pid; else unknown (None)."""
    f.allocator, f.untrusted = checked(f.allocator)
    a = f.allocator
    procs = a.get("other_processes")
    if procs:
        f.other_processes = procs
    total, free, mine = a.get("total_capacity_bytes"), a.get("free_bytes"), a.get("process_in_use_bytes")
    if total and free is not None and mine is not None:
        f.other_process_bytes = max(total - free - mine, 0)
    elif procs:
        f.other_process_bytes = sum(p["bytes"] for p in procs)


GATHERED_PASSES = 3     # passes of one model whose outputs are still alive: a loop gathering them


def _gathered(f: Facts, run: Run) -> tuple[list[Block], int]:
    """Within the step of the focus: what finished calls of one model made and is still
    alive, not saved for backward, from calls no backward will take (under no_grad, or in
    eval mode): each batch's outputs gathered in a list by a loop with no optimizer step
    between its batches (an evaluation collecting its predictions on the device). The
    model that left the most, if at least GATHERED_PASSES of its calls did."""
    if f.focus is None:
        return [], 0
    calls = [c for c in run.meta.get("forward_calls", []) if isinstance(c, dict) and c.get("params", True)
             and type(c.get("seq_start")) is int and type(c.get("seq_end")) is int and c["seq_end"] <= f.focus.seq
             and not (c.get("training") and c.get("grad_enabled"))]
    if len(calls) < GATHERED_PASSES:
        return [], 0
    calls.sort(key=lambda c: c["seq_start"])
    starts = [c["seq_start"] for c in calls]
    by_model: dict = {}
    for b in f.focus_blocks:
        if b.category in (W, G, S, ACT) or b.step != f.focus.step:
            continue
        i = bisect.bisect_right(starts, b.alloc_seq) - 1
        if i < 0 or b.alloc_seq >= calls[i]["seq_end"]:
            continue
        model = calls[i].get("model", -1)
        key = model if type(model) is int and model >= 0 else calls[i].get("module")
        by_model.setdefault(key, {}).setdefault(calls[i]["seq_start"], []).append(b)
    joined = _concatenated(f, run, calls)
    if not by_model:
        return joined
    passes = max(by_model.values(), key=lambda p: sum(b.nbytes for blocks in p.values() for b in blocks))
    if len(passes) < GATHERED_PASSES:
        return joined
    return [b for blocks in passes.values() for b in blocks], len(passes)


_JOINS = ("aten.cat", "aten.concat", "aten.stack", "aten._cat")


def _concatenated(f: Facts, run: Run, calls: list[dict]) -> tuple[list[Block], int]:
    """Outputs gathered by joining them as the loop goes (transformers' Trainer does so with its
    evaluation's predictions unless eval_accumulation_steps is set): after each pass a longer
    tensor made outside the model (the last one joined with the pass's output), the last one
    freed. Each such tensor alive whose joins made at least GATHERED_PASSES - 1 lengths of it
    (the first pass's output is joined by the second; a longer join the OOM asked for counts),
    and the passes the longest took."""
    inside = [(c["seq_start"], c["seq_end"]) for c in calls]

    def outside(b: Block) -> bool:
        return not any(start <= b.alloc_seq < end for start, end in inside)

    alive = sorted((b for b in f.focus_blocks if b.name in _JOINS and b.shape and b.step == f.focus.step
                    and b.category not in (W, G, S, ACT) and outside(b)), key=lambda b: -b.nbytes)
    kept, passes = [], 0
    for last in alive[:8]:          # the largest: each looks through the run's blocks once
        tail = tuple(last.shape[1:])
        lengths = {b.shape[0] for b in run.blocks.values()
                   if b.name in _JOINS and b.dtype == last.dtype and b.shape and tuple(b.shape[1:]) == tail
                   and b.step == last.step and b.alloc_seq <= last.alloc_seq and b.shape[0] <= last.shape[0]}
        row = last.nbytes // max(last.shape[0], 1)
        if f.oom and row and f.requested_bytes and f.requested_bytes % row == 0 \
                and f.requested_bytes // row > last.shape[0]:
            lengths.add(f.requested_bytes // row)      # the join the OOM cut short: one more pass
        if len(lengths) + 1 >= GATHERED_PASSES:
            kept.append(last)
            passes = max(passes, len(lengths) + 1)
    return kept, passes


def _kept(b: Block) -> bool:
    """Could be kept by the user's code: not weights, gradients or optimizer state (those
    live for the run by design), nor what was set up before the first step."""
    return b.category not in (W, G, S) and not (b.step == 0 and b.phase == Phase.OTHER.value)


def _kept_growth(run: Run, steps: list[dict]) -> float:
    """Bytes of tensors that outlive their step, added a step: for each complete step k,
    the bytes alive at its end that earlier steps made (`_kept`), and the least-squares
    slope of that over k. Optimizer state, parameters and their gradients never count, and
    neither does the last step (cut short by the OOM, or the run's tail). Linear: each
    block adds to a range of steps (a difference array)."""
    rows = steps[:-1]
    if len(rows) < 4:
        return 0.0
    index = {r["step"]: i for i, r in enumerate(rows)}
    ends = [r["end_seq"] - 1 for r in rows]          # the last event of each step
    carried = [0] * (len(rows) + 1)
    for b in run.blocks.values():
        if not _kept(b):
            continue
        first = index.get(b.step + 1)                 # the first step it must outlive
        if first is None:
            continue
        if b.free_seq is None:
            last = len(rows) - 1
        else:
            last = bisect.bisect_left(ends, b.free_seq) - 1     # ends before it is freed
        if last >= first:
            carried[first] += b.nbytes
            carried[last + 1] -= b.nbytes
    points, total = [], 0
    for i, r in enumerate(rows):
        total += carried[i]
        if i >= 1:
            points.append((r["step"], total))
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def _find_dataset(f: Facts, run: Run) -> None:
    """Tensors made outside any forward that the inputs are taken from, alive at the focus:
    inputs sliced from them (the tracer notes an input that is a small view of a large
    storage), or batches of their rows (a DataLoader collating samples of a TensorDataset
    makes each batch a new tensor, N x rest -> B x rest of the same dtype, N >= 4 B). With
    them, the tensors of the same length made beside them (the labels)."""
    gathered = {b.id for b in f.gathered}          # outputs a loop joined, not data it reads
    setup = [b for b in f.focus_blocks if b.category in (INP, TMP, OTHER) and b.phase == Phase.OTHER.value
             and b.shape and b.id not in gathered]
    sliced_blocks, sliced_addresses = {}, {}
    for entry in run.meta.get("sliced_inputs") or ():
        if "block" in entry:
            sliced_blocks[entry["block"]] = entry["rows"]
        elif "address" in entry:
            sliced_addresses[entry["address"]] = entry["rows"]
    batches: dict[tuple, int] = {}        # (rest of the shape, dtype) -> most rows of one batch
    for b in run.blocks.values():
        if b.category == INP and b.shape and b.id not in sliced_blocks:
            key = (tuple(b.shape[1:]), b.dtype)
            batches[key] = max(batches.get(key, 0), b.shape[0])
    found, rows = [], 0
    for b in setup:
        taken = sliced_blocks.get(b.id) or (sliced_addresses.get(b.address) if b.address is not None else None)
        if taken is None:
            batch = batches.get((tuple(b.shape[1:]), b.dtype), 0)
            taken = batch if batch and b.shape[0] >= DATASET_ROWS * batch else None
        if taken is not None:
            found.append(b)
            rows = max(rows, taken)
    if not found:
        found = _preloaded(f, run, setup)
        if found:
            kinds = len({(tuple(b.shape), b.dtype) for b in found})     # samples and labels: a batch each
            f.dataset, f.dataset_batch_rows = found, max(b.shape[0] for b in found)
            f.dataset_batches = max(len(found) // kinds, 1)
        elif f.oom and f.oom_phase == Phase.OTHER.value and not _model_ran(f, run) and not f.oom_building:
            # out while the script makes its data (a float copy of a uint8 dataset), no model yet;
            # the allocator source knows no shape of a tensor not yet bound to a name
            made = setup or [b for b in f.focus_blocks if b.category in (INP, TMP, OTHER)
                             and b.phase == Phase.OTHER.value and b.id not in gathered and b.name != WORKSPACE_NAME]
            if made:
                f.dataset, f.dataset_request = made, f.requested_bytes or 0
        return
    lengths = {b.shape[0] for b in found if b.shape[0] >= DATASET_ROWS}
    ids, steps = {b.id for b in found}, {b.step for b in found}
    found += [b for b in setup if b.id not in ids and b.shape[0] in lengths and b.step in steps]
    f.dataset, f.dataset_batch_rows = found, rows


PRELOADED = 8           # tensors one line made before training: a dataset made as batches


def _preloaded(f: Facts, run: Run, setup: list[Block]) -> list[Block]:
    """Data made up front as many tensors by one line of the script (a list of batches moved
    to the device, a dataset moved sample by sample): the blocks of the line that made the
    most setup bytes, at least PRELOADED of them, when the OOM or peak came before any model
    ran, or when the model's inputs were among them."""
    by_line: dict[int, list[Block]] = {}
    for b in setup:
        if b.step == 0 and b.source >= 0:
            by_line.setdefault(b.source, []).append(b)
    if not by_line:
        return []
    blocks = max(by_line.values(), key=lambda group: sum(b.nbytes for b in group))
    if len(blocks) < PRELOADED:
        return []
    fed = any(b.category == INP for b in blocks)
    return blocks if not _model_ran(f, run) or fed else []


def _model_ran(f: Facts, run: Run) -> bool:
    """Whether a model (a module holding parameters) ran a forward before the focus."""
    focus = f.focus.seq if f.focus is not None else run.num_events
    return any(isinstance(c, dict) and c.get("params") and type(c.get("seq_start")) is int
               and c["seq_start"] <= focus for c in run.meta.get("forward_calls", []))
