"""Remedies injected into a script never written for memdoctor, without editing it.

`memdoctor diagnose SCRIPT --try FIX` runs the script twice: as written, and inside
`injected(plan)`, which installs global hooks (undone on exit) that apply a remedy where
the script's own objects pass by:

- "bf16" / "fp16": autocast around every top-level module forward (a global forward
  pre-hook enters it, the matching post-hook leaves it). fp16 gets no loss scaler: that
  needs the script's own backward call, so this is a memory what-if, not a recipe.
- "ckpt=full" / "ckpt=selective" / "ckpt=N": at the first forward pre-hook of the root
  module (a top-level module with parameters) whose activations filled the memory in the
  run as written (`activation_root`: the Generator of a GAN, not the Discriminator called
  first), else of the first root seen, its repeated blocks (checkpointing.checkpoint_units:
  blocks, or segments of a flat nn.Sequential) are checkpointed, before its forward runs.
- "opt=fused": at each optimizer's first step pre-hook, its param_groups (and defaults)
  switch in place to fused=True where the class and the parameters' device have a fused
  kernel, else to foreach=False; torch reads these flags at every step, so the script's
  own optimizer object steps fused from its first step on.
- "alloc=expandable_segments": PYTORCH_CUDA_ALLOC_CONF must be set before the process
  initialises CUDA, so `compare` runs the 'after' in a new process with it set.

What cannot be injected: micro-batching (the script's loop decides what a batch is and
when the optimizer steps), ZeRO (several processes), bf16-true and the optimizer swaps
that replace the optimizer object (the script keeps stepping its own).

Nothing here imports torch at import time, so a bad FIX fails fast.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Iterator

from memdoctor.remedies.plan import Plan

log = logging.getLogger("memdoctor")

INJECTABLE = "bf16, fp16, ckpt=full|selective|N, opt=fused, alloc=expandable_segments"
ALLOC_SETTINGS = {"expandable_segments": "expandable_segments:True"}
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"


class FixError(ValueError):
    """A FIX that is not a plan string, or names a remedy that cannot be injected."""


@dataclass(frozen=True)
class Fix:
    """What `--try` applies: a Plan injected in-process and allocator settings for a new
    process ("expandable_segments:True")."""
    plan: Plan
    allocator: tuple[str, ...] = ()

    def __str__(self) -> str:
        parts = [] if self.plan.is_empty() else [str(self.plan)]
        parts += [f"alloc={k}" for k, v in ALLOC_SETTINGS.items() if v in self.allocator]
        return ",".join(parts)

    def environment(self, environ: dict | None = None) -> dict:
        """`environ` (default os.environ) with the allocator settings merged into
        PYTORCH_CUDA_ALLOC_CONF (a setting already there for the same key is replaced)."""
        env = dict(os.environ if environ is None else environ)
        if not self.allocator:
            return env
        keys = {s.split(":", 1)[0] for s in self.allocator}
        kept = [s for s in env.get(ALLOC_ENV, "").split(",") if s.strip() and s.split(":", 1)[0].strip() not in keys]
        env[ALLOC_ENV] = ",".join(kept + list(self.allocator))
        return env


def parse_fix(text: str) -> Fix:
    """Read a FIX: a Plan string of what can be injected, plus "alloc=expandable_segments".
    Raises FixError with a one-line reason."""
    if not isinstance(text, str) or not text.strip():
        raise FixError(f"--try needs a fix; injectable: {INJECTABLE}")
    plan_items, allocator = [], []
    for item in text.strip().lower().split(","):
        key, sep, value = (s.strip() for s in item.partition("="))
        if sep and key in ("alloc", "allocator"):
            if value not in ALLOC_SETTINGS:
                raise FixError(f"unknown allocator setting {value!r} in {text!r}; known: "
                               f"{', '.join(ALLOC_SETTINGS)}")
            if ALLOC_SETTINGS[value] in allocator:
                raise FixError(f"fix {text!r} sets alloc={value} twice")
            allocator.append(ALLOC_SETTINGS[value])
        else:
            plan_items.append(item)
    try:
        plan = Plan.parse(",".join(plan_items)) if plan_items else Plan()
    except ValueError as exc:
        raise FixError(f"{exc}; injectable: {INJECTABLE}") from None
    check_injectable(plan)
    if plan.is_empty() and not allocator:
        raise FixError(f"--try needs a fix; injectable: {INJECTABLE}")
    return Fix(plan, tuple(allocator))


def check_injectable(plan: Plan) -> None:
    """Raise FixError when a part of the plan cannot be injected into an unedited script."""
    if plan.micro_batch is not None:
        raise FixError(
            f"micro-batching (micro={plan.micro_batch}) cannot be injected without editing the script: "
            "its loop decides what a batch is and when the optimizer steps; train with "
            "memdoctor.remedies.prepare(model, optimizer, Plan(micro_batch=...)).step(batch, loss_fn)")
    if plan.zero is not None:
        raise FixError(f"zero={plan.zero} cannot be injected: ZeRO shards over several processes; "
                       "launch with torchrun and prepare(model, optimizer, Plan(zero=...))")
    if plan.precision == "bf16-true":
        raise FixError("bf16-true cannot be injected: it replaces the parameters the script's optimizer holds; "
                       "try bf16 (autocast), or prepare(model, optimizer, 'bf16-true') in the script")
    if plan.optimizer not in (None, "fused"):
        raise FixError(f"opt={plan.optimizer} cannot be injected: it replaces the optimizer object the script "
                       "keeps stepping; only opt=fused switches an optimizer in place")


# ---- the hooks ----------------------------------------------------------------------------
class Injection:
    """The installed hooks of one `injected(plan)`; `applied` says what was done, in
    words, and `problems` what could not be."""

    def __init__(self, plan: Plan, target: str | None = None, saved: dict[str, int] | None = None) -> None:
        check_injectable(plan)
        self.plan = plan
        self.target = target                    # the class of the root to checkpoint; None: the first
        self.saved = saved or {}                # what its modules saved as written: path -> bytes
        self.applied: list[str] = []
        self.problems: list[str] = []
        self._handles: list = []
        self._undo: list = []
        self._depth = 0
        self._contexts: list = []
        self._tried: dict[int, str] = {}        # top-level modules with parameters seen: id -> class
        self._done_roots = False                # every remedy that waits for a root found one
        self._precision_noted = False
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        self._installed = False

    def install(self) -> None:
        from torch.nn.modules import module as mm
        from torch.optim import optimizer as opt
        check_here(self.plan)
        if self.plan.precision is not None or self.plan.checkpointing is not None:
            self._handles.append(mm.register_module_forward_pre_hook(self._forward_pre))
            self._handles.append(mm.register_module_forward_hook(self._forward_post, always_call=True))
        if self.plan.optimizer == "fused":
            self._handles.append(opt.register_optimizer_step_pre_hook(self._step_pre))
        self._installed = True

    def remove(self) -> None:
        if self._installed:
            self.finish()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._contexts:            # a forward cut short without its post-hook
            ctx = self._contexts.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception as exc:     # the script's objects may be half gone
                log.debug("memdoctor: undoing an injection failed: %r", exc)
        self._undo.clear()
        self._installed = False

    # ---- forward -------------------------------------------------------------------------
    def _forward_pre(self, module, args):
        if _in_backward():               # a checkpointed block's recompute replays its own state
            return None
        if self._depth == 0:
            # with a target class, every model of it (CycleGAN's two generators), else the first
            more = not self._done_roots or (self.target is not None and self.plan.checkpointing is not None)
            if more and id(module) not in self._tried and next(module.parameters(), None) is not None:
                self._tried[id(module)] = type(module).__name__
                try:
                    self._new_root(module)
                except Exception as exc:       # never the script's failure: say so, run on
                    self._done_roots = True
                    self.problems.append(f"injecting into {type(module).__name__} failed: {exc!r}")
            ctx = None
            if self.plan.precision is not None:
                import torch
                from memdoctor.remedies.precision import autocast
                device = _device_of(module) or ("cuda" if torch.cuda.is_available() else "cpu")
                ctx = autocast(self.plan.precision, device)
                ctx.__enter__()
            self._contexts.append(ctx)
        self._depth += 1
        return None

    def _forward_post(self, module, args, output):
        if _in_backward() or self._depth == 0:
            return None
        self._depth -= 1
        if self._depth == 0 and self._contexts:
            ctx = self._contexts.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)
        return None

    def _new_root(self, module) -> None:
        """A top-level module with parameters, seen for the first time: checkpoint the blocks
        of each of the target class, or else of the first one that has repeated blocks (a lone
        embedding or loss module called on its own before the model is passed over)."""
        if self.plan.precision is not None and not self._precision_noted:
            self._precision_noted = True
            fp16 = self.plan.precision == "fp16"
            note = " (no loss scaler: a memory what-if; gradients may underflow)" if fp16 else ""
            self.applied.append(f"{self.plan.precision} autocast around every top-level module forward{note}")
        if self.plan.checkpointing is None:
            self._done_roots = True
            return
        from memdoctor.remedies.checkpointing import apply_checkpointing, find_blocks
        if self.target is not None and type(module).__name__ != self.target:
            return
        if not find_blocks(module):
            return
        try:
            handle = apply_checkpointing(module, self.plan.checkpointing, saved_bytes=_paths_in(module, self.saved))
        except ValueError as exc:
            self.problems.append(f"ckpt={self.plan.checkpointing} not applied to {type(module).__name__}: {exc}")
        else:
            self._undo.append(handle.undo)
            why = " (the model whose forward saved the most of what was alive as written)" if self.target else ""
            self.applied.append(f"{handle.description} of {type(module).__name__}{why}")
        self._done_roots = True

    def finish(self) -> None:
        """Say what waited for a module that never came."""
        if self.plan.checkpointing is not None and not self._done_roots:
            seen = ", ".join(sorted(set(self._tried.values()))) or "none ran"
            which = f"{self.target}, whose activations filled the memory, ran" if self.target else \
                "top-level module with repeated blocks"
            self.problems.append(f"ckpt={self.plan.checkpointing} not applied: no {which} "
                                 f"(top-level modules with parameters: {seen})")

    # ---- optimizer -----------------------------------------------------------------------
    def _step_pre(self, optimizer, args, kwargs):
        if optimizer in self._optimizers:
            return None
        self._optimizers.add(optimizer)
        try:
            how, undo = fuse_in_place(optimizer)
        except Exception as exc:               # never the script's failure: say so, run on
            self.problems.append(f"opt=fused not applied to {type(optimizer).__name__}: {exc}")
            return None
        self._undo.append(undo)
        self.applied.append(f"{type(optimizer).__name__} switched in place to {how} before its first step")
        return None


def _paths_in(root, saved: dict[str, int]) -> dict[str, int]:
    """`saved` in the root's own module paths: a run names a second model of a class by the
    variable holding it (`netD.main.0`), the root itself knows `main.0`."""
    names = {name for name, _ in root.named_modules()}
    out: dict[str, int] = {}
    for path, n in saved.items():
        path = path if path in names else path.partition(".")[2]
        if path in names:
            out[path] = out.get(path, 0) + n
    return out


def check_here(plan: Plan) -> None:
    """Raise FixError when this machine cannot run the plan (autocast in that dtype)."""
    if plan.precision is None:
        return
    import torch
    from memdoctor.remedies.precision import check_autocast
    try:
        check_autocast(plan.precision, "cuda" if torch.cuda.is_available() else "cpu")
    except ValueError as exc:
        raise FixError(str(exc)) from None


def _in_backward() -> bool:
    import torch
    return torch._C._current_graph_task_id() != -1


def _device_of(module) -> str | None:
    p = next(module.parameters(), None)
    return p.device.type if p is not None else None


def fuse_in_place(optimizer):
    """Switch an optimizer to fused=True (else foreach=False) by its param_groups' and
    defaults' flags, which torch reads at every step; returns (what, undo)."""
    import inspect

    import torch
    from memdoctor.remedies.fused import _fused_kernels_cover

    name = type(optimizer).__name__
    accepted = inspect.signature(type(optimizer).__init__).parameters
    differentiable = any(g.get("differentiable") for g in optimizer.param_groups)
    if "fused" in accepted and not differentiable and _fused_kernels_cover(optimizer):
        flags, how = {"fused": True, "foreach": None}, "fused=True"
    elif "foreach" in accepted:
        flags, how = {"foreach": False}, "foreach=False (no fused kernel here)"
        if "fused" in accepted:
            flags["fused"] = None
    else:
        raise ValueError(f"{name} takes neither fused= nor foreach=")
    before = [{k: g.get(k, _MISSING) for k in flags} for g in optimizer.param_groups]
    before_defaults = {k: optimizer.defaults.get(k, _MISSING) for k in flags}
    had_amp_flag = "_step_supports_amp_scaling" in optimizer.__dict__
    amp_flag = getattr(optimizer, "_step_supports_amp_scaling", False)
    steps = {}
    for group in optimizer.param_groups:
        group.update(flags)
    optimizer.defaults.update(flags)
    if flags.get("fused"):
        optimizer._step_supports_amp_scaling = True      # as the constructor sets it for fused=True
        for group in optimizer.param_groups:             # a fused step keeps `step` on the device, fp32
            for p in group["params"]:
                state = optimizer.state.get(p)
                step = state.get("step") if state else None
                if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                    steps[p] = step
                    state["step"] = step.to(device=p.device, dtype=torch.float32)

    def undo() -> None:
        for group, old in zip(optimizer.param_groups, before):
            _restore(group, old)
        _restore(optimizer.defaults, before_defaults)
        if had_amp_flag:
            optimizer._step_supports_amp_scaling = amp_flag
        else:
            optimizer.__dict__.pop("_step_supports_amp_scaling", None)
        for p, step in steps.items():
            state = optimizer.state.get(p)
            if state is not None and isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=step.device, dtype=step.dtype)
    return how, undo


