"""The guards the readers and the command line share: the memory limit for reading files
(stated, settable, charged with what is built), sizes of any length, printable text, and
files written with the user's umask."""
from __future__ import annotations

import gzip
import json
import os
import pickle

import pytest

from memdoctor.capture.oomlog import scan_file
from memdoctor.capture.snapshot import read_snapshot
from memdoctor.limits import DEFAULT_LIMIT, Allowance, ReadLimitError, read_limit
from memdoctor.remedies.plan import Plan
from memdoctor.run import Run, write_atomic
from memdoctor.sanitize import printable, printable_column, printable_data
from memdoctor.units import MAX_SIZE, SizeError, parse_size
from tests.test_oomlog import NEW


# ---- the limit -----------------------------------------------------------------------------
def test_the_limit_is_1_gib_and_settable(monkeypatch):
    monkeypatch.delenv("MEMDOCTOR_READ_LIMIT", raising=False)
    assert read_limit() == DEFAULT_LIMIT == 2**30
    monkeypatch.setenv("MEMDOCTOR_READ_LIMIT", "4GiB")
    assert read_limit() == 4 * 2**30
    monkeypatch.setenv("MEMDOCTOR_READ_LIMIT", "lots")
    with pytest.raises(ReadLimitError, match="MEMDOCTOR_READ_LIMIT"):
        read_limit()


def test_a_trace_of_60000_forward_calls_reads_back_under_the_default_limit(tmp_path, monkeypatch):
    """Features computed sample by sample by a small model under no_grad (60,000 model calls,
    over 300,000 events) is a run memdoctor writes; reading it back charges less than the
    default limit, and at least what reading it takes. (A transform without parameters
    would leave no forward calls: such calls pass through the hooks.)"""
    import tracemalloc
    from memdoctor.capture.script import trace_script
    monkeypatch.delenv("MEMDOCTOR_READ_LIMIT", raising=False)
    script = tmp_path / "preload.py"
    script.write_text("import torch\nfrom torch import nn\n"
                      "class Features(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                      "        self.scale = nn.Parameter(torch.ones(1))\n"
                      "    def forward(self, x):\n        return (x - 0.13) / 0.31 * self.scale\n"
                      "model = Features()\nwith torch.no_grad():\n"
                      "    data = [model(torch.rand(1, 28, 28)) for _ in range(60000)]\n")
    path = tmp_path / "r.memrun.json.gz"
    trace_script(str(script), source="dispatch").run.save(path)
    charged = Allowance("x", limit=1 << 62)
    from memdoctor.run import read_run_text
    read_run_text(path, charged)
    tracemalloc.start()
    try:
        run = Run.load(path)
        taken = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert run.num_events >= 300_000 and len(run.meta["forward_calls"]) == 60_000
    assert taken <= charged.used < DEFAULT_LIMIT


def test_what_json_builds_is_charged_not_only_its_bytes():
    """Two bytes of text, "{}" and a comma, make a 64-byte dict and its slot: the charge
    follows the objects."""
    text = "[" + ",".join(["{}"] * 100_000) + "]"
    allowance = Allowance("x", limit=1 << 62)
    allowance.charge_json(text)
    assert allowance.used > 40 * len(text)


@pytest.mark.parametrize("reader", ["run", "snapshot", "log"])
def test_every_reader_stops_at_the_limit_in_one_line(tmp_path, monkeypatch, reader):
    monkeypatch.setenv("MEMDOCTOR_READ_LIMIT", "1MiB")
    if reader == "run":
        path = tmp_path / "r.memrun.json.gz"
        path.write_bytes(gzip.compress(b'{"events":{"action":[' + b"0," * 1_000_000 + b"0]}}"))
        read = Run.load
    elif reader == "snapshot":
        path = tmp_path / "s.pickle"
        path.write_bytes(pickle.dumps({"segments": [{} for _ in range(100_000)], "device_traces": []}))
        read = read_snapshot
    else:
        path = tmp_path / "l.log"
        path.write_text((NEW + "\n") * 500)
        read = scan_file
    with pytest.raises(ReadLimitError) as caught:
        read(path)
    assert "\n" not in str(caught.value) and "1.00 MiB" in str(caught.value)


def test_a_file_that_never_ends_stops_at_the_limit(monkeypatch):
    monkeypatch.setenv("MEMDOCTOR_READ_LIMIT", "4MiB")
    with pytest.raises(ReadLimitError):
        Run.load("/dev/zero")


# ---- sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["9" * 400, "1" + "0" * 30 + "GiB", "9" * 19, "²", "1e3", "-5", "inf", "nan",
                                  "\x1b[31m1GiB", float("inf"), float("nan"), -1, 2**64, True])
def test_a_size_of_any_kind_is_one_clean_error(text):
    with pytest.raises(SizeError) as caught:
        parse_size(text)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 200 and "\x1b" not in message


def test_sizes_that_are_sizes_still_read():
    assert parse_size("224MiB") == 224 * 2**20
    assert parse_size("1.5GB") == 3 * 2**29
    assert parse_size("2.5") == 2 and parse_size(".5k") == 512
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE


@pytest.mark.parametrize("text", ["micro=²", "micro=" + "9" * 400, "ckpt=٣"])
def test_plan_numbers_are_ascii_digits(text):
    with pytest.raises(ValueError, match="bad value"):
        Plan.parse(text)


# ---- printable text --------------------------------------------------------------------------
def test_printable_takes_out_control_and_direction_characters():
    assert printable("a\x1b]52;c;eA==\x07b\u202ec\x9bd\te\nf") == "a?]52;c;eA==?b?c?d e f"
    assert printable("line\nnext", newlines=True) == "line\nnext"
    assert printable_data({"k\x1b": ["v\x07", 3]}) == {"k?": ["v?", 3]}
    names = ["layer.0", None, "layer.1"]
    assert printable_column(names) is names
    assert printable_column(["a\x1b", None]) == ["a?", None]


# ---- files ------------------------------------------------------------------------------------
@pytest.mark.skipif(os.name != "posix", reason="modes are POSIX")
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_are_written_with_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "report.json", json.dumps({"ok": True}).encode())
        Run(source="dispatch").save(tmp_path / "run.memrun.json.gz")
    finally:
        os.umask(old)
    for name in ("report.json", "run.memrun.json.gz"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode
    assert sorted(os.listdir(tmp_path)) == ["report.json", "run.memrun.json.gz"]
