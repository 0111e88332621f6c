"""memdoctor.watch in a training script: the diagnosis rides on the OOM, the report is
written even then, and memdoctor's own failures never reach the loop."""
import json

import pytest
import torch
from torch import nn

import memdoctor


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model, opt, batch, steps=2):
    for _ in range(steps):
        loss = model(torch.randn(batch, 256)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_oom_gets_the_diagnosis_as_a_note_and_the_report_is_written(tmp_path):
    model, opt = _model()
    report = tmp_path / "oom.json"
    with pytest.raises(torch.OutOfMemoryError) as info:
        with memdoctor.watch(model, opt, budget="48MiB", report=report):
            _train(model, opt, 8192)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert notes.startswith("memdoctor: activations:"), notes
    data = json.loads(report.read_text())
    assert data["oom"] and data["findings"][0]["rule"] == "activations"
    assert not list(tmp_path.glob(".memdoctor-*"))      # no temporary left behind


def test_run_file_report_and_attributes(tmp_path):
    model, opt = _model()
    report = tmp_path / "run.memrun.json.gz"
    with memdoctor.watch(model, opt, report=report) as doc:
        _train(model, opt, 64)
    assert doc.run is not None and not doc.run.ooms
    assert doc.findings == []
    assert memdoctor.Run.load(report).num_events == doc.run.num_events


def test_a_failure_inside_memdoctor_never_breaks_training(monkeypatch):
    from memdoctor.capture import recorder
    model, opt = _model()
    reference, ref_opt = _model()
    _train(reference, ref_opt, 32)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(recorder.Recorder, "add", broken)
    monkeypatch.setattr(recorder.Recorder, "claim", broken)
    torch.manual_seed(0)
    model, opt = _model()
    with memdoctor.watch(model, opt):
        _train(model, opt, 32)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_a_report_that_cannot_be_written_does_not_hide_the_oom(tmp_path):
    model, opt = _model()
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(torch.OutOfMemoryError):
        with memdoctor.watch(model, opt, budget="48MiB", report=blocked / "sub" / "r.json"):
            _train(model, opt, 8192)
