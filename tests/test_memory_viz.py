"""`memdoctor export --memory-viz` and `trace --memory-viz`: a run traced on the CPU becomes a
snapshot that PyTorch's own memory_viz code reads, with memdoctor's categories and phases in
it. (The test unpickles the file it wrote, as the viewer does; memdoctor never unpickles.)"""
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.cuda import _memory_viz as memory_viz

from memdoctor.capture.session import Tracer
from memdoctor.cli import main
from memdoctor.run import CATEGORIES

# what the viewer's own unpickler (torch/utils/viz/MemoryViz.js) reads: protocols 2 to 4 and these opcodes
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
}


@pytest.fixture(scope="module")
def run_file(tmp_path_factory):
    """A small training run traced on the CPU, cut short by an OOM under a budget."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.AdamW(model.parameters())
    tracer = Tracer([model], [opt], budget="3MiB", source="dispatch")
    with pytest.raises(torch.OutOfMemoryError):
        with tracer:
            for batch in (32, 32, 1024):
                model(torch.randn(batch, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad()
    path = tmp_path_factory.mktemp("run") / "small.memrun.json.gz"
    tracer.run.save(path)
    return path


@pytest.fixture(scope="module")
def snapshot(run_file):
    out = run_file.parent / "snap.pickle"
    assert main(["export", str(run_file), "--memory-viz", str(out)]) == 0
    return out


def _load(path):
    with open(path, "rb") as fh:
        return pickle.load(fh)


def test_the_file_is_what_the_viewer_unpickles(snapshot):
    raw = snapshot.read_bytes()
    assert raw[:2] == b"\x80\x04"
    assert {op.name for op, _, _ in pickletools.genops(raw)} <= VIEWER_OPCODES


def test_torch_memory_viz_reads_it(snapshot):
    data = _load(snapshot)
    assert "total_allocated" in memory_viz.segsum(data)     # checks the segment accounting adds up
    assert "raise OutOfMemoryError" in memory_viz.trace(data)
    flame = memory_viz.memory(data, format_flamegraph=lambda lines: lines)
    assert "active_allocated" in flame
    for html in (memory_viz.trace_plot(data), memory_viz.trace_plot(data, filter_freed=True),
                 memory_viz.segment_plot(data)):
        assert "snapshot.pickle" in html
    segments = memory_viz.segments(data, format_flamegraph=lambda lines: lines)
    assert segments.count("\n") >= len(data["segments"][0]["blocks"])


def test_torch_memory_viz_command_line_reads_it(snapshot, tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for args in (["stats", str(snapshot)], ["trace", str(snapshot)],
                 ["trace_plot", str(snapshot), "-o", str(tmp_path / "plot.html")]):
        proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *args], capture_output=True,
                              text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "plot.html").stat().st_size > 1000


def test_categories_phases_and_lines_are_in_it(snapshot):
    data = _load(snapshot)
    trace = data["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert {e["category"] for e in allocs} <= set(CATEGORIES)
    assert {"weights", "gradients", "optimizer_state", "activations"} <= {e["category"] for e in allocs}
    assert "unknown" in {e.get("category") for e in trace}     # viewers that add it themselves need it there
    names = [f["name"] for e in allocs for f in e["frames"]]
    assert any(n.startswith("activations ") for n in names)
    assert any(n.startswith("backward, step ") for n in names) and any(n.startswith("forward, step ") for n in names)
    assert any(f["filename"] == __file__ for e in allocs for f in e["frames"])    # the user's line
    assert all("phase=" in e["user_metadata"] for e in allocs)
    assert [e["action"] for e in trace].count("oom") == 1


def test_trace_and_frees_match_the_segment_at_the_end(snapshot):
    data = _load(snapshot)
    live = {}
    for e in data["device_traces"][0]:
        if e["action"] == "alloc":
            assert e["addr"] not in live
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"]
    (segment,) = data["segments"]
    active = {b["address"]: b["size"] for b in segment["blocks"] if b["state"] == "active_allocated"}
    assert active == live
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]


def test_trace_writes_one_beside_the_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        model = nn.Linear(32, 32)
        model(torch.randn(8, 32)).sum().backward()
    """))
    proc = subprocess.run([sys.executable, "-m", "memdoctor", "trace", "--source", "dispatch", "--memory-viz",
                           "viz.pickle", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = _load(tmp_path / "viz.pickle")
    assert any(e["action"] == "alloc" for e in data["device_traces"][0])


def test_export_refuses_a_folder(run_file, tmp_path):
    assert main(["export", str(run_file), "--memory-viz", str(tmp_path)]) == 2
