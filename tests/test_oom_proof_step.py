"""The OOM-proof step (micro_batch="auto") is all or nothing. An out-of-memory error is put
into each stage of a step in turn (a micro-batch's forward, after BatchNorm has updated
its statistics; its backward; the optimizer step, half the parameters updated; the loss
scaler, after the update), for SGD with momentum, AdamW, the fused and the 8-bit
optimizers, on a model with BatchNorm and dropout. The final parameters, optimizer state,
step counts and buffers equal those of a run that never ran out of memory and took the
micro-batches the OOM-proof run ended up taking."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memdoctor.remedies import prepare
from memdoctor.remedies.microbatch import accumulate_gradients

LIMIT = 4           # micro-batches of more samples "do not fit": the first step halves 8 -> 4
STEPS = 3
FAULTY_STEP = 1


def model_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    make = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=make), torch.randn(8, 4, generator=make)) for _ in range(STEPS)]
    return model, batches


OPTIMIZERS = {
    "sgd-momentum": ("", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "adamw": ("", lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)),
    "fused": ("opt=fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    "adamw-8bit": ("opt=adamw-8bit", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    "sgd-fp16-scaler": ("fp16", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
}
STAGES = ["forward 0", "forward 1", "backward 0", "backward 1", "optimizer", "scaler"]


def plan_of(name: str, micro) -> str:
    extra = OPTIMIZERS[name][0]
    return ",".join(p for p in (extra, f"micro={micro}" if micro else "") if p) or "none"


def everything(model, optimizer) -> list[torch.Tensor]:
    """Parameters, buffers (running statistics, batch counts) and every optimizer state
    tensor (exp_avg, codes and scales, momentum buffers, step counts), in a fixed order."""
    out = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                out.append(value.detach().clone() if torch.is_tensor(value) else torch.tensor(float(value)))
    return out


class Faults:
    """Arms one OOM for one stage of one step, and fires it once."""

    def __init__(self, stage: str) -> None:
        self.stage, self.step, self.calls, self.fired = stage, -1, 0, False

    def armed(self, stage: str) -> bool:
        if self.step == FAULTY_STEP and not self.fired and self.stage == stage:
            self.fired = True
            return True
        return False

    def new_step(self, step: int) -> None:
        self.step, self.calls = step, 0

    def loss_fn(self, model, batch):
        x, y = batch
        if x.shape[0] > LIMIT:
            raise torch.OutOfMemoryError("simulated: the micro-batch does not fit")
        index = self.calls
        self.calls += 1
        self.forward_index = index
        out = model(x)
        if self.armed(f"backward {index}"):
            def fail(grad):
                raise torch.OutOfMemoryError("injected in backward")
            out.register_hook(fail)
        return F.mse_loss(out.float(), y)

    def install(self, prepared) -> None:
        def after_batchnorm(module, args, output):        # BatchNorm has updated its statistics
            if self.armed(f"forward {self.forward_index}"):
                raise torch.OutOfMemoryError("injected in forward")
        prepared.model[2].register_forward_hook(after_batchnorm)
        optimizer = prepared.optimizer
        real_step = optimizer.step

        def half_a_step(*args, **kwargs):
            if not self.armed("optimizer"):
                return real_step(*args, **kwargs)
            later = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            later = later[len(later) // 2:]
            grads = [p.grad for p in later]
            for p in later:
                p.grad = None
            try:
                real_step(*args, **kwargs)                 # half of the parameters are stepped
            finally:
                for p, g in zip(later, grads):
                    p.grad = g
            raise torch.OutOfMemoryError("injected in the optimizer step")
        optimizer.step = half_a_step
        scaler = prepared.scaler
        if scaler is not None:
            real_update = scaler.update

            def update_then_fail(*args, **kwargs):
                real_update(*args, **kwargs)
                if self.armed("scaler"):
                    raise torch.OutOfMemoryError("injected in the scaler")
            scaler.update = update_then_fail


def oom_proof_run(name: str, stage: str):
    """The OOM-proof run with one injected OOM; a step that raises is taken again, as a
    training loop that catches the error would. Returns (state, micro-batch sizes taken)."""
    model, batches = model_and_batches()
    prepared = prepare(model, OPTIMIZERS[name][1](model.parameters()), plan_of(name, "auto"))
    faults = Faults(stage)
    faults.install(prepared)
    torch.manual_seed(2)
    sizes, raised = [], 0
    for step, batch in enumerate(batches):
        faults.new_step(step)
        before = everything(prepared.model, prepared.optimizer)
        try:
            prepared.step(batch, faults.loss_fn)
        except torch.OutOfMemoryError:
            raised += 1           # all or nothing: nothing changed; take the step again
            assert all(torch.equal(a, b) for a, b in zip(everything(prepared.model, prepared.optimizer), before))
            faults.new_step(step)
            prepared.step(batch, faults.loss_fn)
        sizes.append(prepared.auto.size)
    return everything(prepared.model, prepared.optimizer), sizes, faults.fired, raised


def oom_free_run(name: str, sizes: list[int]):
    """The same training with no OOM at all, at the micro-batch sizes given, step by step."""
    model, batches = model_and_batches()
    prepared = prepare(model, OPTIMIZERS[name][1](model.parameters()), plan_of(name, None))
    torch.manual_seed(2)
    for size, batch in zip(sizes, batches):
        prepared.optimizer.zero_grad(set_to_none=True)
        accumulate_gradients(prepared.model, batch, lambda m, b: F.mse_loss(m(b[0]).float(), b[1]), size,
                             context=prepared.precision.context, backward=prepared.precision.backward)
        prepared.precision.step(prepared.optimizer)
        prepared.optimizer.zero_grad(set_to_none=True)
    return everything(prepared.model, prepared.optimizer)


@pytest.mark.parametrize("name, stage", [(n, s) for n in OPTIMIZERS for s in STAGES
                                         if s != "scaler" or "scaler" in n])      # fp16 has the scaler
def test_an_oom_at_any_stage_ends_as_a_run_without_one(name, stage):
    state, sizes, fired, raised = oom_proof_run(name, stage)
    assert fired
    halved = stage.startswith(("forward", "backward"))
    assert sizes == ([LIMIT] + [LIMIT // 2] * (STEPS - 1) if halved else [LIMIT] * STEPS)
    assert raised == (0 if halved else 1)
    expected = oom_free_run(name, [LIMIT] + ([LIMIT // 2] * (STEPS - 1) if halved else [LIMIT] * (STEPS - 1)))
    assert len(state) == len(expected)
    for got, want in zip(state, expected):
        assert torch.equal(got, want), (got - want).abs().max()


def test_without_faults_the_oom_proof_run_is_the_oom_free_run():
    state, sizes, fired, raised = oom_proof_run("adamw", "none")
    assert sizes == [LIMIT] * STEPS and not fired and not raised
    assert all(torch.equal(a, b) for a, b in zip(state, oom_free_run("adamw", sizes)))


@pytest.mark.parametrize("name", ["adamw-8bit", "fused"])
def test_undo_right_after_prepare_gives_the_state_back_unchanged(name):
    model, batches = model_and_batches()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    before = copy.deepcopy(optimizer.state_dict())
    prepare(model, optimizer, OPTIMIZERS[name][0] or "opt=adamw-bf16").undo()
    after = optimizer.state_dict()
    for index, state in before["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after["state"][index][key], state[key]), (index, key)


def test_undo_right_after_prepare_with_bf16_states():
    model, batches = model_and_batches()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.mse_loss(model(batches[0][0]), batches[0][1]).backward()
    optimizer.step()
    before = copy.deepcopy(optimizer.state_dict())
    prepare(model, optimizer, "opt=adamw-bf16").undo()
    for index, state in before["state"].items():
        assert torch.equal(optimizer.state_dict()["state"][index]["exp_avg_sq"], state["exp_avg_sq"])
