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

