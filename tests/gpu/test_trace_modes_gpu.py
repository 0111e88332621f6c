"""The cheaper ways of tracing on CUDA name the same cause: every scenario under its CUDA
budget, traced in light mode (the allocator's history and the models' own hooks only) and
under the dispatch source, gives the expected first finding, as the default tracing does
(tests/gpu/test_scenarios_gpu.py; s10's tests, as there, with no other process on the GPU)."""
import json
import subprocess
import sys

import pytest

from tests.support.paths import shared_path

pytestmark = pytest.mark.gpu

SCENARIOS = [f"s{i:02d}" for i in range(1, 11)]


def _case(prefix):
    expected = json.loads(shared_path("scenarios", "expected.json").read_text())
    name = next(n for n in expected if n.startswith(prefix))
    return name, expected[name]


# Both sources run under the GPU's allocator capped at the budget, so both run out where the
# GPU does; where an op is refused midway (s07's foreach step), the dispatch source takes its
# whole request from the op's outputs (memdoctor.capture.op_outputs).
def _cases():
    for prefix in SCENARIOS:
        yield pytest.param(prefix, ["--light"], id=f"{prefix}-light")
        yield pytest.param(prefix, ["--source", "dispatch"], id=f"{prefix}-dispatch")


@pytest.mark.parametrize("prefix,how", list(_cases()))
def test_cheaper_tracing_names_the_same_cause(prefix, how, tmp_path):
    import torch
    torch.cuda.empty_cache()
    name, exp = _case(prefix)
    cmd = [sys.executable, "-m", "memdoctor", "diagnose", str(shared_path("scenarios", name)), "--json", *how]
    if exp["budget"].get("cuda"):
        cmd += ["--budget", exp["budget"]["cuda"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    rules = [f["rule"] for f in out["findings"]]
    assert rules and rules[0] == exp["cause"], (rules, out["breakdown"])
