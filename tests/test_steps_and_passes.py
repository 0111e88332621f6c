"""What the rules' preconditions rest on, checked on small traced loops: steps recognised from
whatever the script repeats (optimizer steps, backward() calls, model calls), forward passes
without backward only when a graph was built, inputs as the model received them, the leak
rate without the optimizer's state, and the post-processing after a script linear in its
length."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from memdoctor.capture.session import Tracer, label_forwards_without_backward
from memdoctor.diagnosis import diagnose, facts_from_run
from memdoctor.run import Action, Block, Mark, Run

NOB = "forward-without-backward"


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def step_of_outputs(run: Run, op: str = "aten.addmm") -> list[int]:
    """The step of each final-layer output, in the order they were made."""
    return [b.step for b in run.blocks.values() if b.name == op and b.shape == [32, 10]]


# ---- steps -------------------------------------------------------------------------------------
def test_steps_from_backward_calls_when_no_optimizer_steps():
    """pytorch/examples' word_language_model updates with p.data.add_(p.grad): no torch.optim."""
    model = mlp()
    with Tracer(budget=None, source="dispatch") as t:
        for _ in range(5):
            model.zero_grad()
            model(torch.randn(32, 64)).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
    run = t.run
    assert run.meta["steps_from"] == "backward"
    assert step_of_outputs(run) == [0, 1, 2, 3, 4]
    assert run.steps == 6           # five steps and the tail after the last backward


