"""The device memory a training process holds outside the caching allocator: the CUDA context,
and what the driver maps as the step first runs each library's kernels. Neither counts in
`max_memory_reserved()`, and both count against the device: a step whose reserved peak fits
in the GPU's memory less the context alone can still run out.

Measured on the H200 (torch 2.11+cu130, lazy module loading, the default), device memory in
use less the allocator's reserved bytes, before and after every op of a zoo configuration's
steps (benchmarks/zoo/driver_maps.py, `driver_maps_h200_2026-12-03.log`):

- the context: 527 MiB once CUDA is initialised;
- the first kernel the process launches: 90 MiB, and 2 MiB at its first random numbers;
- a thread's first cuBLAS call: 64 MiB (its handle), in each of the ten configurations and
  again at the first matmul of autograd's backward thread;
- a thread's first cuDNN call (a convolution, cuDNN attention, an RNN): 8 MiB, likewise once
  in the forward and once in the backward thread;
- kernel code, loaded as new kernels first run, in pages of 2 MiB: 4-6 MiB in all in those
  configurations besides the above (counted here as 8 MiB).

The driver maps the handles' memory among the allocator's segments, so it also decides where
later segments go (memdoctor.cuda.allocator_model.DriverSpace; the estimate places it where
the step first calls each library). Other GPUs, drivers and library versions map other sizes;
the figures are the H200's.
"""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20

CUDA_CONTEXT_BYTES = 527 * MiB      # once CUDA is initialised
FIRST_KERNELS_BYTES = 92 * MiB      # the first kernel launch (90 MiB) and the first random numbers (2 MiB)
CUBLAS_THREAD_BYTES = 64 * MiB      # a thread's first cuBLAS call
CUDNN_THREAD_BYTES = 8 * MiB        # a thread's first cuDNN call
KERNEL_CODE_BYTES = 8 * MiB         # later kernels' code pages: 4-6 MiB measured, rounded up

# The ops whose CUDA kernels come from cuDNN (on a GPU with cuDNN enabled): convolutions, the
# cuDNN attention backend and RNNs. A depthwise convolution may run PyTorch's own kernel; it is
# counted as cuDNN's, so the estimate errs high by one handle there. The estimate's fused RNNs
# (memdoctor.predict.fused_rnn) dispatch no aten op and note their calls themselves.
CUDNN_OPS = frozenset({
    "convolution", "convolution_backward", "cudnn_convolution", "cudnn_convolution_transpose",
    "_convolution", "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_cudnn_rnn", "_cudnn_rnn_backward", "cudnn_batch_norm", "cudnn_batch_norm_backward",
})


@dataclass
class LibraryMemory:
    """What the step's libraries map outside the allocator, from the threads that call them."""
    cublas_threads: int
    cudnn_threads: int

    @property
    def parts(self) -> dict[str, int]:
        return {"first kernels": FIRST_KERNELS_BYTES,
                "cuBLAS handles": self.cublas_threads * CUBLAS_THREAD_BYTES,
                "cuDNN handles": self.cudnn_threads * CUDNN_THREAD_BYTES,
                "kernel code": KERNEL_CODE_BYTES}

    @property
    def nbytes(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = ", ".join(f"{name} {value // MiB} MiB" for name, value in self.parts.items() if value)
        return (f"outside the allocator, the libraries' own device memory: {shown} "
                f"({self.cublas_threads} thread(s) calling cuBLAS, {self.cudnn_threads} calling cuDNN; "
                "sizes measured on an H200)")
