"""What a module call was handed, read cheaply at every call: its keyword arguments (from
torch's own frame, as global pre-hooks get only the positional ones) and the tensors in
its arguments or output."""
from __future__ import annotations

import sys

import torch
from torch.utils._pytree import tree_leaves


_WRAPPED_CALL = getattr(getattr(torch.nn.Module, "_wrapped_call_impl", None), "__code__", None)


def call_kwargs(depth: int) -> dict | None:
    """The keyword arguments of the module call whose global pre-hook is running
    (`model(input_ids=ids)`): torch hands global pre-hooks the positional ones only.
    `depth`: frames from here up to torch's `inner` in `Module._call_impl`, which calls the
    hooks and holds the kwargs among a dozen locals. Two frames above it, the
    `Module._wrapped_call_impl(self, *args, **kwargs)` that called `_call_impl` holds the same
    ones among three (reading a frame's locals copies them all); where the call came another
    way (a compiled module, `_call_impl` called directly), `inner`'s are read. None where
    neither holds them (another torch version): those inputs go unclaimed."""
    try:
        try:
            frame = sys._getframe(depth + 2)
        except ValueError:          # fewer frames than that: not called the usual way
            frame = None
        if frame is None or frame.f_code is not _WRAPPED_CALL:
            frame = sys._getframe(depth)
            if not frame.f_code.co_filename.endswith(("module.py", "module.pyc")):
                return None
        kwargs = frame.f_locals.get("kwargs")
    except Exception:
        return None
    return kwargs if isinstance(kwargs, dict) else None


_ATOMS = (int, float, bool, str, type(None))
_Tensor = torch.Tensor


def tensors_in(obj) -> list:
    """The tensors in a module's arguments or output. A tensor, a flat tuple of tensors and
    plain values or a dict of them (the call's keyword arguments, most often none) is by far
    the most common: walked directly, a pytree flatten (several microseconds, a transform
    called once a sample) only for anything nested."""
    if obj is None:
        return []
    if isinstance(obj, _Tensor):
        return [obj]
    kind = type(obj)
    if kind is tuple or kind is list or kind is dict:
        found = []
        for x in (obj.values() if kind is dict else obj):
            if isinstance(x, _Tensor):
                found.append(x)
            elif not isinstance(x, _ATOMS):
                break
        else:
            return found
    return [t for t in tree_leaves(obj) if isinstance(t, _Tensor)]
