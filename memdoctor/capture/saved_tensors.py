"""The tracer's saved-tensor hooks' helpers: the unpack that checks a change in place, as
autograd does for tensors no hook holds, and taking the tracer's hooks off autograd's stack."""
from __future__ import annotations

import torch

__all__ = ["pop_saved_hooks", "unpack_checked"]


def unpack_checked(packed):
    """The saved alias, unless it was changed in place since it was saved: then autograd's own
    error, which hooks would otherwise silence (the gradient would be computed from the
    changed values)."""
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; "
            f"expected version {version} instead. (Raised by memdoctor's tracer in autograd's place: "
            "autograd does not check tensors that saved-tensor hooks hold.)")
    return tensor


def pop_saved_hooks(pack) -> None:
    """Take `pack`'s saved-tensor hooks off the stack, leaving any pushed above them."""
    autograd = torch._C._autograd
    above = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        autograd._pop_saved_tensors_default_hooks()
        if top[0] == pack:
            break
        above.append(top)
    for hooks in reversed(above):
        autograd._push_saved_tensors_default_hooks(*hooks)
