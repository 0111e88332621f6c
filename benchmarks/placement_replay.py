"""Where the CUDA driver maps new segments, against the GPU: each recorded trace's own
requests (and the estimate's, where the trace has them) replayed through the allocator model
with the driver's 32 MiB slots, with each segment right below the last, and with the
addresses the GPU's driver really gave (memdoctor.cuda.allocator_model.DriverSpace).

    python benchmarks/placement_replay.py tests/fixtures/*/*.json.gz benchmarks/results/zoo_traces_h200_2026-12-02/*.json.gz

The traces come from benchmarks/zoo/zoo_traces.py and benchmarks/allocator_replay.py (on a
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
    slots, packed = (replay_trace(real["events"], driver=d).peak_reserved for d in placements())
    out = {"trace": path.name, "gpu_reserved": real["max_reserved"], "slots": slots, "packed": packed}
    if real.get("segment_addresses"):
        out["recorded_addresses"] = replay_trace(real["events"], [a for _n, a, _s in real["segment_addresses"]]
                                                 ).peak_reserved
    if "events" in data.get("predicted", {}):
        out["estimate_slots"], out["estimate_packed"] = (replay_trace(data["predicted"]["events"], driver=d).peak_reserved
                                                         for d in placements())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", help="folder for the results file (default benchmarks/results)")
    args = ap.parse_args(argv)
    rows = [r for r in (row(Path(p)) for p in args.traces) if r is not None]
    for r in rows:
        marks = {k: "=" if r[k] == r["gpu_reserved"] else f"{100 * (r[k] / r['gpu_reserved'] - 1):+.1f}%"
                 for k in ("slots", "packed", "recorded_addresses") if k in r}
        print(f"{r['trace']:42s} GPU {r['gpu_reserved'] / GiB:7.3f} GiB  "
              + "  ".join(f"{k} {v}" for k, v in marks.items()))
    summary = {k: sum(r[k] == r["gpu_reserved"] for r in rows) for k in ("slots", "packed")}
    summary["higher_of_the_two"] = sum(max(r["slots"], r["packed"]) == r["gpu_reserved"] for r in rows)
    summary["traces"] = len(rows)
    print(f"\nexact on {summary['traces']} traces: slots {summary['slots']}, packed {summary['packed']}, "
          f"the higher of the two {summary['higher_of_the_two']}")
    print("written:", resultfile.save("placement_replay", resultfile.hardware("cpu"), {"rows": rows,
                                                                                      "summary": summary}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
