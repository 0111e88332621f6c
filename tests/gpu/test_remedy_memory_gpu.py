"""The remedies' memory claim on the GPU: each scenario tests/test_remedy_memory.py re-states
runs out of its `budget.cuda` as written and fits it with its remedy, under memdoctor.watch
with the real allocator capped at the budget.

Each run is a fresh process, so one run's cap and cached blocks cannot touch the next.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu

CHILD = """
import json, sys, torch, memdoctor
from memdoctor.units import parse_size
from tests import test_remedy_memory as cases
name, fixed = sys.argv[1], sys.argv[2] == "1"
case = cases.CASES[name]
budget = parse_size(cases.expected(name)["budget"]["cuda"])
oom = False
with torch.device("cuda"):
    model, optimizer = case.build()
    try:
        with memdoctor.watch(model, optimizer, budget=budget) as doc:
            case.loop(model, optimizer, fixed)
    except torch.OutOfMemoryError:
        oom = True
print(json.dumps({"oom": oom, "budget": budget, "source": doc.run.source if doc.run else None,
                  "peak_allocated": torch.cuda.max_memory_allocated(),
                  "peak_reserved": torch.cuda.max_memory_reserved()}))
"""


def run_case(name: str, fixed: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, name, "1" if fixed else "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _names():
    from tests.test_remedy_memory import CASES
    return list(CASES)


@pytest.mark.parametrize("name", _names())
def test_remedy_fits_the_cuda_budget_the_script_does_not(name):
    before = run_case(name, fixed=False)
    after = run_case(name, fixed=True)
    print(f"{name}: budget {before['budget']}, before reserved {before['peak_reserved']} oom={before['oom']}, "
          f"after allocated {after['peak_allocated']} reserved {after['peak_reserved']} oom={after['oom']}")
    assert before["oom"], before
    assert not after["oom"], after
    assert after["peak_reserved"] <= after["budget"]
