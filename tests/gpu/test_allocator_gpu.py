"""The allocator source on a real GPU: bytes joined to owners must agree with the caching
allocator's own counters."""
import pytest
import torch

from memdoctor.attribution import breakdown_at, live_curve, peak
from memdoctor.run import Action
from memdoctor.capture.session import Tracer

pytestmark = pytest.mark.gpu


def _round512(n: int) -> int:
    return (n + 511) // 512 * 512


@pytest.fixture(scope="module")
def gpt2_run():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with Tracer(models=[model], optimizers=[optimizer], source="allocator") as tracer:
        for _ in range(2):
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    params = list(model.parameters())
    params += list(model.buffers())
    yield tracer.run, params, optimizer
    del model, optimizer
    torch.cuda.empty_cache()


def test_live_bytes_equal_memory_allocated_at_every_phase_boundary(gpt2_run):
    run, _, _ = gpt2_run
    curve = live_curve(run)
    samples = run.meta["phase_samples"]
    assert len(samples) >= 8
    mismatches = [(s["seq"], curve[s["seq"]] if s["seq"] >= 0 else 0, s["allocated"]) for s in samples
                  if s["seq"] < len(curve) and (curve[s["seq"]] if s["seq"] >= 0 else 0) != s["allocated"]]
    worst = max((abs(c - a) for _s, c, a in mismatches), default=0)
    print(f"phase boundaries: {len(samples)}, mismatched: {len(mismatches)}, worst {worst} bytes")
    assert not mismatches[:5], mismatches[:5]


def test_peak_equals_max_memory_allocated(gpt2_run):
    run, _, _ = gpt2_run
    assert peak(run)[1] == run.meta["peak_allocated"]


def _slack(tensors) -> int:
    """The allocator hands out a whole free block when splitting would leave 1 MiB or
    less: a large tensor's block may exceed its rounded size by up to 1 MiB."""
    return sum(1 << 20 for t in tensors if t.numel() * t.element_size() > 1 << 20)


def _check(counted: int, tensors) -> None:
    analytic = sum(_round512(t.numel() * t.element_size()) for t in tensors)
    assert analytic <= counted <= analytic + _slack(tensors), (counted, analytic)


def test_model_states_equal_analytic_bytes(gpt2_run):
    run, params, optimizer = gpt2_run
    end = breakdown_at(run, run.num_events - 1)
    _check(end.by_category["weights"], params)
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda]
    _check(end.by_category["optimizer_state"], states)
    # gradients at the start of the last optimizer step: every parameter has one
    opt_marks = [m for m in run.marks if m.phase == "optimizer"]
    at_step = breakdown_at(run, max(opt_marks[-1].seq - 1, 0))
    _check(at_step.by_category["gradients"], [p for p in params if p.requires_grad])
    weight_blocks = [b for b in run.blocks.values() if b.category == "weights"]
    assert len(weight_blocks) == len({p.untyped_storage().data_ptr() for p in params})


def test_activations_and_phases_present(gpt2_run):
    run, _, _ = gpt2_run
    phases = {m.phase for m in run.marks}
    assert {"forward", "backward", "optimizer"} <= phases
    seq, _ = peak(run)
    b = breakdown_at(run, seq)
    assert b.by_category["activations"] > 0
    ooms = [a for a in run.actions if a == Action.OOM]
    assert not ooms


def test_checkpoint_early_stop_runs_under_the_allocator_source():
    """torch.utils.checkpoint's default (non-reentrant, early stop) raises an exception inside
    backward to stop recomputing; torch's allocator history loses it when it gathers Python
    stacks at frees (a SystemError, measured with torch 2.11 on an H200). The source records
    stacks at allocations only, and the loop runs as it does unwatched."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    w = torch.randn(512, 4096, device="cuda", requires_grad=True)
    h = torch.randn(2048, 512, device="cuda", requires_grad=True)
    t = torch.randint(0, 4096, (2048,), device="cuda")

    def chunk_loss(h, t):
        return torch.nn.functional.cross_entropy(h @ w, t, reduction="sum")

    def step():
        loss = sum(checkpoint(chunk_loss, hc, tc, use_reentrant=False)
                   for hc, tc in zip(h.split(256), t.split(256)))
        loss.backward()
        return loss.item(), w.grad.clone()
    want_loss, want_grad = step()
    w.grad = h.grad = None
    with Tracer(source="allocator") as tracer:
        got_loss, got_grad = step()
    assert got_loss == pytest.approx(want_loss) and torch.allclose(got_grad, want_grad)
    assert tracer.run.num_events > 0


def test_steps_traced_with_stacks_paused_keep_their_lines_and_activations():
    """Full mode pauses Python stacks after the first steps (a few microseconds an
    allocation, on a fast loop the largest cost of the history): a later step's blocks
    still name the user's line, the one the stacked step named, and what backward keeps
    still counts as activations."""
    from memdoctor.capture import allocator
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 1024, device="cuda")
    steps = allocator.STACKED_STEPS + 3
    with Tracer(models=[model], optimizers=[opt], source="allocator") as tracer:
        for _ in range(steps):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    run = tracer.run

    def forward_blocks(step):
        return [b for b in sorted(run.blocks.values(), key=lambda b: b.alloc_seq)
                if b.step == step and b.phase == "forward"]
    stacked, paused = forward_blocks(allocator.STACKED_STEPS - 1), forward_blocks(steps - 1)
    assert [b.nbytes for b in stacked] == [b.nbytes for b in paused] and paused
    assert [b.source for b in stacked] == [b.source for b in paused]
    assert all(b.source >= 0 and run.sources[b.source][0].endswith("test_allocator_gpu.py") for b in paused)
    kept = [b.category for b in paused if b.nbytes == 256 * 4096 * 4]     # GELU's input and output
    assert kept.count("activations") == 2, kept


WORKSPACES = '''
import json, torch
from torch import nn
from memdoctor.capture.session import Tracer
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with Tracer(models=[model], optimizers=[opt], source="allocator") as tracer:
    for _ in range(2):
        model(torch.randn(64, 256, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
print(json.dumps([(b.nbytes, b.category, b.phase, b.name) for b in tracer.run.blocks.values()
                  if b.nbytes >= 1 << 20]))
'''


def test_cublas_workspaces_count_as_other_not_as_the_forwards_activations():
    """In a fresh process the first matmul of the main thread (forward) and of autograd's
    thread (backward) each takes a cuBLAS workspace; nothing else here is 1 MiB or more."""
    import json
    import subprocess
    import sys
    from memdoctor.cuda.blas_workspaces import cublas_workspace_bytes, local_gpu_is_sm90
    done = subprocess.run([sys.executable, "-c", WORKSPACES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    big = json.loads(done.stdout.strip().splitlines()[-1])
    assert big and all(category == "other" and name == "cuBLAS workspace" for _n, category, _p, name in big), big
    full = [phase for nbytes, _c, phase, _n in big if nbytes == cublas_workspace_bytes(local_gpu_is_sm90())]
    assert sorted(full) == ["backward", "forward"], big
