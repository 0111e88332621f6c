"""The tracer: recorder + dispatch source + ownership hooks + budget, as one context
manager (memdoctor.capture.script runs a user's script under it)."""
from __future__ import annotations

import bisect
import os
import sys

import torch

from memdoctor.collector import paused_gc
from memdoctor.run import Phase, Run, backward_cut_short
from memdoctor.units import parse_size
from memdoctor.capture.budget import SimulatedBudget, cap_cuda
from memdoctor.capture.named_tensors import name_blocks
from memdoctor.capture.ranks import rank_info
from memdoctor.capture.dispatch import DispatchSource
from memdoctor.capture.hooks import OwnershipHooks
from memdoctor.capture.frames import note_oom_building, note_oom_line
from memdoctor.capture.keepers import attach_keepers, find_held
from memdoctor.capture.oomlog import requested_bytes
from memdoctor.capture.optimizers import grads_no_optimizer_steps
from memdoctor.capture.recorder import Recorder
from memdoctor.capture.retaining_backwards import RetainingBackwards

def pick_source(source: str) -> str:
    if source not in ("auto", "dispatch", "allocator"):
        raise ValueError(f"unknown source {source!r}: use auto, dispatch or allocator")
    if source == "auto":
        return "allocator" if torch.cuda.is_available() else "dispatch"
    if source == "allocator" and not torch.cuda.is_available():
        raise ValueError("the allocator source needs a CUDA device; use --source dispatch")
    return source


