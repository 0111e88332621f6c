"""A TorchDispatchMode base for modes that see every op, and the device query they answer.

Two costs a mode pays on every op, avoided here:

- torch wraps each mode's `__torch_dispatch__` in dynamo's disable, which imports
  torch._dynamo on the first op and costs a few microseconds an op. Where the code object
  can be marked for dynamo to skip instead (itself and every frame it calls, what the
  disable does), LeanDispatchMode marks each subclass's own `__torch_dispatch__` so, and
  torch does not wrap it; torch versions without the call keep torch's wrapper.
- `t.device` on a FakeTensor is an op, `prim.device`, dispatched through every mode on the
  stack. Code that writes `x.to(y.device)` in a loop (RecurrentGemma's scan: 1,024
  positions) makes two thirds of a fake step's ops device queries. FakeTensor answers it
  from the tensor alone (`fake_device`), so the first mode that sees it answers it, as
  FakeTensorMode would, and the modes under it never see it: they record nothing for it.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy
    _SKIP_ALL = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
except (ImportError, AttributeError, TypeError):
    _SKIP_ALL = None

__all__ = ["DEVICE_QUERY", "LeanDispatchMode", "device_query"]

DEVICE_QUERY = torch.ops.prim.device.default
_META = torch.device("meta")


def device_query(args):
    """The answer to `prim.device` on `args`: a FakeTensor's own device (meta inside its
    kernels, as FakeTensor answers), or the op run as usual on anything else."""
    t = args[0] if len(args) == 1 else None
    if isinstance(t, FakeTensor):
        return _META if t.fake_mode.in_kernel_invocation else t.fake_device
    return DEVICE_QUERY(*args)


class LeanDispatchMode(TorchDispatchMode):
    """A dispatch mode whose `__torch_dispatch__` dynamo skips without a per-op wrapper."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return _SKIP_ALL is None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__torch_dispatch__")
        if _SKIP_ALL is None or own is None or isinstance(own, classmethod):
            return
        try:
            _set_code_exec_strategy(own.__code__, _SKIP_ALL)
        except Exception:       # torch's own wrapper then, as _should_skip_dynamo would have put it
            cls.__torch_dispatch__ = torch._disable_dynamo(own, recursive=True)
