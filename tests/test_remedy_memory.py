"""The remedies' memory claim, measured on the CPU under the scenarios' budgets.

Each scenario's model, data, seed and optimizer are re-stated here as the script has them
(the scripts are not imported). The same loop trains through `prepare(model, optimizer,
plan)` twice under `memdoctor.watch(budget=<budget.cpu>)`: as the script has it, where it
runs out of memory, and with the remedy the scenario's finding names, where it fits. The
measured peaks are printed next to the peak the finding predicted for that remedy
(benchmarks/remedy_memory_cpu.py saves the same table).

Also: chunked_cross_entropy against F.cross_entropy, and `memdoctor diagnose --try`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memdoctor
from memdoctor.attribution import peak
from memdoctor.remedies import Plan, chunked_cross_entropy, prepare
from memdoctor.diagnosis import diagnose, facts_from_run
from memdoctor.units import format_bytes, parse_size
from tests.conftest import ROOT, shared_path


# where the restated loops make their data: benchmarks/remedy_memory_gpu.py sets "cuda" (an
# explicit device, as the scripts have it, rather than a torch.device context: with torch
# 2.11 a checkpoint's recompute under that context fails, which no script here does)
DEVICE = "cpu"


def expected(name: str) -> dict:
    return json.loads(shared_path("scenarios", "expected.json").read_text())[name]


# ---- the scenarios, re-stated --------------------------------------------------------------
# Each loop trains through prepare(); `fixed` switches the remedy on, nothing else changes.

def s02_build():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def s02_loop(model, optimizer, fixed):
    """The script runs 3 steps; 2 reach its peak (the second is the first with momentum
    buffers, the third repeats the second)."""
    prepared = prepare(model, optimizer, Plan(micro_batch=4096) if fixed else Plan())
    for _ in range(2):
        x = torch.randn(16384, 256, device=DEVICE)
        y = torch.randint(0, 10, (16384,), device=DEVICE)
        prepared.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))


class S03Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        return self.out((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, d))


class S03Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = S03Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def s03_build():
    torch.manual_seed(0)
    model = nn.Sequential(*[S03Block(128, 4) for _ in range(4)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def s03_loop(model, optimizer, fixed):
    prepared = prepare(model, optimizer, Plan(checkpointing="full") if fixed else Plan())
    for _ in range(2):
        prepared.step(torch.randn(2, 2048, 128, device=DEVICE), lambda m, x: m(x).pow(2).mean())


class S04Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh())
        self.head = nn.Linear(1024, 1)

    def forward(self, x):
        emb = self.body(x)
        return emb, self.head(emb)


def s04_build():
    torch.manual_seed(0)
    model = S04Encoder()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def s04_keep(emb: torch.Tensor):
    """The fix: a detached copy off the device. On a GPU that is emb.detach().cpu(); on the
    CPU, where .cpu() is the same storage, the copy goes to NumPy memory, which the
    simulated budget (torch's tensors) does not count, as a GPU's does not count host RAM."""
    if emb.device.type != "cpu":
        return emb.detach().cpu()
    return emb.detach().numpy().copy()


def s04_loop(model, optimizer, fixed):
    prepared = prepare(model, optimizer, Plan())
    embeddings, out = [], {}

    def loss_fn(m, batch):
        out["emb"], pred = m(batch[0])
        return (pred - batch[1]).pow(2).mean()
    for _ in range(60):
        x = torch.randn(1024, 256, device=DEVICE)
        y = torch.randn(1024, 1, device=DEVICE)
        prepared.step((x, y), loss_fn)
        emb = out.pop("emb")
        embeddings.append(s04_keep(emb) if fixed else emb)
    assert len(embeddings) == 60


def s05_build():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 100),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def s05_loop(model, optimizer, fixed):
    """The script runs 2 epochs; one reaches its peak (plain SGD keeps no state, so the
    second epoch makes the first's tensors again)."""
    prepared = prepare(model, optimizer, Plan())
    for _ in range(1):
        model.train()
        for _ in range(4):
            x = torch.randn(1024, 512, device=DEVICE)
            y = torch.randint(0, 100, (1024,), device=DEVICE)
            prepared.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        optimizer.zero_grad(set_to_none=True)   # as the script: no gradients left for the evaluation
        model.eval()
        correct = 0
        with torch.no_grad() if fixed else torch.enable_grad():
            for _ in range(2):
                x = torch.randn(8192, 512, device=DEVICE)
                y = torch.randint(0, 100, (8192,), device=DEVICE)
                correct += (model(x).argmax(dim=-1) == y).sum().item()


S06_VOCAB, S06_DIM, S06_SEQ, S06_BATCH = 32000, 128, 512, 4


class S06TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(S06_VOCAB, S06_DIM)
        self.mix = nn.GRU(S06_DIM, S06_DIM, batch_first=True)
        self.head = nn.Linear(S06_DIM, S06_VOCAB, bias=False)

    def forward(self, ids, logits=True):
        hidden, _ = self.mix(self.embed(ids))
        return self.head(hidden) if logits else hidden


def s06_build():
    torch.manual_seed(0)
    model = S06TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def s06_full_loss(m, ids):
    logits = m(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, S06_VOCAB), ids[:, 1:].reshape(-1))


def s06_chunked_loss(m, ids):
    return chunked_cross_entropy(m(ids[:, :-1], logits=False), m.head.weight, ids[:, 1:], chunks=8)


def s06_loop(model, optimizer, fixed):
    prepared = prepare(model, optimizer, Plan())
    for _ in range(2):
        ids = torch.randint(0, S06_VOCAB, (S06_BATCH, S06_SEQ + 1), device=DEVICE)
        prepared.step(ids, s06_chunked_loss if fixed else s06_full_loss)


S08_VOCAB, S08_DIM, S08_HEADS, S08_LAYERS, S08_SEQ, S08_CHOICES = 1024, 256, 4, 6, 1024, 2


class S08Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(S08_DIM)
        self.qkv = nn.Linear(S08_DIM, 3 * S08_DIM)
        self.proj = nn.Linear(S08_DIM, S08_DIM)
        self.ln2 = nn.LayerNorm(S08_DIM)
        self.mlp = nn.Sequential(nn.Linear(S08_DIM, 4 * S08_DIM), nn.GELU(), nn.Linear(4 * S08_DIM, S08_DIM))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, S08_HEADS, d // S08_HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class S08DoubleHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(S08_VOCAB, S08_DIM)
        self.wpe = nn.Embedding(S08_SEQ, S08_DIM)
        self.blocks = nn.ModuleList(S08Block() for _ in range(S08_LAYERS))
        self.ln_f = nn.LayerNorm(S08_DIM)
        self.lm_head = nn.Linear(S08_DIM, S08_VOCAB, bias=False)
        self.mc_head = nn.Linear(S08_DIM, 1)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[-1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x), self.mc_head(x[:, -1]).squeeze(-1)


def s08_build():
    torch.manual_seed(0)
    model = S08DoubleHeads()
    return model, torch.optim.AdamW(model.parameters(), lr=6.25e-5)


def s08_loss(m, ids):
    lm_logits, mc_logits = m(ids)
    lm_loss = F.cross_entropy(lm_logits[:, :-1].reshape(-1, S08_VOCAB), ids[:, 1:].reshape(-1))
    mc_loss = F.cross_entropy(mc_logits.view(2, S08_CHOICES), torch.zeros(2, dtype=torch.long, device=mc_logits.device))
    return lm_loss + mc_loss


def s08_loop(model, optimizer, fixed):
    prepared = prepare(model, optimizer, Plan(checkpointing="full") if fixed else Plan())
    for _ in range(2):
        prepared.step(torch.randint(0, S08_VOCAB, (2 * S08_CHOICES, S08_SEQ), device=DEVICE), s08_loss)


@dataclass(frozen=True)
class Case:
    build: Callable
    loop: Callable
    remedy: str                        # what the test applies
    matches: Callable                  # picks the finding's remedy whose prediction is shown


def _plan_is(prefix: str) -> Callable:
    return lambda r: (r.plan or "").startswith(prefix)


def _title_has(word: str) -> Callable:
    return lambda r: word in r.title


CASES = {
    "s02_large_batch_mlp.py": Case(s02_build, s02_loop, "micro=4096", _plan_is("micro")),
    "s03_long_sequence_attention.py": Case(s03_build, s03_loop, "ckpt=full", _plan_is("ckpt=full")),
    "s04_collect_embeddings.py": Case(s04_build, s04_loop, "keep emb.detach() off the device", _title_has("detached")),
    "s05_validation_pass.py": Case(s05_build, s05_loop, "validation under torch.no_grad()", _title_has("no_grad")),
    "s06_language_model_head.py": Case(s06_build, s06_loop, "chunked_cross_entropy(chunks=8)", _title_has("chunked")),
    "s08_gpt2_doubleheads_finetune.py": Case(s08_build, s08_loop, "ckpt=full", _plan_is("ckpt=full")),
}


# ---- measuring -------------------------------------------------------------------------------
@dataclass
class Measured:
    scenario: str
    cause: str
    remedy: str
    budget_bytes: int
    before_oom: bool
    before_peak_bytes: int
    before_first_rule: str | None
    predicted_remedy: str | None
    predicted_peak_bytes: int | None
    after_oom: bool
    after_peak_bytes: int

    def line(self) -> str:
        def fmt(n):
            return format_bytes(n) if n is not None else "-"
        return (f"{self.scenario:34} budget {fmt(self.budget_bytes):>10} | before {fmt(self.before_peak_bytes):>10}"
                f"{' OOM' if self.before_oom else '    '} | after {fmt(self.after_peak_bytes):>10}"
                f"{' OOM' if self.after_oom else '    '} | predicted {fmt(self.predicted_peak_bytes):>10}"
                f" ({self.predicted_remedy}) | {self.remedy}")


def watched(case: Case, budget: int, fixed: bool):
    """(run, out of memory?) of the case's loop under memdoctor.watch."""
    model, optimizer = case.build()
    oom = False
    try:
        with memdoctor.watch(model, optimizer, budget=budget, source="dispatch") as doc:
            case.loop(model, optimizer, fixed)
    except torch.OutOfMemoryError:
        oom = True
    assert doc.run is not None, "the tracer did not start"
    return doc.run, oom


def measure(name: str) -> Measured:
    case, exp = CASES[name], expected(name)
    budget = parse_size(exp["budget"]["cpu"])
    before, before_oom = watched(case, budget, fixed=False)
    findings = diagnose(facts_from_run(before))
    finding = next((f for f in findings if f.rule == exp["cause"]), None)
    remedy = next((r for r in finding.remedies if case.matches(r)), None) if finding else None
    after, after_oom = watched(case, budget, fixed=True)
    return Measured(
        scenario=name, cause=exp["cause"], remedy=case.remedy, budget_bytes=budget,
        before_oom=before_oom, before_peak_bytes=peak(before)[1],
        before_first_rule=findings[0].rule if findings else None,
        predicted_remedy=(remedy.plan or remedy.title) if remedy else None,
        predicted_peak_bytes=remedy.predicted_peak_bytes if remedy else None,
        after_oom=after_oom, after_peak_bytes=peak(after)[1])


def measure_all() -> list[dict]:
    return [asdict(measure(name)) for name in CASES]


@pytest.mark.parametrize("name", list(CASES))
def test_remedy_fits_the_budget_the_script_does_not(name, capsys):
    m = measure(name)
    with capsys.disabled():
        print("\n" + m.line())
    assert m.before_oom, f"{name} as written should run out of {format_bytes(m.budget_bytes)}"
    assert m.before_first_rule == m.cause
    assert m.predicted_peak_bytes is not None, f"no {m.cause} remedy matching {m.remedy}"
    assert not m.after_oom, f"{name} with {m.remedy} still runs out of memory"
    assert m.after_peak_bytes < m.budget_bytes


# ---- chunked cross-entropy --------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_cross_entropy_equals_the_full_one(bias):
    torch.manual_seed(0)
    hidden = torch.randn(3, 50, 32, requires_grad=True)
    weight = torch.randn(1000, 32, requires_grad=True)
    b = torch.randn(1000, requires_grad=True) if bias else None
    targets = torch.randint(0, 1000, (3, 50))
    targets[0, :7] = -100
    inputs = [t for t in (hidden, weight, b) if t is not None]

    ref = F.cross_entropy(F.linear(hidden, weight, b).reshape(-1, 1000), targets.reshape(-1))
    ref_grads = torch.autograd.grad(ref, inputs)
    for chunks in (1, 7, 8, 150, 1000):
        got = chunked_cross_entropy(hidden, weight, targets, chunks=chunks, bias=b)
        grads = torch.autograd.grad(got, inputs)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    summed = chunked_cross_entropy(hidden, weight, targets, reduction="sum", bias=b)
    torch.testing.assert_close(summed, ref * (targets != -100).sum(), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, bias=b), ref.detach(),
                                   rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_under_bf16_autocast_and_frozen_features():
    torch.manual_seed(1)
    hidden = torch.randn(2, 40, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    targets = torch.randint(0, 300, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(hidden, weight).reshape(-1, 300), targets.reshape(-1))
        got = chunked_cross_entropy(hidden, weight, targets, chunks=3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref.float(), rtol=1e-2, atol=1e-2)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    grads = torch.autograd.grad(got, (hidden, weight))
    for g, r, t in zip(grads, ref_grads, (hidden, weight)):
        assert g.dtype == t.dtype
        torch.testing.assert_close(g, r.to(g.dtype), rtol=5e-2, atol=5e-3)
    # features that need no gradient (a frozen body): the head's weight still gets its gradient
    frozen = hidden.detach()
    (w_grad,) = torch.autograd.grad(chunked_cross_entropy(frozen, weight, targets, chunks=4), (weight,))
    (w_ref,) = torch.autograd.grad(F.cross_entropy(F.linear(frozen, weight).reshape(-1, 300),
                                                   targets.reshape(-1)), (weight,))
    torch.testing.assert_close(w_grad, w_ref, rtol=1e-5, atol=1e-6)
    # double precision stays double
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double()
    got64 = chunked_cross_entropy(h64, w64, targets, chunks=5)
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64, F.cross_entropy(F.linear(h64, w64).reshape(-1, 300), targets.reshape(-1)))


def test_chunked_cross_entropy_keeps_one_chunk_of_logits():
    """Saved for backward: no tensor the size of all tokens' logits; in backward at most a
    few of one chunk's."""
    torch.manual_seed(0)
    tokens, vocab, dim = 2048, 4000, 16
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    full_bytes = tokens * vocab * 4
    with memdoctor.watch(source="dispatch") as doc:
        chunked_cross_entropy(hidden, weight, targets, chunks=8).backward()
    biggest = max(b.nbytes for b in doc.run.blocks.values())
    assert biggest <= full_bytes // 8 + 4096
    assert peak(doc.run)[1] < full_bytes // 2


def test_chunked_cross_entropy_rejects_bad_arguments():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError):
        chunked_cross_entropy(h, w, t, chunks=0)
    with pytest.raises(ValueError):
        chunked_cross_entropy(h, torch.randn(10, 7), t)
    with pytest.raises(ValueError):
        chunked_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError):
        chunked_cross_entropy(h, w, t, reduction="none")


