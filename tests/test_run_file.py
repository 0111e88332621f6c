"""Run files: a saved run loads back exactly, and anything else is refused with one line."""
from __future__ import annotations

import copy
import gzip
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from memdoctor import attribution as A
from memdoctor.run import FORMAT, VERSION, Block, Mark, OOM, Run, RunFileError, Sample
from memdoctor.capture.session import Tracer


def traced_run() -> Run:
    """A real run: two SGD steps and a third cut short by a simulated OOM."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tracer = Tracer(models=[model], optimizers=[opt], budget=64 * 1024, source="dispatch")
    with pytest.raises(torch.OutOfMemoryError):
        with tracer:
            for batch in (8, 8, 512):
                model(torch.randn(batch, 32)).square().mean().backward()
                opt.step()
                opt.zero_grad()
    run = tracer.run
    # fields only a CUDA run fills, so that every column is exercised
    run.samples.append(Sample(seq=3, allocated=1 << 20, reserved=2 << 20))
    run.segments.append({"address": 1 << 40, "total_size": 2 << 20, "stream": 0, "blocks": []})
    next(iter(run.blocks.values())).address = 1 << 40
    return run


def test_traced_run_round_trips_losslessly(tmp_path):
    """save() then load() gives back the same run, field for field, and the same numbers."""
    run = traced_run()
    assert run.ooms and run.marks and len(run.blocks) > 10
    path = tmp_path / "x.memrun.json.gz"
    run.save(path)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = Run.load(path)
    assert back.to_dict() == run.to_dict()
    assert back.blocks == run.blocks and back.marks == run.marks and back.ooms == run.ooms
    assert A.peak(back) == A.peak(run)
    assert A.at_oom(back).to_dict() == A.at_oom(run).to_dict()
    # an uncompressed copy reads the same
    plain = tmp_path / "x.memrun.json"
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    assert Run.load(plain).to_dict() == run.to_dict()


def test_saved_text_is_the_runs_json_exactly(tmp_path):
    """save() makes its JSON a piece at a time, compressed on a second thread: the file
    holds exactly json.dumps of to_dict(), lists longer than a piece and nested meta too."""
    run = traced_run()
    n = 100_003
    run.actions, run.event_blocks, run.event_bytes = [0] * n, list(range(n)), [n - i for i in range(n)]
    run.meta["nested"] = {"calls": [{"a": i, "b": [i, str(i)]} for i in range(30_001)], "empty": {}, "none": []}
    path = tmp_path / "x.memrun.json.gz"
    run.save(path)
    assert gzip.decompress(path.read_bytes()) == json.dumps(run.to_dict(), separators=(",", ":")).encode()


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
maybe_int = st.none() | st.integers(0, 2**62)


@st.composite
def runs(draw) -> Run:
    """Any run a file may hold: values of any kind, indices and sizes within their ranges."""
    n_blocks = draw(st.integers(0, 6))
    n_events = draw(st.integers(0, 20))
    seq = st.integers(0, n_events)
    blocks = {}
    for i in range(n_blocks):
        blocks[i] = Block(
            id=i, nbytes=draw(st.integers(0, 2**50)), category=draw(st.sampled_from(
                ["weights", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "other"])),
            name=draw(names), shape=draw(st.lists(st.integers(0, 2**31), max_size=4)), dtype=draw(names),
            device=draw(names), module=draw(st.none() | names), phase=draw(names),
            step=draw(st.integers(0, 10**6)), alloc_seq=draw(seq),
            free_seq=draw(st.none() | seq), address=draw(maybe_int))
    return Run(
        source=draw(st.sampled_from(["dispatch", "allocator"])),
        device={"type": draw(names), "capacity_bytes": draw(maybe_int)},
        budget_bytes=draw(maybe_int), script=draw(st.none() | names), argv=draw(st.lists(names, max_size=3)),
        torch_version=draw(names),
        actions=draw(st.lists(st.integers(0, 2), min_size=n_events, max_size=n_events)),
        event_blocks=draw(st.lists(st.integers(-1, n_blocks - 1), min_size=n_events, max_size=n_events)),
        event_bytes=draw(st.lists(st.integers(0, 2**50), min_size=n_events, max_size=n_events)),
        blocks=blocks,
        marks=draw(st.lists(st.builds(Mark, seq=seq, phase=names, step=st.integers(0, 99),
                                      module=st.none() | names,
                                      time=st.floats(0, 1e6, allow_nan=False)), max_size=4)),
        ooms=draw(st.lists(st.builds(OOM, seq=seq, requested_bytes=maybe_int, message=names,
                                     phase=names, step=st.integers(0, 99), module=st.none() | names,
                                     simulated=st.booleans(), live_bytes=maybe_int), max_size=2)),
        samples=draw(st.lists(st.builds(Sample, seq=seq, allocated=st.integers(0, 2**40),
                                        reserved=st.integers(0, 2**40)), max_size=2)),
        meta={"note": draw(names), "numbers": draw(st.lists(st.integers(-5, 5), max_size=3))},
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=runs())
def test_any_run_round_trips_losslessly(tmp_path, run):
    """Whatever a Run holds (unicode names, huge sizes, None fields) survives save and load."""
    path = tmp_path / "r.memrun.json.gz"
    run.save(path)
    assert Run.load(path).to_dict() == run.to_dict()


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, repr(text)
    return text


def valid_payload() -> dict:
    return traced_run().to_dict()


def write(path, payload: bytes) -> str:
    path.write_bytes(payload)
    return str(path)


def damaged_files(tmp_path) -> dict[str, str]:
    good = gzip.compress(json.dumps(valid_payload()).encode())
    other_version = {**valid_payload(), "version": VERSION + 1}
    return {
        "truncated gzip": write(tmp_path / "cut.gz", good[: len(good) // 2]),
        "gzip of garbage": write(tmp_path / "gz.gz", gzip.compress(b"\x00\xff not json")),
        "garbage bytes": write(tmp_path / "junk", bytes(range(256)) * 8),
        "empty file": write(tmp_path / "empty", b""),
        "json list": write(tmp_path / "list.json", b"[1, 2, 3]"),
        "json of another tool": write(tmp_path / "other.json", json.dumps({"traceEvents": []}).encode()),
        "a memory snapshot's shape": write(tmp_path / "snap.json",
                                           json.dumps({"segments": [], "device_traces": [[]]}).encode()),
        "wrong version": write(tmp_path / "v2.gz", gzip.compress(json.dumps(other_version).encode())),
        "missing file": str(tmp_path / "nope.memrun.json.gz"),
        "a directory": str(tmp_path),
    }


@pytest.mark.parametrize("case", ["truncated gzip", "gzip of garbage", "garbage bytes", "empty file",
                                  "json list", "json of another tool", "a memory snapshot's shape",
                                  "wrong version", "missing file", "a directory"])
def test_bad_file_raises_run_file_error_in_one_line(tmp_path, case):
    """A file that is not a run of this version is refused with RunFileError, one line."""
    path = damaged_files(tmp_path)[case]
    with pytest.raises(RunFileError) as info:
        Run.load(path)
    text = one_line(info.value)
    if case == "wrong version":
        assert f"version {VERSION + 1}" in text and f"expected {VERSION}" in text


@pytest.mark.parametrize("damage", [
    lambda d: d.__delitem__("events"),
    lambda d: d.__setitem__("events", [1, 2]),
    lambda d: d["events"].update(action="000", block="000", bytes="000"),
    lambda d: d["events"]["bytes"].pop(),
    lambda d: d["blocks"]["nbytes"].__setitem__(0, "4096"),
    lambda d: d["blocks"]["shape"].__setitem__(0, "3x4"),
    lambda d: d["blocks"]["id"].__setitem__(1, d["blocks"]["id"][0]),
    lambda d: d["blocks"]["category"].pop(),
    lambda d: d.__setitem__("marks", {"0": {}}),
    lambda d: d["marks"][0].__setitem__("phase", None),
    lambda d: d["ooms"][0].__setitem__("surprise", 1),
    lambda d: d.__setitem__("meta", []),
    lambda d: d.__setitem__("budget_bytes", "64KiB"),
], ids=["no events", "events a list", "events strings", "event columns differ", "nbytes a string",
        "shape a string", "repeated block id", "block columns differ", "marks a dict", "phase null",
        "unknown oom field", "meta a list", "budget a string"])
def test_run_json_of_another_shape_is_refused(tmp_path, damage):
    """A memdoctor run file whose content has the wrong shape or types is refused."""
    payload = valid_payload()
    damage(payload)
    path = write(tmp_path / "bad.memrun.json.gz", gzip.compress(json.dumps(payload).encode()))
    with pytest.raises(RunFileError) as info:
        Run.load(path)
    assert "damaged" in one_line(info.value)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)


def paths(value, prefix=()):
    """Every path into a JSON value (keys and list indexes), outermost first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:2]):
            yield from paths(v, (*prefix, i))


