"""The estimate against every plan `plan_apply.py` ran on the GPU for 4-12 steps: the peaks of
the two steps the estimate runs, and of a long run (the last step repeated until the
allocator's layout settles, `settle=True`), next to what the GPU measured, and whether each
predicts the OOM a plan met. Under a budget the reserved peak compared is the one with the
allocator capped there (`budget_peak_reserved_bytes`), as the GPU ran it. Needs no GPU: the
measurements are the committed results/plan_apply_<hardware>_<date>.json runs.

    python benchmarks/steady_vs_measured.py [--jobs 2]     # -> results/steady_vs_measured_<hardware>_<date>.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402

GiB = 2 ** 30


def measured_rows() -> list[dict]:
    """The newest measurement of each (model, batch, seq, budget, plan) that ran or met an OOM,
    for memdoctor's own model configurations."""
    from memdoctor.predict.models import MODELS
    newest: dict[tuple, dict] = {}
    for path in resultfile.results("plan_apply"):
        for run in json.loads(path.read_text())["runs"]:
            args = run["args"]
            if args["model"] not in MODELS:
                continue
            for row in run["rows"]:
                if not (row.get("ok") or row.get("oom")):
                    continue
                key = (args["model"], args["batch"], args.get("seq") or 1024, args.get("budget"), row["plan"])
                newest[key] = {"model": key[0], "batch": key[1], "seq": key[2], "budget": key[3], "plan": key[4],
                               "measured_commit": run.get("commit"), "steps": len(row.get("step_seconds") or []),
                               "ok": bool(row.get("ok")), "oom_step": row.get("oom_step"),
                               "allocated": row.get("peak_allocated_bytes"), "reserved": row.get("peak_reserved_bytes")}
    return list(newest.values())


def predict(job: dict) -> dict:
    from memdoctor.predict.estimate import estimate
    from memdoctor.predict.models import get, make_optimizer
    from memdoctor.units import parse_size
    spec = get(job["model"])
    budget = parse_size(job["budget"]) if job["budget"] else None
    out = {}
    for settle in (False, True):
        t0 = time.perf_counter()
        est = estimate(lambda: spec.build_model(job["seq"]), lambda m: make_optimizer("adamw", m),
                       lambda: spec.make_batch(job["batch"], job["seq"]), spec.loss_fn, plan=job["plan"],
                       device="cuda", budget=budget, settle=settle)
        out["settled" if settle else "two_steps"] = {
            "allocated": est.peak_allocated_bytes,
            "reserved": est.peak_reserved_bytes if budget is None else est.budget_peak_reserved_bytes,
            "uncapped_reserved": est.peak_reserved_bytes,
            "oom_step": None if est.fits in (None, True) else est.oom["step"],
            "seconds": round(time.perf_counter() - t0, 1)}
    return {**job, **out}


def _err(pred: int, meas: int | None) -> str:
    return "-" if not meas else f"{100 * (pred - meas) / meas:+.2f}%"


def _cell(p: dict, meas: dict) -> str:
    oom = f", OOM in step {p['oom_step'] + 1}" if p["oom_step"] is not None else ""
    return f"{p['reserved'] / GiB:.2f} ({_err(p['reserved'], meas['reserved'])}){oom}"


def table(rows: list[dict]) -> list[str]:
    lines = ["| configuration | measured at | steps | measured reserved GiB | two steps: reserved GiB (err) | "
             "settled: reserved GiB (err) | allocated err, settled |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        meas = (f"{r['reserved'] / GiB:.2f}" if r["ok"] else
                f"OOM in step {r['oom_step'] + 1} (after {r['reserved'] / GiB:.2f})")
        cfg = f"{r['model']} b{r['batch']} seq {r['seq']} {r['budget'] or 'no cap'}: `{r['plan']}`"
        alloc = _err(r["settled"]["allocated"], r["allocated"]) if r["ok"] else "-"
        lines.append(f"| {cfg} | {r['measured_commit']} | {r['steps'] or r['oom_step']} | {meas} | "
                     f"{_cell(r['two_steps'], r)} | {_cell(r['settled'], r)} | {alloc} |")
    return lines


def summary(rows: list[dict]) -> list[str]:
    out = []
    for name in ("two_steps", "settled"):
        ran = [r for r in rows if r["ok"]]
        errs = sorted(abs(r[name]["reserved"] - r["reserved"]) / r["reserved"] for r in ran)
        under = sum(r[name]["reserved"] < r["reserved"] for r in ran)
        ooms = [r for r in rows if not r["ok"]]
        caught = sum(r[name]["oom_step"] == r["oom_step"] for r in ooms)
        false = sum(r[name]["oom_step"] is not None for r in ran)
        out.append(f"- {name.replace('_', ' ')}: reserved within {100 * errs[len(errs) // 2]:.2f}% (median), "
                   f"{100 * errs[-1]:.2f}% (worst) of {len(ran)} plans that ran, {under} under; "
                   f"{caught} of {len(ooms)} OOMs predicted in their step; {false} OOMs predicted for plans that ran")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    jobs = measured_rows()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, max_tasks_per_child=1) as pool:
        rows = list(pool.map(predict, jobs))
    import torch  # noqa: F401  (its version goes into the result)
    lines = summary(rows)
    print("\n".join(["# The estimate of two steps, and of a long run, against plans run for 4-12 steps on the GPU",
                     f"predicted in {time.perf_counter() - t0:.0f} s", "", *lines, "", *table(rows), ""]))
    print("wrote", resultfile.save("steady_vs_measured", resultfile.hardware("cpu"),
                                   {"summary": lines, "rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
