"""The Recorder keeps blocks as columns while it records and makes them the Run's Block
objects when it stops; an optimizer's owners claimed again each step stay claimed."""
from __future__ import annotations

import torch
from torch import nn

from memdoctor.capture.recorder import Recorder
from memdoctor.capture.session import Tracer
from memdoctor.run import Category, Run


def test_columns_become_the_runs_blocks_when_the_recorder_stops():
    rec = Recorder(Run(source="dispatch", device="cpu"))
    kept = torch.empty(3, 5)                        # 60 bytes
    dropped = torch.empty(7, dtype=torch.float64)   # 56 bytes
    first = rec.add_output(kept, "aten.empty")
    second = rec.add_output(dropped, "aten.empty")
    rec.blocks.source[second] = 4
    rec.claim(kept, Category.WEIGHTS.value, "layer.weight")
    del dropped                                     # its storage dies: the free is recorded
    assert rec.run.blocks == {}                     # nothing made while recording
    run = rec.close()
    assert sorted(run.blocks) == [first, second]
    a, b = run.blocks[first], run.blocks[second]
    assert (a.nbytes, a.shape, a.dtype, a.category, a.name, a.free_seq, a.source) == \
        (60, [3, 5], "float32", "weights", "layer.weight", None, -1)
    assert (b.nbytes, b.shape, b.dtype, b.category, b.free_seq, b.source) == \
        (56, [7], "float64", "temporaries", 2, 4)
    assert run.actions[b.free_seq] == 1 and run.event_blocks[b.free_seq] == second
    assert a.alloc_seq == 0 and b.alloc_seq == 1


class ReplacingMomentum(torch.optim.Optimizer):
    """SGD with momentum whose state is a new tensor each step (no update in place)."""
    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                m = state.get("m")
                state["m"] = p.grad.clone() if m is None else m * 0.9 + p.grad
                p.add_(state["m"], alpha=-0.1)


def test_state_replaced_each_step_is_claimed_each_step():
    """Claims of a storage counted as its owner already are skipped; a new storage under the
    same state key is still claimed, under its name."""
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    opt = ReplacingMomentum(model.parameters())
    with Tracer(models=[model], optimizers=[opt], source="dispatch") as tracer:
        for _ in range(3):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    run = tracer.run
    alive = [b for b in run.blocks.values() if b.free_seq is None and b.category == Category.OPTIMIZER_STATE.value]
    assert sorted(b.name for b in alive) == ["bias:m", "weight:m"]
    assert sorted(b.nbytes for b in alive) == [32, 512]
    made_in_step = sorted(b.step for b in alive)
    assert made_in_step == [2, 2]           # the third step's tensors, not the first's
    states = [b for b in run.blocks.values() if b.category == Category.OPTIMIZER_STATE.value]
    assert len(states) == 6                 # two tensors a step, each claimed in its step


def test_a_parameter_group_added_later_is_claimed_as_weights_and_state():
    # the optimizer's weights are claimed when it is first seen, and again when it steps
    # more parameters: a group added after the first step is counted as a weight, its
    # gradient and Adam's state as theirs, none of them left uncounted or a temporary
    model = nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Tracer(models=[model], optimizers=[opt], source="dispatch") as tracer:
        extra = nn.Parameter(torch.randn(512, 512))      # made inside the trace: counted as an op's output
        for step in range(3):
            if step == 1:
                opt.add_param_group({"params": [extra]})
            loss = model(torch.randn(8, 64)).sum() + (extra.sum() if step else 0)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    big = [b for b in tracer.run.blocks.values() if b.nbytes == 512 * 512 * 4]
    categories = {b.category for b in big}
    assert Category.WEIGHTS.value in categories and Category.OPTIMIZER_STATE.value in categories, categories
    weights = [b for b in big if b.category == Category.WEIGHTS.value]
    assert len(weights) == 1 and weights[0].free_seq is None