_MISSING = object()


def _restore(mapping: dict, old: dict) -> None:
    for key, value in old.items():
        if value is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = value


def activation_root(run) -> str | None:
    """The top-level module (its class name) whose forward passes made most of the
    activations alive at the OOM, else at the peak; None when no forward saved any."""
    by_root = _saved_by_root(run)
    return max(by_root, key=lambda root: sum(by_root[root].values())) if by_root else None


def saved_by_module(run, root: str | None) -> dict[str, int]:
    """What each module of the `root` class's passes saved that was alive at the OOM, else
    at the peak: module path -> bytes, for checkpointing the run of blocks that saved most."""
    return _saved_by_root(run).get(root, {}) if root is not None else {}


def _saved_by_root(run) -> dict[str, dict[str, int]]:
    import bisect

    from memdoctor.attribution import live_blocks, peak
    calls = sorted((c["seq_start"], c["seq_end"] if c.get("seq_end") is not None else run.num_events, c["module"])
                   for c in run.meta.get("forward_calls", []))
    if not calls:
        return {}
    seq = max(run.ooms[0].seq - 1, 0) if run.ooms else peak(run)[0]
    starts = [start for start, _, _ in calls]
    by_root: dict[str, dict[str, int]] = {}
    for b in live_blocks(run, seq):
        if b.category != "activations":
            continue
        i = bisect.bisect_right(starts, b.alloc_seq) - 1
        if i >= 0 and b.alloc_seq < calls[i][1]:
            modules = by_root.setdefault(calls[i][2], {})
            modules[b.module or ""] = modules.get(b.module or "", 0) + b.nbytes
    return by_root


