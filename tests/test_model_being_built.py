"""What the stack was doing to a model when an OOM was raised, read from the live stack or
from the traceback once it unwound (a CUDA OOM is recorded after the fact)."""
import sys

import pytest
import torch
from torch import nn

from memdoctor.capture.frames import model_being_built


class Net(nn.Module):
    def __init__(self, fail):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = Wide(fail)


class Wide(nn.Module):
    def __init__(self, fail):
        super().__init__()
        self.seen = model_being_built(sys._getframe())
        if fail:
            raise torch.OutOfMemoryError("out of memory")


def test_the_outermost_module_being_built_is_named_from_the_stack():
    assert Net(fail=False).b.seen == {"module": "Net", "how": "built"}


def test_the_outermost_module_being_built_is_named_from_a_traceback():
    with pytest.raises(torch.OutOfMemoryError) as info:
        Net(fail=True)
    assert model_being_built(tb=info.value.__traceback__) == {"module": "Net", "how": "built"}


def test_a_module_being_moved_is_named_from_a_traceback():
    model = nn.Sequential(nn.Linear(4, 4))

    def refuse(t):
        raise torch.OutOfMemoryError("out of memory")
    with pytest.raises(torch.OutOfMemoryError) as info:
        model._apply(refuse)
    assert model_being_built(tb=info.value.__traceback__) == {"module": "Sequential", "how": "moved"}


def test_nothing_is_named_outside_a_model_being_made():
    try:
        torch.empty(1).view(-1, 2)
    except RuntimeError as exc:
        assert model_being_built(tb=exc.__traceback__) is None
    assert model_being_built(sys._getframe()) is None
