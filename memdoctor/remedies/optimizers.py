"""Optimizer swaps: a fused step, AdamW with bf16 or 8-bit states, or the step in backward.

`swap_optimizer(model, optimizer, name)` returns `(new_optimizer, handle)`; train with the
new optimizer (and build learning-rate schedulers on it), and `handle.undo()` puts the
user's optimizer back with the state the new one built (dequantized to fp32 for the 8-bit
and bf16 states, so an undo after training with them is lossy by their rounding).

- "fused": torch's own fused=True kernel where the optimizer's class and device have one
  (memdoctor.remedies.fused); else, for Adam/AdamW, memdoctor's FusedAdamW with fp32
  states; else the class rebuilt with foreach=False. Same math, no multi-tensor
  temporaries (foreach's step allocates a copy the size of all parameters).
- "adamw-bf16": FusedAdamW with bf16 states, stochastically rounded: 4 bytes a parameter
  of state instead of 8.
- "adamw-8bit": FusedAdamW with blockwise 8-bit states (256 elements a block, an fp32
  absmax scale a block): about 2 bytes a parameter instead of 8.
- "in-backward": each parameter is stepped by a hook the moment its gradient is complete
  (`register_post_accumulate_grad_hook`), and its gradient freed at once, so the whole
  model's gradients never exist together: the peak loses up to the size of all gradients
  but one. `optimizer.step()` and `zero_grad()` become no-ops, so training loops written
  for an ordinary optimizer run unchanged. "in-backward-8bit" is the same with the
  blockwise 8-bit states: the least memory of all (weights, ~2 bytes a parameter of state,
  one gradient). What does not combine with either:
    * gradient accumulation over micro-batches (several backward passes per step): each
      backward would step. Asking for it (a plan with micro=...) raises ValueError, and a
      second backward reaching a parameter before `step()` raises RuntimeError;
    * clipping by the whole model's gradient norm: no moment has all the gradients
      (`clip_grad_norm_` after backward sees none and clips nothing);
    * fp16 with a loss scaler (the update would use scaled gradients and could not be
      skipped on inf/nan): ValueError; bf16 autocast is fine;
    * an optimizer that steps tensors other than the model's parameters (bf16-true master
      weights): ValueError;
    * DDP / FSDP, whose reducers own the gradients after backward.

Only Adam-family optimizers (torch.optim.Adam, AdamW, FusedAdamW) can become "adamw-bf16",
"adamw-8bit" or "in-backward": their learning rate, betas, eps and weight decay (decoupled
for AdamW, L2 for Adam) are copied per param group, with their state. amsgrad is refused.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from memdoctor.cuda.kernels.adamw import FusedAdamW
from memdoctor.remedies._handle import Handle

log = logging.getLogger("memdoctor")

NAMES = ("fused", "adamw-8bit", "adamw-bf16", "in-backward", "in-backward-8bit")
IN_BACKWARD = ("in-backward", "in-backward-8bit")
_STATE_DTYPE = {"adamw-8bit": "int8", "adamw-bf16": "bf16", "in-backward": "fp32", "in-backward-8bit": "int8",
                "fused": "fp32"}
_HYPER = ("lr", "betas", "eps", "weight_decay")


class InBackwardAdamW(FusedAdamW):
    """FusedAdamW whose update runs inside backward, one parameter at a time.

    A post-accumulate-grad hook on every trainable parameter steps it from its gradient
    and sets `param.grad = None`. `step()` (it still runs a closure and the step hooks)
    and `zero_grad()` do nothing more. A second gradient reaching a parameter before
    `step()` or `zero_grad()` is an error: gradient accumulation does not combine with
    stepping in backward. `remove_hooks()` turns the hooks off.
    """

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._group_index: dict[int, int] = {}
        self._stepped: set[int] = set()
        self._hooks: list = []
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_index[id(p)] = index
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if id(p) in self._stepped:
            raise RuntimeError(
                "memdoctor in-backward optimizer: a parameter received a second gradient "
                "before optimizer.step(); gradient accumulation over several backward "
                "passes (micro-batches) does not combine with stepping in backward. Call "
                "optimizer.step() after each backward, or use opt=adamw-8bit / fused."
            )
        self._stepped.add(id(p))
        self.update_param(p, self.param_groups[self._group_index[id(p)]])
        p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepped.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stepped.clear()
        for group in self.param_groups:       # normally none: freed in backward
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


class SwappedOptimizer(Handle):
    """The new optimizer in `.optimizer`, the user's in `.old`; undo gives the old one
    its hyperparameters and state back (and removes in-backward hooks)."""

    def __init__(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer, description: str,
                 moved_state: dict) -> None:
        self.old = old
        self.optimizer = new
        self._moved_state = moved_state
        super().__init__(description, self._restore)

    def _restore(self) -> None:
        new, old = self.optimizer, self.old
        if hasattr(new, "remove_hooks"):
            new.remove_hooks()
        for old_group, new_group in zip(old.param_groups, new.param_groups):
            for key in _HYPER:
                if isinstance(old_group.get(key), torch.Tensor) and not isinstance(new_group[key], torch.Tensor):
                    old_group[key].fill_(new_group[key])
                else:
                    old_group[key] = new_group[key]
        for group in old.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = new.fp32_state(p)
                moved = self._moved_state.get(id(p))
                if state is None or (moved is not None and _step_of(state) == _step_of(moved)):
                    if moved is not None:   # never stepped since: exactly as it was, not requantized
                        old.state[p] = moved
                    continue
                if isinstance(old, FusedAdamW):
                    old.load_fp32_state(p, state["step"].item(), state["exp_avg"], state["exp_avg_sq"])
                    continue
                step = state["step"].to(torch.float32)
                if on_device:
                    step = step.to(p.device)
                dtype = p.dtype if p.is_floating_point() else torch.float32
                old.state[p] = {"step": step, "exp_avg": state["exp_avg"].to(dtype),
                                "exp_avg_sq": state["exp_avg_sq"].to(dtype)}
        self._moved_state = {}


def _step_of(state: dict) -> float:
    step = state["step"]
    return float(step.item() if isinstance(step, torch.Tensor) else step)


def _is_adam_family(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, FusedAdamW))


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    if "decoupled_weight_decay" in group:
        return bool(group["decoupled_weight_decay"])
    return isinstance(optimizer, torch.optim.AdamW)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _adam_groups(optimizer: torch.optim.Optimizer, name: str) -> list[dict]:
    if not _is_adam_family(optimizer):
        raise ValueError(
            f"opt={name} replaces Adam or AdamW; {type(optimizer).__name__} is a different "
            "algorithm (use opt=fused for it)"
        )
    groups = []
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise ValueError(f"opt={name} does not implement amsgrad")
        groups.append({
            "params": list(group["params"]),
            **{key: _plain(group[key]) for key in _HYPER},
            "decoupled_weight_decay": _decoupled(optimizer, group),
            "maximize": bool(group.get("maximize", False)),
        })
    return groups


def _move_step_hooks(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Step hooks on the user's optimizer (bf16 master weights, the user's own) keep running."""
    for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if hasattr(old, attr) and hasattr(new, attr):
            getattr(new, attr).update(getattr(old, attr))


