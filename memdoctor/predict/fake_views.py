"""View ops on the estimate's fake tensors, made without FakeTensorMode's dispatch.

A view allocates nothing: its output is the input's storage with other sizes and strides.
FakeTensorMode still takes the full path for one (a cache key built from every argument's
metadata, a new FakeTensor from the cache entry), about 0.2 ms, and views are half the ops of
a step written as a Python loop over small slices (a selective scan, an RNN cell). Their meta
kernel, run as FakeTensorMode runs it, gives the same output in a tenth of the time.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

__all__ = ["is_plain_view", "view_of_fakes"]


def is_plain_view(func) -> bool:
    """An aten view op (select, view, transpose, expand, detach, ...) that writes nothing and
    returns one tensor; or `_unsafe_view`, a view in all but its schema (matmul folds its
    batched product with it), which FakeTensorMode never caches."""
    if func is torch.ops.aten._unsafe_view.default:
        return True
    schema = func._schema
    return bool(getattr(func, "is_view", False)) and not schema.is_mutable and len(schema.returns) == 1 \
        and str(schema.returns[0].type) == "Tensor"


def view_of_fakes(func, args, kwargs):
    """`func`'s output from its meta kernel, wrapped as FakeTensorMode wraps one; None where
    FakeTensorMode's own dispatch is needed: a tensor argument that is not a strided fake
    tensor of one mode (a real tensor to convert, a subclass), or a constant it propagates."""
    mode = device = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if type(a) is not FakeTensor or a.constant is not None or a.layout is not torch.strided:
                return None
            if mode is None:
                mode, device = a.fake_mode, a.fake_device
            elif a.fake_mode is not mode or a.fake_device != device:
                return None
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return None
    if mode is None or mode.in_kernel_invocation or mode.shape_env is not None:
        return None
    with in_kernel_invocation_manager(mode):
        out = func(*args, **kwargs)
    return FakeTensor(mode, out, device)
