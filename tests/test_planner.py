"""The planner (memdoctor.predict.planner) and `memdoctor plan`, on GPT-2 124M at short sequences."""
import json

import pytest

from memdoctor.cli import main
from memdoctor.predict.config import estimate_config
from memdoctor.remedies.plan import Plan
from memdoctor.predict.planner import counted_seconds, plan_for_budget

MiB, GiB = 2**20, 2**30
MODEL, BATCH, SEQ = "gpt2-124m", 4, 512
NO_SWAPS = [str(Plan(p, c, m, None, None)) for p in (None, "bf16") for c in (None, "selective", "full")
            for m in (None, 2, 1)]


@pytest.fixture(scope="module")
def plain():
    return estimate_config(MODEL, batch=BATCH, seq=SEQ)


@pytest.fixture(scope="module")
def bf16_full():
    return estimate_config(MODEL, batch=BATCH, seq=SEQ, plan="bf16,ckpt=full")


def test_generous_budget_keeps_the_plain_plan():
    cands = plan_for_budget(MODEL, BATCH, SEQ, 1024 * GiB)
    assert cands[0].plan.is_empty() and str(cands[0].plan) == "none"
    assert cands[0].fits and cands[0].cost == 1.0


def test_tight_budget_picks_the_cheapest_fitting_plan(plain, bf16_full):
    assert bf16_full.peak_reserved_bytes * 1.05 < plain.peak_reserved_bytes
    budget = (bf16_full.peak_reserved_bytes * 1.05 + plain.peak_reserved_bytes) // 2
    cands = plan_for_budget(MODEL, BATCH, SEQ, int(budget), candidates=NO_SWAPS)
    first = cands[0]
    assert first.fits and not first.plan.is_empty()
    direct = estimate_config(MODEL, batch=BATCH, seq=SEQ, plan=str(first.plan))
    assert direct.peak_reserved_bytes <= budget
    assert first.predicted_peak_reserved == direct.peak_reserved_bytes
    assert all(c.cost >= first.cost for c in cands if c.fits)
    assert not any(c.fits for c in cands if c.plan.is_empty())
    # costs are predicted step times (memdoctor.predict.step_time) against the plain plan's
    assert first.step_seconds == pytest.approx(counted_seconds(direct, first.plan))
    assert first.cost == pytest.approx(first.step_seconds / counted_seconds(plain, Plan()))
    for c in cands:
        assert Plan.parse(str(c.plan)) == c.plan
        assert c.step_seconds > 0 and c.cost == pytest.approx(first.cost * c.step_seconds / first.step_seconds)


def test_micro_batch_shortcut_matches_a_direct_estimate():
    derived = plan_for_budget(MODEL, BATCH, SEQ, 1024 * GiB, candidates=["micro=1"], verify=0)[0]
    assert "scaled" in derived.note
    direct = estimate_config(MODEL, batch=BATCH, seq=SEQ, plan="micro=1")
    assert derived.predicted_peak_allocated == pytest.approx(direct.peak_allocated_bytes, rel=0.10)
    assert derived.predicted_peak_reserved == pytest.approx(direct.peak_reserved_bytes, rel=0.10)


def test_the_first_four_fitting_plans_carry_direct_estimates():
    """Derived figures run high on the reserved peak (+5.7% measured on the H200 for GPT-2
    1.5B micro=1): the plans a user is likely to apply are estimated directly."""
    derived_only = ["micro=2", "micro=1", "bf16,micro=2", "bf16,micro=1", "opt=adamw-bf16"]
    cands = plan_for_budget(MODEL, BATCH, SEQ, 1024 * GiB, candidates=derived_only)
    assert len(cands) == 5 and all(c.fits for c in cands)
    assert [c.verified for c in cands] == [True] * 4 + [False]
    for c in cands[:4]:
        direct = estimate_config(MODEL, batch=BATCH, seq=SEQ, plan=str(c.plan))
        assert (c.predicted_peak_allocated, c.predicted_peak_reserved) == \
            (direct.peak_allocated_bytes, direct.peak_reserved_bytes)
        assert "verified by a direct estimate" in c.note
    assert "verified" not in cands[4].note


def test_plans_whose_derived_reserved_peak_runs_high_are_checked_directly():
    """Derived allocated peaks are close; derived reserved peaks can run high (+24% for GPT-2
    774M on the H200): a plan that only the derived reserved peak rules out is estimated."""
    plans = ["none", "bf16,ckpt=full,micro=2,opt=adamw-8bit", "ckpt=full,micro=2,opt=adamw-8bit"]
    derived = {str(c.plan): c for c in plan_for_budget(MODEL, BATCH, SEQ, 1024 * GiB, candidates=plans[1:],
                                                       verify=0)}
    direct = {p: estimate_config(MODEL, batch=BATCH, seq=SEQ, plan=p) for p in plans[1:]}
    high = min(derived[p].predicted_peak_reserved for p in plans[1:])
    low = max(max(d.peak_reserved_bytes, d.peak_allocated_bytes) for d in direct.values())
    assert low < high
    budget = int((low + high) / 2 * 1.05)      # the derived reserved peaks say no, the direct ones yes
    cands = plan_for_budget(MODEL, BATCH, SEQ, budget, candidates=plans)
    fitting = [c for c in cands if c.fits]
    assert sorted(str(c.plan) for c in fitting) == sorted(plans[1:])
    for c in fitting:
        assert c.verified and c.predicted_peak_reserved == direct[str(c.plan)].peak_reserved_bytes
    assert fitting[0].cost <= fitting[1].cost


def test_impossible_budget_exits_3_with_parseable_plans(capsys):
    rc = main(["plan", "--model", MODEL, "--batch", "2", "--seq", "128", "--budget", "100MiB", "--json"])
    assert rc == 3
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == 1
    out = data["plans"]
    assert out and not any(c["fits"] for c in out)
    for c in out:
        Plan.parse(c["plan"])
        assert c["predicted_peak_reserved"] * 1.05 > 100 * MiB


def test_bad_input_is_one_line_exit_2(capsys):
    assert main(["plan", "--model", "no-such-model", "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memdoctor:") and "\n" not in err
    assert main(["plan", "--model", MODEL, "--batch", "0", "--budget", "1GiB"]) == 2


def test_estimates_in_worker_processes_give_the_same_plans(monkeypatch):
    """The parallel path (taken on machines of more than two cores) against the serial one."""
    from memdoctor.predict import planner
    budget = 3 * GiB        # only the 8-bit plan fits (2.7 GiB derived; the others 3.6-4.0 GiB)
    cands = ["none", "bf16", "ckpt=full", "bf16,ckpt=full", "bf16,ckpt=full,opt=adamw-8bit"]
    serial = plan_for_budget(MODEL, BATCH, SEQ, budget, candidates=cands)
    monkeypatch.setattr(planner, "_worker_count", lambda jobs: min(jobs, 2))
    parallel = plan_for_budget(MODEL, BATCH, SEQ, budget, candidates=cands)
    assert [c.to_dict() for c in parallel] == [c.to_dict() for c in serial]
    assert any(c.verified and "verified by a direct estimate" in c.note for c in parallel)