# ---- memdoctor diagnose --try ------------------------------------------------------------------
def try_json(name: str, fix: str, tmp_path) -> tuple[int, dict]:
    script = shared_path("scenarios", name)
    budget = expected(name)["budget"]["cpu"]
    proc = subprocess.run(
        [sys.executable, "-m", "memdoctor", "diagnose", str(script), "--budget", budget, "--source", "dispatch",
         "--try", fix, "--json"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _show(name, fix, data, capsys):
    with capsys.disabled():
        b, a = data["before"], data["after"]
        print(f"\n--try {fix} on {name}: before {format_bytes(b['peak_bytes'])}{' OOM' if b['oom'] else ''}"
              f" ({(b['first_finding'] or {}).get('rule')}), after {format_bytes(a['peak_bytes'])}"
              f"{' OOM' if a['oom'] else ''} ({(a['first_finding'] or {}).get('rule')})")


def test_try_ckpt_full_makes_s03_fit(tmp_path, capsys):
    name = "s03_long_sequence_attention.py"
    code, data = try_json(name, "ckpt=full", tmp_path)
    _show(name, "ckpt=full", data, capsys)
    assert data["fix"] == "ckpt=full"
    assert data["before"]["oom"] and data["before"]["first_finding"]["rule"] == "activations"
    assert any("checkpointing" in line for line in data["after"]["injected"]), data["after"]
    assert data["after"]["peak_bytes"] < data["before"]["peak_bytes"]
    assert not data["after"]["oom"]
    assert data["after"]["peak_bytes"] <= data["budget_bytes"]
    assert code == 0


def test_try_opt_fused_makes_s07_fit(tmp_path, capsys):
    name = "s07_many_params_foreach.py"
    code, data = try_json(name, "opt=fused", tmp_path)
    _show(name, "opt=fused", data, capsys)
    assert data["before"]["oom"]
    assert data["before"]["first_finding"]["rule"] == "optimizer-step-temporaries"
    assert any("fused" in line for line in data["after"]["injected"]), data["after"]
    assert not data["after"]["oom"] and code == 0


@pytest.mark.parametrize("fix", ["micro=4096", "ckpt=sometimes", "opt=adamw-8bit", "zero=2", "bf16,bf16"])
def test_try_a_fix_that_cannot_be_injected_is_one_line_and_exit_2(fix, tmp_path):
    script = tmp_path / "never_run.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    proc = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", str(script), "--try", fix],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memdoctor: "), proc.stderr
    if fix.startswith("micro"):
        assert "micro-batch" in lines[0] and "edit" in lines[0]


# ---- the injection hooks, in-process ----------------------------------------------------------
def _stack():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)])


