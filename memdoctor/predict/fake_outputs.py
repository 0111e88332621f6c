"""Outputs of functional ops on the estimate's fake tensors, memoized by their arguments'
metadata.

FakeTensorMode caches outputs too, but builds each key in Python from two dozen fields of every
tensor argument, through a generic recursion: about 0.2 ms an op on a 2-core machine, most of an
estimate's time for a model of many small ops (a selective scan, an RNN cell in a Python loop).
For an op that writes nothing, aliases nothing, draws nothing and has no data-dependent output,
the outputs' sizes, strides, dtypes and devices follow from the op, its tensor arguments' sizes,
strides, dtypes and devices, its other arguments and the default dtype and device. The memo keys
on those alone, stores only outputs that own a fresh storage of their exact size, and makes a hit's
outputs as FakeTensorMode makes them from its own cache: empty meta tensors wrapped as fakes.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

__all__ = ["OutputMemo", "memoizable"]

_SKIPPED_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape,
                 torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def memoizable(func) -> bool:
    """An aten op that writes no argument, returns only fresh tensors (no alias) and whose
    outputs' shapes depend on no value (no data-dependent or dynamic output) or draw."""
    schema = func._schema
    if not schema.name.startswith("aten::") or schema.is_mutable or getattr(func, "is_view", False):
        return False
    if not schema.returns or any(str(r.type) != "Tensor" or r.alias_info is not None for r in schema.returns):
        return False
    tags = func.tags
    return not any(tag in tags for tag in _SKIPPED_TAGS)


def _nbytes(shape, stride, itemsize: int) -> int:
    """The bytes an empty_strided tensor of these sizes and strides takes."""
    if any(n == 0 for n in shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * itemsize


class OutputMemo:
    """op and argument metadata -> the outputs' (sizes, strides, dtype, device), per fake mode."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}
        self.mode = None            # the fake mode whose tensors it has seen

    def key(self, func, args, kwargs) -> tuple | None:
        """The memo's key for this call, or None where an argument is not one it keys on (a
        real tensor, a constant, a sparse or another mode's fake tensor, an unknown object)."""
        parts: list = [func, torch.get_default_dtype(), torch._C._get_default_device(),
                       torch.is_inference_mode_enabled()]
        if not self._add(args, parts):
            return None
        if kwargs:
            for name in sorted(kwargs):
                parts.append(name)
                if not self._add((kwargs[name],), parts):
                    return None
        return tuple(parts)

    def _add(self, values, parts: list) -> bool:
        for v in values:
            kind = type(v)
            if kind is FakeTensor:
                if v.constant is not None or v.layout is not torch.strided:
                    return False
                if v.fake_mode is not self.mode:
                    if self.mode is not None:
                        return False
                    self.mode = v.fake_mode
                parts.append((v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.fake_device,
                              v.requires_grad, v.is_conj(), v.is_neg(), v.is_inference(),
                              v.untyped_storage().nbytes()))
            elif kind is list or kind is tuple:
                parts.append((kind, len(v)))
                if not self._add(v, parts):
                    return False
            elif kind in _PLAIN:
                parts.append((kind, v))
            else:
                return False
        return True

    def get(self, key: tuple):
        """The outputs for `key`, made anew, or None if it has none."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        metas, is_tuple = entry
        with in_kernel_invocation_manager(self.mode):
            elems = [torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                     for shape, stride, dtype, _ in metas]
        outs = tuple(FakeTensor(self.mode, e, m[3]) for e, m in zip(elems, metas))
        return outs if is_tuple else outs[0]

    def store(self, key: tuple, args, kwargs, out) -> None:
        """Keep `out`'s metadata under `key` if every output is a fake tensor of the mode that
        owns a fresh storage of exactly its size (not an input's, not another output's)."""
        outs = out if isinstance(out, tuple) else (out,)
        seen = set()
        metas = []
        for o in outs:
            if type(o) is not FakeTensor or o.fake_mode is not self.mode or o.layout is not torch.strided \
                    or o.storage_offset() != 0 or o.requires_grad or o.is_conj() or o.is_neg():
                return
            shape, stride = tuple(o.shape), o.stride()
            storage = o.untyped_storage()
            if storage.nbytes() != _nbytes(shape, stride, o.element_size()) or storage._cdata in seen:
                return
            seen.add(storage._cdata)
            metas.append((shape, stride, o.dtype, o.fake_device))
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in seen:
                    return
        self._entries[key] = (tuple(metas), isinstance(out, tuple))
