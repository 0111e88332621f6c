"""Ownership and phase hooks: who owns a storage, and where the run is.

All hooks are global (module forward hooks, optimizer step hooks) or attached to the
user's own parameters, so scripts never written for memdoctor are traced unchanged.
Every hook body is guarded: an error inside memdoctor switches that hook off and logs
once, it never reaches the training loop.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import asdict, dataclass

import torch
from torch.utils._pytree import tree_leaves

from memdoctor.run import Category, Phase
from memdoctor.capture.recorder import Recorder, log


@dataclass
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
            self.broken = True
            log.warning("memdoctor: ownership hooks stopped after an internal error: %r", exc)
            return None
    return wrapper


class OwnershipHooks:
    def __init__(self, recorder: Recorder):
        self.rec = recorder
        self.broken = False
        self.handles: list = []
        self.roots: dict[int, weakref.ref] = {}
        self.module_names: dict[int, str] = {}
        self.param_names: dict[int, str] = {}
        self.stack: list[str] = []
        self.calls: list[ForwardCall] = []
        self.optimizers: dict[int, weakref.ref] = {}
        self.optimizer_info: list[dict] = []
        self._saved = None

    # ---- install / remove -------------------------------------------------------
    def install(self) -> None:
        mm = torch.nn.modules.module
        from torch.optim import optimizer as opt
        self.handles += [
            mm.register_module_forward_pre_hook(self._forward_pre),
            mm.register_module_forward_hook(self._forward_post, always_call=True),
            opt.register_optimizer_step_pre_hook(self._step_pre),
            opt.register_optimizer_step_post_hook(self._step_post),
        ]
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved.__enter__()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._saved = None

    # ---- models and optimizers ----------------------------------------------------
    @guarded
    def adopt_model(self, root: torch.nn.Module) -> None:
        """Learn a model's module and parameter names; claim its weights."""
        if id(root) in self.roots:
            return
        self.roots[id(root)] = weakref.ref(root)
        for name, module in root.named_modules():
            self.module_names.setdefault(id(module), name or type(root).__name__)
        for name, p in root.named_parameters():
            self.param_names.setdefault(id(p), name)
            self.rec.claim(p, Category.WEIGHTS.value, name)
            if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                self.handles.append(p.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_ready, name=name)))
            if p.grad is not None:
                self.rec.claim(p.grad, Category.GRADIENTS.value, name + ".grad")
        for name, b in root.named_buffers():
            self.rec.claim(b, Category.WEIGHTS.value, name)

    @guarded
    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self.optimizers:
            self.optimizers[id(optimizer)] = weakref.ref(optimizer)
            self.optimizer_info.append(describe_optimizer(optimizer))
        self._claim_grads(optimizer)
        self._claim_state(optimizer)

    @guarded
    def find_unstepped_optimizers(self) -> None:
        """An OOM before the first `optimizer.step()` leaves the optimizer unseen by the step
        hooks; the rules still need to know it (its state is coming). Look for optimizers
        over the models' parameters once, at the end, only in that case."""
        if self.optimizers or not self.param_names:
            return
        import gc
        optimizer_type = torch.optim.Optimizer
        for obj in gc.get_objects():     # type(), not isinstance(): touches no lazy attributes
            if issubclass(type(obj), optimizer_type) and any(
                    id(p) in self.param_names for g in obj.param_groups for p in g["params"]):
                self.adopt_optimizer(obj)

    @guarded
    def claim_all_state(self) -> None:
        """Claim what optimizers hold now: a step cut short by an OOM never reaches the
        post-step hook, but the state it created is already in `optimizer.state`."""
        for ref in self.optimizers.values():
            opt = ref()
            if opt is not None:
                self._claim_state(opt)

    def _claim_grads(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.rec.claim(p.grad, Category.GRADIENTS.value, self._pname(p) + ".grad")
                self.rec.claim(p, Category.WEIGHTS.value, self._pname(p))

    def _claim_state(self, optimizer) -> None:
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.rec.claim(value, Category.OPTIMIZER_STATE.value, f"{self._pname(p)}:{key}")
        tables = getattr(optimizer, "device_tables", None)      # memdoctor's FusedAdamW
        if callable(tables):
            for name, value in tables().items():
                self.rec.claim(value, Category.OPTIMIZER_STATE.value, name)

    def _pname(self, p) -> str:
        return self.param_names.get(id(p)) or f"param{tuple(p.shape)}"

    # ---- forward ---------------------------------------------------------------------
    @guarded
    def _forward_pre(self, module, args):
        rec = self.rec
        if not self.stack and not _in_backward():   # a recompute in backward is no new pass
            if id(module) not in self.roots and any(True for _ in module.parameters()):
                self.adopt_model(module)
            for t in tree_leaves(args):
                if isinstance(t, torch.Tensor):
                    rec.claim(t, Category.INPUTS.value)
            name = self.module_names.get(id(module), type(module).__name__)
            self.calls.append(ForwardCall(len(self.calls), name, len(rec.run.actions),
                                          training=module.training,
                                          grad_enabled=torch.is_grad_enabled()))
            self.stack.append(name)
            rec.forward_depth += 1
            if not _in_backward():
                rec.mark(Phase.FORWARD.value, name)
            self.calls[-1].mark_start = len(rec.run.marks) - 1
            return None
        name = self.module_names.get(id(module), type(module).__name__)
        self.stack.append(name)
        rec.forward_depth += 1
        rec.enter_module(name)
        return None

    @guarded
    def _forward_post(self, module, args, output):
        rec = self.rec
        if not self.stack:
            return None
        self.stack.pop()
        rec.forward_depth = max(rec.forward_depth - 1, 0)
        if self.stack:
            rec.enter_module(self.stack[-1])
            return None
        call = self.calls[-1]
        call.seq_end = len(rec.run.actions)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(functools.partial(self._backward_started, call))
        if not _in_backward():
            rec.mark(rec.outer_phase())
        call.mark_end = len(rec.run.marks) - 1
        return None

    def _backward_started(self, call: ForwardCall, grad_outputs):
        """Backward reached this forward's output: it is back-propagated."""
        call.backward = True
        try:
            if self.rec.phase != Phase.BACKWARD.value:
                self.rec.mark(Phase.BACKWARD.value)
        except Exception as exc:
            log.warning("memdoctor: backward mark failed: %r", exc)
        return None

    # ---- backward -------------------------------------------------------------------
    def _pack(self, tensor):
        """Must hand the tensor back whatever happens, or autograd would lose it."""
        self._claim_saved(tensor)
        return tensor

    @guarded
    def _claim_saved(self, tensor):
        self.rec.claim(tensor, Category.ACTIVATIONS.value)

    @guarded
    def _grad_ready(self, param, name: str):
        if param.grad is not None:
            self.rec.claim(param.grad, Category.GRADIENTS.value, name + ".grad")

    # ---- optimizer ------------------------------------------------------------------
    @guarded
    def _step_pre(self, optimizer, args, kwargs):
        self.rec.in_optimizer = True
        self.rec.mark(Phase.OPTIMIZER.value)
        self.adopt_optimizer(optimizer)

    @guarded
    def _step_post(self, optimizer, args, kwargs):
        self._claim_state(optimizer)
        self.rec.in_optimizer = False
        self.rec.step += 1
        self.rec.mark(self.rec.outer_phase())

    # ---- after the run ------------------------------------------------------------------
    def forward_calls(self) -> list[dict]:
        return [asdict(c) for c in self.calls]


def describe_optimizer(optimizer) -> dict:
    """What the rules need to know: kind, implementation and the bytes it steps."""
    defaults = optimizer.defaults
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        "class": type(optimizer).__name__,
        "foreach": defaults.get("foreach"),
        "fused": defaults.get("fused"),
        "momentum": defaults.get("momentum"),
        "num_params": len(params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "largest_param_bytes": max((p.numel() * p.element_size() for p in params), default=0),
        "device": str(params[0].device) if params else "cpu",
    }


def _unpack(tensor):
    return tensor


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
