"""A hostile-input corpus, built here, through every entry point that reads a file or a size
(`diagnose --run/--snapshot/--log`, `report`, `tui`, `estimate`/`plan` sizes), in one
process with a memory cap: every case exits 0, 2 or 3, an error is one line, no case
passes the cap or takes 10 s, and the bytes written hold no control character.

The corpus: bombs of each kind (gzip of zeros, of a million empty objects, of thirty
million events, a pickle whose shared references multiply, deep nesting), run files with
every field tampered (a wrong type, a negative, a huge number, an escape sequence, the
field deleted), escape sequences in every name, oversized numbers, a log that is one long
line, a coloured log, a log with more messages than the limit allows.
"""
from __future__ import annotations

import copy
import gzip
import json
import os
import pickle
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.test_oomlog import NEW, NEW_FACTS
from tests.test_run_file import traced_run
from tests.test_snapshot import make_snapshot

CAP = 2 * 1024**3                       # the test process's address space, torch included
NINES = "9" * 400
# What a crafted name carries: a window title, a paste-buffer write (OSC 52), a screen
# clear, an 8-bit CSI, a bidirectional override, a bell.
ESC = "\x1b]0;PWNED\x07\x1b]52;c;ZWNobyBQV05FRA==\x07\x1b[2J\x9b31m\u202e\x07"
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


# ---- the corpus --------------------------------------------------------------------------
def _gz(data: bytes, level: int = 9) -> bytes:
    return gzip.compress(data, level)


