"""Under the allocator source no op is seen, so gradients zeroed in place are told by the
optimizer's own zero_grad (memdoctor.capture.optimizers): the line that called it and the
gradients' addresses, joined to the allocator's blocks at the end (on a GPU:
tests/gpu/test_realworld_gpu.py, the zero_grad cases)."""
import torch

from memdoctor.capture.hooks import OwnershipHooks
from memdoctor.capture.recorder import Recorder
from memdoctor.run import Run


def _hooks_as_under_the_allocator_source():
    rec = Recorder(Run(source="allocator"))
    rec.claims = []                 # what the allocator source sets: owners joined by address
    return OwnershipHooks(rec, saved_tensors=False)


def test_zero_grad_in_place_names_its_line_and_gradients():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = _hooks_as_under_the_allocator_source()
    hooks.adopt_optimizer(opt)
    model(torch.randn(2, 8)).sum().backward()
    opt.zero_grad(set_to_none=True)                     # frees them: nothing kept
    assert hooks.zero_grads.zeroing == []
    model(torch.randn(2, 8)).sum().backward()
    opt.zero_grad(set_to_none=False)                    # the line that keeps them
    (held,) = hooks.zero_grads.held()
    assert held.holder == "gradients zeroed in place" and held.file == __file__
    assert "set_to_none=False" in open(__file__).read().splitlines()[held.line - 1]
    assert sorted(a for _, a in held.storages) == sorted(p.grad.data_ptr() for p in model.parameters())
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())   # zeroed as asked


def test_the_optimizer_is_left_as_it_was():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    hooks = _hooks_as_under_the_allocator_source()
    hooks.adopt_optimizer(opt)
    assert "zero_grad" in vars(opt)
    hooks.remove()
    assert "zero_grad" not in vars(opt) and opt.zero_grad.__func__ is torch.optim.SGD.zero_grad
