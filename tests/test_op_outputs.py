"""What an op that ran out on the GPU asked for in all: its outputs' bytes from the op run
on meta tensors, and the dispatch source recording that, not the one refused allocation."""
import pytest
import torch

from memdoctor.capture.op_outputs import output_bytes
from memdoctor.capture.session import Tracer

MIB = 1 << 20


def test_a_multi_tensor_op_asks_for_every_output():
    params = [torch.zeros(1024, 1024) for _ in range(3)] + [torch.zeros(1024) for _ in range(3)]
    assert output_bytes(torch.ops.aten._foreach_sqrt.default, (params,), {}) == 3 * 4 * MIB + 3 * 4096


def test_outputs_with_their_statistics_and_no_new_tensor_for_an_in_place_op():
    x = torch.zeros(8, 16)
    # layer norm: the output (8x16 fp32) and its mean and rstd (8 each)
    assert output_bytes(torch.ops.aten.native_layer_norm.default, (x, [16], None, None, 1e-5), {}) == 512 + 32 + 32
    assert output_bytes(torch.ops.aten.add_.Tensor, (x, x), {}) == 0
    assert output_bytes(torch.ops.aten._foreach_sqrt_.default, ([x],), {}) is None       # returns nothing


def test_an_op_without_a_meta_kernel_leaves_the_refused_request():
    assert output_bytes(torch.ops.aten.nonzero.default, (torch.ones(8),), {}) is None


@torch.library.custom_op("memdoctor_test::refused_list", mutates_args=())
def refused_list(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Makes a copy of each input, as a foreach op does, and is refused on the way."""
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB. GPU 0 has a total capacity "
                                 "of 139.81 GiB of which 1.00 MiB is free.")


@refused_list.register_fake
def _(xs):
    return [torch.empty_like(x) for x in xs]


def test_the_dispatch_source_records_a_real_oom_as_the_ops_whole_request():
    xs = [torch.ones(1024, 1024) for _ in range(4)]
    tracer = Tracer(source="dispatch")
    with pytest.raises(torch.OutOfMemoryError):
        with tracer:
            refused_list(xs)
    oom = tracer.run.ooms[-1]
    assert not oom.simulated and oom.requested_bytes == 4 * 4 * MIB      # not the 4 MiB the message names