def test_injected_bf16_autocasts_top_level_forwards_until_exit():
    from memdoctor.remedies.inject import injected
    model, x = _stack(), torch.randn(4, 16)
    with injected("bf16") as injection:
        assert model(x).dtype == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")          # only inside a forward
    assert injection.applied and "bf16 autocast" in injection.applied[0]
    assert model(x).dtype == torch.float32


def test_injected_ckpt_wraps_the_first_roots_blocks_and_keeps_gradients():
    from memdoctor.remedies.checkpointing import is_checkpointed
    from memdoctor.remedies.inject import injected
    reference, x = _stack(), torch.randn(4, 16)
    reference(x).square().sum().backward()
    model = _stack()
    with injected("ckpt=2") as injection:
        model(x).square().sum().backward()
        assert [is_checkpointed(b) for b in model] == [True, True, False]
    assert "2 of 3 blocks" in injection.applied[0]
    assert not any(is_checkpointed(b) for b in model)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("make", [
    lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, **kw),
    lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, **kw),
    lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw),
], ids=["adam", "adamw-amsgrad", "sgd-momentum"])
def test_injected_opt_fused_switches_in_place_to_the_fused_step(make):
    """The script's own optimizer, built foreach=True, steps exactly as one built fused=True."""
    from memdoctor.remedies.inject import injected
    x = torch.randn(4, 16)
    results = []
    for fix, kw in ((None, {"fused": True}), ("opt=fused", {"foreach": True})):
        model = _stack()
        opt = make(model.parameters(), **kw)
        with injected(fix) if fix else contextlib.nullcontext() as injection:
            for _ in range(3):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            assert opt.param_groups[0]["fused"] is True and not opt.param_groups[0]["foreach"]
        results.append([p.detach().clone() for p in model.parameters()])
    assert "fused=True" in injection.applied[0]
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]   # undone
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_injected_refuses_what_needs_a_new_process_or_an_edit():
    from memdoctor.remedies.inject import FixError, injected, parse_fix
    with pytest.raises(FixError, match="new process"):
        with injected("alloc=expandable_segments"):
            pass
    with pytest.raises(FixError, match="editing the script"):
        parse_fix("bf16,micro=8")
    fix = parse_fix("ckpt=selective,alloc=expandable_segments")
    assert str(fix) == "ckpt=selective,alloc=expandable_segments"
    env = fix.environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:False"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"


def test_try_alloc_runs_the_after_in_a_new_process_with_the_setting(tmp_path, monkeypatch):
    from memdoctor.remedies.inject import compare
    script = tmp_path / "tiny.py"
    script.write_text(
        "import os, sys, torch\n"
        "from torch import nn\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write(os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '-') + '\\n')\n"
        "model = nn.Linear(64, 64)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.randn(8, 64)).sum().backward()\n"
        "opt.step()\n")
    seen = tmp_path / "seen.txt"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    tried = compare(str(script), [str(seen)], "alloc=expandable_segments", budget=parse_size("64MiB"),
                    source="dispatch")
    assert seen.read_text().split() == ["-", "expandable_segments:True"]      # before, after
    assert str(tried.fix) == "alloc=expandable_segments"
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in a new process" in tried.applied[0]
    assert not tried.before.ooms and not tried.after.ooms
    assert tried.after.budget_bytes == parse_size("64MiB") and tried.after.meta["exit_code"] == 0
