"""Each finding names the user's line: where the memory was made, or for memory kept alive
(a list that grows, gradients zeroed in place) the line that keeps it; the source table
travels with the run file and comes from a snapshot's frames too."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memdoctor.attribution import breakdown_at, peak
from memdoctor.capture.keepers import find_held
from memdoctor.capture.script import trace_script
from memdoctor.capture.snapshot import snapshot_to_run
from memdoctor.run import Run
from tests.support.paths import shared_path

HERE = Path(__file__).parent
OWN = json.loads((HERE / "scenarios" / "expected.json").read_text())

# scenario -> the line of the script that is the cause (found by its text, checked by number)
OWN_LINES = {
    "leak_outputs_history.py": ("kept.append(hidden)", 17),
    "eval_forward_with_grad.py": ("scores = [model(torch.randn(6144, 256))", 17),
    "dataset_on_device.py": ("features = torch.randn(160_000, 256, device=device)", 7),
    "grads_kept_through_forward.py": ("optimizer.zero_grad(set_to_none=False)", 14),
    # the model is the script's own: its memory is made inside its forward, the call is the line
    "eval_function_sums_loss_tensor.py": ("total = total + F.cross_entropy(model(x), y)", 27),
    # the multi-hot targets are as wide as the logits: the line is the model's, not theirs
    "labels_wide_multilabel.py": ("loss = loss_fn(model(tokens), targets)", 15),
    "eval_gathers_outputs.py": ("all_logits.append(model(x))", 20),
}
SHARED_LINES = {
    "s04_collect_embeddings.py": "embeddings.append(emb)",
    "s05_validation_pass.py": "correct += (model(x).argmax(dim=-1) == y).sum().item()",
}


def diagnose_json(script, budget, cwd):
    proc = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", str(script), "--budget", budget,
                           "--source", "dispatch", "--json"], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def line_of(path: Path, text: str) -> int:
    numbers = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(numbers) == 1, (path, text, numbers)
    return numbers[0]


def check_source(out: dict, path: Path, cause: str, line: int) -> None:
    first = out["findings"][0]
    assert first["rule"] == cause
    src = first["source"]
    assert src is not None, first
    assert (Path(src["file"]).name, src["line"]) == (path.name, line), src
    assert src["label"] == f"{path.name}:{line}"
    assert src["text"] == path.read_text().splitlines()[line - 1].strip()


@pytest.mark.parametrize("name", sorted(OWN_LINES))
def test_own_scenario_names_the_line_of_its_cause(name, tmp_path):
    path = HERE / "scenarios" / name
    text, line = OWN_LINES[name]
    assert line_of(path, text) == line
    out = diagnose_json(path, OWN[name]["budget"], tmp_path)
    check_source(out, path, OWN[name]["cause"], line)


@pytest.mark.parametrize("name", sorted(SHARED_LINES))
def test_shared_scenario_names_the_line_of_its_cause(name, tmp_path):
    path = shared_path("scenarios", name)
    expected = json.loads(shared_path("scenarios", "expected.json").read_text())[name]
    out = diagnose_json(path, expected["budget"]["cpu"], tmp_path)
    check_source(out, path, expected["cause"], line_of(path, SHARED_LINES[name]))


def test_a_leak_names_the_append_and_where_the_tensors_were_made(tmp_path):
    path = HERE / "scenarios" / "leak_outputs_history.py"
    out = diagnose_json(path, OWN["leak_outputs_history.py"]["budget"], tmp_path)
    src = out["findings"][0]["source"]
    assert "keeps them alive" in src["role"] and "`kept`" in src["role"]
    assert src["made_at"]["line"] == line_of(path, "hidden = model[:4](x)")


def test_every_block_made_under_the_tracer_has_a_line_and_the_table_shows_it():
    run = trace_script(str(HERE / "scenarios" / "leak_outputs_history.py"), budget="64MiB", source="dispatch").run
    assert run.ooms and run.source_at(run.ooms[0].source) is not None      # the line that asked
    made = [b for b in run.blocks.values() if b.source >= 0]
    assert len(made) == len(run.blocks)         # the script made every tensor, so every one has its line
    assert {Path(f).name for f, _, _ in run.sources} == {"leak_outputs_history.py"}
    top = breakdown_at(run, peak(run)[0]).top
    assert all(t.source.startswith("leak_outputs_history.py:") for t in top)


def test_sources_round_trip_and_older_files_read_as_unknown(tmp_path):
    run = trace_script(str(HERE / "scenarios" / "grads_kept_through_forward.py"), source="dispatch").run
    path = tmp_path / "r.memrun.json.gz"
    run.save(path)
    back = Run.load(path)
    assert back.sources == run.sources
    assert [b.source for b in back.blocks.values()] == [b.source for b in run.blocks.values()]
    assert back.meta["kept_by"] == run.meta["kept_by"]
    data = json.loads(gzip.decompress(path.read_bytes()))
    del data["sources"], data["blocks"]["source"]       # a file written before the column
    for o in data["ooms"]:
        o.pop("source", None)
    old = Run.from_dict(data)
    assert old.sources == [] and {b.source for b in old.blocks.values()} == {-1}
    data["sources"] = [["x.py", 1, "f"]]
    data["blocks"]["source"] = [5] * len(data["blocks"]["id"])
    with pytest.raises(Exception, match="source"):
        Run.from_dict(data)


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def test_snapshot_frames_give_the_first_user_frame():
    user = "/home/me/project/train.py"
    frames = [_frame("/opt/conda/lib/python3.11/site-packages/torch/nn/functional.py", 2000, "linear"),
              _frame("??", 0, "at::native::mm"),
              _frame("/opt/conda/lib/python3.11/site-packages/transformers/modeling_gpt2.py", 300, "forward"),
              _frame(user, 42, "train_step"), _frame(user, 90, "<module>")]
    snapshot = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 0x1000, "size": 4096, "stream": 0, "frames": frames},
        {"action": "alloc", "addr": 0x3000, "size": 512, "stream": 0, "frames": frames[:3]},
        {"action": "oom", "addr": 0, "size": 1 << 30, "stream": 0, "device_free": 0,
         "frames": [_frame(user, 43, "train_step")]},
    ]]}
    run = snapshot_to_run(snapshot, 0)
    first, second = sorted(run.blocks.values(), key=lambda b: b.alloc_seq)
    assert run.source_at(first.source).label == "train.py:42"
    assert run.source_at(first.source).function == "train_step"
    assert second.source == -1          # no frame of the user's
    assert run.source_at(run.ooms[0].source).line == 43


def test_a_list_on_self_is_found_with_its_append_line():
    class Trainer:
        def __init__(self):
            self.history = []

        def step(self):
            t = torch.ones(4)
            self.history.append(t)          # the line to find
            return sys._getframe()

    trainer = Trainer()
    frame = trainer.step()
    held = find_held(frame=frame)
    found = [h for h in held if h.holder == "self.history"]
    assert found and found[0].line == frame.f_code.co_firstlineno + 2
    assert len(found[0].storages) == 1


class _LazyMapping(dict):
    """transformers' MODEL_MAPPING: a dict whose values() imports every model class, one of
    which may fail to import."""

    def values(self):
        raise ValueError("Could not find SomeModel in transformers")


def test_a_lazy_mapping_beside_the_list_does_not_stop_the_search():
    mapping = _LazyMapping(a=1)     # noqa: F841 (in the frame, as a script's module-level mapping is)
    history = []

    def step():
        history.append(torch.ones(4))       # the line to find
        return sys._getframe(1)

    frame = step()
    found = [h for h in find_held(frame=frame) if h.holder == "history"]
    assert found and len(found[0].storages) == 1


def test_a_real_oom_takes_the_line_of_its_traceback():
    from memdoctor.capture.session import Tracer
    with pytest.raises(torch.OutOfMemoryError):
        with Tracer(source="dispatch") as t:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")  # this line
    src = t.run.source_at(t.run.ooms[0].source)
    assert (Path(src.file).name, src.text()) == ("test_source_lines.py", 'raise torch.OutOfMemoryError('
                                                 '"CUDA out of memory. Tried to allocate 2.00 GiB.")  # this line')


def test_a_thread_without_python_frames_of_the_user_takes_the_waiting_threads_line():
    """CUDA's backward runs on the autograd engine's thread: its blocks take the line the
    training thread waits at (loss.backward())."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from memdoctor.capture.frames import user_line_of_thread
    with ThreadPoolExecutor(1) as pool:             # its thread runs no code of this file
        file, line, function = pool.submit(user_line_of_thread, threading.get_ident()).result()  # here
    assert Path(file).name == "test_source_lines.py" and function.startswith("test_a_thread")
    assert Path(file).read_text().splitlines()[line - 1].endswith("# here")