def test_optimizer_steps_are_the_steps_when_there_are_any():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Tracer(source="dispatch") as t:
        for _ in range(2):          # gradient accumulation: two backward() calls a step
            for _ in range(2):
                model(torch.randn(32, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert t.run.meta["steps_from"] == "optimizer"
    assert step_of_outputs(t.run) == [0, 0, 1, 1]


def test_steps_from_model_calls_without_backward():
    model = mlp()
    with Tracer(source="dispatch") as t, torch.no_grad():
        for _ in range(4):
            model(torch.randn(32, 64))
    assert t.run.meta["steps_from"] == "forward"
    assert step_of_outputs(t.run) == [0, 1, 2, 3]


def test_leak_rate_counts_kept_outputs_not_optimizer_state():
    """Adam makes its state in step 0: the rate is what the loop keeps, one output a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters())
    kept = []
    with Tracer(source="dispatch") as t:
        for _ in range(8):
            out = model(torch.randn(64, 256))
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            kept.append(out)
    facts = facts_from_run(t.run)
    assert facts.growth_per_step == pytest.approx(64 * 512 * 4)


def test_leak_found_with_steps_from_backward_calls():
    model = mlp()
    kept = []
    with Tracer(budget="3MiB", source="dispatch") as t:
        try:
            for _ in range(200):
                model.zero_grad()
                out = model[0](torch.randn(256, 64))
                model[2](model[1](out)).pow(2).mean().backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-0.01)
                kept.append(out)
        except torch.OutOfMemoryError:
            pass
    findings = diagnose(facts_from_run(t.run))
    assert findings and findings[0].rule == "leak", [f.rule for f in findings]
    assert "backward() calls" in findings[0].evidence[0]


# ---- forward passes without backward ------------------------------------------------------------
class Normalize(nn.Module):
    """A per-sample transform: a module without parameters, on plain data."""

    def forward(self, x):
        return (x - 0.5) / 0.25


def test_forward_passes_need_grad_mode_and_a_graph():
    model, norm = mlp(), Normalize()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Tracer(source="dispatch") as t:
        samples = [norm(torch.rand(64)) for _ in range(20)]      # transforms: no graph
        model(torch.stack(samples[:16])).sum().backward()
        opt.step()
        with torch.no_grad():
            model(torch.randn(32, 64))                           # evaluation done right
        kept = model(torch.randn(32, 64))                        # evaluation with grad: kept
    calls = t.run.meta["forward_calls"]
    without = [c for c in calls if c.get("phase") == NOB]
    assert [c["module"] for c in without] == ["Sequential"] and without[0]["params"]
    facts = facts_from_run(t.run)
    assert facts.no_backward_calls == 1
    assert any(b.phase == NOB and b.category == "activations" for b in t.run.blocks.values())
    del kept


def test_evaluation_under_no_grad_is_never_named():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Tracer(budget="2MiB", source="dispatch") as t:
        try:
            model(torch.randn(32, 64)).sum().backward()
            opt.step()
            with torch.no_grad():
                outs = [model(torch.randn(512, 64)) for _ in range(40)]
        except torch.OutOfMemoryError:
            pass
    rules = [f.rule for f in diagnose(facts_from_run(t.run))]
    assert t.run.ooms and "eval-without-no-grad" not in rules


def test_label_forwards_is_linear_in_calls_and_blocks():
    """60,000 passes without backward (a dataset preloaded sample by sample) and 300,000
    blocks: the quadratic version took minutes; a sort and a bisection take well under one."""
    run = Run()
    calls = []
    seq = 0
    for i in range(60_000):
        calls.append({"index": i, "module": "Normalize", "seq_start": seq, "seq_end": seq + 5, "training": True,
                      "grad_enabled": True, "backward": False, "graph": True, "params": False,
                      "mark_start": 2 * i, "mark_end": 2 * i + 1})
        run.marks.append(Mark(seq, "forward", 0))
        for k in range(5):
            run.blocks[seq + k] = Block(seq + k, 4, "temporaries", phase="forward", alloc_seq=seq + k)
            run.actions.append(Action.ALLOC)
        seq += 5
        run.marks.append(Mark(seq, "other", 0))
    run.meta["forward_calls"] = calls
    start = time.process_time()
    label_forwards_without_backward(run, ended_in_oom=False)
    assert time.process_time() - start < 5.0
    assert all(b.phase == NOB for b in run.blocks.values())


# ---- inputs -----------------------------------------------------------------------------------
def test_model_output_passed_to_a_loss_module_is_not_an_input():
    model, criterion = mlp(), nn.CrossEntropyLoss()
    with Tracer(source="dispatch") as t:
        x = torch.randn(32, 64)
        criterion(model(x), torch.zeros(32, dtype=torch.long)).backward()
    logits = [b for b in t.run.blocks.values() if b.shape == [32, 10] and b.name == "aten.addmm"]
    assert logits and all(b.category != "inputs" for b in logits)
    assert any(b.category == "inputs" and b.shape == [32, 64] for b in t.run.blocks.values())


class Keyworded(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, input_ids=None, labels=None):
        return self.body(input_ids)


def test_inputs_passed_by_keyword_are_inputs():
    """transformers' models are called `model(input_ids=..., labels=...)`."""
    model = Keyworded()
    with Tracer(source="dispatch") as t:
        model(input_ids=torch.randn(32, 64), labels=torch.zeros(32))
    shapes = sorted(b.shape for b in t.run.blocks.values() if b.category == "inputs")
    assert shapes == [[32], [32, 64]]


class _Normalize(nn.Module):
    def forward(self, x):
        return (x - 0.1307) / 0.3081


def test_a_transform_without_parameters_is_no_pass_and_what_it_makes_is_made_outside_any_forward():
    """A parameterless module applied to samples that need no gradient (a dataset preloaded
    sample by sample) passes through the hooks: no forward call, no marks; the samples it
    makes belong to the phase around it. A loss module fed a model's output that needs a
    gradient is still a call, and the model's are."""
    model, norm, criterion = mlp(), _Normalize(), nn.CrossEntropyLoss()
    with Tracer(source="dispatch") as t:
        data = [norm(torch.rand(4, 64)) for _ in range(20)]
        criterion(model(data[0]), torch.zeros(4, dtype=torch.long)).backward()
    calls = [c["module"] for c in t.run.meta["forward_calls"]]
    assert len(calls) == 2 and "_Normalize" not in calls, calls
    made = [b for b in t.run.blocks.values() if b.shape == [4, 64] and b.alloc_seq < t.run.marks[1].seq]
    assert len(made) >= 20 and {b.phase for b in made} == {"other"}, {b.phase for b in made}
