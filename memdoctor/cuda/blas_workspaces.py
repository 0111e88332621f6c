"""The workspaces cuBLAS and cuBLASLt take through the caching allocator and keep for the
process's life: their sizes as torch computes them, for the estimate to add and for the
allocator source to recognise among the blocks no tensor owns."""
from __future__ import annotations

import os
import re

import torch

# cuBLAS workspace per (cuBLAS handle, stream), allocated through the caching allocator at the
# first cuBLAS call of a thread and kept for the process's life (aten/src/ATen/cuda/
# CublasHandlePool.cpp, parseChosenWorkspaceSize): CUBLAS_WORKSPACE_CONFIG if set, else
# ":4096:8" = 32 MiB on sm90 (H100/H200) and ":4096:2:16:8" = 8 MiB + 128 KiB elsewhere.
# Handles are per thread, and autograd runs CUDA backward on its own device thread, so a
# training step has two: the main thread's (forward) and the backward thread's.
CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
# cuBLASLt workspace (same file, parseCUDABlasLtWorkspaceSize): CUBLASLT_WORKSPACE_SIZE KiB,
# default 1024 KiB, one per (handle, stream), taken at the first cuBLASLt call: addmm with a
# 1-D bias (nn.Linear with bias) and _scaled_mm.
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
WORKSPACE_NAME = "cuBLAS workspace"     # the name the allocator source gives such a block


def cublas_workspace_bytes(sm90: bool = True) -> int:
    """The cuBLAS workspace per handle and stream, as parseChosenWorkspaceSize computes it."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        found = re.findall(r":([0-9]+):([0-9]+)", config)
        if found:
            return sum(int(size) * 1024 * int(count) for size, count in found)
    return CUBLAS_WORKSPACE_SM90 if sm90 else CUBLAS_WORKSPACE_DEFAULT


def cublaslt_workspace_bytes() -> int:
    """The cuBLASLt workspace per handle and stream (CUBLASLT_WORKSPACE_SIZE KiB)."""
    value = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    try:
        return int(value) * 1024 if value else CUBLASLT_WORKSPACE_BYTES
    except ValueError:
        return CUBLASLT_WORKSPACE_BYTES


def local_gpu_is_sm90() -> bool:
    """Whether cuBLAS would take Hopper's workspace here: this machine's GPU is sm_90, or
    there is no GPU (the estimate then speaks for an H100/H200)."""
    try:
        if torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability()) == (9, 0)
    except Exception:
        pass
    return True
