"""What the allocator source (CUDA) cannot see, and what stands in for it. It cannot tell a
saved tensor from an output the script still refers to: backward calls told to keep their
graph are noted (with their line), and only a step that made one keeps its graph into the
next. It knows no shape for a tensor not yet bound to a name: data made before any model
ran is named without one. Runs traced here are stripped to what that source records."""
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from memdoctor.capture.session import Tracer
from memdoctor.diagnosis.facts import facts_from_run
from memdoctor.diagnosis.rules import retained_graph
from memdoctor.run import Run

SCENARIOS = Path(__file__).parent / "scenarios"


def test_retaining_calls_are_noted_with_their_line_and_the_wrappers_removed():
    backward, grad = torch.autograd.backward, torch.autograd.grad
    model = nn.Linear(8, 8)
    with Tracer(models=[model], source="dispatch") as tracer:
        x = torch.randn(4, 8, requires_grad=True)
        model(x).sum().backward()                                           # frees its graph
        model(x).sum().backward(retain_graph=True)
        (g,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        g.sum().backward()
    assert (torch.autograd.backward, torch.autograd.grad) == (backward, grad)
    calls = tracer.run.meta["retaining_backwards"]
    lines = [c["site"][1] for c in calls]
    assert [Path(c["site"][0]).name for c in calls] == ["test_allocator_blind_spots.py"] * 2
    source = Path(__file__).read_text().splitlines()
    assert "retain_graph=True" in source[lines[0] - 1] and "create_graph=True" in source[lines[1] - 1]


def test_a_graph_kept_into_the_next_step_needs_a_retaining_backward_in_that_step(tmp_path):
    saved = tmp_path / "run.memrun.json.gz"
    subprocess.run([sys.executable, "-m", "memdoctor", "trace", str(SCENARIOS / "retain_graph_stray.py"),
                    "--budget", "56MiB", "-o", str(saved)], capture_output=True, timeout=600, check=False)
    run = Run.load(saved)
    assert run.meta["retaining_backwards"]
    assert retained_graph.check(facts_from_run(run)) is not None
    run.meta["retaining_backwards"] = []         # the same tensors, no backward told to keep them
    assert retained_graph.check(facts_from_run(run)) is None


DATA_FIRST = """import torch
x, y = torch.randn(180_000, 256), torch.randint(0, 10, (180_000,))
model = torch.nn.Linear(256, 10)
print(model(x[:10]).sum())
"""


def test_data_made_before_any_model_is_named_without_its_shape(tmp_path):
    """Out of memory making the dataset, before any model ran: the allocator source knows
    neither the shape of a tensor not yet bound to a name nor a category for what is made
    outside any mark; the data is named all the same."""
    from memdoctor.diagnosis.rules import data_on_device
    script, saved = tmp_path / "data_first.py", tmp_path / "run.memrun.json.gz"
    script.write_text(DATA_FIRST)
    subprocess.run([sys.executable, "-m", "memdoctor", "trace", str(script), "--budget", "177MiB", "-o", str(saved)],
                   capture_output=True, timeout=600, check=False, cwd=tmp_path)
    run = Run.load(saved)
    for b in run.blocks.values():           # as the allocator source leaves them
        b.shape, b.category = [], "other"
    found = data_on_device.check(facts_from_run(run))
    assert found is not None and found.accounts_for_bytes == 180_000 * 256 * 4 + 180_000 * 8
