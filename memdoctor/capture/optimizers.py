"""What the tracer notes of an optimizer besides its steps: a description the rules read,
and, under the allocator source, gradients zeroed in place.

`optimizer.zero_grad(set_to_none=False)` keeps every gradient allocated through the next
forward. The dispatch source sees the zeroing op itself; the allocator source sees no op,
so the optimizer's own zero_grad tells it: wrapped on the instance while the hooks are in,
it notes the user's line that called it and the gradients' addresses, which join the
allocator's blocks when the run is built (as the holders of those gradients).
"""
from __future__ import annotations

import sys

from memdoctor.capture.frames import first_user_frame
from memdoctor.capture.keepers import Held
from memdoctor.capture.recorder import log

HOLDER = "gradients zeroed in place"


class _Unwrap:
    """What the hooks' handle list calls to take the wrapper off an optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def remove(self) -> None:
        self.optimizer.__dict__.pop("zero_grad", None)


class ZeroGradWatch:
    def __init__(self):
        # (the user's line, the gradients' addresses) of each zero_grad(set_to_none=False)
        self.zeroing: list[tuple[tuple[str, int, str], list[int]]] = []
        self.broken = False

    def watch(self, optimizer) -> _Unwrap:
        """Wrap `optimizer.zero_grad`; returns what removes the wrapper."""
        original = optimizer.zero_grad
        note = self._note

        def zero_grad(*args, **kwargs):
            if not kwargs.get("set_to_none", args[0] if args else True):
                note(optimizer)
            return original(*args, **kwargs)
        optimizer.zero_grad = zero_grad
        return _Unwrap(optimizer)

    def _note(self, optimizer) -> None:
        if self.broken:
            return
        try:
            line = first_user_frame(sys._getframe(2))      # _note <- zero_grad <- the caller
            addresses = [p.grad.untyped_storage().data_ptr() for g in optimizer.param_groups
                         for p in g["params"] if p.grad is not None]
            if line is not None and addresses:
                self.zeroing.append((line, addresses))
        except Exception as exc:        # never the training's failure
            self.broken = True
            log.warning("memdoctor: noting gradients zeroed in place stopped: %r", exc)

    def held(self) -> list[Held]:
        """The lines that zeroed gradients in place, as holders of those gradients."""
        return [Held(*line, HOLDER, [(0, a) for a in addresses]) for line, addresses in self.zeroing]


def inner_optimizer(optimizer):
    """The optimizer a framework's wrapper steps (accelerate's AcceleratedOptimizer, which
    transformers' Trainer uses too, keeps it as `.optimizer`; Lightning's as `._optimizer`):
    its kind says what state it keeps."""
    import torch
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def describe_optimizer(optimizer) -> dict:
    """What the rules need to know: kind, implementation and the bytes it steps."""
    optimizer = inner_optimizer(optimizer)
    defaults = optimizer.defaults
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    # a frozen parameter gets no gradient, and optimizers make no state for it (peft's
    # examples hand a LoRA model's every parameter to AdamW)
    params = [p for p in everything if p.requires_grad]
    return {
        "class": type(optimizer).__name__,
        "foreach": defaults.get("foreach"),
        "fused": defaults.get("fused"),
        "momentum": defaults.get("momentum"),
        "implementations": [k for k in ("foreach", "fused") if k in defaults],   # what its constructor takes
        "history_size": defaults.get("history_size"),
        "num_params": len(params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "largest_param_bytes": max((p.numel() * p.element_size() for p in params), default=0),
        "frozen_param_bytes": sum(p.numel() * p.element_size() for p in everything if not p.requires_grad),
        "device": str(everything[0].device) if everything else "cpu",
    }


def grads_no_optimizer_steps(models: dict[int, object], optimizers,
                             names: dict[int, str]) -> tuple[list[str], list[int]]:
    """The traced models' parameters that have a gradient no optimizer holds (a loss network
    or a teacher left requiring grad: backward fills their gradients, nothing steps or frees
    them), and the models (by the order they were first seen) with parameters requiring grad,
    none of which an optimizer holds. Empty where no optimizer was seen (a hand-written
    update steps them all)."""
    stepped = {id(p) for o in optimizers if o is not None for g in o.param_groups for p in g["params"]}
    if not stepped:
        return [], []
    grads, whole = [], []
    for order, model in models.items():
        params = list(model.named_parameters()) if model is not None else []
        unstepped = [(name, p) for name, p in params if p.grad is not None and id(p) not in stepped]
        grads += [names.get(id(p), name) for name, p in unstepped]
        if any(p.requires_grad for _, p in params) and not any(id(p) in stepped for _, p in params):
            whole.append(order)     # (before its first backward, no gradient yet)
    return grads, whole


def closure_outside_the_step(rec, args: tuple, kwargs: dict):
    """`optimizer.step(closure)` (LBFGS, SAM, Lightning's automatic optimization, which hands
    every optimizer a closure running `training_step`, zero_grad and backward): the closure's
    forward, loss and backward are the training step's, not the optimizer's scratch. The
    step's pre-hook gets the closure wrapped so that the run leaves the optimizer phase while
    it runs; returns the (args, kwargs) to step with, None where there is no closure."""
    closure = kwargs.get("closure") if kwargs else None
    positional = closure is None and bool(args) and callable(args[0])
    closure = args[0] if positional else closure
    if closure is None or getattr(closure, "_memdoctor_outside_step", False):
        return None

    def outside_the_step(*a, **k):
        was = rec.in_optimizer
        rec.in_optimizer = False
        rec.mark(rec.outer_phase())
        try:
            return closure(*a, **k)
        finally:
            rec.in_optimizer = was
            rec.mark(rec.outer_phase())

    outside_the_step._memdoctor_outside_step = True
    if positional:
        return (outside_the_step, *args[1:]), kwargs
    return args, {**kwargs, "closure": outside_the_step}
