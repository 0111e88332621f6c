"""What a new user meets in the first minutes of the command line: the script's own
arguments need no `--`, `--version`, one line naming the extra to install when one is
missing (the diagnosis printed first), progress only for a person at a terminal, and tables
that keep their columns in a pipe."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from memdoctor.cli import main, progress
from memdoctor.cli.main import build_parser
from memdoctor.cli.script_args import split
from memdoctor.version import __version__

SCRIPT = textwrap.dedent("""
    import argparse, json, sys
    import torch
    from torch import nn
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("-o")
    args = parser.parse_args()
    print("ARGV=" + json.dumps(sys.argv[1:]))
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.epochs):
        model(torch.randn(512, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
""")


def memdoctor(*args, cwd, hide=None):
    """`python -m memdoctor ARGS`; `hide`: a module made unimportable, as when not installed."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MEMDOCTOR_DEBUG", None)
    code = "import sys, runpy\n"
    if hide:
        code += f"sys.modules[{hide!r}] = None\n"
    code += "sys.argv[0] = 'memdoctor'\nrunpy.run_module('memdoctor', run_name='__main__')\n"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("argv, ours, theirs", [
    (["diagnose", "train.py", "--budget", "96MiB", "--epochs", "3"],
     ["diagnose", "train.py", "--budget", "96MiB"], ["--epochs", "3"]),
    (["diagnose", "--json", "train.py", "--epochs", "3", "--json"], ["diagnose", "--json", "train.py"],
     ["--epochs", "3", "--json"]),
    (["diagnose", "train.py", "--budget=1GiB", "--", "-o", "x"], ["diagnose", "train.py", "--budget=1GiB"],
     ["-o", "x"]),
    (["trace", "train.py", "data.txt", "-o", "y"], ["trace", "train.py"], ["data.txt", "-o", "y"]),
    (["diagnose", "--run", "a.gz", "b.gz", "--json"], ["diagnose", "--run", "a.gz", "b.gz", "--json"], []),
    (["estimate", "build.py", "--batch", "2", "--", "x"], ["estimate", "build.py", "--batch", "2"], ["x"]),
])
def test_the_scripts_arguments_are_split_off(argv, ours, theirs):
    assert split(build_parser(), argv) == (ours, theirs)


def test_script_arguments_reach_the_script_without_dashes(script):
    proc = memdoctor("diagnose", script.name, "--budget", "96MiB", "--source", "dispatch", "--json",
                     "--epochs", "3", "-o", "out", cwd=script.parent)
    assert proc.returncode == 0, proc.stderr
    assert 'ARGV=["--epochs", "3", "-o", "out"]' in proc.stderr       # the script's print, on stderr under --json
    data = json.loads(proc.stdout)
    assert data["budget_bytes"] == 96 * 2**20 and not data["oom"]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"memdoctor {__version__}"


@pytest.fixture
def saved_run(tmp_path):
    import torch
    from torch import nn

    from memdoctor.capture.session import Tracer
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    x = torch.randn(4096, 64)       # made before the trace: the budget counts what comes inside
    tracer = Tracer([model], budget="1MiB", source="dispatch")
    with pytest.raises(torch.OutOfMemoryError):
        with tracer:
            model(x).sum().backward()
    path = tmp_path / "r.memrun.json.gz"
    tracer.run.save(path)
    return path


def test_report_without_plotly_names_the_extra_in_one_line(saved_run):
    proc = memdoctor("report", saved_run, "-o", "x.html", cwd=saved_run.parent, hide="plotly")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "memdoctor: the HTML report needs plotly: pip install 'memdoctor[report]'"]
    assert not (saved_run.parent / "x.html").exists()


def test_diagnose_report_without_plotly_still_prints_the_diagnosis(saved_run):
    proc = memdoctor("diagnose", "--run", saved_run, "--report", "x.html", cwd=saved_run.parent, hide="plotly")
    assert proc.returncode == 2, proc.stderr
    assert "activations" in proc.stdout                          # the diagnosis, printed first
    assert proc.stderr.strip().splitlines() == [
        "memdoctor: the HTML report needs plotly: pip install 'memdoctor[report]'"]


def test_progress_only_for_a_person_at_a_terminal(monkeypatch):
    class Args:
        json = False
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert progress.wanted(Args())
    Args.json = True
    assert not progress.wanted(Args())
    Args.json = False
    monkeypatch.setenv("RANK", "1")
    assert not progress.wanted(Args())
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    monkeypatch.setenv("RANK", "0")
    assert not progress.wanted(Args())


def test_progress_draws_on_a_terminal(monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    class Args:
        json = False
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    with progress.working(Args(), "tracing train.py"):
        pass
    assert "tracing train.py" in screen.getvalue()


def test_tables_keep_their_columns_in_a_pipe(script, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    proc = memdoctor("trace", "--source", "dispatch", script.name, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr
    widths = {len(line) for line in proc.stdout.splitlines() if line.startswith(("┏", "┃", "│"))}
    assert max(widths) > 80                             # wider than rich's default for a pipe
    assert "optimizer_state" in proc.stdout or "weights" in proc.stdout
    assert "made in" in proc.stdout                     # a header cut into pieces would not read so


def test_watch_without_plotly_keeps_the_note_and_names_the_extra(tmp_path, monkeypatch, caplog):
    import logging

    import torch
    from torch import nn

    import memdoctor
    monkeypatch.setitem(sys.modules, "plotly", None)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    with caplog.at_level(logging.WARNING, logger="memdoctor"), pytest.raises(torch.OutOfMemoryError) as info:
        with memdoctor.watch(model, budget="1MiB", report=tmp_path / "oom.html", source="dispatch"):
            model(torch.randn(4096, 64)).sum().backward()
    assert any(n.startswith("memdoctor: ") for n in info.value.__notes__)
    assert "pip install 'memdoctor[report]'" in caplog.text
    assert not (tmp_path / "oom.html").exists()
