"""Backward calls that keep their graph: `backward(retain_graph=True)`, `create_graph=True`,
`autograd.grad(..., retain_graph=True)`.

A step's saved tensors outlive its backward only where such a call kept them; a tensor the
script still refers to after its backward (the last output, the loss) looks the same to the
allocator, which does not know which tensors autograd saved. The calls are noted with the
mark in force and the user's line, for the retained-graph rule.
"""
from __future__ import annotations

import sys

import torch

from memdoctor.capture.frames import first_user_frame
from memdoctor.capture.recorder import Recorder

# positional places of retain_graph and create_graph in torch.autograd.backward and .grad
_BACKWARD_ARGS = (2, 3)
_GRAD_ARGS = (3, 4)


class RetainingBackwards:
    """Wraps torch.autograd.backward (which Tensor.backward calls) and torch.autograd.grad
    for the duration of a trace; a wrapper that fails to note a call still makes it."""

    def __init__(self, recorder: Recorder):
        self.rec = recorder
        self.calls: list[dict] = []

    def install(self):
        """Wrap both functions; returns what undoes it."""
        backward, grad = torch.autograd.backward, torch.autograd.grad
        note = self._note

        def retaining_backward(*args, **kwargs):
            note(args, kwargs, _BACKWARD_ARGS)
            return backward(*args, **kwargs)

        def retaining_grad(*args, **kwargs):
            note(args, kwargs, _GRAD_ARGS)
            return grad(*args, **kwargs)
        retaining_backward.__wrapped__, retaining_grad.__wrapped__ = backward, grad
        torch.autograd.backward, torch.autograd.grad = retaining_backward, retaining_grad

        def undo():
            torch.autograd.backward, torch.autograd.grad = backward, grad
        return undo

    def _note(self, args: tuple, kwargs: dict, places: tuple[int, int]) -> None:
        try:
            retain, create = (args[i] if len(args) > i else kwargs.get(name)
                              for i, name in zip(places, ("retain_graph", "create_graph")))
            if not (retain or (retain is None and create)):
                return
            site = first_user_frame(sys._getframe(2))
            self.calls.append({"mark": len(self.rec.run.marks) - 1, "site": list(site) if site else None})
        except Exception:       # noting is a bonus: the user's backward runs whatever happens here
            pass
