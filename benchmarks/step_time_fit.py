"""Fit memdoctor.predict.step_time's machine constants to step times measured on the GPU.

Reads the step times `plan_apply.py` measured (the runs of results/plan_apply_h200_*.json
named below), counts each plan's work with an estimate on this machine (kept in the result
as "work" and read back from the newest result: GPT-2 1.5B estimates take 10-40 s each on two
cores), fits the five constants by a grid search on the log error, and prints and saves the
predicted against measured seconds with the fitted constants to
results/step_time_fit_<hardware>_<date>.json.

    python benchmarks/step_time_fit.py             # work counts read from the newest result
    python benchmarks/step_time_fit.py --recount   # counted again (after a change to what counts as an op)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402

# steady-state step times (the second half of 12 steps) of GPT-2 1.5B plans on an H200, two
# GPUs side by side and nothing else: (commit, tag) of plan_apply runs; the last two ran each
# plan three times round-robin, one on each GPU
MEASURED = [("33720a2", "gpt2-1.5b_b8_bf16_nocap"), ("33720a2", "gpt2-1.5b_b8_32GiB_costs"),
            ("46367a8", "gpt2-1.5b_b2_16GiB"), ("b8500f3", "gpt2-1.5b_b8_32GiB_gpu0"),
            ("b8500f3", "gpt2-1.5b_b8_32GiB_gpu1")]


def measured_rows() -> list[dict]:
    runs = {(run.get("commit"), run.get("tag")): run
            for path in resultfile.results("plan_apply", "h200") for run in json.loads(path.read_text())["runs"]}
    rows = []
    for commit, tag in MEASURED:
        run = runs[commit, tag]
        a = run["args"]
        for r in run["rows"]:
            if r.get("median_step_seconds"):
                rows.append({"model": a["model"], "batch": a["batch"], "seq": a["seq"], "plan": r["plan"],
                             "measured_s": r["median_step_seconds"], "source": f"{commit} {tag}"})
    return rows


def cached_work() -> dict:
    """The work counts of the newest result: plan key -> the estimate's `work`."""
    try:
        return json.loads(resultfile.latest("step_time_fit").read_text())["work"]
    except FileNotFoundError:
        return {}


def work_of(row: dict, cache: dict) -> dict:
    key = f"{row['model']}/b{row['batch']}/s{row['seq']}/{row['plan']}"
    if key not in cache:
        from memdoctor.predict.config import estimate_config
        est = estimate_config(row["model"], batch=row["batch"], seq=row["seq"], plan=row["plan"])
        cache[key] = est.work
        print(f"  counted {key} in {est.elapsed_s:.1f} s", flush=True)
    return cache[key]


def predict(work: dict, machine, plan: str = "none") -> float:
    """The step time the planner predicts: memdoctor.predict.step_time with `machine`, and the
    planner's measured extra for 8-bit states."""
    from memdoctor.remedies.plan import Plan
    from memdoctor.predict.planner import plan_seconds
    from memdoctor.predict.step_time import Work
    return plan_seconds(Plan.parse(plan), Work.from_dict(work["compute"]), Work.from_dict(work["optimizer"]),
                        machine=machine)


def fit(rows: list[dict]):
    """The constants with the least sum of squared log errors, on a log-spaced grid."""
    import numpy as np
    from memdoctor.remedies.plan import Plan
    from memdoctor.predict.planner import OPT_COST
    from memdoctor.predict.step_time import Machine

    def grid(lo: float, hi: float, n: int):
        return lo * (hi / lo) ** (np.arange(n) / (n - 1))

    op_s, launch, mode, f16, f32, bw = np.meshgrid(grid(1e-6, 30e-6, 25), grid(20e-6, 1e-3, 9),
                                                   grid(5e-6, 200e-6, 11),
                                                   grid(150e12, 900e12, 15), grid(20e12, 120e12, 9),
                                                   grid(1e12, 40e12, 15), indexing="ij")
    best = None
    for p in (1.0, 1.25, 1.5, 2.0, 3.0, 4.0):
        err = np.zeros(op_s.shape)
        for r in rows:
            t = OPT_COST.get(Plan.parse(r["plan"]).optimizer, 1.0)
            s = 0.0
            for part in ("compute", "optimizer"):
                w = r["work"][part]
                cpu = w["ops"] * op_s + w.get("launches", 0) * launch + w.get("mode_ops", 0) * mode
                gpu = w["flops16"] / f16 + w["flops32"] / f32 + w["bytes"] / bw
                s = s + (cpu ** p + gpu ** p) ** (1.0 / p)
            err += np.log(t * s / r["measured_s"]) ** 2
        i = np.unravel_index(np.argmin(err), err.shape)
        if best is None or err[i] < best[0]:
            best = (err[i], Machine("fit", float(op_s[i]), float(launch[i]), float(mode[i]), float(f16[i]), float(f32[i]),
                                    float(bw[i]), p))
    return best[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    ap.add_argument("--recount", action="store_true", help="count each plan's work again, not from the newest result")
    args = ap.parse_args(argv)
    from memdoctor.predict.step_time import H200
    cache = {} if args.recount else cached_work()
    rows = measured_rows()
    for r in rows:
        r["work"] = work_of(r, cache)
    m = fit(rows)
    names = ("op_seconds", "launch_seconds", "mode_op_seconds", "flops16", "flops32", "bytes_per_s", "overlap_p")
    fitted, shipped = ({k: getattr(c, k) for k in names} for c in (m, H200))
    print("fitted:", ", ".join(f"{k}={v:.3g}" for k, v in fitted.items()))
    print("memdoctor.predict.step_time.H200:", ", ".join(f"{k}={v:.3g}" for k, v in shipped.items()))
    print(f"{'batch':>5}  {'plan':<44}{'measured s':>11}{'fitted s':>9}{'err':>6}{'H200 s':>8}{'err':>6}")
    table = []
    for r in rows:
        f, h = predict(r["work"], m, r["plan"]), predict(r["work"], H200, r["plan"])
        table.append({"model": r["model"], "batch": r["batch"], "plan": r["plan"], "source": r["source"],
                      "ops": r["work"]["compute"]["ops"], "measured_s": r["measured_s"], "fitted_s": f,
                      "h200_s": h, "h200_error_pct": round(100 * (h / r["measured_s"] - 1), 1)})
        print(f"{r['batch']:>5}  {r['plan']:<44}{r['measured_s']:>11.3f}{f:>9.3f}"
              f"{100 * (f / r['measured_s'] - 1):>+6.0f}{h:>8.3f}{100 * (h / r['measured_s'] - 1):>+6.0f}")
    errors = sorted(abs(t["h200_error_pct"]) for t in table)
    data = {"fitted": fitted, "h200": shipped, "median_abs_error_pct": errors[len(errors) // 2],
            "worst_abs_error_pct": errors[-1], "rows": table, "work": dict(sorted(cache.items()))}
    print("wrote", resultfile.save("step_time_fit", resultfile.hardware("cpu"), data, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
