"""PyTorch features that refuse saved-tensor hooks run with memdoctor's set aside.

torch.func's grad, vjp, jacrev and hessian (and anyone's
`torch.autograd.graph.disable_saved_tensors_hooks`) raise "don't yet support saved tensor
hooks" when any are installed, and the tracer installs one to see what autograd saves.
While a trace runs, `torch.autograd.graph.disable_saved_tensors_hooks` (which torch.func
looks up at each call) is wrapped: memdoctor's hooks are taken off the stack for the
call and put back after it. The tensors saved inside count as temporaries rather than
activations, and the log says so once. Put back by the last trace to end, as
dispatch.py does with `UntypedStorage.resize_`.

A trace started inside such a region (hooks disabled) installs no saved-tensor hooks at
all: `hooks_disabled()` says when.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.autograd.graph as autograd_graph

log = logging.getLogger("memdoctor")

_C = torch._C._autograd
_packs: list = []           # the pack hooks of the traces running, innermost last
_original = None
_said = False


def hooks_disabled() -> bool:
    """Saved-tensor hooks are switched off here (inside torch.func, or a user's
    disable_saved_tensors_hooks): pushing one would raise."""
    return _C._saved_tensors_hooks_get_disabled_error_message() is not None


@contextlib.contextmanager
def _stepping_aside(error_message: str):
    """disable_saved_tensors_hooks, with memdoctor's hooks off the stack meanwhile."""
    global _said
    popped = []
    top = _C._top_saved_tensors_default_hooks(True)
    while top is not None and any(top[0] == pack for pack in _packs):
        _C._pop_saved_tensors_default_hooks()
        popped.append(top)
        top = _C._top_saved_tensors_default_hooks(True)
    if popped and not _said:
        _said = True
        log.warning("memdoctor: a PyTorch feature that refuses saved-tensor hooks (torch.func's grad, "
                    "vjp, jacrev, hessian) runs untraced by them: what it saves counts as temporaries")
    try:
        with _original(error_message):
            yield
    finally:
        for hooks in reversed(popped):
            _C._push_saved_tensors_default_hooks(*hooks)


def step_aside_for(pack) -> None:
    """From now on, features that disable saved-tensor hooks set `pack`'s hooks aside."""
    global _original
    if not _packs:
        _original = autograd_graph.disable_saved_tensors_hooks
        autograd_graph.disable_saved_tensors_hooks = _stepping_aside
    _packs.append(pack)


def stop_stepping_aside_for(pack) -> None:
    global _original
    for i in range(len(_packs) - 1, -1, -1):
        if _packs[i] == pack:
            del _packs[i]
            break
    if not _packs and _original is not None:
        if autograd_graph.disable_saved_tensors_hooks is _stepping_aside:
            autograd_graph.disable_saved_tensors_hooks = _original
        _original = None
