"""A configuration built for the estimate: the user's build() called and what it returns
checked, and a batch of real tensors made fake."""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["call_build", "fakeify", "deepcopy_keeps_fake_mode"]


@contextlib.contextmanager
def deepcopy_keeps_fake_mode():
    """`copy.deepcopy` of a fake tensor keeps the fake mode it belongs to, until the block
    ends. Tensor.__deepcopy__ deep-copies a FakeTensor's __dict__, its FakeTensorMode with
    it, so a module cloned at build (nn.TransformerEncoder's `_get_clones`, any
    `copy.deepcopy(layer)`) gets parameters of another mode; the estimate's mode then takes
    each as a foreign tensor and converts it once to a new fake one, whose views the step
    uses: every such parameter counted twice, once more under the name of its first view
    (`aten.t`: 162 MiB for torch's 6-layer TransformerEncoder in fp32, 4% over the H200's
    allocated peak). A GPU copies each parameter once."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    own = FakeTensorMode.__dict__.get("__deepcopy__")
    FakeTensorMode.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if own is None:
            del FakeTensorMode.__deepcopy__
        else:
            FakeTensorMode.__deepcopy__ = own


def call_build(build, fake_mode, device):
    """(model, optimizer, batch, loss_fn) from `build(fake_mode, device)` (or `build()` for a
    build taking no arguments), which may return them as a dict; ValueError for anything
    else. No optimizer means AdamW at lr 1e-4."""
    try:
        takes = len(inspect.signature(build).parameters)
    except (TypeError, ValueError):
        takes = 2
    got = build(fake_mode, device) if takes >= 2 else build()
    if isinstance(got, dict):
        missing = [k for k in ("model", "optimizer", "batch", "loss_fn") if k not in got]
        if missing:
            raise ValueError(f"build() returned a dict without {', '.join(missing)}")
        got = (got["model"], got["optimizer"], got["batch"], got["loss_fn"])
    if not (isinstance(got, (tuple, list)) and len(got) == 4):
        raise ValueError("build() must return (model, optimizer, batch, loss_fn) or a dict with those keys")
    model, optimizer, batch, loss_fn = got
    if not isinstance(model, nn.Module):
        raise ValueError(f"build() returned a {type(model).__name__} as the model, not an nn.Module")
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if not callable(loss_fn):
        raise ValueError("build() must return a loss_fn(model, batch)")
    return model, optimizer, batch, loss_fn


def fakeify(batch, fake_mode, device):
    """A batch of real tensors as fake ones on `device` (other leaves unchanged)."""

    def conv(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.fake_tensor.FakeTensor):
            return fake_mode.from_tensor(x).to(device)
        if isinstance(x, torch.Tensor):
            return x.to(device)
        return x
    return tree_map(conv, batch)
