"""pytest's hooks for this suite: GPU tests are skipped where there is no CUDA device, and
run side by side (pytest -n) they share the GPU except one marked whole_gpu, which runs
alone. Helpers the tests share live in tests/support/."""
import os
import tempfile

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_turn(request):
    """A GPU test holds a shared lock while it runs, a whole_gpu test an exclusive one: s10
    starts a process that takes all the GPU memory left, which would make the tests beside it
    run out of memory, and two of it side by side each find too little to fill."""
    if "gpu" not in request.keywords:
        yield
        return
    import fcntl
    with open(os.path.join(tempfile.gettempdir(), "memdoctor-gpu-tests.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if "whole_gpu" in request.keywords else fcntl.LOCK_SH)
        yield
