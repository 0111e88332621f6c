"""An OOM part-way through the first training forward: the fixes' predicted peaks carry the
blocks not yet run, the gradients backward makes and the optimizer state, so a fix said to
fit does fit (tests/scenarios/blocks_cut_short.py: six blocks, out in the second)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scenarios" / "blocks_cut_short.py"
MiB = 2 ** 20
BUDGET = "60MiB"


def _memdoctor(*args, cwd) -> dict:
    proc = subprocess.run([sys.executable, "-m", "memdoctor", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _remedies(finding) -> dict:
    return {r["plan"]: r for r in finding["remedies"] if r["plan"]}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _memdoctor("diagnose", SCRIPT, "--budget", BUDGET, "--json", "--", 8, cwd=tmp_path_factory.mktemp("plain"))


def test_the_blocks_not_yet_run_are_counted_and_a_quarter_batch_is_predicted_from_above(plain, tmp_path):
    first = plain["findings"][0]
    assert first["rule"] == "activations", [f["rule"] for f in plain["findings"]]
    assert any("block 2 of 6" in e for e in first["evidence"]), first["evidence"]
    quarter = _remedies(first)["micro=auto"]
    real = _memdoctor("trace", SCRIPT, "--json", "--", 2, cwd=tmp_path)["peak_bytes"]     # batch 8 / 4
    assert real <= quarter["predicted_peak_bytes"] <= 1.2 * real, (quarter, real)
    assert first["fits_after_fix"] is True
    fits = _memdoctor("diagnose", SCRIPT, "--budget", BUDGET, "--json", "--", 2, cwd=tmp_path)
    assert not fits["oom"]


def test_full_checkpointing_is_predicted_from_above_and_below_selective(plain, tmp_path):
    remedies = _remedies(plain["findings"][0])
    full = remedies["ckpt=full"]["predicted_peak_bytes"]
    tried = _memdoctor("diagnose", SCRIPT, "--budget", "1GiB", "--try", "ckpt=full", "--json", "--", 8, cwd=tmp_path)
    real = tried["after"]["peak_bytes"]
    assert real <= full <= 1.25 * real, (full, real)
    assert full <= remedies["ckpt=selective"]["predicted_peak_bytes"]


def test_an_optimizer_wrapped_by_accelerate_is_the_adamw_it_wraps(plain, tmp_path):
    pytest.importorskip("accelerate")
    wrapped = _memdoctor("diagnose", SCRIPT, "--budget", BUDGET, "--json", "--", 8, "accelerate", cwd=tmp_path)
    assert [f["rule"] for f in wrapped["findings"]] == [f["rule"] for f in plain["findings"]]
    ours = {p: r["predicted_peak_bytes"] for p, r in _remedies(plain["findings"][0]).items()}
    theirs = {p: r["predicted_peak_bytes"] for p, r in _remedies(wrapped["findings"][0]).items()}
    assert theirs == ours


def test_tensors_kept_on_a_functions_ctx_are_the_forwards_not_model_states(tmp_path):
    """The attention weights kept on ctx pass no saved-tensor hook; the forward still holds
    them, and the step needs four times the model states: activations come first, and a
    quarter batch (76.9 MiB traced) is not said to fit in 60 MiB."""
    out = _memdoctor("diagnose", SCRIPT, "--budget", BUDGET, "--json", "--", 8, "kept", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "activations", [f["rule"] for f in out["findings"]]
    real = _memdoctor("trace", SCRIPT, "--json", "--", 2, "kept", cwd=tmp_path)["peak_bytes"]
    assert real > 60 * MiB
    assert _remedies(first)["micro=auto"]["predicted_peak_bytes"] > 60 * MiB


def test_a_checkpointed_model_out_in_its_backward_is_told_fewer_rows_in_its_frameworks_terms(tmp_path):
    """Each block checkpointed, the optimizer prepared by accelerate: it runs out recomputing a
    block in backward. Checkpointing is not offered again; a quarter batch is predicted from
    above (with the gradients the rest of backward makes); bf16 is said as accelerate's setting."""
    pytest.importorskip("accelerate")
    out = _memdoctor("diagnose", SCRIPT, "--budget", "40MiB", "--json", "--", 8, "ckpt", "accelerate", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "activations", [f["rule"] for f in out["findings"]]
    assert any(e.startswith("checkpointed already") for e in first["evidence"]), first["evidence"]
    remedies = _remedies(first)
    assert not any(plan.startswith("ckpt") for plan in remedies), list(remedies)
    real = _memdoctor("trace", SCRIPT, "--json", "--", 2, "ckpt", cwd=tmp_path)["peak_bytes"]
    assert real <= remedies["micro=auto"]["predicted_peak_bytes"] <= 1.2 * real
    assert remedies["bf16"]["in_framework"] == "accelerate: its config file, mixed_precision='bf16'"
    assert "gradient_accumulation_steps" in remedies["micro=auto"]["in_framework"]


def test_a_trainer_run_is_told_its_fixes_as_training_arguments(tmp_path):
    pytest.importorskip("accelerate")
    script = Path(__file__).parent / "realworld" / "hf" / "trainer_classify.py"
    out = _memdoctor("diagnose", script, "--budget", "160MiB", "--json", "--", "--batch", 16, "--seq", 256,
                     cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "activations"
    remedies = _remedies(first)
    assert remedies["bf16"]["in_framework"] == "transformers: TrainingArguments(bf16=True)"
    assert remedies["ckpt=full"]["in_framework"].startswith("transformers: TrainingArguments(")


ROOT_STACK = """
import sys
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)]).double()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    x = torch.randn(int(sys.argv[1]), 256, dtype=torch.float64)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_root_stack_of_like_blocks_in_float64_is_extrapolated_and_not_told_autocast(tmp_path):
    """A model that is itself an nn.Sequential of six like blocks, in float64: the blocks after
    the OOM's are counted, and bf16 autocast (which leaves float64 alone) is not offered."""
    script = tmp_path / "stack.py"
    script.write_text(ROOT_STACK)
    out = _memdoctor("diagnose", script, "--budget", "64MiB", "--json", "--", 8192, cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "activations"
    assert any("block 2 of 6" in e for e in first["evidence"]), first["evidence"]
    assert any("float64" in e for e in first["evidence"])
    remedies = _remedies(first)
    assert "bf16" not in remedies
    real = _memdoctor("trace", script, "--json", "--", 2048, cwd=tmp_path)["peak_bytes"]
    assert real <= remedies["micro=auto"]["predicted_peak_bytes"]