@contextlib.contextmanager
def injected(plan: Plan | str, target: str | None = None, saved: dict[str, int] | None = None) -> Iterator[Injection]:
    """Install the hooks that apply `plan` to whatever the code inside creates and runs;
    removed, and what they changed undone, on exit. Only what `check_injectable` allows;
    allocator settings need a new process (see `compare`). `target`: the class name of
    the top-level module to checkpoint (activation_root); None: the first with blocks."""
    if isinstance(plan, str):
        fix = parse_fix(plan)
        if fix.allocator:
            raise FixError(f"{', '.join(fix.allocator)} must be set before CUDA starts: run in a new process "
                           f"with {ALLOC_ENV} set (compare() does)")
        plan = fix.plan
    injection = Injection(plan, target, saved)
    injection.install()
    try:
        yield injection
    finally:
        injection.remove()


# ---- before and after ------------------------------------------------------------------------
@dataclass
class Tried:
    """The two runs of `compare`: the script as written, and with the fix injected."""
    fix: Fix
    before: object                  # memdoctor.run.Run
    after: object
    applied: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def compare(script: str, args: list[str] | None, fix: Fix | str, budget=None, source: str = "auto") -> Tried:
    """Trace the script as written, then with `fix` injected: in this process on the
    dispatch source, in a new one on the CUDA allocator source (a fresh caching allocator)
    or when the fix sets allocator options. The script's output goes where stdout goes."""
    import gc

    from memdoctor.capture.script import trace_script
    from memdoctor.capture.session import pick_source
    fix = parse_fix(fix) if isinstance(fix, str) else fix
    check_here(fix.plan)
    args = list(args or [])
    grouped = _process_group_up()
    before = trace_script(script, args, budget=budget, source=source).run
    gc.collect()
    if not grouped:
        _end_process_group()        # the script's own: it makes it again in the 'after' run
    target = activation_root(before) if fix.plan.checkpointing is not None else None
    saved = saved_by_module(before, target)
    # the CUDA caching allocator keeps what the first run reserved: the after starts afresh
    if fix.allocator or pick_source(source) == "allocator":
        after, applied, problems = _after_in_new_process(script, args, fix, budget, source, target, saved)
    else:
        with injected(fix.plan, target, saved) as injection:
            after = trace_script(script, args, budget=budget, source=source).run
        if not grouped:
            _end_process_group()
        applied, problems = injection.applied, injection.problems
        if not applied and not problems:
            problems = [f"{fix}: nothing to apply it to (no module forward or optimizer step ran)"]
    return Tried(fix, before, after, applied, problems)


