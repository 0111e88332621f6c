"""Every scenario under its CUDA budget: a real OOM with its requested size, and the
expected cause ranked first.

s10 starts a neighbour process that takes all of the GPU's memory but the scenario's budget:
run its tests with no other process on the GPU (`pytest tests/gpu -k s10`, not under `-n`;
the rest run side by side with `-n 8 -k "not s10"`)."""
import json
import subprocess
import sys

import pytest

from tests.support.paths import shared_path

pytestmark = pytest.mark.gpu

EXPECTED = None


def _expected():
    global EXPECTED
    if EXPECTED is None:
        EXPECTED = json.loads(shared_path("scenarios", "expected.json").read_text())
    return EXPECTED


SCENARIOS = [f"s{i:02d}" for i in range(1, 11)]


@pytest.fixture(autouse=True)
def empty_device():
    """s10 sizes its neighbour from the free memory: give back what this test process
    (earlier GPU tests) keeps cached."""
    import gc
    import torch
    gc.collect()
    torch.cuda.empty_cache()


def _script(prefix):
    exp = _expected()
    name = next(n for n in exp if n.startswith(prefix))
    return name, exp[name]


@pytest.mark.parametrize("prefix", SCENARIOS)
def test_diagnose_names_the_cause_first(prefix, tmp_path):
    name, exp = _script(prefix)
    path = shared_path("scenarios", name)
    cmd = [sys.executable, "-m", "memdoctor", "diagnose", str(path), "--json"]
    if exp["budget"].get("cuda"):
        cmd += ["--budget", exp["budget"]["cuda"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["oom"] is True
    assert out["ooms"] and out["ooms"][0]["requested_bytes"], out["ooms"]
    rules = [f["rule"] for f in out["findings"]]
    assert rules and rules[0] == exp["cause"], (rules, out["breakdown"])
