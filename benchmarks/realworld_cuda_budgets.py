"""Which CUDA budgets make the own real-world cases run out for their own cause: each case
without a CUDA budget (tests/realworld/cases.json) diagnosed on a GPU under both sources at
its CPU budget plus a few margins (the allocator source counts what the caching allocator
reserves, cuBLAS's workspaces and rounding included, so a CPU budget runs out elsewhere).

    python benchmarks/realworld_cuda_budgets.py --margins 0 32 64 96 --jobs 8   # on a GPU

Prints one line per case, margin and source (the first finding and every rule), and saves
them with the command, commit and versions.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402
from memdoctor.units import parse_size  # noqa: E402
from tests.gpu.test_realworld_gpu import _on_cuda  # noqa: E402
from tests.realworld.test_realworld import CASES, diagnose, prepare  # noqa: E402

MiB = 2 ** 20


def _one(case: dict, margin: int, source: str, work_root: Path, runs: Path | None = None) -> dict:
    budget = parse_size(case["budget"]["cpu"]) + margin * MiB
    trial = dict(case, budget={**case["budget"], "cuda": f"{budget // MiB}MiB"})
    work = work_root / f"{case['name']}_{margin}_{source}"
    try:
        prepare(trial, work)
        tag = f"{case['name']}_{margin}_{source}"
        save = ("-o", str(runs / f"{tag}.memrun.json.gz")) if runs else ()
        out = diagnose(trial, work, kind="cuda", options=("--source", source, *save))
        if runs:
            (runs / f"{tag}.diagnose.json").write_text(json.dumps(out, default=str))
    except BaseException as exc:        # a failed run is a row too
        return {"case": case["name"], "margin_mib": margin, "source": source, "error": repr(exc)[-500:]}
    rules = [f["rule"] for f in out["findings"]]
    first = out["findings"][0] if out["findings"] else {}
    return {"case": case["name"], "cause": case["cause"], "margin_mib": margin, "budget": trial["budget"]["cuda"],
            "source": source, "rules": rules, "right": bool(rules) and rules[0] == case["cause"],
            "title": first.get("title"), "line": (first.get("source") or {}).get("text"),
            "peak": {k: out.get(k) for k in ("peak_allocated_bytes", "peak_reserved_bytes", "verdict") if k in out}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--margins", type=int, nargs="+", default=[0, 32, 64, 96], help="MiB over the CPU budget")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--out", default=None, help="folder for the results file (default benchmarks/results)")
    ap.add_argument("--cases", nargs="+", default=None, help="only these cases (with a margin each: NAME:MIB)")
    ap.add_argument("--save-runs", default=None, help="folder for each run's traced run and diagnosis JSON")
    args = ap.parse_args(argv)
    cases = [_on_cuda(c) for c in CASES if "cuda" not in c["budget"]]
    trials = [(c, m) for c in cases for m in args.margins]
    if args.cases:
        wanted = [name.partition(":") for name in args.cases]
        by_name = {c["name"]: c for c in map(_on_cuda, CASES)}
        trials = [(by_name[name], int(margin or 0)) for name, _, margin in wanted]
    runs = Path(args.save_runs) if args.save_runs else None
    if runs:
        runs.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_one, c, m, s, Path(tmp), runs) for c, m in trials for s in ("allocator", "dispatch")]
        for fut in futures:
            row = fut.result()
            rows.append(row)
            print(json.dumps(row, default=str)[:600], flush=True)
    print("saved", resultfile.save("realworld_cuda_budgets", resultfile.hardware("cuda"), {"rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
