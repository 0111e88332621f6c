"""The dispatch tracer, checked against numbers counted independently of it.

Every expected number here is counted by the test itself (parameter, gradient and
optimizer-state bytes read off the model and optimizer; saved-for-backward storages read off
the autograd graph; live bytes and the peak counted by a separate TorchDispatchMode written
below) or by PyTorch's own MemTracker, never read back from memdoctor.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import runpy
import weakref
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memdoctor import attribution as A
from memdoctor.run import CATEGORIES
from memdoctor.capture import recorder as recorder_mod
from memdoctor.capture.script import trace_script
from memdoctor.capture.session import Tracer
from memdoctor.units import parse_size
from tests.support.paths import shared_path


# ---- an independent counter ---------------------------------------------------------------
class StorageCounter(TorchDispatchMode):
    """Counts, on its own, the bytes of every storage an op returns: each storage once (keyed
    by its StorageImpl), released by a finalizer when the storage object dies. Keeps the
    running total and its maximum."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _released(self, key: int) -> None:
        self.live_bytes -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.sizes:
                continue
            self.sizes[key] = n = storage.nbytes()
            self.live_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._released, key)
        return out


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def saved_for_backward(loss: torch.Tensor) -> dict[int, int]:
    """{storage key: bytes} of every tensor saved in loss's autograd graph, found by walking
    grad_fn -> next_functions and reading each node's `_saved_*` attributes."""
    found: dict[int, int] = {}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    found[storage_key(t)] = t.untyped_storage().nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`, each counted once."""
    sizes = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


# ---- the model and the training loop ------------------------------------------------------
class MLP(nn.Module):
    """An MLP that returns its own loss, so the forward phase covers the whole graph."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(),
                                  nn.Linear(128, 10))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.body(x), y)


@dataclass
class StepFacts:
    """What the test counted itself during one training step."""
    params: int = 0
    saved: int = 0          # saved-for-backward storages, minus parameters and the batch
    grads: int = 0          # .grad bytes when optimizer.step() is called
    state: int = 0          # optimizer.state tensors after the step
    live: dict[str, int] = field(default_factory=dict)   # counter's live bytes, when counting


def train_mlp(device: str, opt_kwargs: dict, steps: int = 3, counter: StorageCounter | None = None):
    """Build an MLP and AdamW on `device` and train `steps` steps; call from inside the
    tracing context so everything is created under it. Returns (model, facts per step)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **opt_kwargs)
    facts = []
    for _ in range(steps):
        f = StepFacts(params=tensor_bytes(model.parameters()))
        x = torch.randn(32, 64, device=device)
        y = torch.randint(0, 10, (32,), device=device)
        loss = model(x, y)
        exclude = {storage_key(t) for t in [*model.parameters(), x, y]}
        f.saved = sum(n for k, n in saved_for_backward(loss).items() if k not in exclude)
        if counter is not None:
            f.live["forward"] = counter.live_bytes
        loss.backward()
        f.grads = tensor_bytes(p.grad for p in model.parameters())
        if counter is not None:
            f.live["backward"] = counter.live_bytes
        opt.step()
        f.state = tensor_bytes(t for s in opt.state.values() for t in s.values()
                               if isinstance(t, torch.Tensor))
        if counter is not None:
            f.live["step"] = counter.live_bytes
        opt.zero_grad(set_to_none=True)
        del loss, x, y
        facts.append(f)
    return model, facts


def spans(run) -> list[tuple[str, int, int, int]]:
    """(phase, step, first seq, end seq) for each run of marks with the same phase and step."""
    out: list[list] = []
    for m in run.marks:
        if out and out[-1][0] == m.phase and out[-1][1] == m.step:
            continue
        if out:
            out[-1][3] = m.seq
        out.append([m.phase, m.step, m.seq, run.num_events])
    return [tuple(s) for s in out]


def probe_seqs(run, step: int) -> dict[str, int]:
    """The last event of the forward and of the backward of `step`, and the last event
    before the next step begins (after the optimizer step)."""
    sp = spans(run)
    fwd = [s for s in sp if s[0] == "forward" and s[1] == step]
    bwd = [s for s in sp if s[0] == "backward" and s[1] == step]
    nxt = [s for s in sp if s[1] == step + 1]
    assert len(fwd) == 1 and len(bwd) == 1 and nxt, sp
    return {"forward": fwd[0][3] - 1, "backward": bwd[0][3] - 1, "step": nxt[0][2] - 1}


OPTIMIZERS = {"foreach": {"foreach": False}, "fused": {"fused": True}}


def fused_on_cpu_works() -> bool:
    try:
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode()


def traced_and_counted(device: str, opt_name: str):
    """Train twice from the same seed: once under memdoctor's Tracer, once under the test's
    own counter (separately, so the tracer cannot share a mistake with it)."""
    if opt_name == "fused" and not fused_on_cpu_works():
        pytest.skip("AdamW(fused=True) does not run on the CPU in this torch")
    if opt_name == "fused" and device == "meta":
        pytest.skip("torch refuses AdamW(fused=True) for meta tensors (supported: cpu, cuda, ...)")
    outer = fake_mode() if device == "fake" else contextlib.nullcontext()
    dev = "cpu" if device == "fake" else device
    with outer:
        tracer = Tracer(source="dispatch")
        with tracer:
            model, facts = train_mlp(dev, OPTIMIZERS[opt_name])
    with (fake_mode() if device == "fake" else contextlib.nullcontext()):
        counter = StorageCounter()
        with counter:
            _, counted = train_mlp(dev, OPTIMIZERS[opt_name], counter=counter)
    return tracer.run, model, facts, counted, counter


def checked_numbers(device: str, opt_name: str) -> dict:
    """Run the MLP traced and counted on `device`, check every number against the test's
    own count, and return the numbers by step."""
    run, model, facts, counted, counter = traced_and_counted(device, opt_name)
    assert run.steps >= 3
    n_params = len(list(model.parameters()))
    numbers: dict = {"peak": A.peak(run)[1]}
    for step, (f, c) in enumerate(zip(facts, counted)):
        seqs = probe_seqs(run, step)
        fwd = A.breakdown_at(run, seqs["forward"])
        bwd = A.breakdown_at(run, seqs["backward"])
        after = A.breakdown_at(run, seqs["step"])
        # the same training without memdoctor has the same live bytes at the same points
        assert {k: A.breakdown_at(run, s).total_bytes for k, s in seqs.items()} == c.live
        assert f.params == sum(p.numel() * p.element_size() for p in model.parameters())
        assert fwd.by_category["weights"] == f.params
        assert fwd.by_category["activations"] == f.saved > 0
        assert fwd.by_category["inputs"] == 32 * 64 * 4 + 32 * 8      # x float32, y int64
        assert bwd.by_category["gradients"] == f.grads == f.params
        assert after.by_category["optimizer_state"] == f.state
        assert after.by_category["activations"] == 0                     # graph freed
        # AdamW keeps exp_avg and exp_avg_sq per parameter, plus a 4-byte float `step`
        assert f.state == 2 * f.params + 4 * n_params
        # what the step allocates besides its state is scratch: temporaries, gone by its end
        scratch = []
        for _, _, start, end in [s for s in spans(run) if s[0] == "optimizer" and s[1] == step]:
            for b in run.blocks.values():
                if start <= b.alloc_seq < end and b.category != "optimizer_state":
                    scratch.append(b)
                    assert b.category == "temporaries", b
                    assert b.free_seq is not None and b.free_seq < end, b
        if opt_name == "foreach":        # the per-parameter loop builds `denom` each time
            assert len(scratch) >= n_params
        numbers[step] = (fwd.by_category, bwd.by_category, after.by_category)
    assert A.peak(run)[1] == run.meta["peak_live_bytes"] == counter.peak_bytes
    return numbers


@functools.lru_cache(maxsize=None)
def cpu_numbers(opt_name: str) -> dict:
    return checked_numbers("cpu", opt_name)


@pytest.mark.parametrize("opt_name", ["foreach", "fused"])
def test_mlp_adamw_exact_on_cpu(opt_name):
    """3 AdamW steps of an MLP: weights, gradients before the step, optimizer state after
    it (with the `step` tensors), saved activations at the end of forward, the step's
    scratch (temporaries), live bytes at every phase end and the peak all equal the test's
    own counts, to the byte."""
    cpu_numbers(opt_name)


@pytest.mark.parametrize("device", ["meta", "fake"])
@pytest.mark.parametrize("opt_name", ["foreach", "fused"])
def test_mlp_adamw_exact_on_meta_and_fake(device, opt_name):
    """The same checks pass on `meta` and under FakeTensorMode (model built inside it, the
    tracer entered inside it), and every number is the CPU run's."""
    numbers = checked_numbers(device, opt_name)
    assert numbers == cpu_numbers(opt_name)


@pytest.mark.parametrize("opt_name", ["foreach", "fused"])
def test_peak_matches_torch_memtracker(opt_name):
    """One AdamW step on a model and optimizer made (and warmed up) outside the tracer:
    memdoctor's peak equals torch.distributed._tools.mem_tracker.MemTracker's peak total.

    The two agree to the byte on the CPU: MemTracker counts each storage once as
    size * element_size and only rounds to 512 bytes on CUDA. Its categories differ (it
    calls the step's scratch `Optstate` and every forward output `Activation`), so only the
    total and the parameter bytes are compared."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    if opt_name == "fused" and not fused_on_cpu_works():
        pytest.skip("AdamW(fused=True) does not run on the CPU in this torch")

    def warmed_up():
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **OPTIMIZERS[opt_name])
        for _ in range(2):
            model(torch.randn(32, 64), torch.randint(0, 10, (32,))).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, opt

    def one_step(model, opt):
        model(torch.randn(32, 64), torch.randint(0, 10, (32,))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model, opt = warmed_up()
    mt = mem_tracker.MemTracker()
    mt.track_external(model, opt)
    with mt:
        one_step(model, opt)
    theirs = mt.get_tracker_snapshot("peak")[torch.device("cpu")]

    model, opt = warmed_up()
    tracer = Tracer(models=[model], optimizers=[opt], source="dispatch")
    with tracer:
        one_step(model, opt)
    seq, ours = A.peak(tracer.run)
    assert ours == theirs["Total"]
    param_type = next(k for k in theirs if getattr(k, "name", "") == "PARAM")
    assert A.breakdown_at(tracer.run, seq).by_category["weights"] == theirs[param_type]


# ---- a transformer: activations by module -----------------------------------------------
class Encoder(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x).square().mean()


def test_transformer_activations_by_module():
    """A 3-layer nn.TransformerEncoder step: activations split by module add up to the
    activations total (which equals the graph's saved storages), and each encoder layer
    holds a nonzero, nearly equal share."""
    torch.manual_seed(0)
    model = Encoder(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = Tracer(models=[model], optimizers=[opt], source="dispatch")
    with tracer:
        x = torch.randn(4, 32, 64)
        loss = model(x)
        exclude = {storage_key(t) for t in [*model.parameters(), x]}
        saved = sum(n for k, n in saved_for_backward(loss).items() if k not in exclude)
        loss.backward()
        opt.step()
    run = tracer.run
    seq = probe_seqs(run, 0)["forward"]
    b = A.breakdown_at(run, seq)
    assert b.by_category["activations"] == saved
    assert sum(b.by_module.values()) == b.total_bytes
    per_module: dict[str, int] = {}
    for blk in A.live_blocks(run, seq):
        if blk.category == "activations":
            key = A.module_of(blk) or "(outside modules)"
            per_module[key] = per_module.get(key, 0) + blk.nbytes
    assert sum(per_module.values()) == b.by_category["activations"]
    layers = {i: sum(n for m, n in per_module.items()
                     if m == f"encoder.layers.{i}" or m.startswith(f"encoder.layers.{i}."))
              for i in range(3)}
    assert all(n > 0 for n in layers.values()), per_module
    # everything saved belongs to a layer; identical layers save identical bytes, except that
    # the last layer's output is also saved, by the loss's square (batch 4 x 32 x 64 float32)
    assert sum(layers.values()) == b.by_category["activations"], per_module
    assert layers[0] == layers[1]
    assert layers[2] - layers[1] == 4 * 32 * 64 * 4
    assert max(layers.values()) <= 1.1 * min(layers.values()), layers


# ---- the bundled scenarios ----------------------------------------------------------------
def cpu_scenarios() -> list[str]:
    expected = json.loads(shared_path("scenarios", "expected.json").read_text())
    return sorted(name for name, e in expected.items() if "cpu" in e.get("budget", {}))


def _scenario_names():
    # collected at import: a missing ../shared must not break collection (shared_path skips
    # or fails the test itself when it runs)
    from tests.support.paths import SHARED
    try:
        expected = json.loads((SHARED / "scenarios" / "expected.json").read_text())
    except OSError:
        return ["s01_big_mlp_adam.py"]
    return sorted(name for name, e in expected.items() if "cpu" in e.get("budget", {}))


SCENARIOS = _scenario_names()


def budget_of(name: str) -> str:
    expected = json.loads(shared_path("scenarios", "expected.json").read_text())
    return expected[name]["budget"]["cpu"]


def quiet_trace(path, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):
        return trace_script(str(path), **kwargs)


def test_a_traced_script_leaves_the_garbage_collector_as_it_was(tmp_path):
    """The collector is kept off the objects made before the script (frozen) and paused
    while the run is built: afterwards it is on, and nothing is left frozen; a collector
    the caller switched off stays off, and objects the caller froze stay frozen."""
    import gc
    script = tmp_path / "cycles.py"
    script.write_text("import torch\nclass Node:\n    pass\n"
                      "for _ in range(3):\n    a, b = Node(), Node()\n    a.other, b.other = b, a\n"
                      "    a.t = torch.ones(1024)\n")
    assert gc.get_freeze_count() == 0
    result = quiet_trace(script, source="dispatch")
    assert result.exit_code == 0 and result.run.num_events > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        quiet_trace(script, source="dispatch")
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()
    try:
        quiet_trace(script, source="dispatch")
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_arrays_torch_did_not_allocate_take_no_memory(tmp_path):
    """torch.from_numpy and torch.as_tensor of an array wrap numpy's memory, which no device
    holds (a GPU run copies it with `.to("cuda")`); torch.tensor copies it: one 8 MiB copy, as
    PyTorch's profiler counts, and one more for `y * 2`."""
    script = tmp_path / "arrays.py"
    script.write_text("import numpy as np, torch\n"
                      "a = np.ones((2048, 1024), dtype=np.float32)\n"
                      "x = torch.tensor(a)\ny = torch.from_numpy(a)\nz = torch.as_tensor(a).view(-1)\n"
                      "w = y * 2\n")
    result = quiet_trace(script, source="dispatch")
    assert result.exit_code == 0
    assert A.peak(result.run)[1] == 2 * 2048 * 1024 * 4     # x and w


def test_every_cpu_scenario_is_listed():
    """The eight CPU scenarios s01-s08 are the ones the parametrized tests below run."""
    assert cpu_scenarios() == SCENARIOS
    assert len(SCENARIOS) == 8


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_ooms_under_its_budget(name):
    """Under its CPU budget each scenario stops with a simulated OOM whose request would
    have taken live bytes past the budget."""
    path = shared_path("scenarios", name)
    budget = budget_of(name)
    result = quiet_trace(path, budget=budget, source="dispatch")
    run = result.run
    assert result.oom and result.exit_code == 1
    assert run.budget_bytes == parse_size(budget)
    assert len(run.ooms) == 1
    oom = run.ooms[0]
    assert oom.simulated and oom.requested_bytes > 0
    assert oom.live_bytes + oom.requested_bytes > run.budget_bytes >= oom.live_bytes
    # what attribution says was alive at the OOM is what the OOM recorded
    assert A.at_oom(run).total_bytes == oom.live_bytes
    assert "out of memory" in result.error


@pytest.mark.slow          # the scenarios' full compute: 1-15 s each on 2 cores
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_fits_without_budget_and_peak_is_exact(name):
    """Without a budget each scenario completes, and its traced peak equals the peak the
    test's own counter saw on the same execution (the counter is an outer dispatch mode, so
    both see every op; a separate untraced run is compared in the next test)."""
    path = shared_path("scenarios", name)
    counter = StorageCounter()
    with counter:
        result = quiet_trace(path, source="dispatch")
    run = result.run
    assert not result.oom and result.exit_code == 0, result.error
    ours = A.peak(run)[1]
    assert ours == counter.peak_bytes          # exact: both count each storage's nbytes once
    assert ours > parse_size(budget_of(name))      # or the budgeted run could not OOM
    rows = A.per_step(run)
    assert run.steps >= 3 and len(rows) >= 2
    assert sum(A.at_peak(run).by_category.values()) == ours
    if name.startswith("s04"):
        # 60 steps, and each one keeps its 1024x1024 float32 embeddings alive: the end of
        # step bytes climb by exactly 4 MiB a step once the optimizer state exists
        assert run.steps >= 60 and len(rows) >= 60
        ends = [r["end_bytes"] for r in rows if 1 <= r["step"] <= 59]
        assert {b - a for a, b in zip(ends, ends[1:])} == {1024 * 1024 * 4}


def test_scenario_peak_matches_separate_untraced_run():
    """s07 run alone under the test's counter (no memdoctor at all) peaks at the same bytes
    as the traced run: the tracer holds nothing alive and frees nothing early."""
    path = shared_path("scenarios", "s07_many_params_foreach.py")
    counter = StorageCounter()
    with contextlib.redirect_stdout(io.StringIO()), counter:
        runpy.run_path(str(path), run_name="__main__")
    result = quiet_trace(path, source="dispatch")
    assert A.peak(result.run)[1] == counter.peak_bytes


# ---- memdoctor's own failures never reach the training step -------------------------------
def train_two_steps(tracer_factory=None):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ctx = tracer_factory(model, opt) if tracer_factory else contextlib.nullcontext()
    with ctx:
        for _ in range(2):
            model(torch.randn(32, 64), torch.randint(0, 10, (32,))).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], ctx


def faulty_tracer(monkeypatch, method: str, calls: dict):
    """A Tracer whose Recorder.`method` raises RuntimeError from the moment the tracer is in
    until it starts to leave (so entering and the final bookkeeping are not what is tested)."""
    def boom(*args, **kwargs):
        calls["n"] = calls.get("n", 0) + 1
        raise RuntimeError("injected fault")

    class Faulty(Tracer):
        def __enter__(self):
            out = super().__enter__()
            monkeypatch.setattr(recorder_mod.Recorder, method, boom)
            return out

        def __exit__(self, *exc):
            monkeypatch.undo()
            return super().__exit__(*exc)
    return Faulty


@pytest.mark.parametrize("method", ["claim", "add", "_alloc", "mark", "free"])
def test_internal_error_never_alters_training(monkeypatch, method, caplog):
    """A RuntimeError raised inside the Recorder while the hooks and the dispatch mode run
    is swallowed: the loop completes and the parameters are bit-identical to an untraced
    run's and to a traced run without the fault."""
    clean, _ = train_two_steps()
    traced, _ = train_two_steps(lambda m, o: Tracer(models=[m], optimizers=[o], source="dispatch"))
    calls: dict = {}
    faulty = faulty_tracer(monkeypatch, method, calls)
    with caplog.at_level("WARNING", logger="memdoctor"):
        broken, ctx = train_two_steps(lambda m, o: faulty(models=[m], optimizers=[o], source="dispatch"))
    assert calls["n"] > 0, "the fault was never reached"
    for a, b, c in zip(clean, traced, broken):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert ctx.run is not None
    assert "stopped after an internal error" in caplog.text


def test_failing_free_never_causes_a_simulated_oom(monkeypatch):
    """If recording frees breaks, live bytes can no longer be trusted, so the simulated
    budget must not fire on them: training that fits its budget completes, unchanged."""
    clean, _ = train_two_steps()
    counter = StorageCounter()
    with counter:
        train_two_steps()
    budget = int(counter.peak_bytes * 1.05)
    faulty = faulty_tracer(monkeypatch, "free", {})
    broken, ctx = train_two_steps(lambda m, o: faulty(models=[m], optimizers=[o], budget=budget,
                                                      source="dispatch"))
    assert not ctx.run.ooms
    assert all(torch.equal(a, b) for a, b in zip(clean, broken))


def test_a_graph_never_back_propagated_dies_with_it_as_untraced():
    """An evaluation without no_grad builds a graph that the script drops unused: under the
    tracer its saved tensors die with it, as they do untraced. The relu's output is saved by
    the node that made it; handing autograd that very tensor back from the saved-tensor hook
    would make the node hold its own output, a cycle that keeps every such graph alive."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 1))

    def evaluate(refs):
        model.eval()
        hidden = torch.relu(model[0](torch.randn(64, 32)))
        refs.append(weakref.ref(hidden))
        return model[1](hidden).sum().item()
    for tracer in (contextlib.nullcontext(), Tracer(source="dispatch")):
        refs: list = []
        with tracer:
            for _ in range(3):
                evaluate(refs)
            alive = sum(r() is not None for r in refs)
        assert len(refs) == 3 and alive == 0, (type(tracer).__name__, alive)


def test_category_names_are_the_contract():
    """The category names every breakdown uses are exactly the seven of the JSON contract."""
    assert CATEGORIES == ["weights", "gradients", "optimizer_state", "activations",
                          "temporaries", "inputs", "other"]


def test_storages_resized_in_place_are_followed():
    """FSDP2 frees gathered weights with `untyped_storage().resize_(0)` and gathers them
    again into the same storage: the tracer ends the block and starts a new one."""
    import memdoctor
    from memdoctor.attribution import peak
    MiB = 2**20
    before = torch.UntypedStorage.__dict__.get("resize_")
    with memdoctor.watch(source="dispatch", budget="7MiB") as doc:
        a = torch.empty(MiB, dtype=torch.uint8).fill_(1)        # 1 MiB
        storage = a.untyped_storage()
        storage.resize_(0)
        b = torch.empty(5 * MiB, dtype=torch.uint8)
        storage.resize_(MiB)                                      # 6 MiB live
        with pytest.raises(torch.OutOfMemoryError):
            storage.resize_(3 * MiB)                              # 8 MiB would pass the budget
        del b
        storage.resize_(0)
        live = doc.tracer.recorder.live_bytes
    assert live == 0
    assert peak(doc.run)[1] == 6 * MiB
    sizes = sorted(blk.nbytes for blk in doc.run.blocks.values())
    assert sizes == [MiB, MiB, 5 * MiB] and all(blk.free_seq is not None for blk in doc.run.blocks.values())
    assert torch.UntypedStorage.__dict__.get("resize_") is before      # the method is put back


def test_a_saved_tensor_changed_in_place_raises_under_the_tracer_as_without_it():
    """Autograd checks no saved tensor that hooks hold for a change in place; the tracer's
    hooks do, so a script with that bug fails under memdoctor as it does without it, instead
    of training on with gradients of the changed values. Unchanged, backward is the same."""
    def sigmoid_changed_in_place():
        x = torch.ones(4, requires_grad=True)
        y = x.sigmoid()             # saves its output for backward
        y.mul_(2)
        y.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sigmoid_changed_in_place()
    with Tracer(source="dispatch"):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            sigmoid_changed_in_place()
        x = torch.ones(4, requires_grad=True)
        (x.sigmoid() * 3).sum().backward()
    expected = 3 * torch.sigmoid(torch.ones(4)) * (1 - torch.sigmoid(torch.ones(4)))
    assert torch.allclose(x.grad, expected)
