"""memdoctor.cuda.reduce_scratch: the CUDA reduction kernel's scratch allocations.

MEASURED holds what `aten.sum.dim_IntList` (bias gradients in a backward pass) allocated
through the caching allocator on an NVIDIA H200 (132 SMs, 2048 threads/SM, warp 32),
torch 2.11+cu130: [global staging buffer bytes, semaphore bytes], or [] for none.
"""
import pytest

from memdoctor.cuda.reduce_scratch import reduction_scratch_bytes

FP32, BF16 = 4, 2

MEASURED = [
    # shape, reduced dims, input dtype bytes, [buffer, semaphores]
    ((12608, 768), 0, FP32, [77463552, 24]),
    ((12608, 768), 0, BF16, [77463552, 24]),
    ((12608, 3072), 0, FP32, [138412032, 96]),
    ((12608, 3072), 0, BF16, [138412032, 96]),
    ((12608, 2304), 0, FP32, [139198464, 72]),
    ((16384, 30522), 0, FP32, [62509056, 1908]),
    ((16384, 768), 0, FP32, [100663296, 24]),
    ((16384, 3072), 0, FP32, [138412032, 96]),
    ((4096, 1600), 0, FP32, [52428800, 52]),
    ((4096, 6400), 0, FP32, [140902400, 200]),
    ((4096, 4800), 0, FP32, [137625600, 152]),
    ((8192, 1024), 0, FP32, [67108864, 32]),
    ((8192, 4096), 0, FP32, [138412032, 128]),
    ((8192, 3072), 0, FP32, [138412032, 96]),
    ((2, 2048, 2048), (0, 1), FP32, [67108864, 64]),
    ((64, 1000), 0, FP32, []),
]


@pytest.mark.parametrize("shape,dims,dtype_bytes,expected", MEASURED,
                         ids=[f"{'x'.join(map(str, s))}-d{d}-{b}B" for s, d, b, _ in MEASURED])
def test_measured_h200(shape, dims, dtype_bytes, expected):
    # bf16 sums accumulate in fp32 (acc 4 bytes) and write bf16 (out_bytes = dtype_bytes)
    got = reduction_scratch_bytes(shape, dims, dtype_bytes, acc_bytes=4,
                                  sm_count=132, max_threads_per_sm=2048, warp_size=32)
    assert got == expected


def test_negative_dims_and_list_dims_match():
    assert reduction_scratch_bytes((2, 2048, 2048), [-3, -2], FP32) == [67108864, 64]
    assert reduction_scratch_bytes((12608, 768), (-2,), FP32) == [77463552, 24]


@pytest.mark.parametrize("shape,dims,dtype_bytes", [
    ((8, 16), 0, FP32),                 # small bias gradient
    ((64, 1000), 0, BF16),
    ((100,), 0, FP32),                  # full reduction of a small vector
    ((32, 32), None, FP32),             # full reduction, dims=None
    ((32, 32), (), FP32),               # sum(dim=[]) reduces everything too
    ((4, 8, 16), (0, 1, 2), BF16),
    ((4096, 768), -1, FP32),            # reduction over the last dim: one block per row
    ((4096, 768), -1, BF16),
    ((1, 768), 0, FP32),                # reducing a size-1 dim
    ((0, 768), 0, FP32),                # empty input: no launch
    ((), None, FP32),                   # 0-d tensor
])
def test_no_scratch(shape, dims, dtype_bytes):
    assert reduction_scratch_bytes(shape, dims, dtype_bytes) == []


def test_full_reduction_of_a_large_vector_reduces_across_blocks():
    buf, sem = reduction_scratch_bytes((1 << 24,), None, FP32)
    assert sem == 4                     # one output: grid.x == 1
    assert buf % 4 == 0 and buf > 4     # fp32 partial sums, one per block (block.x reduces)


def test_fewer_sms_means_fewer_blocks_per_output():
    full = reduction_scratch_bytes((16384, 768), 0, FP32)
    half = reduction_scratch_bytes((16384, 768), 0, FP32, sm_count=66)
    assert half[1] == full[1] and half[0] < full[0]


def test_split_for_32bit_indexing():
    # 32768 x 30522 fp32 exceeds 32-bit byte offsets: two launches over halves of dim 0,
    # each the same as the measured 16384 x 30522 case.
    assert reduction_scratch_bytes((32768, 30522), 0, FP32) == [62509056, 1908] * 2
    # bf16 -> bf16 cannot accumulate partial sums in the output: an fp32 AccumulationBuffer
    # of num_outputs elements comes first.
    sizes = reduction_scratch_bytes((65536, 32768), 0, BF16)
    assert sizes[0] == 32768 * 4
    assert len(sizes) == 5 and sizes[1:3] == sizes[3:5]
