"""Swap the optimizer for its fused implementation.

The default multi-tensor ("foreach") step allocates temporaries the size of a whole
parameter group; a fused step updates each tensor in one kernel without them. Where a class
has no fused kernel for the device, foreach=False (one tensor at a time) avoids the same
temporaries, more slowly.
"""
from __future__ import annotations

import logging

import torch

from memdoctor.remedies._handle import Handle

log = logging.getLogger("memdoctor")


class OptimizerSwap(Handle):
    """The new optimizer in `.optimizer`; undo loads its state back into the old one.

    Build learning-rate schedulers on `.optimizer`: one built on the old object would
    change a learning rate nothing reads.
    """

    def __init__(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer, description: str) -> None:
        self.old = old
        self.optimizer = new
        self._flags = [{k: g.get(k) for k in ("fused", "foreach")} for g in old.param_groups]
        self._step_placement = {
            id(p): (s["step"].device, s["step"].dtype)
            for p, s in old.state.items()
            if isinstance(s.get("step"), torch.Tensor)
        }
        super().__init__(description, self._load_back)

    def _load_back(self) -> None:
        state = self.optimizer.state_dict()
        for group, flags in zip(state["param_groups"], self._flags):
            group.update(flags)
        self.old.load_state_dict(state)
        fused_or_capturable = {
            id(p) for g in self.old.param_groups if g.get("fused") or g.get("capturable") for p in g["params"]
        }
        for p, s in self.old.state.items():
            step = s.get("step")
            if not isinstance(step, torch.Tensor) or id(p) in fused_or_capturable:
                continue
            device, dtype = self._step_placement.get(id(p), (torch.device("cpu"), step.dtype))
            s["step"] = step.to(device=device, dtype=dtype)


def _move_step_hooks(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Hooks registered on the old optimizer (bf16 master weights, the user's) keep running."""
    for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if hasattr(old, attr) and hasattr(new, attr):
            getattr(new, attr).update(getattr(old, attr))


def _fused_kernels_cover(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter's device has fused kernels: torch checks only at the first
    step, too late to fall back."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return True
    devices = set(_get_fused_kernels_supported_devices())
    return all(p.device.type in devices and p.is_floating_point()
               for g in optimizer.param_groups for p in g["params"])


def _rebuild(optimizer: torch.optim.Optimizer, fused: bool) -> torch.optim.Optimizer:
    if fused and not _fused_kernels_cover(optimizer):
        raise RuntimeError("no fused kernels for these parameters' devices or dtypes")
    flags = {"fused": True, "foreach": None} if fused else {"foreach": False}
    groups = [{**{k: v for k, v in g.items() if k not in ("fused", "foreach")}, **flags} for g in optimizer.param_groups]
    new = type(optimizer)(groups, **flags)
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group.update(flags)
    new.load_state_dict(state)
    return new


def use_fused_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerSwap:
    """Rebuild the optimizer's class with fused=True (else foreach=False), carrying over
    param_groups hyperparameters, state and step hooks."""
    name = type(optimizer).__name__
    try:
        new, how = _rebuild(optimizer, fused=True), "fused=True"
    except (TypeError, RuntimeError, ValueError) as fused_error:
        try:
            new, how = _rebuild(optimizer, fused=False), "foreach=False (no fused kernel here)"
        except (TypeError, RuntimeError, ValueError):
            raise ValueError(f"{name} takes neither fused= nor foreach=: {fused_error}") from fused_error
    _move_step_hooks(optimizer, new)
    handle = OptimizerSwap(optimizer, new, f"{name} rebuilt with {how}")
    optimizer.state.clear()  # the new optimizer holds it now; two holders could double it
    log.info("memdoctor: %s", handle.description)
    return handle
