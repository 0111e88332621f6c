"""Multi-rank runs: a Run per rank (named by rank), merged findings with the ranks named."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from memdoctor.cli import main
from memdoctor.capture.ranks import per_rank_path, rank_info
from memdoctor.diagnosis.merge import merge_findings
from memdoctor.diagnosis.base import FREE_FIX, STRUCTURAL, Finding
from tests.support.paths import ROOT


def test_per_rank_paths():
    assert per_rank_path("run.memrun.json.gz", 1) == "run.rank1.memrun.json.gz"
    assert per_rank_path("out/oom.json", 0) == "out/oom.rank0.json"
    assert per_rank_path("oom.html", 3) == "oom.rank3.html"
    assert per_rank_path("snapshot", 2) == "snapshot.rank2"


def test_rank_info_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_info() == (1, 4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_info() is None
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert rank_info() is None


def test_merged_findings_keep_the_worst_rank_and_the_engine_order():
    leak0 = Finding("leak", "grows 1 MiB a step", 1 << 20, tier=FREE_FIX)
    leak1 = Finding("leak", "grows 3 MiB a step", 3 << 20, tier=FREE_FIX)
    acts1 = Finding("activations", "activations", 1 << 30, tier=STRUCTURAL)
    merged = merge_findings([(0, [leak0]), (1, [acts1, leak1])])
    assert [m.finding.rule for m in merged] == ["leak", "activations"]     # a free fix first
    leak = merged[0]
    assert leak.ranks == [0, 1] and leak.worst_rank == 1 and leak.finding is leak1
    assert leak.to_dict()["accounts_for_bytes_by_rank"] == {"0": 1 << 20, "1": 3 << 20}
    assert merged[1].ranks == [1]


SCRIPT = textwrap.dedent('''
    import os, sys, torch
    import memdoctor
    from torch import nn
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = 256 if rank == 0 else 8192          # rank 1 got the long sequences
    try:
        with memdoctor.watch(model, opt, budget="48MiB", report=sys.argv[1], source="dispatch"):
            for _ in range(2):
                x = torch.randn(batch, 256)
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError:
        print(f"rank {rank}: out of memory", flush=True)
''')


def test_torchrun_ranks_write_their_own_runs_and_diagnose_together(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    report = tmp_path / "oom.memrun.json.gz"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(report)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [tmp_path / "oom.rank0.memrun.json.gz", tmp_path / "oom.rank1.memrun.json.gz"]
    assert all(r.exists() for r in runs) and not report.exists()

    code = main(["diagnose", "--run", str(runs[1]), str(runs[0]), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 3
    assert out["ranks"] == [0, 1] and out["first_oom_rank"] == 1
    assert [r["oom"] for r in out["per_rank"]] == [False, True]
    top = out["findings"][0]
    assert top["ranks"] == [1] and top["worst_rank"] == 1 and top["rule"] == "activations"

    code = main(["diagnose", "--run", str(runs[0]), str(runs[1])])
    text = capsys.readouterr().out
    assert code == 3
    assert "rank 1 ran out of memory first" in text and "activations on rank 1:" in text

    assert main(["diagnose", "--run", str(runs[0]), str(runs[0])]) == 2      # one run per rank
    assert "same rank" in capsys.readouterr().err