_BASE = None


def base_payload() -> dict:
    global _BASE
    if _BASE is None:
        _BASE = valid_payload()
    return _BASE


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_run_file_loads_or_is_refused(data):
    """Replace or delete any part of a real run's JSON: loading either refuses it with
    RunFileError or gives a run that round-trips and that attribution can read."""
    payload = copy.deepcopy(base_payload())
    where = data.draw(st.sampled_from([p for p in paths(payload) if p]))
    parent = payload
    for key in where[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()):
        parent[where[-1]] = data.draw(JSON)
    elif isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent.pop(where[-1])
    try:
        run = Run.from_dict(json.loads(json.dumps(payload)))
    except RunFileError as exc:
        one_line(exc)
        return
    assert Run.from_dict(run.to_dict()).to_dict() == run.to_dict()
    A.peak(run)
    A.at_peak(run)
    A.per_step(run)


def test_save_is_atomic(tmp_path, monkeypatch):
    """A save that fails half way leaves the previous file intact and no temporary behind."""
    path = tmp_path / "keep.memrun.json.gz"
    first = traced_run()
    first.save(path)
    before = path.read_bytes()

    def fail(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        Run(source="dispatch").save(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["keep.memrun.json.gz"]


def test_format_marker_is_checked():
    """A dict without memdoctor's format marker is not a run, whatever else it holds."""
    payload = base_payload()
    with pytest.raises(RunFileError, match="not a memdoctor run file"):
        Run.from_dict({**payload, "format": "something.else"})
    assert payload["format"] == FORMAT