def _zeros_gz(size: int) -> bytes:
    """gzip of `size` zero bytes, made a MiB at a time."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    return b"".join([z.compress(chunk) for _ in range(size >> 20)] + [z.flush()])


def _paths(value, prefix=()):
    """Every path into a JSON value (dict keys, the first list element), outermost first."""
    if prefix:
        yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list) and value:
        yield from _paths(value[0], (*prefix, 0))


def _with_escapes(value, key=None):
    """Every string in a run's JSON carrying ESC (but the format marker and categories,
    which decide whether the file is read at all)."""
    if isinstance(value, str):
        return value if key in ("format", "category") else value + ESC
    if isinstance(value, dict):
        return {k: _with_escapes(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_escapes(v, key) for v in value]
    return value


# One mutation a field, in turn: a wrong type, a negative, a huge number, an escape
# sequence, deletion, an index past the end.
MUTATIONS = ("type", "negative", "huge", "escape", "delete", "past")


def _tampered(base: dict, where: tuple, how: str) -> dict:
    payload = copy.deepcopy(base)
    parent = payload
    for k in where[:-1]:
        parent = parent[k]
    key = where[-1]
    if how == "delete":
        del parent[key]
    else:
        parent[key] = {"type": {"x": [1]}, "negative": -(2**40), "huge": 10**30, "escape": ESC,
                       "past": len(base["events"]["action"]) + 1}[how]
    return payload


def _base_runs() -> dict[str, dict]:
    from memdoctor.capture.snapshot import snapshot_to_run
    return {"traced": traced_run().to_dict(), "snapshot": snapshot_to_run(make_snapshot()).to_dict()}


def _run_files(folder: Path) -> dict[str, tuple[Path, tuple]]:
    """name -> (file, exit codes it may give)."""
    out: dict[str, tuple[Path, tuple]] = {}

    def put(name: str, data: bytes, codes=(0, 2, 3)) -> None:
        path = folder / f"{name}.memrun.json.gz"
        path.write_bytes(data)
        out[name] = (path, codes)

    bases = _base_runs()
    for base_name, base in bases.items():
        put(f"run-{base_name}-escapes", _gz(json.dumps(_with_escapes(base)).encode()), (0, 3))
        for i, where in enumerate(_paths(base)):
            how = MUTATIONS[i % len(MUTATIONS)]
            if where in (("format",), ("version",)):
                continue
            name = f"run-{base_name}-{'.'.join(map(str, where))}-{how}"
            put(name, _gz(json.dumps(_tampered(base, where, how)).encode()))
    base = bases["traced"]
    zeros = b'{"format":"memdoctor.run","version":1,"events":{"action":[' + b"0," * 30_000_000 + b"0]}}"
    put("run-bomb-thirty-million-events", _gz(zeros), (2,))
    put("run-bomb-empty-objects", _gz(json.dumps({**base, "meta": {"x": [{}] * 12_000_000}}).encode()), (2,))
    put("run-bomb-deep-nesting", _gz(json.dumps(base)[:-1].encode() + b',"deep":' + b"[" * 200_000
                                     + b"]" * 200_000 + b"}"), (2,))
    put("run-bomb-zeros", _zeros_gz(300 << 20), (2,))
    put("run-oversized-block", _gz(json.dumps(_tampered(base, ("blocks", "nbytes", 0), "huge")).encode()), (2,))
    put("run-oversized-budget", _gz(json.dumps({**base, "budget_bytes": 2**70}).encode()), (2,))
    return out


def _snapshots(folder: Path) -> dict[str, tuple[Path, tuple]]:
    out: dict[str, tuple[Path, tuple]] = {}

    def put(name: str, data: bytes, codes=(0, 2, 3)) -> None:
        path = folder / f"{name}.snapshot"
        path.write_bytes(data)
        out[name] = (path, codes)

    snap = make_snapshot()
    named = copy.deepcopy(snap)
    for trace in named["device_traces"]:
        for e in trace:
            for f in e.get("frames", []):
                f["filename"] = f["filename"].replace(".py", ESC + ".py")
                f["name"] = ESC
    named["allocator_settings"] = {ESC: ESC}
    named["external_annotations"] = [{"stage": ESC}]
    put("snap-escapes", pickle.dumps(named), (0, 3))
    put("snap-escapes-json", json.dumps(named).encode(), (0, 3))
    put("snap-bomb-empty-objects", _gz(b'{"segments":[' + b"{}," * 20_000_000 + b'{}],"device_traces":[]}'), (2,))
    put("snap-bomb-zeros", _zeros_gz(300 << 20), (2,))
    block = {"size": 1, "state": "inactive"}
    shared = {"address": 0, "total_size": 0, "blocks": [block] * 100_000}
    put("snap-bomb-shared-references", pickle.dumps({"segments": [shared] * 100_000, "device_traces": []}), (2,))
    levels: object = [0] * 100
    for _ in range(4):
        levels = {str(i): levels for i in range(100)}
    put("snap-bomb-shared-settings", pickle.dumps({"segments": [], "device_traces": [],
                                                   "allocator_settings": levels}), (0,))
    negative = copy.deepcopy(snap)
    negative["segments"][0]["total_size"] = -10**12
    put("snap-negative-size", pickle.dumps(negative), (2,))
    huge = copy.deepcopy(snap)
    huge["device_traces"][0][0]["size"] = 10**30
    put("snap-huge-size", pickle.dumps(huge), (2,))
    return out


def _logs(folder: Path) -> dict[str, tuple[Path, tuple, dict]]:
    out: dict[str, tuple[Path, tuple, dict]] = {}

    def put(name: str, data: bytes, codes, env=None) -> None:
        path = folder / f"{name}.log"
        path.write_bytes(data)
        out[name] = (path, codes, env or {})

    put("log-one-long-line", b"\x00" * (5 << 20) + b"x" * (3 << 20) + NEW.encode() + b"\n", (3,))
    coloured = NEW.replace("Tried to allocate 2.50 GiB", "Tried to allocate \x1b[1;31m2.50\x1b[0m GiB")
    put("log-coloured", f"\x1b[32mstep 1 loss 0.3\x1b[0m\n{coloured}\n".encode(), (3,))
    put("log-escapes", f"[rank{ESC}]: {NEW}\n{ESC}\n".encode(), (3,))
    put("log-more-messages-than-the-limit", (NEW + "\n").encode() * 2000, (2,),
        {"MEMDOCTOR_READ_LIMIT": "1MiB"})
    put("log-binary", bytes(range(256)) * 4000, (0,))
    return out


def corpus(folder: Path) -> list[dict]:
    """The cases: {"id", "argv", "env", "codes", "html"}."""
    cases = []
    for name, (path, codes) in {**_run_files(folder), **_snapshots(folder)}.items():
        flag = "--run" if name.startswith("run-") else "--snapshot"
        if not name.endswith(MUTATIONS):         # a tampered field: --json and the report suffice
            cases.append({"id": f"{name} diagnose", "argv": ["diagnose", flag, str(path)], "codes": codes})
        cases.append({"id": f"{name} diagnose --json", "argv": ["diagnose", flag, str(path), "--json"],
                      "codes": codes})
        if flag == "--run":
            html = folder / f"{name}.html"
            cases.append({"id": f"{name} report", "argv": ["report", str(path), "-o", str(html)],
                          "codes": tuple(0 if c == 3 else c for c in codes), "html": str(html)})
    for name, (path, codes, env) in _logs(folder).items():
        for extra in ([], ["--json"]):
            cases.append({"id": f"{name} diagnose{' --json' if extra else ''}",
                          "argv": ["diagnose", "--log", str(path), *extra], "codes": codes, "env": env})
    script = folder / "train.py"
    script.write_text("print('never run')\n")
    for argv in (["diagnose", str(script), "--budget", NINES], ["trace", str(script), "--budget", "-5"],
                 ["tui", "--script", str(script), "--budget", NINES],
                 ["plan", "--model", "gpt2-124m", "--budget", NINES],
                 ["estimate", "--model", "gpt2-124m", "--budget", NINES],
                 ["estimate", "--model", "gpt2-124m", "--plan", "micro=²"],
                 ["estimate", "--model", "gpt2-124m", "--micro-batch", "²"],
                 ["diagnose", "--run", str(folder / "missing" / ESC)]):
        cases.append({"id": " ".join(a if len(a) < 40 else a[:12] + "..." for a in argv[:4]).replace(ESC, "ESC"),
                      "argv": argv, "codes": (2,)})
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    folder = tmp_path_factory.mktemp("hostile")
    cases = corpus(folder)
    (folder / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, "-m", "tests.support.cli_under_cap", str(folder / "cases.json"),
                           str(folder / "results.json"), str(CAP)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r["id"]: r for r in json.loads((folder / "results.json").read_text())}
    return {c["id"]: (c, got[c["id"]]) for c in cases}


# ---- the checks --------------------------------------------------------------------------
def test_every_case_exits_0_2_or_3_in_one_line_under_the_cap_and_in_time(results):
    bad = []
    for case_id, (case, r) in results.items():
        err = r["stderr"].strip()
        if r["code"] not in case["codes"]:
            bad.append(f"{case_id}: exit {r['code']!r} (expected {case['codes']}): {err[:300]!r}")
        elif r["code"] == 2 and len(err.splitlines()) != 1:
            bad.append(f"{case_id}: exit 2 with {len(err.splitlines())} lines: {err[:300]!r}")
        elif "Traceback" in r["stdout"] + r["stderr"]:
            bad.append(f"{case_id}: a traceback")
        if r["seconds"] > 10:
            bad.append(f"{case_id}: {r['seconds']:.1f} s")
        if r["max_rss_bytes"] > CAP:
            bad.append(f"{case_id}: {r['max_rss_bytes'] >> 20} MiB resident")
    assert not bad, f"{len(bad)} of {len(results)} cases:\n  " + "\n  ".join(bad)


def test_no_control_character_from_a_file_reaches_the_terminal(results):
    bad = []
    for case_id, (case, r) in results.items():
        for stream in ("stdout", "stderr"):
            text = r[stream].encode("latin-1").decode("utf-8", "replace")
            found = CONTROL.search(text.replace("\n", ""))
            if found:
                bad.append(f"{case_id} {stream}: {found.group()!r} in {text[max(0, found.start() - 60):][:120]!r}")
    assert not bad, "\n  ".join(bad)


def test_html_reports_hold_no_control_character(results):
    """In the page's text and its data block; the bundled plotly.js is left out (its
    minified source holds such characters of its own)."""
    bad = []
    for case_id, (case, r) in results.items():
        if case.get("html") and r["code"] == 0:
            html = Path(case["html"]).read_text(encoding="utf-8")
            page = re.sub(r"<script>.*?</script>", "", html, flags=re.S)
            found = re.search("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e]", page)
            if found:
                bad.append(f"{case_id}: {found.group()!r} in {page[max(0, found.start() - 60):][:100]!r}")
    assert not bad, "\n  ".join(bad)


def test_bombs_stop_at_the_limit_with_a_line_that_says_so(results):
    for case_id, (case, r) in results.items():
        if "bomb" in case_id and r["code"] == 2:
            assert "limit" in r["stderr"] or "damaged" in r["stderr"] or "readable" in r["stderr"], (
                case_id, r["stderr"])
    limit = results["run-bomb-thirty-million-events diagnose"][1]["stderr"]
    assert "MEMDOCTOR_READ_LIMIT" in limit and "1.00 GiB" in limit


def test_logs_are_read_through_long_lines_and_colours(results):
    for name in ("log-one-long-line", "log-coloured", "log-escapes"):
        out = json.loads(results[f"{name} diagnose --json"][1]["stdout"])
        first = {k: v for k, v in out["ooms"][0].items() if k in NEW_FACTS}
        assert first == NEW_FACTS, name
    assert "1.00 MiB" in results["log-more-messages-than-the-limit diagnose"][1]["stderr"]


def test_escaped_names_still_show_as_printable_text(results):
    """Cleaning keeps the readable rest of a name: only the control characters go."""
    out = results["run-traced-escapes diagnose --json"][1]["stdout"]
    assert "PWNED" in out and "\\u001b" not in out


def test_the_command_line_itself_gives_the_same_answers(results, tmp_path):
    """A few cases again through `python -m memdoctor` (the driver calls main() in-process)."""
    for case_id in ("run-bomb-zeros diagnose", "snap-negative-size diagnose", "log-coloured diagnose"):
        case, r = results[case_id]
        proc = subprocess.run([sys.executable, "-m", "memdoctor", *case["argv"]], cwd=ROOT, capture_output=True,
                              timeout=120)
        assert proc.returncode == r["code"], (case_id, proc.stderr)
        assert proc.stderr.decode("latin-1") == r["stderr"]


# ---- the TUI -----------------------------------------------------------------------------
def test_tui_shows_no_control_character_from_a_run_file(tmp_path):
    pytest.importorskip("textual")
    from tests.test_tui import drive, screen_text, settle
    from memdoctor.tui.app import MemdoctorApp
    path = tmp_path / "escapes.memrun.json.gz"
    path.write_bytes(_gz(json.dumps(_with_escapes(traced_run().to_dict())).encode()))
    shown = []

    async def script(app, pilot):
        await settle(app, pilot)
        for key in "12345":
            await pilot.press(key)
            await pilot.pause()
            shown.append(screen_text(app))
        await pilot.press("q")
    drive(MemdoctorApp(path), script)
    text = "\n".join(shown)
    assert "PWNED" in text                 # the names are shown, cleaned
    found = CONTROL.search(text.replace("\n", ""))
    assert found is None, repr(text[max(0, found.start() - 80):found.start() + 40])


@pytest.mark.parametrize("how", ["negative", "huge", "type"])
def test_tui_refuses_a_tampered_run_in_one_line(tmp_path, how):
    from memdoctor.run import RunFileError
    from memdoctor.tui import loader
    base = traced_run().to_dict()
    path = tmp_path / "bad.memrun.json.gz"
    path.write_bytes(_gz(json.dumps(_tampered(base, ("blocks", "nbytes", 0), how)).encode()))
    with pytest.raises(RunFileError) as caught:
        loader.load(path).build_run()
    assert "\n" not in str(caught.value) and "damaged" in str(caught.value)
