"""Whether the estimate's fake step makes the allocations a real step makes, on the CPU, for
the zoo's architectures (the held-out set by default).

Per architecture, in a fresh process, at a small batch in fp32: the estimate on the CPU
(`device="cpu"`: fake CPU tensors, the CPU's kernels) against two real AdamW steps on the CPU
(memdoctor.predict.fake_step.train_step, the model built inside), traced by memdoctor's
dispatch source, each allocation rounded as the allocator model rounds: the peak of live
bytes; and the same steps counted by torch.profiler with no dispatch mode active (the
estimate's count: under a dispatch mode autograd sums gradients out of place), the error's
reference. No GPU is needed: it checks the fake step itself (data-dependent ops, module
conversions, packed sequences, autograd's saved tensors) on real models; CUDA's kernels and
allocator are checked against a GPU by benchmarks/zoo_accuracy.py.

    python benchmarks/zoo/cpu_steps.py [--set holdout|zoo|all] [--only NAME...] [--batch 2] [--workers 2]

Prints a row per architecture and writes results/cpu_steps_<hardware>_<date>.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent
ROOT = ZOO_DIR.parent.parent
for path in (ROOT, ROOT / "benchmarks", ZOO_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402

TAG = "CPU_STEPS "
CHILD_TIMEOUT_S = 900


def child(name: str, batch: int) -> dict:
    """The estimate and the real steps of one architecture, in this process."""
    import torch
    from memdoctor.capture.session import Tracer
    from memdoctor.predict.config import estimate_config
    from memdoctor.predict.fake_step import train_step
    from tests.support.real_steps import plain_peak, rounded_live_peak      # the counts the CPU tests use
    from zoo_models import build

    torch.manual_seed(0)
    t0 = time.perf_counter()
    est = estimate_config(script=str(ZOO_DIR / "zoo_script.py"), script_args=[name, str(batch)], device="cpu")
    estimate_s = time.perf_counter() - t0
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with Tracer(source="dispatch") as tracer:
        model, optimizer, data, loss_fn = build(name, batch)
        for _ in range(2):
            train_step(model, optimizer, data, loss_fn)
    real_s = time.perf_counter() - t0
    traced = rounded_live_peak(tracer.run)
    del model, optimizer, data
    torch.manual_seed(0)
    built: dict = {}        # build() makes the model, optimizer and batch at once, inside the count
    peak = plain_peak(lambda: built.setdefault("all", build(name, batch))[0], lambda _: built["all"][1],
                      lambda: built["all"][2], loss_fn)

    def err(count):
        return round(100 * (est.peak_allocated_bytes - count) / count, 3) if count else None
    return {"predicted_allocated_bytes": est.peak_allocated_bytes, "real_peak_bytes": peak,
            "error_pct": err(peak), "traced_peak_bytes": traced, "traced_error_pct": err(traced),
            "estimate_seconds": round(estimate_s, 1), "real_seconds": round(real_s, 1),
            "notes": [n[:160] for n in est.notes]}


def run_child(name: str, batch: int) -> dict:
    row = {"arch": name, "batch": batch}
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", name, str(batch)], capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ZOO_DIR)])})
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {CHILD_TIMEOUT_S} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return {**row, **json.loads(line[len(TAG):])}
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return {**row, "error": tail[-1][:300] if tail else f"exit {proc.returncode}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the estimate's fake step against real steps on the CPU")
    ap.add_argument("--set", dest="which", choices=("zoo", "holdout", "all"), default="holdout")
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    ap.add_argument("--child", nargs=2, metavar=("NAME", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(TAG + json.dumps(child(args.child[0], int(args.child[1]))), flush=True)
        return 0
    from zoo_models import ZOO
    names = args.only or [n for n, a in ZOO.items() if args.which == "all" or a.held_out == (args.which == "holdout")]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        print(f"unknown architecture(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = []
    print(f"{'architecture':<18}{'real MiB':>10}{'est. MiB':>10}{'error':>9}{'traced':>9}{'est. s':>8}{'real s':>8}",
          flush=True)
    with cf.ThreadPoolExecutor(args.workers) as pool:
        for row in pool.map(lambda n: run_child(n, args.batch), names):
            rows.append(row)
            if "error" in row:
                print(f"{row['arch']:<18}  {row['error']}", flush=True)
            else:
                print(f"{row['arch']:<18}{row['real_peak_bytes'] / 2**20:>10.1f}"
                      f"{row['predicted_allocated_bytes'] / 2**20:>10.1f}{row['error_pct']:>+8.2f}%"
                      f"{row['traced_error_pct']:>+8.2f}%"
                      f"{row['estimate_seconds']:>8.1f}{row['real_seconds']:>8.1f}", flush=True)
    errs = [abs(r["error_pct"]) for r in rows if r.get("error_pct") is not None]
    summary = {"architectures": len(rows), "compared": len(errs), "failed": [r["arch"] for r in rows if "error" in r],
               "median_abs_error_pct": round(statistics.median(errs), 3) if errs else None,
               "worst": max(rows, key=lambda r: abs(r.get("error_pct") or 0))["arch"] if errs else None,
               "worst_abs_error_pct": max(errs) if errs else None,
               "within_1pct": sum(e <= 1.0 for e in errs)}
    import torch
    data = {"env": {"torch": torch.__version__, "cpu_count": os.cpu_count(), "batch": args.batch},
            "elapsed_s": round(time.perf_counter() - t0, 1), "summary": summary, "rows": rows}
    path = resultfile.save("cpu_steps", resultfile.hardware("cpu"), data, out=args.out)
    print(json.dumps(summary))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
