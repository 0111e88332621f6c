"""The remedies' memory claim on the GPU: each scenario tests/support/remedy_cases.py re-states
runs out of its `budget.cuda` as written and fits it with its remedy, under memdoctor.watch
with the real allocator capped at the budget, each run in a fresh process, so that one run's
cap and cached blocks cannot touch the next.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def child(name: str, fixed: bool) -> dict:
    """One run of the case's loop on the GPU, capped at its budget; what it used and how it ended."""
    import torch

    import memdoctor
    from memdoctor.units import parse_size
    from tests.support import remedy_cases as cases
    case = cases.CASES[name]
    budget = parse_size(cases.expected(name)["budget"]["cuda"])
    out = {"scenario": name, "fixed": fixed, "budget": budget, "oom": False}
    cases.DEVICE = "cuda"
    model, optimizer = case.build()
    model.to("cuda")            # in place: the optimizer (no state yet) keeps the same parameters
    try:
        with memdoctor.watch(model, optimizer, budget=budget) as doc:
            case.loop(model, optimizer, fixed)
    except torch.OutOfMemoryError as exc:
        out.update(oom=True, error=str(exc).splitlines()[0][:300])
    torch.cuda.synchronize()
    out.update(source=doc.run.source if doc.run else None,
               first_rule=doc.findings[0].rule if doc.findings else None,
               peak_allocated=torch.cuda.max_memory_allocated(),
               peak_reserved=torch.cuda.max_memory_reserved())
    return out


def run_child(name: str, fixed: bool) -> dict:
    code = ("import json, sys; from tests.gpu.test_remedy_memory_gpu import child; "
            "print(json.dumps(child(sys.argv[1], sys.argv[2] == '1')))")
    proc = subprocess.run([sys.executable, "-c", code, name, str(int(fixed))], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"scenario": name, "fixed": fixed, "failed": True,
                "error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(lines[-1])


def _names():
    from tests.support.remedy_cases import CASES
    return list(CASES)


@pytest.mark.parametrize("name", _names())
def test_remedy_fits_the_cuda_budget_the_script_does_not(name):
    before = run_child(name, fixed=False)
    after = run_child(name, fixed=True)
    print(f"{name}: before {before}\nafter {after}")
    assert not before.get("failed") and not after.get("failed"), (before, after)
    assert before["oom"], before
    assert not after["oom"], after
    assert after["peak_reserved"] <= after["budget"]
