"""Ownership and phase hooks: who owns a storage, and where the run is.

All hooks are global (module forward hooks, optimizer step hooks) or attached to the
user's own parameters, so scripts never written for memdoctor are traced unchanged.
Every hook body is guarded: an error inside memdoctor switches that hook off and logs
once, it never reaches the training loop.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from dataclasses import dataclass, fields
from operator import attrgetter

import torch

from memdoctor.run import Category, Phase
from memdoctor.capture.callargs import call_kwargs as _call_kwargs, tensors_in as _tensors
from memdoctor.capture.frames import first_user_frame
from memdoctor.capture.recorder import Recorder, log
from memdoctor.capture.saved_tensors import pop_saved_hooks, unpack_checked
from memdoctor.capture import frameworks
from memdoctor.capture.block_lists import block_lists
from memdoctor.capture.checkpoint_seen import CheckpointSeen
from memdoctor.capture.root_names import root_prefix
from memdoctor.capture.storages import storage_key as _storage_key, storage_of as _storage_of
from memdoctor.capture.optimizers import ZeroGradWatch, closure_outside_the_step, describe_optimizer, inner_optimizer
from memdoctor.capture.stepaside import hooks_disabled, step_aside_for, stop_stepping_aside_for

DATASET_ROWS = 4        # an input taken from a storage this many times its size: a dataset's slice
_FORWARD, _BACKWARD, _OPTIMIZER = Phase.FORWARD.value, Phase.BACKWARD.value, Phase.OPTIMIZER.value
_INPUTS, _ACTIVATIONS = Category.INPUTS.value, Category.ACTIVATIONS.value
# a C++ guard: a detach under it costs about a microsecond, through the dispatch source's mode ten
_NO_PYTHON_DISPATCH = getattr(torch._C, "_DisableTorchDispatch", contextlib.nullcontext)


@dataclass(slots=True)
class ForwardCall:
    """One outermost module call: the unit that is, or never is, back-propagated."""
    index: int
    module: str
    seq_start: int
    seq_end: int | None = None
    training: bool = True
    grad_enabled: bool = True
    backward: bool = False
    mark_start: int = 0
    mark_end: int | None = None
    params: bool = False        # the module holds parameters: a model, not a transform or a loss
    graph: bool = False         # its output carries an autograd graph (grad mode on, something to save)
    model: int = -1             # which model object ran (calls of one model share it; two of one class do not)
    site: list | None = None    # [file, line, function]: the user's line that called it
    input_grad: bool = False    # an input requires grad (a loss network on a model's output)


def guarded(method):
    """Run a hook body; on an internal error, log once and turn the hook set off."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.broken:
            return None
        try:
            return method(self, *args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            self.stop_after(exc)
            return None
    return wrapper


STAMP_DEPTH = 3     # allocator source: modules this deep (model, its parts, their blocks) tag blocks


class OwnershipHooks:
    """`light`: no global module hooks, no saved-tensor or per-parameter hooks; the models'
    outermost calls are hooked on the models themselves (found by a global pre-hook that is
    removed as soon as one is adopted), so every inner module call stays on PyTorch's fast
    path. Owners are then joined by address from the models and optimizers alone.
    `saved_tensors=False`: no saved-tensor hooks (the allocator source tells what backward
    keeps from the blocks' lifetimes instead)."""

    def __init__(self, recorder: Recorder, light: bool = False, saved_tensors: bool = True):
        self.rec = recorder
        self.light = light
        self.saved_tensors = saved_tensors and not light
        self._discovery = None
        self._state_sizes: dict[int, int] = {}
        self._param_counts: dict[int, int] = {}     # optimizer -> parameters it steps, when last claimed
        self.broken = False
        self.handles: list = []
        self.roots: dict[int, weakref.ref] = {}
        self.root_order: dict[int, int] = {}       # id of a model -> the order it was first seen in
        self.module_names: dict[int, str] = {}
        self.frameworks: set[str] = set()           # training frameworks seen driving the run
        self.ddp: list[dict] = []                    # DistributedDataParallel wrappers: their buckets
        self.recomputed: set[str] = set()           # modules a backward called (checkpointing's recompute)
        self.block_counts: dict[str, int] = {}      # a list of repeated blocks ("blocks" of blocks.0-11) -> its length
        self.checkpointed = CheckpointSeen()        # blocks seen running inside a checkpoint in the forward
        self._module_paths: set[str] = set()        # the models' module paths so far, prefixed as named
        self.param_names: dict[int, str] = {}
        self.stack: list[str] = []
        self.calls: list[ForwardCall] = []
        self.optimizers: dict[int, weakref.ref] = {}
        self.optimizer_info: list[dict] = []
        self.optimizer_steps = 0
        self.backward_ends: list[int] = []       # mark index where each backward() call ended
        self._queued_task = None
        self._outputs: dict[int, weakref.ref] = {}   # storages of the last forward outputs
        self.sliced: dict[tuple[str, int], int] = {}  # storage -> rows of the largest input sliced from it
        self._parameterless: dict[int, weakref.ref] = {}
        self._saved = None
        self._stepping_aside = False
        self.removed = False
        self.zero_grads = ZeroGradWatch()      # allocator source: gradients zeroed in place
        # how a saved tensor of a subclass is aliased; None: its own detach, through every mode.
        # The estimate's fake tensors are aliased without dispatch (DataDependent.alias)
        self.alias_subclass = None

    def stop_after(self, exc: Exception) -> None:
        """An internal error in a hook: log it once and turn the hook set off."""
        self.broken = True
        log.warning("memdoctor: ownership hooks stopped after an internal error: %r", exc)

    # ---- install / remove -------------------------------------------------------
    def install(self) -> None:
        """Register the global hooks, one at a time, so that remove() undoes exactly what
        got installed should one fail. Where saved-tensor hooks are switched off (inside
        torch.func, or a disable_saved_tensors_hooks block) none is pushed: what autograd
        saves then counts as temporaries."""
        mm = torch.nn.modules.module
        from torch.optim import optimizer as opt
        self.handles.append(opt.register_optimizer_step_pre_hook(self._step_pre))
        self.handles.append(opt.register_optimizer_step_post_hook(self._step_post))
        if self.light:
            self._discovery = mm.register_module_forward_pre_hook(self._discover)
            self.handles.append(self._discovery)
            return
        self.handles.append(mm.register_module_forward_pre_hook(self._forward_pre))
        self.handles.append(mm.register_module_forward_hook(self._forward_post, always_call=True))
        if not self.saved_tensors:
            return
        if hooks_disabled():
            log.warning("memdoctor: saved-tensor hooks are switched off here; tensors saved for "
                        "backward count as temporaries")
            return
        saved = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack_checked)
        saved.__enter__()
        self._saved = saved
        step_aside_for(self._pack)
        self._stepping_aside = True

    def remove(self) -> None:
        """Remove every hook installed, each whatever the others do; safe to call again."""
        self.removed = True
        failure = None
        while self.handles:
            try:
                self.handles.pop().remove()
            except Exception as exc:
                failure = failure or exc
        if self._stepping_aside:
            try:
                stop_stepping_aside_for(self._pack)
                self._stepping_aside = False
            except Exception as exc:
                failure = failure or exc
        if self._saved is not None:
            pop_saved_hooks(self._pack)
            self._saved = None
        if failure is not None:
            raise failure

    # ---- models and optimizers ----------------------------------------------------
    @guarded
    def adopt_model(self, root: torch.nn.Module) -> None:
        """Learn a model's module and parameter names (a second model of a class already seen
        prefixed: memdoctor.capture.root_names); claim its weights."""
        if id(root) in self.roots:
            return
        pre = root_prefix(root, self._module_paths, [r() for r in self.roots.values()], sys._getframe(2))
        self.roots[id(root)] = weakref.ref(root)
        self.frameworks |= frameworks.of_model(root)
        self.ddp += frameworks.ddp_buckets(root)
        self.block_counts.update({(pre + c).rstrip("."): n for c, n in block_lists(root).items()})
        self.checkpointed.add_blocks(root, self.block_counts, pre)
        self.root_order[id(root)] = len(self.root_order)
        if self.light:
            self._hook_root(root)
        by_address = self.rec.claims is not None     # the allocator source joins grads by address
        for name, module in root.named_modules():
            self.module_names.setdefault(id(module), pre + name if name else type(root).__name__)
            self._module_paths.add(pre + name)
        for name, p in root.named_parameters():
            name = pre + name
            self.param_names.setdefault(id(p), name)
            self.rec.claim(p, Category.WEIGHTS.value, name)
            if p.requires_grad and not by_address and hasattr(p, "register_post_accumulate_grad_hook"):
                self.handles.append(p.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_ready, name=name)))
            if p.grad is not None:
                self.rec.claim(p.grad, Category.GRADIENTS.value, name + ".grad")
        for name, b in root.named_buffers():
            self.rec.claim(b, Category.WEIGHTS.value, pre + name)

    def _hook_root(self, root: torch.nn.Module) -> None:
        """Light mode: this model's own outermost-call hooks, and no more discovery."""
        self.handles.append(root.register_forward_pre_hook(self._forward_pre))
        self.handles.append(root.register_forward_hook(self._forward_post, always_call=True))
        if self._discovery is not None:
            self._discovery.remove()
            self._discovery = None

    @guarded
    def _discover(self, module, args):
        """Light mode: the first model called with parameters is adopted (and hooked)."""
        if not self.roots and not _in_backward() and self._holds_parameters(module):
            self.adopt_model(module)
            self._forward_pre(module, args)

    @guarded
    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Claim what the optimizer steps: weights and state when it is first seen or steps
        more parameters, the gradients (made anew each backward) at every step; the state a
        step makes or replaces is claimed after it (`_step_post`). A framework's wrapper is
        the optimizer it wraps (found both ways, it is one)."""
        self.frameworks |= frameworks.of_optimizer(optimizer)
        optimizer = inner_optimizer(optimizer)
        first = id(optimizer) not in self.optimizers
        if first:
            self.optimizers[id(optimizer)] = weakref.ref(optimizer)
            self.optimizer_info.append(describe_optimizer(optimizer))
            if self.rec.claims is not None:
                self.handles.append(self.zero_grads.watch(optimizer))
        params = sum(len(group["params"]) for group in optimizer.param_groups)
        grown = self._param_counts.get(id(optimizer)) != params     # first seen, or a group added
        self._param_counts[id(optimizer)] = params
        self._claim_grads(optimizer, weights=grown)
        if grown:
            self._claim_state(optimizer)

    @guarded
    def find_unstepped_optimizers(self, after_oom: bool) -> None:
        """An OOM before an optimizer's first `step()` (the only one, or a GAN's second) leaves it
        unseen by the step hooks; the rules still need to know it (its state is coming). Look for
        optimizers over the models' parameters once, at the end, only in that case."""
        if (self.optimizers and not after_oom) or not self.param_names:
            return
        import gc
        optimizer_type = torch.optim.Optimizer
        for obj in gc.get_objects():     # type(), not isinstance(): touches no lazy attributes
            if issubclass(type(obj), optimizer_type) and id(obj) not in self.optimizers and any(
                    id(p) in self.param_names for g in obj.param_groups for p in g["params"]):
                self.adopt_optimizer(obj)

    @guarded
    def claim_idle_modules(self) -> None:
        """Modules never called while tracing (EMA copies, a teacher kept for later) still
        hold their parameters and buffers: found once at the end, where a model was traced,
        and claimed as weights under their class and attribute names."""
        if not self.roots:
            return
        import gc
        module_type = torch.nn.Module
        live = self.rec.live if self.rec.claims is None else None   # the dispatch source's storages
        for obj in gc.get_objects():     # type(), not isinstance(): touches no lazy attributes
            if not issubclass(type(obj), module_type) or id(obj) in self.module_names:
                continue
            for kind in ("_parameters", "_buffers"):
                tensors = obj.__dict__.get(kind)
                for name, t in (tensors.items() if isinstance(tensors, dict) else ()):
                    if not isinstance(t, torch.Tensor) or id(t) in self.param_names:
                        continue
                    if live is not None and _storage_key(t) not in live:
                        continue        # made before the trace or elsewhere: not this run's memory
                    self.rec.claim(t, Category.WEIGHTS.value, f"{type(obj).__name__}.{name} (not called)")

    @guarded
    def claim_all_state(self) -> None:
        """Claim what optimizers hold now: a step cut short by an OOM never reaches the
        post-step hook, but the state it created is already in `optimizer.state`."""
        for ref in self.optimizers.values():
            opt = ref()
            if opt is not None:
                self._claim_state(opt)

    def _claim_grads(self, optimizer, weights: bool = True) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.rec.claim_again(p.grad, Category.GRADIENTS.value, lambda: self._pname(p) + ".grad")
                if weights:
                    self.rec.claim_again(p, Category.WEIGHTS.value, lambda: self._pname(p))

    def _claim_state(self, optimizer, only_if_grown: bool = False) -> None:
        if only_if_grown:       # LBFGS keeps its history in lists that grow a step at a time
            size = sum(len(v) if isinstance(v, list) else 1 for state in optimizer.state.values() for v in state.values())
            if self._state_sizes.get(id(optimizer)) == size:
                return
            self._state_sizes[id(optimizer)] = size
        for p, state in optimizer.state.items():
            for key, value in state.items():
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor):
                        self.rec.claim_again(t, Category.OPTIMIZER_STATE.value, lambda: f"{self._pname(p)}:{key}")
        tables = getattr(optimizer, "device_tables", None)      # memdoctor's FusedAdamW
        if callable(tables):
            for name, value in tables().items():
                self.rec.claim(value, Category.OPTIMIZER_STATE.value, name)

    def _pname(self, p) -> str:
        return self.param_names.get(id(p)) or f"param{tuple(p.shape)}"

    # ---- forward ---------------------------------------------------------------------
    # The two global module hooks run at every module call (a transform's, once a sample):
    # each guards itself as `guarded` would, whose wrapper would cost about as much again.
    def _forward_pre(self, module, args):
        if self.broken:
            return None
        try:
            if not self.stack and _graph_task() == -1:    # a recompute in backward is no new pass
                if not self._passes_through(module, args):
                    self._outermost_pre(module, args)
            else:
                self._inner_pre(module)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            self.stop_after(exc)
        return None

    def _passes_through(self, module, args) -> bool:
        """An outermost call of a module without parameters that can build no graph (grad
        mode off, or no positional input that requires grad): a transform applied to each
        sample as a dataset is preloaded, a metric, a loss under no_grad. It is no pass of a
        model: no ForwardCall, no marks, and what it makes belongs to the phase around it
        (a dataset made sample by sample is made outside any forward). Its post-hook finds
        the stack empty and does nothing; a model it runs inside is an outermost call of its
        own."""
        if self._holds_parameters(module):
            return False
        if not _grad_enabled():
            return True
        for t in _tensors(args):
            if t.requires_grad:
                return False
        return True

    def _outermost_pre(self, module, args) -> None:
        """An outermost call starts: claim its inputs, open its ForwardCall, mark it."""
        rec = self.rec
        if id(module) not in self.roots and self._holds_parameters(module):
            self.adopt_model(module)
        kwargs = _call_kwargs(3)        # _call_kwargs <- here <- _forward_pre <- torch's inner
        inputs = _tensors(args) + _tensors(kwargs) if kwargs else _tensors(args)
        for t in inputs:
            self._claim_input(t)
        name = self.module_names.get(id(module), type(module).__name__)
        calls = self.calls
        site = first_user_frame(sys._getframe(1))    # the caller of the module, outwards from the hook
        if len(calls) < 8:
            self.frameworks |= frameworks.of_frames(sys._getframe(1))
        # positional: index, module, seq_start, seq_end, training, grad_enabled, backward,
        # mark_start, mark_end, params, graph, model, site
        call = ForwardCall(len(calls), name, len(rec.run.actions), None, module.training,
                           _grad_enabled(), False, 0, None, id(module) in self.roots, False,
                           self.root_order.get(id(module), -1), list(site) if site else None)
        call.input_grad = any(t.requires_grad for t in inputs)
        calls.append(call)
        self.stack.append(name)
        rec.forward_depth += 1
        rec.mark(_FORWARD, name)
        call.mark_start = len(rec.run.marks) - 1

    def _inner_pre(self, module) -> None:
        """A call inside another (or a recompute in backward): the module running now."""
        name = self.module_names.get(id(module), type(module).__name__)
        if not self.stack and len(self.recomputed) < 4096:
            self.recomputed.add(name)       # outermost in backward: checkpointing recomputes it
        self.checkpointed.check(module)
        self.stack.append(name)
        rec = self.rec
        rec.forward_depth += 1
        if rec.on_mark is None or len(self.stack) <= STAMP_DEPTH:   # a tag costs a call into CUDA's allocator
            rec.enter_module(name)

    def _claim_input(self, t: torch.Tensor) -> None:
        """A tensor handed to an outermost call is an input, unless a forward made it."""
        storage = _storage_of(t)        # asked once: each call makes a new Python object
        if self._made_by_forward(t, storage):
            return
        self._claim_as(t, storage, _INPUTS)
        if storage is not None and storage.nbytes() >= DATASET_ROWS * max(t.nbytes, 1):
            self._note_slice(t, storage)     # a small view of a large storage

    def _forward_post(self, module, args, output):
        if self.broken:
            return None
        try:
            self._post(output)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            self.stop_after(exc)
        return None

    def _post(self, output) -> None:
        """A module call ends: the outermost one closes its ForwardCall and notes its outputs."""
        rec = self.rec
        if not self.stack:
            return None
        self.stack.pop()
        rec.forward_depth = max(rec.forward_depth - 1, 0)
        if self.stack:
            if rec.on_mark is None or len(self.stack) < STAMP_DEPTH:
                rec.enter_module(self.stack[-1])
            return None
        call = self.calls[-1]
        call.seq_end = len(rec.run.actions)
        self._outputs.clear()
        for t in _tensors(output):
            self._note_output(t)
            if t.grad_fn is not None:
                call.graph = True
                t.grad_fn.register_prehook(functools.partial(self._backward_started, call))
        if _graph_task() == -1:
            rec.mark(rec.outer_phase())
        call.mark_end = len(rec.run.marks) - 1
        return None

    def _note_output(self, t: torch.Tensor) -> None:
        """Remember the output's storage by a weak reference: the recorder's own for it where
        it has one (no new object a call), else a new one."""
        try:
            storage = t.untyped_storage()
            key = storage._cdata
            entry = self.rec.live.get(key)
            self._outputs[key] = entry if entry is not None else weakref.ref(storage)
        except Exception:
            pass

    def _holds_parameters(self, module) -> bool:
        """Asked at every outermost call (a transform runs once a sample): walked once a
        module, the answer kept while that module lives."""
        known = self._parameterless.get(id(module))
        if known is not None and known() is module:
            return False
        if any(True for _ in module.parameters()):
            return True
        self._parameterless[id(module)] = weakref.ref(module)
        return False

    def _note_slice(self, t: torch.Tensor, storage) -> None:
        """An input that is a small view of a large storage (a batch sliced from a dataset
        held whole, DATASET_ROWS times its size or more): remember the storage (its block, or
        its address under the allocator source) and the rows taken from it."""
        entry = self.rec.live.get(storage._cdata)
        key = ("block", entry.id) if entry is not None else ("address", storage.data_ptr())
        rows = t.shape[0] if t.dim() else 1
        self.sliced[key] = max(self.sliced.get(key, 0), rows)

    def sliced_inputs(self) -> list[dict]:
        return [{kind: value, "rows": rows} for (kind, value), rows in self.sliced.items()]

    def _made_by_forward(self, t: torch.Tensor, storage) -> bool:
        """A model's output handed on (to an nn.Module loss, to a second model) is no input:
        it carries a graph, or it is (a view of) the last forward's output."""
        if t.grad_fn is not None:
            return True
        if storage is None:
            return False
        ref = self._outputs.get(storage._cdata)
        return ref is not None and ref() is not None

    def _backward_started(self, call: ForwardCall, grad_outputs):
        """Backward reached this forward's output: it is back-propagated (a backward after
        the trace ended finds the hooks removed and changes nothing)."""
        if self.removed:
            return None
        call.backward = True
        try:
            if self.rec.phase != _BACKWARD:
                self.rec.mark(_BACKWARD)
            task = torch._C._current_graph_task_id()
            if task != self._queued_task:       # one end mark per backward() call
                self._queued_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        except Exception as exc:
            log.warning("memdoctor: backward mark failed: %r", exc)
        return None

    def _backward_ended(self):
        """The backward() call finished: a step boundary when no optimizer steps are seen."""
        try:
            rec = self.rec
            rec.mark()      # the phase stays: the engine still holds its seed gradient here
            self.backward_ends.append(len(rec.run.marks) - 1)
            if rec.claims is not None and not self.optimizers:    # a hand-written update: no step hook claims the grads
                self._claim_model_grads()
                if rec.on_step_end is not None:
                    rec.on_step_end()
        except Exception as exc:
            log.warning("memdoctor: backward end mark failed: %r", exc)

    def _claim_model_grads(self) -> None:
        for ref in self.roots.values():
            root = ref()
            for name, p in (root.named_parameters() if root is not None else ()):
                if p.grad is not None:
                    self.rec.claim(p.grad, Category.GRADIENTS.value, name + ".grad")

    # ---- backward -------------------------------------------------------------------
    def _pack(self, tensor):
        """Must hand the tensor back whatever happens, or autograd would lose it: a detached
        alias (same storage). The tensor object itself, when it is the output of the node
        saving it, would make a reference cycle through that node that keeps a graph nobody
        back-propagates (an evaluation without no_grad) alive after the script drops it.
        Runs for nearly every op of a forward, so `guarded`'s wrapper is written out here.
        With the alias goes its version: autograd checks no saved tensor that hooks handle
        for a change in place, so `unpack_checked` does, as autograd would have."""
        if not self.broken:
            try:
                self._claim_as(tensor, _storage_of(tensor), _ACTIVATIONS)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                self.stop_after(exc)
        if type(tensor) is torch.Tensor:
            with _NO_PYTHON_DISPATCH():    # an alias, no op of the traced run: not through a dispatch mode
                return tensor.detach(), tensor._version
        if self.alias_subclass is not None:
            try:
                return self.alias_subclass(tensor), tensor._version
            except Exception as exc:
                self.alias_subclass = None
                log.warning("memdoctor: aliasing a saved tensor failed, detaching instead: %r", exc)
        return tensor.detach(), tensor._version      # a subclass (a fake tensor) needs its own dispatch

    def _claim_as(self, t: torch.Tensor, storage, category: str) -> None:
        """`claim(t, category)`; a storage counted already (nearly always: an op's output, a
        weight) the short way."""
        if storage is None or not self.rec.claim_counted(t, storage, category):
            self.rec.claim(t, category, storage=storage)

    @guarded
    def _grad_ready(self, param, name: str):
        if param.grad is not None:
            self.rec.claim(param.grad, Category.GRADIENTS.value, name + ".grad")

    # ---- optimizer ------------------------------------------------------------------
    @guarded
    def _step_pre(self, optimizer, args, kwargs):
        self.rec.in_optimizer = True
        self.optimizer_steps += 1        # counted as it starts: a first step the OOM cut short is one
        self.rec.mark(_OPTIMIZER)
        self.adopt_optimizer(optimizer)
        return closure_outside_the_step(self.rec, args, kwargs)

    @guarded
    def _step_post(self, optimizer, args, kwargs):
        self._claim_state(optimizer, only_if_grown=self.rec.claims is not None)
        if self.rec.on_step_end is not None:
            self.rec.on_step_end()
        self.rec.in_optimizer = False
        self.rec.step += 1
        self.rec.mark(self.rec.outer_phase())

    # ---- after the run ------------------------------------------------------------------
    def forward_calls(self) -> list[dict]:
        names = [f.name for f in fields(ForwardCall)]
        values = attrgetter(*names)
        return [dict(zip(names, values(c))) for c in self.calls]

    def step_starts(self) -> tuple[str, list[int]]:
        """What the script repeats, as mark indices where a step begins: optimizer steps
        (numbered as they run, so none here), else the ends of backward() calls (a hand-written
        update such as `p.data.add_(p.grad, alpha=-lr)`), else the calls of the model called
        most often (a loop with no backward at all)."""
        if self.optimizer_steps:
            return "optimizer", []
        if self.backward_ends:
            return "backward", list(self.backward_ends)
        models = [c for c in self.calls if c.params]
        if not models:
            return "none", []
        counts: dict[str, int] = {}
        for c in models:
            counts[c.module] = counts.get(c.module, 0) + 1
        top = max(counts, key=counts.get)
        return "forward", [c.mark_start for c in models if c.module == top][1:]


_graph_task = torch._C._current_graph_task_id      # -1 outside autograd's engine
_grad_enabled = torch.is_grad_enabled


def _in_backward() -> bool:
    return _graph_task() != -1
