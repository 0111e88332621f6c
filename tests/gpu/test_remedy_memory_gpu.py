"""The remedies' memory claim on the GPU: each scenario tests/test_remedy_memory.py re-states
runs out of its `budget.cuda` as written and fits it with its remedy, under memdoctor.watch
with the real allocator capped at the budget (benchmarks/remedy_memory_gpu.py runs each in
a fresh process, so one run's cap and cached blocks cannot touch the next).
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _names():
    from tests.test_remedy_memory import CASES
    return list(CASES)


@pytest.mark.parametrize("name", _names())
def test_remedy_fits_the_cuda_budget_the_script_does_not(name):
    from benchmarks.remedy_memory_gpu import run_child
    before = run_child(name, fixed=False)
    after = run_child(name, fixed=True)
    print(f"{name}: before {before}\nafter {after}")
    assert not before.get("failed") and not after.get("failed"), (before, after)
    assert before["oom"], before
    assert not after["oom"], after
    assert after["peak_reserved"] <= after["budget"]
