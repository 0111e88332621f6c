"""Real code nobody here wrote, diagnosed through the CLI as a user would run it: each case
of cases.json is a public codebase (nanoGPT, pytorch/examples' word_language_model,
transformers' models in a hand-written loop and under its Trainer), unmodified or with a
one- or two-line change (`patch`) that brings in one known cause, at a budget where it runs
out of memory. The first finding must be the cause, and no finding in `absent` may appear.

Case fields: name, codebase (where the code comes from, commit and license), dir
("shared:PATH" under ../shared, or "own:PATH" beside this file), prepare (a script and its
arguments, found in the copy or beside this file, run in the copy), patch (exact one-time
replacements in the copy), script, args, budget per device kind (cuda: why a case has
none for CUDA), requires (modules),
cause, line (where the cause is one line of the script: text the first finding's source
line must hold, any of them), absent, why.
"""
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.support.paths import ROOT, shared_path

HERE = Path(__file__).parent
CASES = json.loads((HERE / "cases.json").read_text())
TIMEOUT = int(os.environ.get("PER_SCRIPT_S", "600"))


def source_dir(case: dict) -> Path:
    kind, _, rel = case["dir"].partition(":")
    return shared_path(*rel.split("/")) if kind == "shared" else HERE / rel


def prepare(case: dict, work: Path) -> None:
    """Copy the code, apply the case's change, make its data: the sources stay untouched."""
    shutil.copytree(source_dir(case), work, ignore=shutil.ignore_patterns("__pycache__"))
    for path in work.rglob("*"):
        path.chmod(path.stat().st_mode | 0o200)
    for change in case.get("patch", []):
        target = work / change["file"]
        text = target.read_text()
        assert text.count(change["old"]) == 1, (case["name"], change["old"])
        target.write_text(text.replace(change["old"], change["new"]))
    if case.get("prepare"):
        script, *rest = case["prepare"]
        path = work / script if (work / script).exists() else HERE / script
        subprocess.run([sys.executable, str(path), *rest], cwd=work, check=True, capture_output=True)


def diagnose(case: dict, work: Path, kind: str = "cpu", options: tuple = ()) -> dict:
    """`memdoctor diagnose` on the case as a user runs it; `options` go to memdoctor."""
    args = case.get(f"args_{kind}", case.get("args", []))
    cmd = [sys.executable, "-m", "memdoctor", "diagnose", case["script"], "--budget", case["budget"][kind],
           *options, "--json", "--", *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode in (0, 3), proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", [c for c in CASES if "cpu" in c["budget"]], ids=lambda c: c["name"])
def test_real_code_cause_comes_first(case, tmp_path):
    missing = [m for m in case.get("requires", []) if find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    work = tmp_path / "case"
    prepare(case, work)
    out = diagnose(case, work)
    rules = [f["rule"] for f in out["findings"]]
    assert rules and rules[0] == case["cause"], (case["why"], rules, out["findings"][:1])
    assert not set(rules) & set(case.get("absent", [])), rules
    check_line(case, out["findings"][0])


def check_line(case: dict, finding: dict) -> None:
    """The first finding names the script's line that makes or keeps the memory."""
    if not case.get("line"):
        return
    text = (finding.get("source") or {}).get("text") or ""
    assert any(fragment in text for fragment in case["line"]), (case["name"], finding.get("source"))


def test_two_codebases_for_every_cause():
    codebases = defaultdict(set)
    for case in CASES:
        codebases[case["cause"]].add(case["codebase"].split()[0])
    thin = {cause: sorted(names) for cause, names in codebases.items() if len(names) < 2}
    assert not thin, thin


def test_changes_are_one_or_two_lines():
    for case in CASES:
        changed = sum(max(len(c["old"].splitlines()), len(c["new"].splitlines()))
                      - sum(1 for line in c["old"].splitlines() if line in c["new"].splitlines())
                      for c in case.get("patch", []))
        assert changed <= 2, (case["name"], changed)
