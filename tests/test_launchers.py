"""`torchrun --nproc-per-node 2 -m memdoctor diagnose SCRIPT`: two gloo ranks each trace
themselves, rank 0 prints one diagnosis for both with the ranks named, rank 1 prints
nothing."""
import os
import subprocess
import sys
import textwrap

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
def test_a_remedy_tried_under_torchrun_runs_the_script_again_in_its_process_group(tmp_path):
    """`--try` runs the script twice in each rank's process: the process group the first run
    made and left is ended first, so the second can make it again, and the fix is measured."""
    pytest.importorskip("torch.distributed.run")
    (tmp_path / "ddp.py").write_text(SCRIPT.replace("    dist.destroy_process_group()\n", ""))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("MEMDOCTOR_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "memdoctor", "diagnose", "ddp.py", "--budget", "48MiB", "--source", "dispatch",
                           "--try", "ckpt=full", "--", "--steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "twice" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert "after --try ckpt=full" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "nothing to apply it to" not in proc.stdout
