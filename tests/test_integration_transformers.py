"""memdoctor in a real transformers Trainer, on the CPU: the callback diagnoses an OOM under a
budget and writes the report, and a Plan turned into TrainingArguments lowers the measured
peak to what memdoctor predicts for that plan."""
import json
import logging

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")       # Trainer needs it

from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from memdoctor.integrations import settings_for  # noqa: E402
from memdoctor.integrations.transformers import MemdoctorCallback  # noqa: E402
from tests.support import tiny_gpt2  # noqa: E402

MiB = 2**20


@pytest.fixture(autouse=True)
def _quiet():
    hf_logging.set_verbosity_error()


def _trainer(tmp_path, callback, **args):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=tiny_gpt2.BATCH, max_steps=2,
                    report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True)
    settings.update(args)
    return Trainer(model=tiny_gpt2.model(), args=TrainingArguments(**settings),
                   train_dataset=tiny_gpt2.TokenDataset(), callbacks=[callback] if callback else [])


def _peak(tmp_path, **args) -> int:
    callback = MemdoctorCallback(source="dispatch")
    _trainer(tmp_path, callback, **args).train()
    assert not callback.doc.run.ooms
    return callback.doc.run.meta["peak_live_bytes"]


def test_an_oom_in_trainer_is_diagnosed_and_the_report_written(tmp_path):
    report = tmp_path / "oom.json"
    callback = MemdoctorCallback(budget="9MiB", report=report, source="dispatch")
    trainer = _trainer(tmp_path, callback)
    with pytest.raises(torch.OutOfMemoryError) as info:
        trainer.train()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert notes.startswith("memdoctor: activations:"), notes
    data = json.loads(report.read_text())
    assert data["oom"] and data["findings"][0]["rule"] == "activations"
    assert callback.doc.findings[0].rule == "activations"


def test_a_callback_added_after_the_trainer_was_built_says_so(tmp_path, caplog):
    late = MemdoctorCallback(source="dispatch")
    trainer = _trainer(tmp_path, None, max_steps=1)
    trainer.add_callback(late)
    with caplog.at_level(logging.WARNING, logger="memdoctor"):
        trainer.train()
    assert late.doc is None and "callback.attach(trainer)" in caplog.text


@pytest.fixture(scope="module")
def before(tmp_path_factory):
    """The Trainer's measured peak as the user wrote it, and memdoctor's prediction of it."""
    measured = _peak(tmp_path_factory.mktemp("before"))
    predicted = tiny_gpt2.predicted_peak(None)
    assert measured == pytest.approx(predicted, rel=0.1), (measured / MiB, predicted / MiB)
    return measured


@pytest.mark.parametrize("plan", ["micro=4", "ckpt=full"])
def test_a_plan_as_training_arguments_lowers_the_peak_as_predicted(tmp_path, before, plan):
    settings = settings_for(plan, "transformers", batch_size=tiny_gpt2.BATCH)
    assert not settings.unsupported
    after, predicted_after = _peak(tmp_path, **settings.values), tiny_gpt2.predicted_peak(plan)
    assert after < 0.6 * before, (plan, before / MiB, after / MiB)
    assert after == pytest.approx(predicted_after, rel=0.1), (plan, after / MiB, predicted_after / MiB)


def test_weights_loaded_with_from_pretrained_count_as_weights(tmp_path):
    """On the CPU `from_pretrained` memory-maps a safetensors file: storages torch never
    allocated, which a GPU run holds on the device. They count as the model's weights, to the
    byte; gradients and AdamW's state are counted as usual."""
    from memdoctor.capture.session import Tracer
    from memdoctor import attribution as A
    from transformers import GPT2LMHeadModel
    tiny_gpt2.model().save_pretrained(tmp_path / "tiny")
    tracer = Tracer(source="dispatch")
    with tracer:
        model = GPT2LMHeadModel.from_pretrained(tmp_path / "tiny")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = tiny_gpt2.tokens(tiny_gpt2.BATCH)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    after = A.breakdown_at(tracer.run, tracer.run.num_events - 1).by_category
    assert after["weights"] == params
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    assert after["gradients"] == params and after["optimizer_state"] == 2 * params + steps