def _process_group_up() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _end_process_group() -> None:
    """End the default process group a script made and left (one rank: a launch of several is
    refused before), so that the script can make it again when it runs a second time here."""
    import torch.distributed as dist
    if _process_group_up():
        dist.destroy_process_group()


def _after_in_new_process(script, args, fix: Fix, budget, source, target: str | None = None,
                          saved: dict[str, int] | None = None):
    """The 'after' run in `python -m memdoctor.remedies.inject` with the fix's environment;
    the script's output goes where ours goes now."""
    import torch
    from memdoctor.run import Run
    env = fix.environment()
    try:
        sys.stdout.flush()
        stdout = sys.stdout.fileno()     # under --json that is stderr
    except (AttributeError, OSError, ValueError):
        stdout = None
    with tempfile.TemporaryDirectory(prefix="memdoctor-try-") as tmp:
        out = os.path.join(tmp, "after.memrun.json.gz")
        cmd = [sys.executable, "-m", "memdoctor.remedies.inject", os.path.abspath(script),
               "--source", source, "--out", out, "--plan", str(fix.plan)]
        if budget is not None:
            cmd += ["--budget", str(int(budget))]
        if target is not None:
            cmd += ["--target", target]
        if saved:
            with open(os.path.join(tmp, "saved.json"), "w") as fh:
                json.dump(saved, fh)
            cmd += ["--saved", fh.name]
        proc = subprocess.run([*cmd, "--", *args], env=env, stdout=stdout)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"the 'after' run in a new process failed (exit {proc.returncode})")
        after = Run.load(out)
        with open(out + ".json") as fh:
            record = json.load(fh)
    applied, problems = list(record["applied"]), list(record["problems"])
    if fix.allocator:
        note = "" if torch.cuda.is_available() else " (no effect without CUDA)"
        applied.insert(0, f"{ALLOC_ENV}={env[ALLOC_ENV]} in a new process{note}")
    return after, applied, problems


