"""transformers' Trainer gathering its evaluation's logits on the device (no
eval_accumulation_steps): a leak within one step, told in the Trainer's own settings, not
a dataset held on the device (tests/scenarios/trainer_eval_gathers_logits.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
SCRIPT = Path(__file__).parent / "scenarios" / "trainer_eval_gathers_logits.py"


def _diagnose(*args, cwd, budget="300MiB") -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", SCRIPT, "--budget", budget, "--json",
                           "--", *args], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


def test_the_trainers_gathered_logits_are_a_leak_within_its_evaluation(tmp_path):
    code, out = _diagnose(cwd=tmp_path)
    assert code == 3
    rules = [f["rule"] for f in out["findings"]]
    assert rules[0] == "leak" and "data-on-device" not in rules, rules
    first = out["findings"][0]
    assert first["details"]["passes"] >= 4
    assert first["accounts_for_bytes"] >= 32 * 128 * 8000 * 4          # the 32 rows joined so far
    assert "eval_accumulation_steps" in first["remedies"][0]["how"]
    assert first["fits_after_fix"] is True


def test_the_same_evaluation_without_gathering_fits(tmp_path):
    code, out = _diagnose("160", "loss-only", cwd=tmp_path)
    assert code == 0 and not out["oom"], out["findings"]


def test_out_of_memory_in_the_third_join_is_the_same_leak(tmp_path):
    """The OOM asks for the join of the third pass's logits: two joins alive and the one asked
    for make three passes gathered."""
    code, out = _diagnose(cwd=tmp_path, budget="200MiB")
    assert code == 3 and out["ooms"][0]["requested_bytes"] == 3 * 8 * 128 * 8000 * 4
    first = out["findings"][0]
    assert first["rule"] == "leak", [f["rule"] for f in out["findings"]]
    assert "eval_accumulation_steps" in first["remedies"][0]["how"]


def test_an_evaluation_batch_too_large_for_its_logits_is_told_as_the_trainers_setting(tmp_path):
    """The Trainer's evaluation (under no_grad) runs out making the loss over a batch's logits,
    an 8000-word vocabulary: large logits, not a shape bug. The fix is the evaluation batch, in
    TrainingArguments, and its peak is the training's before it, as a quarter of the batch
    measures."""
    code, out = _diagnose("32", "loss-only", "--eval-batch", "32", cwd=tmp_path, budget="200MiB")
    assert code == 3
    first = out["findings"][0]
    assert first["rule"] == "large-logits", [f["rule"] for f in out["findings"]]
    remedy = next(r for r in first["remedies"] if r["title"] == "smaller evaluation batch")
    assert "per_device_eval_batch_size" in remedy["in_framework"]
    _, quarter = _diagnose("32", "loss-only", "--eval-batch", "8", cwd=tmp_path, budget="1GiB")
    assert abs(remedy["predicted_peak_bytes"] - quarter["peak_bytes"]) <= 0.05 * quarter["peak_bytes"]
