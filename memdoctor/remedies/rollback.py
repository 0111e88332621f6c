"""What one training step changes, kept aside so that an out-of-memory part-way through
can put it back: the OOM-proof step (micro_batch="auto") is all or nothing.

A step changes the gradients (autobatch keeps those), the buffers (BatchNorm's running
statistics and batch count), the random number generators (dropout draws again on a
retry), and in its optimizer part the parameters, the optimizer's state and step counts
and the loss scaler. `Checkpoint` copies the first three before the step, cheap (buffers
are small); `OptimizerCheckpoint` copies the rest just before the optimizer part, to the
CPU so that no device memory is spent on it.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def _cpu_copy(value: Any) -> Any:
    """Tensors (in dicts and lists too) copied to the CPU; anything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return copy.deepcopy(value)


class Checkpoint:
    """The buffers and the RNG states of `model` before a step; restore() puts them back."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    @torch.no_grad()
    def restore(self) -> None:
        for buffer, saved in self.buffers:
            buffer.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


class OptimizerCheckpoint:
    """The parameters (the model's and the optimizer's: bf16-true keeps fp32 masters), the
    optimizer's state and the loss scaler's, before the optimizer part of a step."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler=None) -> None:
        self.params = [(p, p.detach().to("cpu", copy=True)) for p in params]
        self.optimizer = optimizer
        self.state = _cpu_copy(optimizer.state_dict())
        self.scaler = scaler
        self.scaler_state = scaler.state_dict() if scaler is not None else None

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in self.params:
            p.copy_(saved)
        # load_state_dict puts each value back on its parameter's device, drops the state
        # a first step made, and makes memdoctor's FusedAdamW forget its cached buckets
        self.optimizer.load_state_dict(self.state)
        if self.scaler is not None:
            if self.scaler_state:               # a disabled scaler keeps none
                self.scaler.load_state_dict(self.scaler_state)
            _forget_stage(self.scaler)


def _forget_stage(scaler) -> None:
    """A scaler interrupted between step() and update() still thinks it stepped (and
    unscaled) this optimizer: a retry would be refused. Start its bookkeeping afresh."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is not None:
        states.clear()
