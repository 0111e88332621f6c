"""LBFGS keeps history_size pairs of flat vectors as its state (in lists): model states, with
a shorter history as the fix (the history length it names fits), never a fused or foreach
step LBFGS does not take (tests/scenarios/lbfgs_history.py)."""
import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scenarios" / "lbfgs_history.py"


def _diagnose(*args, cwd) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", SCRIPT, "--budget", "120MiB", "--json",
                           "--", *map(str, args)], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


def test_lbfgs_history_is_its_state_and_the_shorter_history_named_fits(tmp_path):
    code, out = _diagnose(10, cwd=tmp_path)
    assert code == 3
    rules = [f["rule"] for f in out["findings"]]
    assert rules[0] == "model-states" and "optimizer-step-temporaries" not in rules, rules
    first = out["findings"][0]
    params = 2 * (1024 * 1024 + 1024) * 4
    assert first["details"]["optimizer_state"] >= 23 * params          # 10 pairs and three more vectors
    shorter = first["remedies"][0]
    pairs = int(re.search(r"history_size=(\d+)", shorter["how"]).group(1))
    assert 1 <= pairs < 10 and shorter["predicted_peak_bytes"] <= 120 * 2 ** 20
    assert not any("fused" in r["how"] or "8-bit" in r["title"] for r in first["remedies"])
    code, fixed = _diagnose(pairs, cwd=tmp_path)
    assert code == 0 and not fixed["oom"]
    assert fixed["peak_bytes"] <= shorter["predicted_peak_bytes"] * 1.05
