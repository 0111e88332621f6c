"""How long an estimate takes on a CPU: GPT-2 1.5B at batch 1, sequence 1024 (the target:
under 30 s), and GPT-2 124M for scale. Splits the time into the fake-tensor steps (build,
two training steps under the dispatch tracer) and the allocator replay, whose cost grows as
O(events log free-blocks). Prints the numbers and writes
results/estimate_speed_<hardware>_<date>.json.

    python benchmarks/estimate_speed.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402

CASES = [("gpt2-1.5b", 1, 1024), ("gpt2-124m", 8, 1024)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    import torch

    from memdoctor.cuda.allocator_model import AllocatorConfig, CachingAllocatorModel
    from memdoctor.predict.estimate import estimate_built
    from memdoctor.predict.replay import counted_blocks, replay
    from memdoctor.predict.models import get
    import_s = time.perf_counter() - t0

    rows = []
    for name, batch, seq in CASES:
        totals, replays = [], []
        est = None
        for _ in range(args.repeat):
            t = time.perf_counter()
            est = estimate_built(get(name).builder(batch=batch, seq=seq), device="cuda")
            totals.append(time.perf_counter() - t)
            counted = counted_blocks(est.run, est.run.blocks[0].device.split(":")[0], skip_cpu_scalars=True)
            t = time.perf_counter()
            replay(est.run, counted, CachingAllocatorModel(None, AllocatorConfig()))
            replays.append(time.perf_counter() - t)
        row = {
            "model": name, "batch": batch, "seq": seq, "params": est.params,
            "events": est.run.num_events,
            "estimate_s_median": round(statistics.median(totals), 2),
            "estimate_s_all": [round(x, 2) for x in totals],
            "replay_s_median": round(statistics.median(replays), 3),
            "replay_us_per_event": round(1e6 * statistics.median(replays) / max(est.run.num_events, 1), 2),
            "peak_allocated_gib": round(est.peak_allocated_bytes / 2**30, 2),
            "peak_reserved_gib": round(est.peak_reserved_bytes / 2**30, 2),
            "simulated_on": est.simulated_on,
        }
        rows.append(row)
        print(f"{name:<10} batch {batch} seq {seq}: {row['estimate_s_median']:.1f} s median of {args.repeat} "
              f"({row['events']} events; replay {row['replay_s_median'] * 1000:.0f} ms, "
              f"{row['replay_us_per_event']} us/event); peak {row['peak_allocated_gib']} GiB allocated, "
              f"{row['peak_reserved_gib']} GiB reserved")
    result = {
        "target": "GPT-2 1.5B, batch 1, seq 1024: under 30 s on a CPU",
        "met": rows[0]["estimate_s_median"] < 30,
        "import_s": round(import_s, 2),
        "cases": rows,
        # the estimate runs on fake tensors: on a machine with a GPU this stays 0
        "gpu_max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine(),
                    "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
    }
    print("wrote", resultfile.save("estimate_speed", resultfile.hardware("cpu"), result, args.out))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
