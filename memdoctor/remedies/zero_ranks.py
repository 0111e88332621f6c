"""What ZeRO asks of the ranks before it shards anything: an initialised process group, the
same trained parameters on every rank, an optimizer that updates elementwise; and torch's
flat collectives under one name across torch versions."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("memdoctor")

# Optimizers whose update of an element reads only that element's parameter, gradient and
# state (plus scalars): a flat shard cutting through tensors steps them exactly.
ELEMENTWISE_OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
    "ASGD", "Rprop", "FusedAdamW",
})
WHOLE_TENSOR_OPTIMIZERS = frozenset({
    "Adafactor", "LBFGS", "SparseAdam", "Muon", "LAMB", "Lamb", "LARS", "Shampoo", "SOAP",
})

# torch 2.13 renamed the flat collectives (the old names warn); 2.11 has only the old ones
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def require_group(group):
    """`group`, or the default group; a ValueError saying how to launch when there is none."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "ZeRO needs torch.distributed initialised: launch with `torchrun --nproc-per-node N script.py` "
            "and call torch.distributed.init_process_group() before applying it"
        )
    return group if group is not None else dist.group.WORLD


def check_optimizer(optimizer: torch.optim.Optimizer, stage: int) -> None:
    name = type(optimizer).__name__
    if name in WHOLE_TENSOR_OPTIMIZERS and stage < 3:
        raise ValueError(f"ZeRO-{stage} shards cut through parameters, and {name} needs whole tensors; "
                         "use zero=3 (FSDP2: the optimizer then steps DTensors) or an elementwise optimizer such as AdamW")
    if name not in ELEMENTWISE_OPTIMIZERS and stage < 3:
        log.warning("memdoctor: ZeRO-%d assumes %s updates each element on its own (as Adam and SGD do)",
                    stage, name)


def trained_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    """The optimizer's trainable parameters, per param_group; each must be one of the model's."""
    in_model = {id(p) for p in model.parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) not in in_model:
                raise ValueError(
                    "the optimizer steps a tensor that is not one of the model's parameters (bf16-true's fp32 "
                    "masters?); ZeRO shards the model's own parameters: use precision bf16 (autocast) with zero"
                )
            if p.requires_grad:
                params.append(p)
        groups.append(params)
    return groups


def check_same_everywhere(values: list[int], group, what: str) -> None:
    """Raise on every rank if the ranks disagree (different models would hang a collective)."""
    mine = torch.tensor(values, dtype=torch.float64)
    device = collective_device(group)
    mine = mine.to(device)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise ValueError(f"ranks differ in {what}: every rank must apply ZeRO to the same model and optimizer")


def source_rank(group) -> int:
    """The global rank of the group's first rank: where initial values are broadcast from."""
    return dist.get_global_rank(group, 0)


def collective_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
