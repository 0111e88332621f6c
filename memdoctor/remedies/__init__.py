"""Remedies: each a plain function that changes a model, optimizer or step and returns a
handle that can undo it, and `prepare`, which applies a whole Plan.

Only Plan is imported eagerly, so that the CLI can parse plans without importing torch.
"""
from __future__ import annotations

import importlib

from memdoctor.remedies.plan import Plan

_LAZY = {
    "prepare": "step",
    "Prepared": "step",
    "swap_optimizer": "optimizers",
    "apply_zero": "zero",
    "Handle": "_handle",
    "autocast": "precision",
    "grad_scaler": "precision",
    "cast_to_bf16_with_masters": "precision",
    "apply_precision": "precision",
    "MasterWeights": "precision",
    "Precision": "precision",
    "find_blocks": "checkpointing",
    "apply_checkpointing": "checkpointing",
    "is_checkpointed": "checkpointing",
    "blocks_to_fit": "checkpointing",
    "predicted_peak": "checkpointing",
    "batch_size": "microbatch",
    "split_batch": "microbatch",
    "accumulate_gradients": "microbatch",
    "AutoMicroBatch": "autobatch",
    "oom_proof_accumulate": "autobatch",
    "use_fused_optimizer": "fused",
    "OptimizerSwap": "fused",
    "chunked_cross_entropy": "chunked_ce",
    "injected": "inject",
}

__all__ = ["Plan", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'memdoctor.remedies' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"memdoctor.remedies.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
