"""Triton kernels for the optimizer step (fused AdamW with fp32, bf16 or 8-bit states).

Imported lazily: `import memdoctor.cuda.kernels` does not import torch or triton;
`FusedAdamW` and the rest load `adamw` (and triton, when installed) on first use.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "FusedAdamW": "adamw",
    "STATE_DTYPES": "adamw",
    "QBLOCK": "adamw",
    "HAVE_TRITON": "adamw",
    "triton_usable": "adamw",
    "state_bytes": "adamw",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'memdoctor.cuda.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"memdoctor.cuda.kernels.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