def _main(argv: list[str] | None = None) -> int:
    """The 'after' run of `compare` in a new process: trace SCRIPT with --plan injected,
    save the run to --out and what was injected to --out.json; 0 unless memdoctor failed."""
    import argparse

    from memdoctor.capture.script import trace_script
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m memdoctor.remedies.inject")
    p.add_argument("script")
    p.add_argument("--plan", default="none")
    p.add_argument("--budget", type=int)
    p.add_argument("--source", default="auto")
    p.add_argument("--out", required=True)
    p.add_argument("--target", help="the class of the top-level module to checkpoint")
    p.add_argument("--saved", help="a JSON file: module path -> bytes it saved as written")
    ns = p.parse_args(argv)
    plan = Plan.parse(ns.plan)
    if plan.is_empty():
        run, applied, problems = trace_script(ns.script, script_args, budget=ns.budget, source=ns.source).run, [], []
    else:
        saved = None
        if ns.saved:
            with open(ns.saved) as fh:
                saved = json.load(fh)
        with injected(plan, ns.target, saved) as injection:
            run = trace_script(ns.script, script_args, budget=ns.budget, source=ns.source).run
        applied, problems = injection.applied, injection.problems
    run.save(ns.out)
    with open(ns.out + ".json", "w") as fh:
        json.dump({"applied": applied, "problems": problems}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
