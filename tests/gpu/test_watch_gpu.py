"""memdoctor.watch on a GPU, as a training script uses it: light mode names the cause of an
OOM as full mode does."""
import json

import pytest
import torch
from torch import nn

import memdoctor

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["light", "full"])
def test_watch_names_the_cause_of_an_oom(mode, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = tmp_path / "oom.json"
    with pytest.raises(torch.OutOfMemoryError):
        with memdoctor.watch(model, opt, budget="512MiB", report=report, mode=mode):
            for _ in range(2):
                loss = model(torch.randn(65536, 256, device="cuda")).square().mean()    # 256 MiB a layer
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    data = json.loads(report.read_text())
    assert data["oom"] and data["findings"][0]["rule"] == "activations", [f["rule"] for f in data["findings"]]
    del model, opt
    torch.cuda.empty_cache()


@pytest.mark.parametrize("source", ["allocator", "dispatch"])
def test_the_budget_holds_where_the_process_cached_more_than_it(source, tmp_path):
    """A process that held 2 GiB before (a bigger model earlier in a notebook) keeps those
    segments cached; the allocator hands cached blocks out without checking the cap, so
    the budget releases them first and the run meets its OOM where a 512 MiB GPU would.
    The model is made first: made after, its weights would be carved out of the free
    2 GiB and pin it (the next test)."""
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
    cached = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    del cached
    assert torch.cuda.memory_reserved() >= 2 << 30
    report = tmp_path / "oom.json"
    with pytest.raises(torch.OutOfMemoryError):
        with memdoctor.watch(model, budget="512MiB", report=report, source=source):
            model(torch.randn(65536, 256, device="cuda")).square().mean().backward()   # 256 MiB a layer
    assert torch.cuda.memory_reserved() <= 512 << 20            # the cache released, the cap held
    assert json.loads(report.read_text())["oom"]
    del model
    torch.cuda.empty_cache()


def test_the_budget_says_when_live_tensors_hold_more_than_it(tmp_path, caplog):
    """A live tensor pins its whole segment: a budget smaller than what the process holds
    cannot behave like a GPU of that size, and the user is told so, with the bytes."""
    torch.cuda.empty_cache()
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    model = nn.Linear(256, 256).cuda()
    with caplog.at_level("WARNING", logger="memdoctor"):
        try:
            with memdoctor.watch(model, budget="512MiB", report=tmp_path / "r.json"):
                model(torch.randn(8, 256, device="cuda")).sum().backward()
        except torch.OutOfMemoryError:
            pass        # a new segment (cuBLAS's workspace) is past the cap at once, as the warning says
    assert "more than the budget of 512.00 MiB" in caplog.text and "1.00 GiB" in caplog.text, caplog.text
    del held, model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode", ["light", "full"])
def test_watch_names_a_slow_leak_and_its_line(mode, tmp_path):
    """16 MiB kept a step under a 1 GiB budget with 512 MiB of model states: the OOM comes
    after about 16 steps, stacks paused in full mode for most of them, and the finding
    still names the leak and the line that keeps it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kept = []
    report = tmp_path / "oom.json"
    with pytest.raises(torch.OutOfMemoryError):
        with memdoctor.watch(model, opt, budget="1GiB", report=report, mode=mode):
            for _ in range(200):
                out = model(torch.randn(1024, 4096, device="cuda"))
                out.square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                kept.append(out.detach())
    data = json.loads(report.read_text())
    first = data["findings"][0]
    assert first["rule"] == "leak", [f["rule"] for f in data["findings"]]
    assert "kept.append(out.detach())" in (first.get("source") or {}).get("text", "")
    del model, opt, kept
    torch.cuda.empty_cache()
