"""`memdoctor trace` as a user runs it: a subprocess, its exit code, stdout and stderr."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from memdoctor import attribution as A
from memdoctor.run import CATEGORIES, Run

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn

    print("ARGV=" + json.dumps(sys.argv))
    if "--fail" in sys.argv:
        raise ValueError("the script's own bug")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    for step in range(2):
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print("done")
""")


def memdoctor(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MEMDOCTOR_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "memdoctor", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memdoctor: "), proc.stderr
    return lines[0]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_missing_script_is_a_usage_error(tmp_path):
    """A script that does not exist: exit 2, one line on stderr, nothing traced."""
    line = assert_one_line_error(memdoctor("trace", "nope.py", cwd=tmp_path), 2)
    assert "nope.py" in line
    assert os.listdir(tmp_path) == []


def test_directory_is_a_usage_error(tmp_path):
    """A folder given as the script: exit 2, one line."""
    (tmp_path / "folder").mkdir()
    line = assert_one_line_error(memdoctor("trace", "folder", cwd=tmp_path), 2)
    assert "folder" in line


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_unreadable_script_is_a_usage_error(script, tmp_path):
    """A script the user cannot read: exit 2, one line."""
    script.chmod(0)
    try:
        line = assert_one_line_error(memdoctor("trace", script.name, cwd=tmp_path), 2)
    finally:
        script.chmod(0o644)
    assert "cannot read" in line


def test_json_when_it_fits_and_script_args(script, tmp_path):
    """--json prints the versioned contract (seven categories that add up to the peak) and
    exits 0; arguments after `--` reach the script unchanged; the saved run agrees."""
    args = ["--alpha", "1", "two words", "--", "-x"]
    proc = memdoctor("trace", script.name, "--json", "--source", "dispatch", "-o", "run.memrun.json.gz",
                     "--", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)           # stdout is the JSON alone: the script's prints go to stderr
    assert {"version", "oom", "ooms", "peak_bytes", "budget_bytes", "breakdown"} <= set(out)
    assert out["version"] == 1 and out["oom"] is False and out["ooms"] == []
    assert out["budget_bytes"] is None
    assert list(out["breakdown"]) == CATEGORIES
    assert sum(out["breakdown"].values()) == out["peak_bytes"] > 0
    argv_line = next(line for line in proc.stderr.splitlines() if line.startswith("ARGV="))
    assert json.loads(argv_line[5:]) == [script.name, *args]
    run = Run.load(tmp_path / "run.memrun.json.gz")
    assert A.peak(run)[1] == out["peak_bytes"]
    assert run.argv == args and run.script == str(script)


def test_json_on_oom_exits_3(script, tmp_path):
    """Under a budget the script cannot meet: exit 3, the OOM in the JSON with the request
    that would have passed the budget, and a run file saved beside it by default."""
    proc = memdoctor("trace", script.name, "--json", "--budget", "24KiB", "--source", "dispatch", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    out = json.loads(proc.stdout)
    assert out["oom"] is True and out["budget_bytes"] == 24 * 1024
    oom = out["ooms"][0]
    assert oom["simulated"] is True and oom["requested_bytes"] > 0
    assert oom["live_bytes"] + oom["requested_bytes"] > out["budget_bytes"]
    assert list(out["breakdown"]) == CATEGORIES
    assert Run.load(tmp_path / "train.memrun.json.gz").ooms


def test_failing_script_exits_1_in_one_line(script, tmp_path):
    """The script's own exception (not memory): exit 1 and one line naming it, no traceback."""
    proc = memdoctor("trace", script.name, "--source", "dispatch", "--", "--fail", cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["memdoctor: the script failed: ValueError: the script's own bug"], proc.stderr
