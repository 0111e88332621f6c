"""A model too big for the budget on a real GPU: moved there with `.to("cuda")` or built
there (`torch.set_default_device("cuda")`), the OOM comes while its weights are made, and
the model is named, not data."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = """
import sys
import torch
from torch import nn
if sys.argv[1] == "built":
    torch.set_default_device("cuda")
model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(5)])      # 320 MiB in fp32
model = model.to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(torch.randn(8, 4096, device="cuda")).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize("how, cls", [("moved", "Sequential"), ("built", "Linear")])
def test_a_model_too_big_for_the_budget_is_named_while_it_is_made(how, cls, tmp_path):
    script = tmp_path / "too_big.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", str(script), "--budget", "200MiB",
                           "--json", "--", how], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    first = out["findings"][0]
    assert first["rule"] == "model-states", [(f["rule"], f["title"]) for f in out["findings"]]
    assert (first["details"]["how"], first["details"]["building"]) == (how, cls)
    assert first["details"]["requested"] >= 4096 * 4096 * 4
