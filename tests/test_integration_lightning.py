"""memdoctor in a real Lightning Trainer, on the CPU: the callback diagnoses an OOM under a
budget and writes the report, and a Plan turned into Trainer arguments lowers the measured
peak to what memdoctor predicts for that plan."""
import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")

from memdoctor.integrations import settings_for  # noqa: E402
from memdoctor.integrations.lightning import MemdoctorCallback  # noqa: E402
from tests.support import tiny_gpt2  # noqa: E402

MiB = 2**20


class TinyLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_gpt2.model()

    def training_step(self, batch, index):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _fit(callback, batch_size=tiny_gpt2.BATCH, **trainer_args):
    data = torch.utils.data.DataLoader(tiny_gpt2.tokens(), batch_size=batch_size)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **trainer_args)
    trainer.fit(TinyLM(), data)


def test_an_oom_in_fit_is_diagnosed_and_the_report_written(tmp_path):
    report = tmp_path / "oom.json"
    callback = MemdoctorCallback(budget="9MiB", report=report, source="dispatch")
    with pytest.raises(torch.OutOfMemoryError) as info:
        _fit(callback)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert notes.startswith("memdoctor: activations:"), notes
    assert "test_integration_lightning.py" in notes        # the user's line: training_step's forward
    data = json.loads(report.read_text())
    assert data["oom"] and data["findings"][0]["rule"] == "activations"


def test_a_plan_as_trainer_arguments_lowers_the_peak_as_predicted():
    settings = settings_for("micro=4", "lightning", batch_size=tiny_gpt2.BATCH)
    assert settings.values == {"accumulate_grad_batches": 4} and settings.dataloader == {"batch_size": 4}
    peaks = []
    for batch_size, args in ((tiny_gpt2.BATCH, {}), (settings.dataloader["batch_size"], settings.values)):
        callback = MemdoctorCallback(source="dispatch")
        _fit(callback, batch_size, **args)
        assert not callback.doc.run.ooms
        peaks.append(callback.doc.run.meta["peak_live_bytes"])
    before, after = peaks
    assert after < 0.6 * before, (before / MiB, after / MiB)
    assert before == pytest.approx(tiny_gpt2.predicted_peak(None), rel=0.1)
    assert after == pytest.approx(tiny_gpt2.predicted_peak("micro=4"), rel=0.1)


LIGHTNING_LM = Path(__file__).parent / "fixtures" / "scripts" / "lightning_lm.py"


def _diagnose(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", str(LIGHTNING_LM), *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_lightnings_gradients_kept_through_the_next_forward_are_named_with_lightnings_fix(tmp_path):
    """Lightning's automatic optimization zeroes the gradients after `training_step`'s forward:
    the last step's gradients sit beside the activations. The fix is said in Lightning's terms,
    and the fixed module (its own `optimizer_step` freeing them) fits at the predicted peak. The
    step's closure (forward, loss, backward) is the training step's, not the optimizer's; the
    modules `training_step` calls are named by their path in the LightningModule."""
    out = _diagnose("--budget", "90MiB", "--json", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "grads-during-forward", [f["rule"] for f in out["findings"]]
    remedy = first["remedies"][0]
    assert "def optimizer_step" in remedy["in_framework"] and "zero_grad(set_to_none=True)" in remedy["in_framework"]
    fixed = _diagnose("--budget", "90MiB", "--json", "--", "--fix", cwd=tmp_path)
    assert not fixed["oom"]
    assert abs(remedy["predicted_peak_bytes"] - fixed["peak_bytes"]) <= 0.02 * fixed["peak_bytes"]
    big = _diagnose("--budget", "120MiB", "--json", "--", "--batch", "32", cwd=tmp_path)
    assert big["findings"][0]["rule"] == "activations"
    assert any(line.startswith("largest savers: body.layers.") for line in big["findings"][0]["evidence"])


def test_a_validation_step_keeping_its_logits_on_self_names_the_list(tmp_path):
    """Lightning's docs keep step outputs in a list on the module (`self.val_logits`) for a
    metric over the epoch: out of memory in validation, the leak names the line that appends."""
    out = _diagnose("--budget", "100MiB", "--json", "--", "--validate", cwd=tmp_path)
    first = out["findings"][0]
    assert first["rule"] == "leak", [f["rule"] for f in out["findings"]]
    assert first["source"]["text"].strip() == "self.val_logits.append(logits)"
    assert first["accounts_for_bytes"] % (4 * 128 * 2048 * 4) == 0      # whole batches of logits
