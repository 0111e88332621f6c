"""The device memory the libraries map outside the caching allocator (memdoctor.cuda.library_memory):
counted per thread that calls cuBLAS or cuDNN, and placed among the segments where the driver
maps it."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
from torch import nn

from memdoctor.cuda.allocator_model import CachingAllocatorModel, DriverSpace, MiB, replay_trace
from memdoctor.cuda.library_memory import (CUBLAS_THREAD_BYTES, CUDA_CONTEXT_BYTES, CUDNN_THREAD_BYTES,
                                           FIRST_KERNELS_BYTES, KERNEL_CODE_BYTES, LibraryMemory)
from memdoctor.predict.estimate import estimate

FIXTURES = Path(__file__).parent / "fixtures" / "zoo_traces"


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _loss(model, batch):
    return model(batch).float().pow(2).mean()


def test_a_matmul_model_maps_a_cublas_handle_per_thread_and_no_cudnn():
    est = estimate(lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)), _adamw,
                   lambda: torch.randn(32, 64), _loss, device="cuda", probe_gpu=False)
    # the forward's addmm on the script's thread, the backward's mm on autograd's
    assert est.library_bytes == FIRST_KERNELS_BYTES + 2 * CUBLAS_THREAD_BYTES + KERNEL_CODE_BYTES
    assert est.cuda_context_bytes == CUDA_CONTEXT_BYTES
    assert est.device_bytes_needed == est.peak_reserved_bytes + CUDA_CONTEXT_BYTES + est.library_bytes
    assert any("cuBLAS handles 128 MiB" in n and "2 thread(s) calling cuBLAS, 0 calling cuDNN" in n
               for n in est.notes)
    assert est.to_dict()["library_bytes"] == est.library_bytes


def test_a_convolutional_model_maps_cudnn_handles_in_both_threads():
    est = estimate(lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4)),
                   _adamw, lambda: torch.randn(4, 3, 16, 16), _loss, device="cuda", probe_gpu=False)
    assert est.library_bytes == (FIRST_KERNELS_BYTES + 2 * CUBLAS_THREAD_BYTES + 2 * CUDNN_THREAD_BYTES
                                 + KERNEL_CODE_BYTES)


def test_a_cpu_estimate_has_no_library_memory():
    est = estimate(lambda: nn.Linear(8, 8), _adamw, lambda: torch.randn(4, 8), _loss, device="cpu")
    assert est.library_bytes == 0 and est.device_bytes_needed == est.peak_reserved_bytes


def test_library_memory_adds_up():
    lib = LibraryMemory(cublas_threads=1, cudnn_threads=2)
    assert lib.nbytes == FIRST_KERNELS_BYTES + CUBLAS_THREAD_BYTES + 2 * CUDNN_THREAD_BYTES + KERNEL_CODE_BYTES
    assert "cuDNN handles 16 MiB" in lib.describe()


def test_a_mapping_takes_the_addresses_the_next_segment_would_have_had():
    plain, mapped = CachingAllocatorModel(), CachingAllocatorModel()
    mapped.map_outside(64 * MiB)
    a, b = plain.malloc(20 * MiB), mapped.malloc(20 * MiB)
    assert b.addr == a.addr + 64 * MiB                   # the first chunk fills upwards
    assert mapped.reserved == plain.reserved == 20 * MiB  # and the mapping is not reserved


def test_the_h200s_mappings_placed_where_they_happened_give_its_reserved_peak():
    """UNet bf16 batch 8 on the H200, with the memory outside the allocator read around every op
    (benchmarks/zoo/driver_maps.py): replaying its own requests, the driver's rule alone reserves
    1.6% more than the GPU; with the libraries' mappings placed where they happened, the GPU's
    bytes, as at its recorded segment addresses."""
    real = json.loads(gzip.decompress((FIXTURES / "unet_bf16_b8_driver_maps.json.gz").read_bytes()))["real"]
    gpu = real["max_reserved"]
    assert replay_trace(real["events"], [a for _, a, _ in real["segment_addresses"]]).peak_reserved == gpu
    assert replay_trace(real["events"]).peak_reserved > 1.01 * gpu

    model = CachingAllocatorModel(driver=DriverSpace())
    # the first kernels' mapping is in the first chunk's part the driver holds from the start
    todo = sorted((g["allocations_before"], g["bytes"]) for g in real["outside_growths"] if g["allocations_before"] > 10)
    assert [b // MiB for _, b in todo] == [66, 10, 8, 64, 2]     # cuBLAS, cuDNN, cuDNN (backward), cuBLAS (backward)
    blocks, count = {}, 0
    for action, n, size in real["events"]:
        if action == 1:
            while todo and todo[0][0] <= count:
                model.map_outside(todo.pop(0)[1])
            blocks[n] = model.malloc(size)
            count += 1
        else:
            model.free(blocks.pop(n))
    assert model.peak_reserved == gpu


def test_an_lstm_counts_cudnn_handles_for_its_fused_calls_in_both_threads():
    """The estimate's fused RNNs dispatch no aten op of cuDNN's; they note their calls."""
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(16, 32, batch_first=True)
            self.head = nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.rnn(x)[0])
    est = estimate(Tagger, _adamw, lambda: torch.randn(4, 10, 16), _loss, device="cuda", probe_gpu=False)
    assert est.library_bytes == (FIRST_KERNELS_BYTES + 2 * CUBLAS_THREAD_BYTES + 2 * CUDNN_THREAD_BYTES
                                 + KERNEL_CODE_BYTES)
