"""The ZeRO remedy, `apply_zero`: optimizer state and gradients (ZeRO-1/2), and parameters
too (ZeRO-3), sharded over the data-parallel ranks on PyTorch's own torch.distributed.

`apply_zero(model, optimizer, stage=2)` changes the model and the user's optimizer in
place (the same optimizer object keeps stepping, so learning-rate schedulers built on it
still work) and returns a ZeroHandle: `.undo()` (a collective: every rank calls it) gathers
the optimizer state back into the user's optimizer and gives the parameters their own
storage again. The process group is the user's (torchrun + init_process_group, gloo or
NCCL); every rank must call apply_zero with the same model and optimizer.

Two implementations:
- ZeRO-1/2: memdoctor's own flat buckets (zero_flat; its layout in zero_buckets, the
  gradient reduction during backward in zero_reduce, fp32 masters in zero_masters). The
  shards cut through parameters, so the optimizer must update elementwise (SGD, Adam,
  AdamW, RMSprop, Adagrad, ... and memdoctor's FusedAdamW); Adafactor, LBFGS or Muon need
  whole tensors and are refused (zero_ranks checks what ZeRO needs of the ranks).
- ZeRO-3: FSDP2's fully_shard (zero_fsdp). `impl="fsdp"` with stage 2 uses FSDP2 with
  reshard_after_forward=False instead of the flat buckets.

Why the flat buckets for ZeRO-2 and not FSDP2(reshard_after_forward=False): measured with
gloo on 2 CPU ranks (`torchrun --nproc-per-node 2 benchmarks/zero_memory.py --device cpu`:
the s01 model, 4 x [Linear(2048, 2048), GELU], batch 8, fp32, AdamW foreach=False; per
rank, MiB; step: mean of 8 steps after 2 warm-ups on this 2-core machine):

    config                      after step   peak (tracer)   peak (RSS)   step (ms)
    DDP                            320.2         352.2          352.7        336
    ZeRO-2 flat buckets            160.1         184.1          280.4        369
    ZeRO-2 FSDP2, no reshard       128.1         192.5          337.7        559
    ZeRO-3 FSDP2                   128.1         176.4          335.8        649

"after step": every live tensor's storage after optimizer.step() (DDP: the tracer, which
also sees its 64 MiB of C++-held buckets). "peak (tracer)": memdoctor's dispatch tracer
(it follows FSDP2's storage resizes and counts a DTensor's local shard). "peak (RSS)":
resident memory sampled every 0.5 ms with every large allocation its own mapping; it also
counts gloo's internal buffers and the process's own growth. On GPT-2 shaped models
(`--model gpt2-tiny`, bf16 autocast) the flat buckets stepped in 49 ms against FSDP2's 106.
FSDP2 holds less between steps (its weights are sharded then) but, from the first
all-gather to the end of backward, the sharded weights and the gathered ones, 1 + 1/N times
the model, and it all-gathers before every forward, micro-batches included; the flat buckets
hold the weights once and gather once per step, after the optimizer, and the reduction
overlaps backward bucket by bucket. The flat path also keeps `model` an
ordinary module (no class swap, no DTensor in user code), which the rest of memdoctor
(checkpointing, the tracer's ownership of weights and gradients, watch's budget) works with
unchanged. FSDP2 is the tool for ZeRO-3, where the weights must leave the rank between uses:
it gathers one block at a time, with prefetching.

Limits: the optimizer's state_dict() holds this rank's shard (save one per rank, or undo()
first for a whole one); micro=auto (halving on OOM) does not combine with ZeRO, since an OOM
on one rank leaves the ranks' collectives out of step; fp32 masters kept outside the model
by the optimizer (the bf16-true remedy alone) are refused: ZeRO keeps them itself with
master_weights=True.

Mixed precision: with fp16 (a GradScaler), each rank sees only its shard's gradients, so
the inf check must be agreed across ranks: use torch's ShardedGradScaler
(`sharded_grad_scaler(scaler)` converts one; `prepare` does it for a Plan).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from memdoctor.remedies.zero_flat import DEFAULT_BUCKET_BYTES, FlatZero
from memdoctor.remedies.zero_fsdp import FSDPZero
from memdoctor.remedies.zero_handle import ZeroHandle, sharded_grad_scaler
from memdoctor.remedies.zero_ranks import (ELEMENTWISE_OPTIMIZERS, WHOLE_TENSOR_OPTIMIZERS, check_optimizer,
                                           require_group)
from memdoctor.remedies.zero_reduce import MAX_IN_FLIGHT

log = logging.getLogger("memdoctor")

__all__ = ["apply_zero", "ZeroHandle", "FlatZero", "FSDPZero", "sharded_grad_scaler", "DEFAULT_BUCKET_BYTES",
           "MAX_IN_FLIGHT", "ELEMENTWISE_OPTIMIZERS", "WHOLE_TENSOR_OPTIMIZERS"]


def apply_zero(model: nn.Module, optimizer: torch.optim.Optimizer, stage: int = 2, process_group=None, *,
               impl: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               master_weights: bool = False) -> ZeroHandle:
    """Shard optimizer state and gradients (stage 1, 2) or also parameters (stage 3) over the
    ranks of `process_group` (default: the default group torchrun's script initialised).

    `impl`: "flat" (stages 1-2, the default for them) or "fsdp" (FSDP2; the default and only
    choice for stage 3). `master_weights`: the trained parameters become bf16 and each rank
    keeps fp32 masters of its shard (flat stages 1-2 only). Collective: every rank calls it, and
    later `handle.undo()`.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
    impl = impl or ("fsdp" if stage == 3 else "flat")
    if impl not in ("flat", "fsdp"):
        raise ValueError(f"impl must be 'flat' or 'fsdp', not {impl!r}")
    if stage == 3 and impl != "fsdp":
        raise ValueError("ZeRO-3 shards parameters between uses: that is FSDP2 (impl='fsdp')")
    group = require_group(process_group)
    check_optimizer(optimizer, stage)
    if master_weights and impl != "flat":
        raise ValueError("master weights are kept by the flat ZeRO-1/2 only; ZeRO-3 (FSDP2) does not take bf16-true")
    if impl == "flat":
        handle: ZeroHandle = FlatZero(model, optimizer, stage, group, bucket_bytes=bucket_bytes,
                                      master_weights=master_weights)
    else:
        handle = FSDPZero(model, optimizer, stage, group)
    if dist.get_rank(group) == 0:
        log.info("memdoctor: %s", handle.description)
    else:
        log.debug("memdoctor: %s", handle.description)
    return handle
