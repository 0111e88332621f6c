"""memdoctor.watch on a GPU, as a training script uses it: light mode still names the cause
of an OOM, and full mode names a slow leak's cause and line although it pauses Python stacks
between its first steps and the steps near the budget."""
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


def test_a_slow_leak_is_named_with_the_line_that_keeps_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4096, 1024, device="cuda")
    kept = []
    report = tmp_path / "oom.json"
    with pytest.raises(torch.OutOfMemoryError):
        with memdoctor.watch(model, opt, budget="1GiB", report=report):
            for _ in range(200):
                out = model(x)
                out.square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                kept.append(out)        # 16 MiB a step, for good
    steps = len(kept)
    data = json.loads(report.read_text())
    first = data["findings"][0]
    assert steps > 20 and first["rule"] == "leak", (steps, [f["rule"] for f in data["findings"]])
    assert "kept.append(out)" in ((first.get("source") or {}).get("text") or ""), first.get("source")
    del model, opt, kept, x
    torch.cuda.empty_cache()
