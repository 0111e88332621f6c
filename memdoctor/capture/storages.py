"""A tensor's storage, asked without failing (a tensor subclass or a meta tensor may have none)."""
from __future__ import annotations

import torch


def storage_of(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except Exception:
        return None


def storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return None
