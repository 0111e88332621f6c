"""Triton kernels for the optimizer step (fused AdamW with fp32, bf16 or 8-bit states).

Imported lazily: `import memdoctor.cuda.kernels` does not import torch or triton;
`FusedAdamW` and the rest load their module on first use: adamw (the optimizer), adamw_math
(the update in torch ops and the state formats), adamw_triton (the kernels; triton, when
installed).
"""
from __future__ import annotations

import importlib

_LAZY = {
    "FusedAdamW": "adamw",
    "state_bytes": "adamw",
    "STATE_DTYPES": "adamw_math",
    "QBLOCK": "adamw_math",
    "state_bytes_per_param": "adamw_math",
    "HAVE_TRITON": "adamw_triton",
    "triton_usable": "adamw_triton",
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
