"""What the allocator source (CUDA) cannot see, and what stands in for it. It cannot tell a
saved tensor from an output the script still refers to: backward calls told to keep their
graph are noted (with their line), and only a step that made one keeps its graph into the
next; a loss made between forward and backward that backward frees is saved, what outlives
a pass under no_grad is not. It knows no shape for a tensor not yet bound to a name: data
made before any model ran is named without one. cuBLAS's workspaces take their part of any
limit. Runs traced here on the CPU are stripped to what that source records."""
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_a_loss_outside_the_model_saved_for_backward_counts_as_activations():
    """What the allocator source makes of a step (no saved-tensor hooks): a tensor made
    between the forward and the backward (a similarity matrix of a contrastive loss) that the
    backward frees is saved for it; one freed before the backward is a temporary, and so is
    the batch made before the forward."""
    from memdoctor.capture.allocator import _freed_by_backward_are_activations, _label_blocks
    from memdoctor.run import Block, Mark
    run = Run(source="allocator")
    run.marks = [Mark(0, "other", 0), Mark(2, "forward", 0, "model"), Mark(10, "other", 0),
                 Mark(20, "backward", 0, "model"), Mark(30, "optimizer", 0), Mark(40, "other", 1)]
    blocks = {"batch": (1, 25, 0), "scores": (12, 22, 2), "softmax_scratch": (13, 14, 2), "loss": (15, 45, 2)}
    made = {}
    for i, (name, (alloc, free, mark)) in enumerate(blocks.items()):
        made[name] = run.blocks[i] = Block(i, 1 << 20, alloc_seq=alloc, free_seq=free)
    _label_blocks(run, run.marks, {made[n].id: (blocks[n][2], None) for n in blocks})
    assert {b.category for b in made.values()} == {"temporaries"}
    _freed_by_backward_are_activations(run)
    assert {n: b.category for n, b in made.items()} == {
        "batch": "temporaries", "scores": "activations", "softmax_scratch": "temporaries", "loss": "temporaries"}


def test_model_states_are_weighed_against_what_tensors_can_have(tmp_path):
    """On a Hopper GPU cuBLAS's two workspaces take 64 MiB of any limit: a GAN's two models
    and their Adam states (58 MiB) crowd a 132 MiB limit whose 64 MiB are workspaces, though
    they are under half of it."""
    from memdoctor.diagnosis.rules import model_states
    from memdoctor.run import Block
    saved = tmp_path / "run.memrun.json.gz"
    subprocess.run([sys.executable, "-m", "memdoctor", "trace", str(SCENARIOS / "gan_two_optimizers.py"),
                    "--budget", "68MiB", "-o", str(saved)], capture_output=True, timeout=600, check=False, cwd=tmp_path)
    run = Run.load(saved)
    run.budget_bytes = 132 << 20
    plain = facts_from_run(run)
    assert plain.model_state_bytes < 0.5 * plain.limit_bytes and model_states.check(plain) is None
    with_workspaces = facts_from_run(run)
    with_workspaces.focus_blocks += [Block(10 ** 6 + i, 32 << 20, "other", "cuBLAS workspace") for i in range(2)]
    found = model_states.check(with_workspaces)
    assert found is not None and "64.00 MiB of it cuBLAS's workspaces" in found.evidence[0]


def test_what_outlives_a_pass_under_no_grad_is_its_output_not_saved():
    """An evaluation under no_grad gathering its logits in a list: what its passes leave is
    their outputs (the leak rule's to read), where a training pass's are saved for backward."""
    from memdoctor.capture.allocator import _outliving_forward_are_activations
    from memdoctor.run import Block, Mark
    run = Run(source="allocator")
    run.marks = [Mark(0, "other", 0), Mark(2, "forward", 0, "model"), Mark(10, "backward", 0, "model"),
                 Mark(20, "optimizer", 0), Mark(30, "other", 1), Mark(32, "forward", 1, "model"),
                 Mark(40, "other", 1)]
    run.meta["forward_calls"] = [{"mark_start": 1, "mark_end": 2, "grad_enabled": True},
                                 {"mark_start": 5, "mark_end": 6, "grad_enabled": False}]
    saved = run.blocks[0] = Block(0, 1 << 20, "temporaries", phase="forward", alloc_seq=3, free_seq=12)
    output = run.blocks[1] = Block(1, 1 << 20, "temporaries", phase="forward", step=1, alloc_seq=33)
    run.actions = [0] * 50          # the events' count is all this reads of them
    _outliving_forward_are_activations(run)
    assert (saved.category, output.category) == ("activations", "temporaries")


BLIND_CASES = [
    ("two_towers_contrastive.py", [], "192MiB", "activations"),     # the loss's softmaxes, outside the towers
    ("eval_gathers_outputs.py", [], "160MiB", "leak"),              # outputs of passes under no_grad
    # no backward kept a graph; an 8000-word head is a vocabulary by the loss's log-softmax over
    # it, an op name the allocator does not record: without it, the blocks' activations come first
    ("head_outside_blocks.py", [], "180MiB", "large-logits", "activations"),
    ("validation_sums_loss_tensors.py", [], "150MiB", "eval-without-no-grad"),
    # dropping retain_graph fits only if the backward frees what it used as it goes: which
    # saved tensors it has used by its peak is read from sizes where no shapes are known
    ("retain_graph_stray.py", [], "56MiB", "retained-graph"),
]


@pytest.mark.parametrize("case", BLIND_CASES, ids=[c[0] for c in BLIND_CASES])
def test_named_from_what_the_allocator_records(case):
    """Each scenario traced on the CPU, then stripped to what the allocator source records
    (no shapes, op names or saved-tensor hooks) and labelled as it labels: the cause is the
    one named with everything known (benchmarks/allocator_blind.py runs them all)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import allocator_blind
    row = allocator_blind.run_case(*case[:4])
    assert row["dispatch"][:1] == [case[3]] and row["allocator"][:1] == [case[-1]], row
