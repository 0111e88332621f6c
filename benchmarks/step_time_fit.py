"""Fit memdoctor.predict.step_time's machine constants to step times measured on the GPU.

Reads the step times `plan_apply.py` measured (its JSON files, named below), counts each
plan's work with an estimate on this machine (cached in --cache: GPT-2 1.5B estimates take
10-40 s each on two cores), fits the five constants by a grid search on the log error, and
prints and saves the table of predicted against measured seconds with the fitted constants.

    python benchmarks/step_time_fit.py [--out benchmarks/results] [--cache .../work_counts.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GPU = ROOT / "benchmarks" / "results" / "gpu"
# steady-state step times (the second half of 12 steps), two lanes side by side and nothing else
# (pass 23: each plan three times round-robin, on each GPU)
MEASURED = [GPU / "h200x2_pass21" / "plan_apply_gpt2-1.5b_b8_bf16_nocap.json",
            GPU / "h200x2_pass21" / "plan_apply_gpt2-1.5b_b8_32GiB_costs.json",
            GPU / "h200x2_pass18" / "plan_apply_gpt2-1.5b_b2_16GiB.json",
            GPU / "h200x2_pass23" / "plan_apply_gpt2-1.5b_b8_32GiB_gpu0.json",
            GPU / "h200x2_pass23" / "plan_apply_gpt2-1.5b_b8_32GiB_gpu1.json"]


def measured_rows() -> list[dict]:
    rows = []
    for path in MEASURED:
        data = json.loads(path.read_text())
        a = data["args"]
        for r in data["rows"]:
            if r.get("median_step_seconds"):
                rows.append({"model": a["model"], "batch": a["batch"], "seq": a["seq"], "plan": r["plan"],
                             "measured_s": r["median_step_seconds"], "source": f"{path.parent.name}/{path.name}"})
    return rows


def work_of(row: dict, cache: dict) -> dict:
    key = f"{row['model']}/b{row['batch']}/s{row['seq']}/{row['plan']}"
    if key not in cache:
        from memdoctor.predict.estimate import estimate_config
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

    op_s, launch, mode, f16, f32, bw = np.meshgrid(grid(1e-6, 10e-6, 21), grid(20e-6, 1e-3, 9),
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--cache", default=str(ROOT / "benchmarks" / "results" / "step_time_work.json"))
    args = ap.parse_args()
    from memdoctor.predict.step_time import H200
    cache_path = Path(args.cache)
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    rows = measured_rows()
    for r in rows:
        r["work"] = work_of(r, cache)
    cache_path.write_text(json.dumps(cache, indent=1, sort_keys=True))
    m = fit(rows)
    lines = ["# Step time: memdoctor.predict.step_time's model against step times measured on the H200", "",
             "`python benchmarks/step_time_fit.py`: work counted by estimates on the CPU; step times from "
             + ", ".join(f"`{p.parent.name}/{p.name}`" for p in MEASURED) + ".", "",
             f"Fitted: op_seconds={m.op_seconds:.3g}, launch_seconds={m.launch_seconds:.3g}, mode_op_seconds={m.mode_op_seconds:.3g}, flops16={m.flops16:.3g}, flops32={m.flops32:.3g}, "
             f"bytes_per_s={m.bytes_per_s:.3g}, overlap_p={m.overlap_p:g}. In memdoctor.predict.step_time.H200: "
             f"op_seconds={H200.op_seconds:.3g}, launch_seconds={H200.launch_seconds:.3g}, mode_op_seconds={H200.mode_op_seconds:.3g}, flops16={H200.flops16:.3g}, flops32={H200.flops32:.3g}, "
             f"bytes_per_s={H200.bytes_per_s:.3g}, overlap_p={H200.overlap_p:g}.", "",
             "| model | batch | plan | ops | measured s | fitted s | err % | H200 constants s | err % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fitted, shipped = predict(r["work"], m, r["plan"]), predict(r["work"], H200, r["plan"])
        lines.append(f"| {r['model']} | {r['batch']} | {r['plan']} | {r['work']['compute']['ops']} | "
                     f"{r['measured_s']:.3f} | {fitted:.3f} | {100 * (fitted / r['measured_s'] - 1):+.0f} | "
                     f"{shipped:.3f} | {100 * (shipped / r['measured_s'] - 1):+.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (Path(args.out) / "step_time_fit.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
