"""Where the CUDA driver maps new segments, against the GPU: each recorded trace's own
requests (and the estimate's, where the trace has them) replayed through the allocator model
with the driver's rule the estimate replays, its 32 MiB slots alone, and each segment right
below the last (memdoctor.cuda.allocator_model.placements), and with the addresses the GPU's
driver really gave.

    python benchmarks/placement_replay.py tests/fixtures/*/*.json.gz benchmarks/results/zoo_traces_h200_2026-12-02/*.json.gz

The estimate reports the higher of the driver's rule and the slots alone; the summary counts
how often that is exact and under. The traces come from benchmarks/zoo/zoo_traces.py and benchmarks/allocator_replay.py (on a
GPU); this replay needs none. Writes placement_replay_<hardware>_<date>.json with a row per
trace and how many each placement reserves exactly as the GPU did.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402
from memdoctor.cuda.allocator_model import placements, replay_trace  # noqa: E402

GiB = 1024 ** 3


def row(path: Path) -> dict | None:
    data = json.loads(gzip.decompress(path.read_bytes()))
    real = data.get("real", data)
    if "events" not in real:
        return None
    out = {"trace": path.name, "gpu_reserved": real["max_reserved"],
           **{name: replay_trace(real["events"], driver=d).peak_reserved for name, d in placements().items()}}
    if real.get("segment_addresses"):
        out["recorded_addresses"] = replay_trace(real["events"], [a for _n, a, _s in real["segment_addresses"]]
                                                 ).peak_reserved
    if "events" in data.get("predicted", {}):
        out.update({f"estimate_{name}": replay_trace(data["predicted"]["events"], driver=d).peak_reserved
                    for name, d in placements().items()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", help="folder for the results file (default benchmarks/results)")
    args = ap.parse_args(argv)
    rows = [r for r in (row(Path(p)) for p in args.traces) if r is not None]
    for r in rows:
        marks = {k: "=" if r[k] == r["gpu_reserved"] else f"{100 * (r[k] / r['gpu_reserved'] - 1):+.1f}%"
                 for k in (*placements(), "recorded_addresses") if k in r}
        print(f"{r['trace']:42s} GPU {r['gpu_reserved'] / GiB:7.3f} GiB  "
              + "  ".join(f"{k} {v}" for k, v in marks.items()))
    names = list(placements())
    summary = {k: sum(r[k] == r["gpu_reserved"] for r in rows) for k in names}
    summary["highest"] = sum(max(r[k] for k in names) == r["gpu_reserved"] for r in rows)
    # what the estimate reports: the higher of the driver's rule and the slots alone
    reported = [max(r["driver"], r["slots"]) for r in rows]
    summary["reported_exact"] = sum(v == r["gpu_reserved"] for v, r in zip(reported, rows))
    summary["reported_under"] = [r["trace"] for v, r in zip(reported, rows) if v < r["gpu_reserved"]]
    summary["driver_under"] = [r["trace"] for r in rows if r["driver"] < r["gpu_reserved"]]
    summary["traces"] = len(rows)
    print(f"\nexact on {summary['traces']} traces: " + ", ".join(f"{k} {summary[k]}" for k in names)
          + f", the highest of them {summary['highest']}; the estimate's (driver or slots, the higher) "
          f"{summary['reported_exact']}, under on {len(summary['reported_under'])} (the driver's rule alone: "
          f"{len(summary['driver_under'])})")
    print("written:", resultfile.save("placement_replay", resultfile.hardware("cpu"), {"rows": rows,
                                                                                      "summary": summary}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
