"""What other tools say about the same configuration, printed next to the estimate: DeepSpeed's
ZeRO-2 model-states rule, accelerate's four times the model, 16 bytes a parameter, and torch's
MemTracker run on the same fake step."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

import torch

from memdoctor.predict.cpu_standin import CpuForCuda, cuda_built
from memdoctor.predict.data_dependent import DataDependent
from memdoctor.predict.eager_libraries import eager
from memdoctor.predict.fake_build import call_build
from memdoctor.predict.fake_caches import clear_caches_filled
from memdoctor.predict.fake_step import force_cuda_default_foreach, train_step
from memdoctor.predict.fused_rnn import cudnn_rnns
from memdoctor.predict.fused_tables import FusedTables
from memdoctor.remedies.plan import Plan

if TYPE_CHECKING:
    from memdoctor.predict.result import Estimate

__all__ = ["compute_anchors", "deepspeed_zero2_model_states_bytes", "accelerate_adam_bytes", "memtracker_peak"]


def deepspeed_zero2_model_states_bytes(params: int, world_size: int = 1) -> int:
    """DeepSpeed's estimate_zero2_model_states_mem_needs without CPU offload, per GPU: fp16
    weights and gradients (2 + 2 bytes a parameter) plus fp32 master weights, momentum and
    variance (and fp32 gradients: 16 bytes) sharded over the GPUs."""
    return 4 * params + int(16 * params / max(world_size, 1))


def accelerate_adam_bytes(param_bytes: int) -> int:
    """accelerate's model-memory rule for training with Adam: four times the model's size."""
    return 4 * param_bytes


def compute_anchors(build: Callable, plan: Plan, device: str, est: Estimate, world_size: int = 1,
                    steps: int = 2) -> dict:
    """What other tools would say about the same configuration."""
    out: dict[str, Any] = {
        "deepspeed_zero2_model_states_bytes": deepspeed_zero2_model_states_bytes(est.params, world_size),
        "accelerate_adam_x4_bytes": accelerate_adam_bytes(est.param_bytes),
        "model_states_16_bytes_per_param": 16 * est.params,
    }
    try:
        out["memtracker_peak_bytes"] = memtracker_peak(build, plan, device, steps)
    except Exception as exc:        # an anchor failing is a fact to report, not an error
        out["memtracker_peak_bytes"] = None
        out["memtracker_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return out


def memtracker_peak(build: Callable, plan: Plan | None, device: str = "cuda", steps: int = 2) -> int:
    """torch.distributed._tools.mem_tracker.MemTracker's peak (all categories, the target
    device) for the same build and steps under FakeTensorMode, with the same handling of what
    fake tensors cannot run as the estimate's (data-dependent ops, cuDNN's fused RNNs,
    libraries that detect fake tensors), so that it counts the same ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    target = torch.device(device).type
    on_cpu = target == "cuda" and not cuda_built()
    sim = "cpu" if on_cpu else target
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    redirect = CpuForCuda() if on_cpu else contextlib.nullcontext()
    tables = FusedTables()
    rnns = cudnn_rnns(device_type="cpu" if on_cpu else "cuda") if target == "cuda" else contextlib.nullcontext()
    with clear_caches_filled(), fake_mode, DataDependent(), redirect, rnns, eager() as libraries:
        mt = MemTracker()
        with mt:
            with torch.device(sim):
                model, optimizer, batch, loss_fn = call_build(build, fake_mode, sim)
            prepared = None
            if plan is not None and not plan.is_empty():
                from memdoctor.remedies import prepare
                prepared = prepare(model, optimizer, plan, device_type=sim)
                optimizer = prepared.optimizer
            if target == "cuda":
                force_cuda_default_foreach(optimizer)
            tables.watch(optimizer)
            libraries.refresh()
            for _ in range(steps):
                train_step(model, optimizer, batch, loss_fn, prepared, fake=True)
                mt.reset_mod_stats()        # its per-module stats take one iteration at a time
        snap = mt.get_tracker_snapshot("peak")
    best = 0
    for dev, values in snap.items():
        if torch.device(dev).type == sim:
            best = max(best, int(values.get("Total", 0)))
    return best