class Tracer:
    """Trace everything run inside `with Tracer(...) as t:`; `t.run` is the Run after exit.

    models / optimizers made before the tracer starts are claimed up front; those made
    inside are found by the global hooks on their first forward and first step.
    """

    def __init__(self, models=(), optimizers=(), budget=None, source: str = "auto", mode: str = "full"):
        self.models = [m for m in models if m is not None]
        self.optimizers = [o for o in optimizers if o is not None]
        self.budget = parse_size(budget) if budget is not None else None
        self.source = pick_source(source)
        if mode not in ("full", "light"):
            raise ValueError(f"unknown mode {mode!r}: use full or light")
        # light: the allocator's history and the models' and optimizers' own hooks only
        # (a CUDA job that runs for days); under the dispatch source every op is seen anyway
        self.light = mode == "light" and self.source == "allocator"
        self.run: Run | None = None
        self.recorder: Recorder | None = None
        self._undo: list = []

    def __enter__(self) -> "Tracer":
        """Start tracing. Should any step fail (or a KeyboardInterrupt come) part-way,
        whatever was installed is removed again before the error goes on."""
        self._undo: list = []
        try:
            self._start()
        except BaseException:
            self._remove_all()
            if self.recorder is not None:
                self.recorder.stop()
            raise
        return self

    def _start(self) -> None:
        self.recorder = self.allocator = None
        run = Run(source=self.source, budget_bytes=self.budget, torch_version=torch.__version__)
        run.device = device_facts(self.source)
        ranked = rank_info()
        if ranked is not None:
            run.meta["rank"], run.meta["world_size"] = ranked
        self.recorder = rec = Recorder(run)
        self.hooks = OwnershipHooks(rec, light=self.light, saved_tensors=self.source != "allocator")
        self._undo.append(self.hooks.remove)        # removes what install() got to
        self.hooks.install()
        self.retaining = RetainingBackwards(rec)
        self._undo.append(self.retaining.install())
        if self.source == "allocator":
            from memdoctor.capture.allocator import AllocatorSource
            self.allocator = AllocatorSource(rec, self.budget, light=self.light)
            self._undo.append(self.allocator.abandon)
            self.allocator.start()
        else:
            on_gpu = run.device.get("type") == "cuda"
            if on_gpu:      # host memory is no GPU memory: a dataset kept on the CPU takes none
                rec.skip_devices = frozenset({"cpu"})
            if self.budget is not None and on_gpu:
                self._cap_cuda(self.budget)
            elif self.budget is not None:
                rec.budget = SimulatedBudget(rec, self.budget, run.device.get("type", "cpu"))
            self.mode = DispatchSource(rec)
            self.mode.__enter__()                   # all or nothing
            self._undo.append(lambda: self.mode.__exit__(None, None, None))
        for m in self.models:
            self.hooks.adopt_model(m)
        for o in self.optimizers:
            self.hooks.adopt_optimizer(o)

    def _cap_cuda(self, budget: int) -> None:
        """On a GPU the budget caps the caching allocator, as under the allocator source: the
        run then runs out where the GPU would (cuBLAS's workspaces and the allocator's
        rounding count), and both sources see the same OOM."""
        index = torch.cuda.current_device()
        previous = torch.cuda.get_per_process_memory_fraction(index)
        cap_cuda(budget, index)
        self._undo.append(lambda: torch.cuda.set_per_process_memory_fraction(previous, index))

    def abandon(self) -> None:
        """Remove whatever is still installed and record nothing more: for a caller whose
        __enter__ or __exit__ failed before it could. Safe to call again."""
        try:
            self._remove_all()
        finally:
            if self.recorder is not None:
                self.recorder.stop()

    def _remove_all(self) -> None:
        """Remove what was installed, last first, each removal whatever the others do; a
        removal that failed stays listed, for the next call to try again. The first
        failure is raised once all have run."""
        failure, failed = None, []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except BaseException as exc:
                failure = failure or exc
                failed.append(undo)
        self._undo[:0] = reversed(failed)
        if failure is not None:
            raise failure

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Remove everything installed, then build the Run. The removal comes first and
        happens on every path; a failure while building raises (watch logs it)."""
        rec = self.recorder
        caller = sys._getframe(1)
        try:
            if self.allocator is None:
                self._remove_all()
            else:                               # the allocator's history is read by stop()
                self._undo = [u for u in self._undo if u != self.allocator.abandon]
                self._remove_all()
                self._undo.append(self.allocator.abandon)
            with paused_gc():               # only memdoctor's own objects are made here
                self._build(exc, tb, caller)
        finally:
            self._remove_all()                  # the allocator's, when stop() never ran
            rec.stop()
        return False

    def _build(self, exc, tb, caller) -> None:
        rec = self.recorder
        self.hooks.find_unstepped_optimizers(isinstance(exc, torch.OutOfMemoryError))
        self.hooks.claim_idle_modules()
        self.hooks.claim_all_state()
        oom_message = str(exc).strip() if isinstance(exc, torch.OutOfMemoryError) else None
        if oom_message and rec.run.device.get("type") == "cuda":
            rec.run.device["nvml_at_oom"] = _nvml_now(rec.run.device.get("index", 0))
        rec.run.meta["forward_calls"] = self.hooks.forward_calls()
        rec.run.meta["optimizers"] = self.hooks.optimizer_info
        roots = {self.hooks.root_order.get(key, -1): r() for key, r in self.hooks.roots.items()}
        grads, models = grads_no_optimizer_steps(roots, [r() for r in self.hooks.optimizers.values()],
                                                 self.hooks.param_names)
        if grads or models:
            rec.run.meta["unstepped_grads"], rec.run.meta["unstepped_models"] = grads, models
        rec.run.meta["sliced_inputs"] = self.hooks.sliced_inputs()
        rec.run.meta["block_counts"] = dict(self.hooks.block_counts)
        rec.run.meta["recomputed_in_backward"] = sorted(self.hooks.recomputed)
        rec.run.meta["checkpointed_in_forward"] = sorted(self.hooks.checkpointed.seen)
        rec.run.meta["frameworks"] = sorted(self.hooks.frameworks)
        rec.run.meta["ddp"] = list(self.hooks.ddp)
        rec.run.meta["retaining_backwards"] = self.retaining.calls
        rec.run.meta["steps_from"], starts = self.hooks.step_starts()
        rec.renumber_steps(starts)
        held = find_held(tb, caller,             # containers of tensors in the user's frames
                         graphs=not (self.hooks.recomputed or self.hooks.checkpointed.seen))
        if self.allocator is not None:
            rec.active = False
            self.run = self.allocator.stop(oom_message)
            self._undo.clear()                  # stop() released what start() took
            _calls_to_seqs(self.run)
            attach_keepers(self.run, held + self.hooks.zero_grads.held())
            name_blocks(self.run, tb, caller)
        else:
            if oom_message and not any(o.message == oom_message for o in rec.run.ooms):
                rec.record_oom(requested_bytes(oom_message), oom_message, simulated=False)
            attach_keepers(rec.run, held, rec.live)
            self.run = rec.close()
        if self.allocator is None:
            self.run.meta["peak_live_bytes"] = rec.peak_bytes
        note_oom_line(self.run, tb)
        note_oom_building(self.run, tb)
        label_forwards_without_backward(self.run, ended_in_oom=bool(self.run.ooms))


def _calls_to_seqs(run: Run) -> None:
    """Allocator runs place marks after the fact: restate forward calls in event indices."""
    for c in run.meta.get("forward_calls", []):
        c["seq_start"] = run.marks[c["mark_start"]].seq if c["mark_start"] < len(run.marks) else 0
        end = c.get("mark_end")
        c["seq_end"] = run.marks[end].seq if end is not None and end < len(run.marks) else None


def device_facts(source: str) -> dict:
    if source == "allocator" or torch.cuda.is_available():
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        props = torch.cuda.get_device_properties(index) if torch.cuda.is_available() else None
        facts = {"type": "cuda", "index": index}
        if props is not None:
            facts.update(name=props.name, capacity_bytes=props.total_memory)
        try:
            from memdoctor.cuda.nvml import device_facts as nvml_facts
            facts["nvml"] = nvml_facts(index)
        except Exception as exc:     # NVML is a bonus, never a requirement
            facts["nvml"] = {"available": False, "reason": str(exc)}
        facts["allocator_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        return facts
    return {"type": "cpu"}


def _nvml_now(index: int) -> dict:
    try:
        from memdoctor.cuda.nvml import device_facts as nvml_facts
        return nvml_facts(index)
    except Exception as exc:
        return {"available": False, "reason": str(exc)}


def _model_of(call: dict):
    return call.get("model", -1) if call.get("model", -1) != -1 else call.get("module")


def _site(call: dict) -> tuple | None:
    return tuple(call["site"]) if call.get("site") else None


def _predicting(c: dict, calls: list, i: int, first_awaiting: int, propagated_sites: set,
                last_of_model: dict, since_update: int) -> bool:
    """The pass the OOM cut short predicts, though its model is in training mode with grad on:
    its model was trained (back-propagated, then an optimizer step) from another line, no line
    of this one was ever back-propagated, and no training pass before it awaits a backward (a
    loss's other half). A prediction loop after each training step left without no_grad."""
    trained = last_of_model.get(_model_of(c))
    return (c["training"] and c.get("site") is not None and _site(c) not in propagated_sites
            and trained is not None and calls[trained]["seq_start"] < since_update <= c["seq_start"]
            and first_awaiting >= i)


def label_forwards_without_backward(run: Run, ended_in_oom: bool) -> None:
    """Forward passes that built a graph nobody back-propagated keep their saved tensors for
    nothing. A pass needs grad mode on and an output carrying a graph (under no_grad, or a
    transform on plain data, nothing is kept). When the run ends in an OOM, the passes
    since the last back-propagated one may still get their backward: those in training
    mode (micro-batches whose losses are summed before one backward), and those in training
    mode since the last back-propagated pass of their own model (a GAN's generator, whose
    backward comes through the discriminator's later pass), those whose input requires grad
    (a frozen loss network on a model's output), those from a line whose passes were
    back-propagated before (a teacher left requiring grad) and those after a training pass
    still awaiting its backward (the target's features of a perceptual loss) do not count;
    those in eval mode do (the classic validation loop without no_grad), the one cut short
    too (in training mode as well where `_predicting` says it predicts), and so do those in
    training mode of a model no optimizer trains, on inputs needing
    no gradient (an `AveragedModel` predicting, left in training mode as torch's docs leave
    it). Where the OOM cut a backward short, the passes since the last optimizer step await
    it (`autograd.grad` may have run a backward of its own between: a gradient penalty).
    Linear: the passes' ranges are sorted, each event a bisection."""
    calls = run.meta.get("forward_calls", [])
    last_backward = max((i for i, c in enumerate(calls) if c["backward"]), default=-1)
    cut = backward_cut_short(run) if ended_in_oom else None
    since_update = max((m.seq for m in run.marks if m.phase == Phase.OPTIMIZER.value
                        and run.ooms and m.seq < run.ooms[0].seq), default=0)     # the last optimizer step
    last_of_model = {}
    for i, c in enumerate(calls):
        if c["backward"]:
            last_of_model[_model_of(c)] = i
    propagated_sites = {_site(c) for c in calls if c["backward"] and c.get("site")}
    unstepped = set(run.meta.get("unstepped_models") or [])     # models no optimizer trains
    first_awaiting = next((j for j in range(last_backward + 1, len(calls)) if calls[j]["training"]
                           and calls[j]["grad_enabled"] and calls[j].get("graph")), len(calls))
    ranges = []
    for i, c in enumerate(calls):
        if c["backward"] or not c["grad_enabled"]:
            continue
        cut_short = i == len(calls) - 1 and ended_in_oom
        untrained = c.get("model") in unstepped and not c.get("input_grad")     # an AveragedModel's prediction
        untrained = untrained or cut_short and _predicting(c, calls, i, first_awaiting, propagated_sites,
                                                           last_of_model, since_update)
        if ended_in_oom and i > last_backward and c["training"] and not untrained:
            continue            # a training forward the OOM came before its backward
        if ended_in_oom and c["training"] and not untrained and i > last_of_model.get(_model_of(c), -1):
            continue            # its model's latest: a later pass's backward may reach it (a GAN's G(z))
        if cut is not None and (c["training"] or c.get("graph")) and (
                cut[0] <= c["seq_start"] < cut[1] or c["seq_start"] > since_update):
            continue            # a forward whose backward the OOM cut short before reaching it (a frozen
            #                     net's pass in eval mode feeding the loss too; any since the last optimizer
            #                     step, where `autograd.grad` ran a backward of its own between: a gradient penalty)
        if ended_in_oom and i > last_backward and (c.get("input_grad") or _site(c) in propagated_sites
                                                   or first_awaiting < i):
            continue            # gradients flow through it (a loss network on a model's output), its line's
            #                     passes were back-propagated before (a teacher left requiring grad), or a
            #                     training pass before it awaits the same backward (its loss's other half)
        if not cut_short and not c.get("graph", True):
            continue            # nothing saved: no graph was built
        end = c["seq_end"] if c["seq_end"] is not None else run.num_events
        ranges.append((c["seq_start"], end))
        c["phase"] = Phase.FORWARD_NO_BACKWARD.value
    if not ranges:
        return
    ranges.sort()
    starts, ends = [], []
    for a, b in ranges:             # merged, so one bisection answers
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    fwd, nob = Phase.FORWARD.value, Phase.FORWARD_NO_BACKWARD.value

    def inside(seq: int) -> bool:
        i = bisect.bisect_right(starts, seq) - 1
        return i >= 0 and seq < ends[i]
    for m in run.marks:
        if m.phase == fwd and inside(m.seq):
            m.phase = nob
    for b in run.blocks.values():
        if b.phase == fwd and inside(b.alloc_seq):
            b.phase = nob
    for o in run.ooms:
        if o.phase == fwd and inside(o.seq):
            o.phase = nob
