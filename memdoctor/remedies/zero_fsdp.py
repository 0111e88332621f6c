"""ZeRO-3 (and ZeRO-2 with impl="fsdp") through FSDP2's `fully_shard`: the weights leave
the rank between uses, gathered one block at a time, with prefetching.

FSDP2 (`torch.distributed.fsdp.fully_shard`, reshard_after_forward=True for ZeRO-3) goes
on each repeated block (memdoctor.remedies.checkpointing.find_blocks) and on the root; the
optimizer's parameters become the DTensor shards, and its state is cut to match. Undo gives
the user's Parameter objects their full values back, and the modules their classes,
attributes and hooks as they were.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memdoctor.remedies.zero_handle import ZeroHandle
from memdoctor.remedies.zero_ranks import check_same_everywhere, source_rank, trained_params
from memdoctor.units import format_bytes


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:          # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class FSDPZero(ZeroHandle):
    """ZeRO-3 (and ZeRO-2 with impl="fsdp") through FSDP2's fully_shard."""

    impl = "fsdp"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, stage: int, group) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        self.model, self.optimizer, self.stage, self.group = model, optimizer, stage, group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        groups = trained_params(model, optimizer)
        check_same_everywhere([sum(p.numel() for p in model.parameters()), len(list(model.parameters()))],
                               group, "parameters")
        first = next(model.parameters(), None)
        if first is None:
            raise ValueError("the model has no parameters to shard")
        device_type = first.device.type
        if device_type == "cuda" and first.device.index is not None:
            torch.cuda.set_device(first.device)
        self.mesh = DeviceMesh.from_group(group, device_type)
        # where every parameter lives, before FSDP replaces them (tied weights: every place)
        self._places: list[tuple[nn.Module, str, nn.Parameter]] = []
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    self._places.append((module, name, p))
        names = {}
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
        self._sync_from_rank0(model)
        from memdoctor.remedies.checkpointing import find_blocks
        blocks = [m for _, m in find_blocks(model)]
        self._modules = blocks + [model]
        self._saved = [(m, m.__class__, set(m.__dict__), {h: set(getattr(m, h, {}) or {}) for h in _HOOK_DICTS})
                       for m in self._modules]
        reshard = stage >= 3
        fully_shard = _fully_shard()
        for m in self._modules:
            fully_shard(m, mesh=self.mesh, reshard_after_forward=reshard)
        new_by_name = dict(model.named_parameters())
        self._old_to_new = {}
        for p_old_id, name in names.items():
            self._old_to_new[p_old_id] = new_by_name[name]
        self._original_params = [list(g["params"]) for g in optimizer.param_groups]
        old_state = {p: optimizer.state.pop(p) for ps in groups for p in ps if p in optimizer.state}
        for gi, g in enumerate(optimizer.param_groups):
            g["params"] = [self._old_to_new[id(p)] for p in groups[gi]]
        for p in list(optimizer.state.keys()):
            del optimizer.state[p]
        for p_old, state in old_state.items():
            new = self._old_to_new[id(p_old)]
            optimizer.state[new] = {k: self._shard_like(v, p_old, new) for k, v in state.items()}
        # the user's references to the old parameters must not keep the full weights alive
        self._old_params = {id(p): p for _, _, p in self._places}
        self._old_shapes = {}
        for p in self._old_params.values():
            self._old_shapes[id(p)] = (p.shape, p.dtype, p.device)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None
        total = sum(p.numel() * p.element_size() for p in self._old_to_new.values())
        local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else
                    p.numel() * p.element_size() for p in self._old_to_new.values())
        self.total_param_bytes, self.local_param_bytes = total, local
        what = "parameters, gradients and optimizer state" if stage >= 3 else "gradients and optimizer state"
        super().__init__(
            f"ZeRO-{stage} over {self.world_size} ranks ({dist.get_backend(group)}), FSDP2 fully_shard on "
            f"{len(blocks)} blocks and the root (reshard_after_forward={reshard}): {what} sharded; this rank "
            f"holds {format_bytes(local)} of {format_bytes(total)} of parameters",
            self._undo,
        )

    @torch.no_grad()
    def _sync_from_rank0(self, model: nn.Module) -> None:
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point() or t.dtype in (torch.int64, torch.int32):
                dist.broadcast(t.data, src=source_rank(self.group), group=self.group)

    def _shard_like(self, value: Any, old: nn.Parameter, new: nn.Parameter) -> Any:
        if not (isinstance(value, torch.Tensor) and value.shape == old.shape and value.dim() > 0):
            return value.clone() if isinstance(value, torch.Tensor) else value
        from torch.distributed.tensor import DTensor
        if not isinstance(new, DTensor):
            return value.clone()
        local_new = new.to_local()
        rows = old.shape[0]
        chunk = math.ceil(rows / self.world_size)
        start = min(self.rank * chunk, rows)
        local = value.detach()[start:start + local_new.shape[0]].clone()
        return DTensor.from_local(local, new.device_mesh, new.placements, shape=new.shape, stride=new.stride(),
                                  run_check=False)

    def no_sync(self):
        return _fsdp_no_sync(self.model)

    @torch.no_grad()
    def _undo(self) -> None:
        from torch.distributed.tensor import DTensor
        opt = self.optimizer
        new_to_old = {id(new): self._old_params[old_id] for old_id, new in self._old_to_new.items()}
        # full parameters back into the user's Parameter objects
        for old_id, new in self._old_to_new.items():
            old = self._old_params[old_id]
            full = new.full_tensor() if isinstance(new, DTensor) else new.detach()
            old.data = full.detach().clone()
            old.grad = None
        state = {}
        for new_p, s in list(opt.state.items()):
            old = new_to_old.get(id(new_p))
            if old is None:
                continue
            state[old] = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in s.items()}
        opt.state.clear()
        for g, params in zip(opt.param_groups, self._original_params):
            g["params"] = params
        for p, s in state.items():
            opt.state[p] = s
        # the module attributes, classes and hooks as they were
        for module, name, old in self._places:
            current = module._parameters.get(name)
            if current is not None and current is not old and old.numel() == 0:
                full = current.full_tensor() if isinstance(current, DTensor) else current.detach()
                old.data = full.detach().clone()
            module._parameters[name] = old
        for module, cls, keys, hooks in self._saved:
            for h, before in hooks.items():
                d = getattr(module, h, None)
                if d is None:
                    continue
                for k in [k for k in d if k not in before]:
                    del d[k]
            for k in [k for k in module.__dict__ if k not in keys]:
                del module.__dict__[k]
            module.__class__ = cls


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)
