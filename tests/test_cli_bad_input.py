"""Bad input to `memdoctor diagnose`: one line on stderr and exit 2 (or a clean "nothing
found"), never a traceback, never code from a file run."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "memdoctor", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=cwd)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_snapshot_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "x": Payload(marker)}))
    proc = run_cli("diagnose", "--snapshot", snap, cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"\x00\xff" * 5000, b"\x1f\x8b\x08garbage"])
def test_garbage_snapshot_and_run_files(tmp_path, content):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(content)
    for flag in ("--snapshot", "--run"):
        proc = run_cli("diagnose", flag, bad, cwd=tmp_path)
        assert proc.returncode == 2, (flag, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1


def test_logs_without_an_oom_and_unreadable_logs(tmp_path):
    binary = tmp_path / "core.bin"
    binary.write_bytes(bytes(range(256)) * 4000)
    proc = run_cli("diagnose", "--log", binary, "--json", cwd=tmp_path)
    assert proc.returncode == 0 and '"oom": false' in proc.stdout
    for target in (tmp_path, tmp_path / "missing.log"):
        proc = run_cli("diagnose", "--log", target, cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_bad_budget_and_missing_script(tmp_path):
    proc = run_cli("diagnose", "nope.py", "--budget", "lots", cwd=tmp_path)
    assert proc.returncode == 2
    proc = run_cli("diagnose", "nope.py", cwd=tmp_path)
    assert proc.returncode == 2 and "no such script" in proc.stderr


def test_a_size_argument_of_any_length_is_one_line(tmp_path):
    for argv in (["diagnose", "x.py", "--budget", "9" * 400], ["plan", "--model", "gpt2-124m", "--budget", "9" * 400],
                 ["diagnose", "x.py", "--budget", "\x1b]0;title\x07"]):
        proc = run_cli(*argv, cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr


@pytest.mark.parametrize("argv", [["explain"], ["diagnose", "keep_losses.py", "--budget", "96MiB"]],
                         ids=["explain", "diagnose-tables"])
def test_a_reader_that_stops_reading_gets_no_internal_error(argv, tmp_path):
    """`memdoctor explain | head -1`, `memdoctor diagnose ... | head`: the pipe closes under
    memdoctor's output (plain lines, rich's tables); it stops quietly with the shell's code for
    that (141), no "internal error"."""
    examples = Path(__file__).parents[1] / "examples"
    proc = subprocess.Popen([sys.executable, "-m", "memdoctor", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=examples if argv[0] == "diagnose" else tmp_path)
    proc.stdout.close()         # the reader is gone before memdoctor writes
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err
    assert err.decode().strip() == ""
