"""`torchrun --nproc-per-node 2 -m memdoctor diagnose SCRIPT`: two gloo ranks each trace
themselves, rank 0 prints one diagnosis for both with the ranks named, rank 1 prints
nothing."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import argparse
    import torch
    import torch.distributed as dist
    from torch import nn
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1)
    steps = parser.parse_args().steps
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(8192, 256)).square().mean().backward()     # both ranks: more than the budget
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_ranks_print_one_diagnosis_naming_the_ranks(tmp_path):
    pytest.importorskip("torch.distributed.run")
    (tmp_path / "ddp.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MEMDOCTOR_RANK_WAIT_S": "60"}
    env.pop("MEMDOCTOR_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "memdoctor", "diagnose", "ddp.py", "--budget", "48MiB", "--source", "dispatch",
                           "--steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert out.count("2 ranks: ") == 1, (out, proc.stderr[-2000:])
    assert "rank 0 out of memory" in out and "rank 1 out of memory" in out
    assert out.count("activations on all ranks") == 1
    assert "Traceback" not in out
    assert sorted(p.name for p in tmp_path.glob("ddp.rank*.memrun.json.gz")) == [
        "ddp.rank0.memrun.json.gz", "ddp.rank1.memrun.json.gz"]


@pytest.mark.slow
def test_a_remedy_tried_under_torchrun_is_refused_in_one_line(tmp_path):
    """`--try` runs the script twice in each process; ranks cannot meet in a second process
    group through the launcher's store: each rank says so in one line, exit 2, and nothing hangs
    (the launcher stops the other ranks when the first exits: one may be stopped before it says so)."""
    pytest.importorskip("torch.distributed.run")
    (tmp_path / "ddp.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("MEMDOCTOR_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "memdoctor", "diagnose", "ddp.py", "--budget", "48MiB", "--source", "dispatch",
                           "--try", "ckpt=full", "--", "--steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "--try runs the script twice" in line]
    # each rank says so; the launcher may stop the slower one before it does, on busy cores
    assert 1 <= len(lines) <= 2, proc.stderr[-2000:]
    assert "exitcode  : 2" in proc.stderr


def _ranks_json(tmp_path, *script_args) -> dict:
    script = Path(__file__).parent / "scenarios" / "ddp_buckets.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MEMDOCTOR_RANK_WAIT_S": "60"}
    env.pop("MEMDOCTOR_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "memdoctor", "diagnose", str(script), "--budget", "96MiB", "--source", "dispatch",
                           "--json", "--", *script_args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_ddps_gradient_buckets_are_model_states_with_the_bucket_view_as_the_fix(tmp_path):
    """DDP keeps a copy of every gradient in its buckets: counted with the model states, and
    gradient_as_bucket_view=True offered first, predicted at the peak the script then has."""
    pytest.importorskip("torch.distributed.run")
    (tmp_path / "copy").mkdir()
    out = _ranks_json(tmp_path / "copy")
    first = out["findings"][0]
    assert first["rule"] == "model-states"
    params = (1024 * 2048 + 2048 + 2048 * 1024 + 1024) * 4
    assert "gradient buckets" in first["evidence"][0]
    assert abs(first["accounts_for_bytes"] - 5 * params) <= 64        # and AdamW's step counts
    fix = first["remedies"][0]
    assert "gradient_as_bucket_view=True" in fix["how"]
    (tmp_path / "view").mkdir()
    viewed = _ranks_json(tmp_path / "view", "view")
    assert not viewed["oom"]
    peak = max(r["peak_bytes"] for r in viewed["per_rank"])
    assert abs(fix["predicted_peak_bytes"] - peak) <= 0.02 * peak


ONE_RANK_LEAKS = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch import nn
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    for step in range(30):
        out = model(torch.randn(512, 256))
        loss = out.square().mean()
        loss.backward(retain_graph=rank == 1)
        opt.step()
        opt.zero_grad()
        if rank == 1:
            kept.append(loss)       # rank 1 only: every step's loss and the graph it kept
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_an_oom_on_one_rank_is_reported_without_waiting_for_it(tmp_path):
    """Rank 1 runs out while rank 0 waits in DDP's all-reduce for it: rank 1 leaves at once (exit
    0), rank 0's collective fails, and rank 0 reports rank 1's OOM and exits 3, well before the
    60 s either would wait for the other."""
    pytest.importorskip("torch.distributed.run")
    (tmp_path / "ddp.py").write_text(ONE_RANK_LEAKS)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MEMDOCTOR_RANK_WAIT_S": "60"}
    env.pop("MEMDOCTOR_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "memdoctor", "diagnose", "ddp.py", "--budget", "24MiB", "--source", "dispatch"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=55)
    out = proc.stdout
    assert "rank 1 out of memory" in out and "rank 0 ran" in out, (out, proc.stderr[-2000:])
    assert "leak on rank 1" in out
    assert "exitcode  : 3" in proc.stderr and proc.returncode != 0
