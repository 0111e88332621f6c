"""Lower precision: autocast (bf16, fp16 with a loss scaler) and bf16 weights with fp32 masters.

Autocast keeps the weights in fp32 and halves the activations; "bf16-true" also halves
weights and gradients, keeping fp32 copies only for the optimizer so small updates are not
lost to bf16 rounding.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable, ContextManager

import torch
from torch import nn

from memdoctor.remedies._handle import Handle

log = logging.getLogger("memdoctor")

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-true": torch.bfloat16}


def autocast(precision: str | None, device_type: str) -> ContextManager:
    """A fresh autocast context for one forward pass ("bf16-true" autocasts too, so that
    fp32 inputs from a data loader meet bf16 weights without dtype errors)."""
    if precision is None:
        return contextlib.nullcontext()
    if precision not in _AUTOCAST_DTYPES:
        raise ValueError(f"unknown precision {precision!r}; use one of {tuple(_AUTOCAST_DTYPES)}")
    return torch.autocast(device_type=device_type, dtype=_AUTOCAST_DTYPES[precision])


def check_autocast(precision: str, device_type: str) -> None:
    """Raise if autocast would silently turn itself off (it only warns) on this device."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = autocast(precision, device_type)
    if not getattr(ctx, "_enabled", True):
        raise ValueError(f"{precision} autocast is not supported on {device_type} in torch {torch.__version__}")


def grad_scaler(
    device_type: str,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> "torch.amp.GradScaler":
    """torch.amp's dynamic loss scaler: a step whose gradients hold inf/nan is skipped and
    the scale multiplied by backoff_factor; after growth_interval good steps it grows."""
    try:
        return torch.amp.GradScaler(
            device_type,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"fp16 needs a loss scaler, and torch.amp.GradScaler({device_type!r}) failed: {exc}") from exc


class MasterWeights(Handle):
    """bf16 parameters for forward/backward, fp32 masters for the optimizer.

    Optimizer step hooks move each bf16 gradient into its master's fp32 `.grad` (freeing the
    bf16 one) before the step and copy the stepped masters back into the bf16 parameters
    after it, so the user's own `optimizer.step()` does the right thing.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bf16 param, fp32 master)
        self._dtypes: dict[int, torch.dtype] = {}
        self._frozen: list[torch.Tensor] = []
        stepped: set[int] = set()
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                stepped.add(id(p))
                if not p.is_floating_point():
                    masters.append(p)
                    continue
                master = p.detach().to(torch.float32, copy=True).requires_grad_(p.requires_grad)
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                self._dtypes[id(p)] = p.dtype
                p.data = p.data.to(torch.bfloat16)
                self.pairs.append((p, master))
                masters.append(master)
            group["params"] = masters
        for p in model.parameters():
            if id(p) not in stepped and p.is_floating_point() and p.dtype != torch.bfloat16:
                self._dtypes[id(p)] = p.dtype
                p.data = p.data.to(torch.bfloat16)
                self._frozen.append(p)
        self._hooks = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.grads_to_masters()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.masters_to_params()),
        ]
        super().__init__(
            f"bf16 weights for {len(self.pairs)} trained and {len(self._frozen)} frozen parameters, "
            "fp32 masters for the optimizer"
        )

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        for p, master in self.pairs:
            p.copy_(master)

    def undo(self) -> None:
        if self.undone:
            return
        for hook in self._hooks:
            hook.remove()
        by_master = {id(m): p for p, m in self.pairs}
        with torch.no_grad():
            for p, master in self.pairs:
                p.data = master.detach().to(self._dtypes[id(p)])
                p.grad = None
            for p in self._frozen:  # their fp32 digits were not kept: that was the saving
                p.data = p.data.to(self._dtypes[id(p)])
        for group in self.optimizer.param_groups:
            restored = []
            for m in group["params"]:
                p = by_master.get(id(m), m)
                if m in self.optimizer.state and p is not m:
                    self.optimizer.state[p] = self.optimizer.state.pop(m)
                restored.append(p)
            group["params"] = restored
        super().undo()


def cast_to_bf16_with_masters(model: nn.Module, optimizer: torch.optim.Optimizer) -> MasterWeights:
    """Cast the model's floating parameters to bf16; the optimizer steps fp32 masters."""
    handle = MasterWeights(model, optimizer)
    log.info("memdoctor: %s", handle.description)
    return handle


class Bf16Weights(Handle):
    """bf16-true under ZeRO-1/2: the frozen parameters are cast to bf16 here; the trained ones
    are cast by ZeRO, which first makes the fp32 masters of each rank's shard from their
    exact values. Undo casts every parameter back (from bf16: the lost digits stay lost)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._dtypes: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
        frozen = 0
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and id(p) not in self._dtypes:
                    self._dtypes[id(p)] = (p, p.dtype)
                    if id(p) not in trained and p.dtype != torch.bfloat16:
                        p.data = p.data.to(torch.bfloat16)
                        frozen += 1
        super().__init__(f"bf16 weights ({frozen} frozen cast here, the trained ones by ZeRO with fp32 masters "
                         "of each rank's shard)")

    def undo(self) -> None:
        if self.undone:
            return
        with torch.no_grad():
            for p, dtype in self._dtypes.values():
                p.data = p.data.to(dtype)
                p.grad = None
        super().undo()


class Precision(Handle):
    """The applied precision: the forward context, the backward and the optimizer step."""

    def __init__(
        self,
        precision: str | None,
        device_type: str,
        scaler: "torch.amp.GradScaler | None" = None,
        masters: "MasterWeights | Bf16Weights | None" = None,
    ) -> None:
        self.precision = precision
        self.device_type = device_type
        self.scaler = scaler
        self.masters = masters
        undo: Callable[[], None] | None = masters.undo if masters is not None else None
        super().__init__(f"{precision or 'fp32'} on {device_type}", undo)

    def context(self) -> ContextManager:
        return autocast(self.precision, self.device_type)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the optimizer; with a scaler, unscale first and skip the step on inf/nan."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()


def apply_precision(
    model: nn.Module, optimizer: torch.optim.Optimizer, precision: str | None, device_type: str,
    *, masters_in_zero: bool = False,
) -> Precision:
    """Set up `precision` ("bf16", "fp16", "bf16-true" or None) for training on device_type.
    `masters_in_zero`: for bf16-true, cast the weights only; ZeRO keeps the masters."""
    if precision is None:
        return Precision(None, device_type)
    check_autocast(precision, device_type)
    if precision == "bf16":
        handle = Precision(precision, device_type)
        log.info("memdoctor: bf16 autocast on %s (fp32 weights)", device_type)
    elif precision == "fp16":
        handle = Precision(precision, device_type, scaler=grad_scaler(device_type))
        log.info("memdoctor: fp16 autocast on %s with a dynamic loss scaler", device_type)
    elif masters_in_zero:
        handle = Precision(precision, device_type, masters=Bf16Weights(model, optimizer))
        log.info("memdoctor: %s", handle.masters.description)
    else:
        handle = Precision(precision, device_type, masters=cast_to_bf16_with_masters(model, optimizer))
    return handle
