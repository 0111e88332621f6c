"""watch and the Tracer leave nothing behind, whatever fails: every memdoctor function they
call on the way in and out is made to raise in turn (a RuntimeError, then a
KeyboardInterrupt), and features that refuse memdoctor's hooks (torch.func, torch.compile,
disable_saved_tensors_hooks) run. Afterwards torch's global module and optimizer hooks,
its dispatch modes and saved-tensor hooks are as before, and a plain training step gives
the same bits as one in a process that never saw memdoctor."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import memdoctor
from memdoctor.capture import dispatch, stepaside
from memdoctor.capture.session import Tracer

PACKAGE = str(Path(memdoctor.__file__).parent)
ORIGINAL_DISABLE = torch.autograd.graph.disable_saved_tensors_hooks


class Injected(Exception):
    """The fault a test puts into memdoctor."""


def leftovers(model: nn.Module) -> dict:
    """Everything a trace installs, as counts and flags: all zero / false when none is left."""
    mm, oo = module_hooks, optimizer_hooks
    return {
        "module hooks": sum(len(getattr(mm, name, {})) for name in (
            "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
            "_global_backward_pre_hooks", "_global_backward_hooks", "_global_module_registration_hooks",
            "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")),
        "optimizer hooks": len(oo._global_optimizer_pre_hooks) + len(oo._global_optimizer_post_hooks),
        "dispatch modes": len(_get_current_dispatch_mode_stack()),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(True) is not None,
        "saved-tensor hooks disabled": torch._C._autograd._saved_tensors_hooks_get_disabled_error_message(),
        "resize_ wrapped": "resize_" in torch.UntypedStorage.__dict__ or bool(dispatch._resize_listeners),
        "disable_saved_tensors_hooks wrapped": (torch.autograd.graph.disable_saved_tensors_hooks
                                                is not ORIGINAL_DISABLE) or bool(stepaside._packs),
        "parameter hooks": sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                               for p in model.parameters()),
        "tracing": sys.gettrace() is not None,
    }


NOTHING = {"module hooks": 0, "optimizer hooks": 0, "dispatch modes": 0, "saved-tensor hooks": False,
           "saved-tensor hooks disabled": None, "resize_ wrapped": False,
           "disable_saved_tensors_hooks wrapped": False, "parameter hooks": 0, "tracing": False}


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def step(model, opt, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_of(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def reference() -> list[torch.Tensor]:
    """Two plain steps, the second as the watched runs take it after their watched one."""
    model, opt = build()
    step(model, opt, 1)
    step(model, opt, 2)
    return state_of(model)


REFERENCE = None


def assert_clean_and_same(model, opt) -> None:
    """Nothing left behind, and a plain step afterwards equals the reference bit for bit."""
    global REFERENCE
    assert leftovers(model) == NOTHING
    step(model, opt, 2)
    REFERENCE = REFERENCE or reference()
    assert all(torch.equal(a, b) for a, b in zip(state_of(model), REFERENCE))


def calls_in(action) -> list:
    """The memdoctor functions `action()` calls, each once, in the order first called."""
    seen: dict = {}

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.setdefault(frame.f_code, None)
        return None
    sys.settrace(trace)
    try:
        action()
    finally:
        sys.settrace(None)
    return list(seen)


def raising_at(code, fault: type[BaseException]):
    """A trace function that makes `code` raise `fault` when it is called."""
    def trace(frame, event, arg):
        if event == "call" and frame.f_code is code:
            raise fault(f"injected at {code.co_name}")
        return None
    return trace


def run_watched(tmp_path, fault_at=None, fault=Injected, where: str = "enter", use_tracer: bool = False):
    """One watched (or traced) training step with `fault` raised at the first call of
    `fault_at` during `where` ("enter" or "exit"). Returns (model, opt, what escaped)."""
    model, opt = build()
    ctx = (Tracer([model], [opt], source="dispatch") if use_tracer
           else memdoctor.watch(model, opt, report=tmp_path / "r.json", source="dispatch"))
    escaped = []

    def guarded(call):
        if fault_at is None:
            return call()
        sys.settrace(raising_at(fault_at, fault))
        try:
            return call()
        except BaseException as exc:          # noqa: B036 - what escapes is what is checked
            escaped.append(exc)
        finally:
            sys.settrace(None)

    entered = guarded(ctx.__enter__) if where == "enter" else ctx.__enter__()
    if escaped:
        step(model, opt, 1)                   # the training goes on as the user's code would
        return model, opt, escaped
    step(model, opt, 1)
    if where == "exit":
        guarded(lambda: ctx.__exit__(None, None, None))
    else:
        ctx.__exit__(None, None, None)
    assert entered is ctx
    return model, opt, escaped


def _functions(tmp_path, where: str, use_tracer: bool) -> list:
    model, opt = build()
    ctx = (Tracer([model], [opt], source="dispatch") if use_tracer
           else memdoctor.watch(model, opt, report=tmp_path / "r.json", source="dispatch"))
    found = calls_in(ctx.__enter__) if where == "enter" else ctx.__enter__()
    step(model, opt, 1)
    if where == "exit":
        found = calls_in(lambda: ctx.__exit__(None, None, None))
    else:
        ctx.__exit__(None, None, None)
    called = getattr(type(ctx), f"__{where}__").__code__      # the user's call itself: not internal
    return [code for code in found if code is not called]


PARTS = 4          # the functions of one case, split so that each test stays short


@pytest.mark.parametrize("part", range(PARTS))
@pytest.mark.parametrize("where", ["enter", "exit"])
@pytest.mark.parametrize("use_tracer", [False, True], ids=["watch", "Tracer"])
def test_a_fault_in_any_function_on_the_way_in_or_out_leaves_nothing(tmp_path, caplog, where, use_tracer, part):
    functions = _functions(tmp_path, where, use_tracer)
    assert len(functions) > (5 if where == "enter" else 20)
    for code in functions[part::PARTS]:
        model, opt, escaped = run_watched(tmp_path, code, Injected, where, use_tracer)
        if not use_tracer:
            assert not escaped, (code.co_name, escaped)   # watch never lets its own failure through
        assert_clean_and_same(model, opt), code.co_name


@pytest.mark.parametrize("where", ["enter", "exit"])
def test_a_keyboard_interrupt_anywhere_on_the_way_in_or_out_leaves_nothing(tmp_path, where):
    functions = _functions(tmp_path, where, use_tracer=False)
    for code in functions[:: max(1, len(functions) // 12)]:
        model, opt, escaped = run_watched(tmp_path, code, KeyboardInterrupt, where)
        # never swallowed (but where CPython itself does: in a weakref callback)
        assert all(isinstance(e, KeyboardInterrupt) for e in escaped), code.co_name
        assert_clean_and_same(model, opt), code.co_name


def test_an_oom_raised_by_memdoctor_inside_the_block_leaves_nothing(tmp_path):
    model, opt = build()
    with pytest.raises(torch.OutOfMemoryError) as caught:
        with memdoctor.watch(model, opt, budget="1KiB", source="dispatch"):
            step(model, opt, 1)
    assert "simulated" in str(caught.value) and caught.value.__notes__
    model, opt = build()
    step(model, opt, 1)
    assert_clean_and_same(model, opt)
    nn.Linear(512, 512)(torch.randn(64, 512))      # a model built later is no longer under a budget


def test_existing_optimizer_state_is_not_charged_to_the_budget(tmp_path):
    """The state two steps made before the block, found on exit, raises no OOM of memdoctor's."""
    model, opt = build()
    opt = torch.optim.Adam(model.parameters())
    step(model, opt, 1)
    with memdoctor.watch(model, budget="64KiB", source="dispatch") as doc:
        model(torch.randn(8, 16)).sum().backward()
    assert doc.run is not None and not doc.run.ooms
    assert doc.run.meta["optimizers"][0]["class"] == "Adam"
    assert leftovers(model) == NOTHING


