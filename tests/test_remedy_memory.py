"""The remedies' memory claim, measured on the CPU under the scenarios' budgets.

Each scenario's model, data, seed and optimizer are re-stated as the script has them, in
tests/support/remedy_cases.py (the scripts are not imported). The same loop trains through
`prepare(model, optimizer, plan)` twice under `memdoctor.watch(budget=<budget.cpu>)`: as the
script has it, where it runs out of memory, and with the remedy the scenario's finding names, where it fits. The
measured peaks are printed next to the peak the finding predicted for that remedy.

Also: chunked_cross_entropy against F.cross_entropy, and `memdoctor diagnose --try`.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memdoctor
from memdoctor.attribution import peak
from memdoctor.remedies import chunked_cross_entropy
from memdoctor.units import format_bytes, parse_size
from tests.support.paths import ROOT, shared_path
from tests.support.remedy_cases import CASES, expected, measure


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
