"""Which traced matrices are a batch scored against itself (a contrastive loss), read from
real runs: CLIP's logits are; a bias-free Linear as wide as the batch is not."""
import subprocess
import sys
from pathlib import Path

from memdoctor.diagnosis.in_batch import pair_bytes_at_once, pair_matrices
from memdoctor.run import Run

SCENARIOS = Path(__file__).parent / "scenarios"

WIDE_MLP = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.ReLU(), nn.Linear(256, 256, bias=False))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    x = torch.randn(256, 64)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def _traced(script: Path, tmp_path: Path) -> Run:
    out = tmp_path / "run.memrun.json.gz"
    subprocess.run([sys.executable, "-m", "memdoctor", "trace", str(script), "-o", str(out)], check=True,
                   capture_output=True, timeout=300, cwd=tmp_path)
    return Run.load(out)


def test_clip_logits_are_the_batch_against_itself(tmp_path):
    run = _traced(SCENARIOS / "contrastive_two_towers.py", tmp_path)
    pairs = pair_matrices(run)
    assert pairs and {tuple(b.shape) for b in pairs} == {(1024, 1024)}
    assert {b.name for b in pairs} == {"aten.mm"}
    # the scores, the two log-softmaxes saved for backward, and backward's gradients of them
    assert pair_bytes_at_once(run, pairs, 1) >= 3 * 1024 * 1024 * 4


def test_a_linear_as_wide_as_the_batch_is_not(tmp_path):
    script = tmp_path / "wide_mlp.py"
    script.write_text(WIDE_MLP)
    run = _traced(script, tmp_path)
    assert any(b.name == "aten.mm" and b.shape == [256, 256] for b in run.blocks.values())
    assert pair_matrices(run) == []
