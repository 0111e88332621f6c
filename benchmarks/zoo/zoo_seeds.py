"""The peaks a zoo configuration reaches on a GPU over many seeds, beside the estimate's.

A model whose steps draw at random (LayerDrop skipping a layer, a router's choice) has no
one peak: each seed's draws give their own. A LayerDrop that skips a layer in the first
step makes that layer's optimizer state a step later, where the allocator's cache is split
otherwise, and its reserved peak is higher; one seed's run (zoo_accuracy.py measures seed 0)
may or may not draw that. The estimate reports the highest peak it finds over the draws it
varies (memdoctor.predict.random_draws), the one a user told "fits" must fit whatever the
seed. This measures each configuration once per seed, each in a fresh process (8 at a time
on one GPU), and compares the highest and lowest peaks with the estimate's prediction taken
from a zoo_accuracy result.

    python benchmarks/zoo/zoo_seeds.py --against benchmarks/results/zoo_accuracy_h200_<date>.json \\
        --seeds 16 --out DIR wav2vec2/bf16/b4 hubert/fp32/b4

Writes zoo_seeds_<hardware>_<date>.json (benchmarks/results, or --out) and prints a line per
configuration.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for path in (ROOT, ROOT / "benchmarks", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402
import zoo_accuracy  # noqa: E402

TAG = "ZOO_SEED "


def _child(row: dict, seed: int) -> dict:
    import torch
    torch.manual_seed(seed)
    return zoo_accuracy._measure(row)


def child_result(script: str, args: list[str], tag: str, timeout: float = 300) -> dict:
    """Run `script args` in a fresh Python process: the JSON it prints after `tag`, or
    {"error": its last lines}."""
    cmd = [sys.executable, script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])[:400]}


def _run(row: dict, seed: int) -> dict:
    args = ["--child", json.dumps(row), "--seed", str(seed)]
    return {"seed": seed, **child_result(str(Path(__file__).resolve()), args, TAG)}


def _pct(predicted, measured):
    return None if not predicted or not measured else round(100.0 * (predicted - measured) / measured, 2)


def summarize(row: dict, seeds: list[dict], predicted: dict | None) -> dict:
    """The lowest and highest peaks over the seeds, and the estimate's error against each."""
    ok = [s for s in seeds if "measured_reserved_bytes" in s]
    out = {"id": row["id"], "seeds": sorted(seeds, key=lambda s: s["seed"]), "measured_seeds": len(ok)}
    if not ok:
        return out
    for kind in ("allocated", "reserved"):
        values = [s[f"measured_{kind}_bytes"] for s in ok]
        out[f"{kind}_min_bytes"], out[f"{kind}_max_bytes"] = min(values), max(values)
        if predicted and predicted.get(f"predicted_{kind}_bytes"):
            p = predicted[f"predicted_{kind}_bytes"]
            out[f"predicted_{kind}_bytes"] = p
            out[f"error_{kind}_vs_max_pct"] = _pct(p, max(values))
            out[f"error_{kind}_vs_min_pct"] = _pct(p, min(values))
            out[f"seeds_within_1pct_of_predicted_{kind}"] = sum(abs(v - p) <= 0.01 * v for v in values)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a zoo configuration's GPU peaks over many seeds")
    ap.add_argument("ids", nargs="*", help="configurations, as zoo_accuracy.py names them (wav2vec2/bf16/b4)")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=zoo_accuracy.STEPS)
    ap.add_argument("--against", help="a zoo_accuracy result: the estimate's predictions")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(TAG + json.dumps(_child(json.loads(args.child), args.seed), default=str), flush=True)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("zoo_seeds.py measures on a GPU: no CUDA device here", file=sys.stderr)
        return 2
    rows = {r["id"]: {**r, "measure_steps": args.steps} for r in zoo_accuracy.configs(None, list(zoo_accuracy.MODES), "all")}
    unknown = [i for i in args.ids if i not in rows]
    if unknown or not args.ids:
        print(f"unknown configuration(s): {', '.join(unknown) or '(none given)'}", file=sys.stderr)
        return 2
    predicted = {}
    if args.against:
        predicted = {r["id"]: r for r in json.loads(Path(args.against).read_text()).get("configs", [])}
    jobs = [(i, s) for i in args.ids for s in range(args.seeds)]
    by_id: dict[str, list] = {i: [] for i in args.ids}
    with cf.ThreadPoolExecutor(args.workers) as pool:
        for (i, _), result in zip(jobs, pool.map(lambda job: _run(rows[job[0]], job[1]), jobs)):
            by_id[i].append(result)
    results = [summarize(rows[i], by_id[i], predicted.get(i)) for i in args.ids]
    for r in results:
        print(f"{r['id']:<24} reserved over {r['measured_seeds']} seeds: {r.get('reserved_min_bytes', 0) / 2**20:.0f}"
              f"-{r.get('reserved_max_bytes', 0) / 2**20:.0f} MiB; predicted "
              f"{(r.get('predicted_reserved_bytes') or 0) / 2**20:.0f} MiB ({r.get('error_reserved_vs_max_pct')}% vs the "
              f"highest, {r.get('seeds_within_1pct_of_predicted_reserved')} seeds within 1%)")
    hw = resultfile.hardware("cuda")
    path = resultfile.save("zoo_seeds", hw, {"seeds": args.seeds, "steps": args.steps, "against": args.against,
                                            "configs": results}, out=args.out)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
