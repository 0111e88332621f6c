"""The zoo's summary with the highest peak over seeds as the measurement of each configuration
whose steps draw at random.

zoo_accuracy.py measures every configuration with seed 0. A model with LayerDrop (wav2vec2,
HuBERT) has no one peak: each seed's draws give their own, up to 18% apart, and the estimate
reports the highest it finds over the draws it varies, the peak a user told "fits" must fit
whatever the seed. This takes a zoo result and the zoo_seeds.py results that measured those
configurations over many seeds, puts the highest peak over the seeds in place of seed 0's
(kept as measured_seed0_*), and writes the summary again; nothing is run.

    python benchmarks/zoo/zoo_over_seeds.py benchmarks/results/zoo_accuracy_h200_<date>.json \\
        benchmarks/results/zoo_seeds_h200_<date>.json

Writes zoo_accuracy_over_seeds_<hardware>_<date>.json (benchmarks/results, or --out).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for path in (ROOT, ROOT / "benchmarks", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402
import zoo_accuracy  # noqa: E402


def over_seeds(rows: list[dict], seeds: list[dict]) -> list[dict]:
    """`rows` with each configuration in `seeds` measured as its highest peaks over the seeds."""
    highest = {s["id"]: s for s in seeds if s.get("reserved_max_bytes")}
    out = []
    for r in rows:
        s = highest.get(r["id"])
        if s is not None:
            r = {**r, "measured_seed0_allocated_bytes": r.get("measured_allocated_bytes"),
                 "measured_seed0_reserved_bytes": r.get("measured_reserved_bytes"),
                 "measured_allocated_bytes": s["allocated_max_bytes"], "measured_reserved_bytes": s["reserved_max_bytes"],
                 "measured_over_seeds": s["measured_seeds"]}
        out.append(zoo_accuracy._with_errors(r))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("zoo", help="a zoo_accuracy.py result")
    ap.add_argument("seeds", nargs="+", help="zoo_seeds.py results")
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    zoo = json.loads(Path(args.zoo).read_text())
    seeds = [c for p in args.seeds for c in json.loads(Path(p).read_text())["configs"]]
    rows = over_seeds(zoo["configs"], seeds)
    summary = zoo_accuracy.summarize(rows, dry_run=False)
    print("\n".join(zoo_accuracy.summary_lines(summary, None, zoo.get("elapsed_s", 0))))
    hw = (zoo.get("env", {}).get("gpu") or "cpu").split()[-1].lower()
    data = {"zoo": args.zoo, "zoo_commit": zoo.get("commit"), "seeds_results": args.seeds,
            "over_seeds": sorted(r["id"] for r in rows if "measured_over_seeds" in r),
            "env": zoo.get("env"), "summary": summary, "configs": rows}
    print("written:", resultfile.save("zoo_accuracy_over_seeds", hw, data, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
