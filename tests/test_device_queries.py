"""`t.device` on a fake tensor is an op (prim.device) that each dispatch mode on the stack sees;
the first of memdoctor's modes answers it as FakeTensor does (memdoctor.capture.lean_mode).
A scan written as `h.to(gate.device)` per position (RecurrentGemma's) then estimates what
the same scan without the device reads estimates: the same events, bytes and work, since
on a GPU reading a tensor's device launches nothing."""
from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, in_kernel_invocation_manager

from memdoctor.capture.lean_mode import device_query
from memdoctor.predict.estimate import estimate


class _Scan(nn.Module):
    """A linear recurrence over positions, reading the gate's device at each one or not."""

    def __init__(self, read_device: bool):
        super().__init__()
        self.gate = nn.Linear(64, 64)
        self.read_device = read_device

    def forward(self, x):
        a = torch.sigmoid(self.gate(x))
        h = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            if self.read_device:
                h = h.to(a.device)
            h = a[:, t] * h + x[:, t]
            out.append(h)
        return torch.stack(out, 1)


def _estimate(read_device: bool):
    return estimate(lambda: _Scan(read_device), None, lambda: torch.randn(8, 32, 64),
                    lambda m, x: m(x).square().mean(), device="cuda", probe_gpu=False)


def test_device_reads_in_a_loop_change_no_event_byte_or_op_count():
    plain, reading = _estimate(False), _estimate(True)
    assert reading.peak_allocated_bytes == plain.peak_allocated_bytes
    assert reading.peak_reserved_bytes == plain.peak_reserved_bytes
    assert len(reading.run.actions) == len(plain.run.actions)
    assert reading.work == plain.work
    assert plain.work["compute"]["ops"] > 32 * 3         # the scan's ops are counted


def test_the_answer_is_fake_tensors_own_device():
    with FakeTensorMode() as mode:
        t = torch.empty(3, device="cpu")
    assert device_query((t,)) == t.device == torch.device("cpu")
    with in_kernel_invocation_manager(mode):                  # FakeTensor's kernels run on meta
        assert device_query((t,)) == torch.device("meta")
    real = torch.empty(2)
    assert device_query((real,)) == torch.device("cpu")


def test_memdoctors_dispatch_modes_run_unwrapped_and_dynamo_skips_them():
    """torch would wrap each mode's __torch_dispatch__ in dynamo's disable (a wrapper per op);
    where the code object can be marked for dynamo to skip, each of memdoctor's four modes
    runs its own function, marked so."""
    from memdoctor.capture import lean_mode
    from memdoctor.capture.dispatch import DispatchSource
    from memdoctor.predict.data_dependent import DataDependent
    from memdoctor.predict.kernel_layouts import KernelLayouts
    from memdoctor.predict.kernel_watch import KernelWatch
    for mode in (DispatchSource, DataDependent, KernelLayouts, KernelWatch):
        own = mode.__dict__["__torch_dispatch__"]
        if lean_mode._SKIP_ALL is None:          # a torch without the call: torch's own wrapper
            assert getattr(own, "_torchdynamo_disable", False), mode
        else:
            assert not hasattr(own, "_torchdynamo_orig_callable"), mode
            assert own.__code__.co_name == "__torch_dispatch__", mode
