"""cuBLAS's workspaces among the allocator source's blocks: per thread, the earliest block of
a workspace's exact size that is never freed and that no tensor claims, and no others.
Checked on a run built by hand; tests/gpu/test_allocator_gpu.py checks it on an H200."""
import pytest

from memdoctor.capture.allocator import _blas_workspaces
from memdoctor.cuda.blas_workspaces import cublas_workspace_bytes, cublaslt_workspace_bytes
from memdoctor.run import Block, Run

WS = cublas_workspace_bytes(True)      # 32 MiB: no GPU here stands for an sm90 one


@pytest.fixture(autouse=True)
def _no_config(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)


def _block(run: Run, nbytes: int, phase: str, freed: bool = False, shape=None) -> Block:
    bid = len(run.blocks)
    b = Block(bid, nbytes, "temporaries", "", phase=phase, alloc_seq=bid, free_seq=bid + 100 if freed else None)
    if shape:
        b.shape, b.dtype = shape, "float32"
    run.blocks[bid] = b
    return b


def test_the_first_unclaimed_blocks_of_a_workspaces_size_are_workspaces():
    run = Run(source="allocator")
    forward = _block(run, WS, "forward")
    forward.name = "linear.py:134 forward"                    # the frame that made it
    lt = _block(run, cublaslt_workspace_bytes(), "forward")
    freed = _block(run, WS, "forward", freed=True)            # freed: a tensor of that size
    claimed = _block(run, WS, "forward", shape=[2048, 4096])  # a tensor's: it has a shape
    backward = _block(run, WS, "backward")
    third = _block(run, WS, "backward")                       # one a thread
    _blas_workspaces(run)
    assert [b.category for b in (forward, lt, backward)] == ["other"] * 3
    assert {b.name for b in (forward, lt, backward)} == {"cuBLAS workspace"}
    assert [b.category for b in (freed, claimed, third)] == ["temporaries"] * 3


def test_a_kept_tensor_of_a_workspaces_size_in_the_forward_stays_a_tensor():
    """An autoencoder's [2048, 4096] fp32 output kept in a list is 32 MiB, made in the first
    forward after the main thread's workspace and before the backward thread's."""
    run = Run(source="allocator")
    batch = _block(run, WS, "other", freed=True)              # the batch, made before any matmul
    main = _block(run, WS, "forward")
    kept = _block(run, WS, "forward")
    backward = _block(run, WS, "backward")
    _blas_workspaces(run)
    assert [b.category for b in (batch, main, kept, backward)] == ["temporaries", "other", "temporaries", "other"]


def test_a_block_a_live_tensor_keeps_its_data_in_is_no_workspace():
    """Where the main thread's workspace came before the trace (or was never taken), the kept
    output is the thread's first block of that size: a tensor Python refers to says it is one."""
    run = Run(source="allocator")
    kept = _block(run, WS, "forward")
    kept.address = 0x7F0000000000
    backward = _block(run, WS, "backward")
    backward.address = 0x7F0004000000
    _blas_workspaces(run, {kept.address})
    assert (kept.category, backward.category) == ("temporaries", "other")


def test_a_configured_workspace_size_is_the_one_recognised(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    run = Run(source="allocator")
    default = _block(run, WS, "forward")
    configured = _block(run, 8 << 20, "forward")
    _blas_workspaces(run)
    assert (default.category, configured.category) == ("temporaries", "other")