def test_torch_func_grad_runs_under_watch_and_says_so_once(caplog):
    model, opt = build()
    x = torch.randn(4, 16)

    def loss(weight, x):
        return (x @ weight.T).square().sum()
    plain = torch.func.grad(loss)(model[0].weight, x)
    with caplog.at_level(logging.WARNING, logger="memdoctor"):
        with memdoctor.watch(model, opt, source="dispatch") as doc:
            grads = [torch.func.grad(loss)(model[0].weight, x) for _ in range(3)]
            jac = torch.func.jacrev(lambda w: (x @ w.T).sum(0))(model[0].weight)
            step(model, opt, 1)
    assert all(torch.equal(g, plain) for g in grads) and jac.shape == (32, 32, 16)
    assert doc.run is not None and doc.findings is not None
    said = [r for r in caplog.records if "torch.func" in r.getMessage()]
    assert len(said) <= 1
    assert_clean_and_same(model, opt)


def test_watch_inside_disable_saved_tensors_hooks_and_the_other_way_round():
    model, opt = build()
    with torch.autograd.graph.disable_saved_tensors_hooks("this region refuses saved-tensor hooks"):
        with memdoctor.watch(model, opt, source="dispatch") as doc:
            step(model, opt, 1)
    assert doc.run is not None and doc.run.num_events > 0
    assert leftovers(model) == NOTHING
    model, opt = build()
    with memdoctor.watch(model, opt, source="dispatch") as doc:
        with torch.autograd.graph.disable_saved_tensors_hooks("a feature of the user's"):
            step(model, opt, 1)
    assert doc.run is not None
    assert_clean_and_same(model, opt)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_runs_under_watch(backend):
    if backend == "inductor":
        pytest.skip("inductor compiles a tiny model in about a minute on a 2-core CPU; "
                    "aot_eager runs the same dynamo and AOTAutograd paths in a second")
    model, opt = build()
    compiled = torch.compile(model, backend=backend)
    with memdoctor.watch(model, opt, source="dispatch") as doc:
        torch.manual_seed(1)
        compiled(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert doc.run is not None
    assert_clean_and_same(model, opt)
