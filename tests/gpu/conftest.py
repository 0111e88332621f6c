"""GPU tests share a process with the others of their xdist worker: a test that leaves
tensors alive changes what the next one's allocator holds. Each test is checked after it
runs, so that a leak fails the test that made it, not a later one."""
import gc

import pytest


@pytest.fixture(autouse=True)
def _no_gpu_memory_left_behind(request):
    import torch
    if not torch.cuda.is_available():
        yield
        return
    before = _allocated(torch)
    yield
    left = _allocated(torch) - before
    assert left <= LEFT_BEHIND_LIMIT, f"{request.node.name} left {left / 2**20:.1f} MiB of GPU tensors alive"


LEFT_BEHIND_LIMIT = 64 << 20        # the libraries' own small buffers (cuDNN dropout states, RNG) may stay


def _allocated(torch) -> int:
    """Bytes of live tensors: cuBLAS's workspaces (kept per thread and stream) cleared first."""
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    return torch.cuda.memory_allocated()
