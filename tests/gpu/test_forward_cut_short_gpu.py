"""On CUDA (the allocator source, which knows the outermost module at an OOM): a training
forward out in its second block of six still has the blocks after it counted, and the
backward thread's cuBLAS workspaces, so a quarter batch is predicted from above
(tests/scenarios/blocks_cut_short.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SCRIPT = Path(__file__).parents[1] / "scenarios" / "blocks_cut_short.py"


def _memdoctor(*args, cwd) -> dict:
    proc = subprocess.run([sys.executable, "-m", "memdoctor", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_a_forward_out_part_way_predicts_a_quarter_batch_from_above_on_cuda(tmp_path):
    out = _memdoctor("diagnose", SCRIPT, "--budget", "96MiB", "--json", "--", 8, "cuda", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "activations", [f["rule"] for f in out["findings"]]
    assert any(" of 6: the rest of the forward" in e for e in first["evidence"]), first["evidence"]
    quarter = next(r for r in first["remedies"] if r["plan"] == "micro=auto")
    real = _memdoctor("trace", SCRIPT, "--json", "--", 2, "cuda", cwd=tmp_path)["peak_bytes"]
    assert real <= quarter["predicted_peak_bytes"] <= 1.2 * real, (quarter["predicted_peak_bytes"], real)