def _take_state(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> dict:
    """Move the user's Adam state into `new` (quantized there); clear it from `old` so that
    its memory is freed. Returns what was moved, for an undo before any new step."""
    moved = {}
    for group in old.param_groups:
        for p in group["params"]:
            state = old.state.get(p)
            if not state or "exp_avg" not in state:
                continue
            if isinstance(old, FusedAdamW):
                fp32 = old.fp32_state(p)
                new.load_fp32_state(p, fp32["step"].item(), fp32["exp_avg"], fp32["exp_avg_sq"])
            else:
                step = state["step"]
                step = step.item() if isinstance(step, torch.Tensor) else float(step)
                new.load_fp32_state(p, step, state["exp_avg"], state["exp_avg_sq"])
            moved[id(p)] = old.state.pop(p)
    return moved


def _torch_fused_available(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's class takes fused= and has fused kernels for every parameter."""
    try:
        if "fused" not in inspect.signature(type(optimizer).__init__).parameters:
            return False
    except (TypeError, ValueError):
        return False
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:
        devices = {"cuda"}
    return all(p.device.type in devices and p.is_floating_point()
               for g in optimizer.param_groups for p in g["params"])


def _check_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer,
                       precision: str | None, micro_batch: Any) -> None:
    if micro_batch is not None:
        raise ValueError(
            "opt=in-backward steps each parameter during backward, so it cannot accumulate "
            f"gradients over micro-batches (micro={micro_batch}); drop one of the two"
        )
    if precision == "fp16":
        raise ValueError(
            "opt=in-backward does not combine with fp16: the loss scaler must unscale the "
            "gradients and skip steps on inf/nan before the update; use bf16"
        )
    owned = {id(p) for p in model.parameters()}
    strangers = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
    if strangers:
        raise ValueError(
            f"opt=in-backward: the optimizer steps {len(strangers)} tensors that are not the "
            "model's parameters (bf16-true master weights?); their gradients never reach a "
            "backward hook"
        )


def swap_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    name: str,
    *,
    precision: str | None = None,
    micro_batch: Any = None,
) -> tuple[torch.optim.Optimizer, Handle]:
    """Replace `optimizer` by the one `name` says; returns (new_optimizer, handle).

    `precision` and `micro_batch` (a Plan's fields) are checked against "in-backward",
    which combines with neither fp16 nor micro-batches.
    """
    if name not in NAMES:
        raise ValueError(f"optimizer must be one of {NAMES}, not {name!r}")
    kind = type(optimizer).__name__
    if name == "fused":
        if _torch_fused_available(optimizer) or not _is_adam_family(optimizer):
            from memdoctor.remedies.fused import use_fused_optimizer
            handle = use_fused_optimizer(optimizer)   # logs its own line
            return handle.optimizer, handle
    if name in IN_BACKWARD:
        _check_in_backward(model, optimizer, precision, micro_batch)
    groups = _adam_groups(optimizer, name)
    cls = InBackwardAdamW if name in IN_BACKWARD else FusedAdamW
    new = cls(groups, state_dtype=_STATE_DTYPE[name])
    try:
        moved = _take_state(optimizer, new)
    except BaseException:
        if hasattr(new, "remove_hooks"):
            new.remove_hooks()
        raise
    _move_step_hooks(optimizer, new)
    count = sum(len(g["params"]) for g in groups)
    what = {
        "fused": "FusedAdamW (fp32 states; no fused kernel in torch for it here)",
        "adamw-bf16": "FusedAdamW with bf16 states (stochastic rounding)",
        "adamw-8bit": "FusedAdamW with blockwise 8-bit states",
        "in-backward": "AdamW stepped in backward, gradients freed per parameter",
        "in-backward-8bit": "AdamW with blockwise 8-bit states stepped in backward, gradients freed per parameter",
    }[name]
    handle = SwappedOptimizer(optimizer, new, f"{kind} -> {what}, {count} tensors", moved)
    log.info("memdoctor: optimizer %s", handle.description)
    return new, handle
