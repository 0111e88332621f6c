"""Where one estimate's time goes, at two batch sizes: cProfile's top functions for GPT-2 1.5B
(seq 1024) at batch 1 and batch 8. On the H200 machine's CUDA build a batch-8 estimate took
2-4x what it takes on the CPU build of the development machine, while batch 1 took the same
(GPU passes 17 and 19); this shows which functions grow.

    python benchmarks/estimate_profile.py [--plan bf16] [--batches 1 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-1.5b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--plan", default="bf16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT") or "out")
    args = ap.parse_args()
    import torch
    from memdoctor.predict.estimate import estimate_config

    estimate_config(args.model, batch=1, seq=args.seq, plan=args.plan)     # imports and caches warm
    rows = []
    for batch in args.batches:
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        est = estimate_config(args.model, batch=batch, seq=args.seq, plan=args.plan)
        prof.disable()
        seconds = time.perf_counter() - t
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        rows.append({"batch": batch, "seconds": round(seconds, 2), "events": est.run.num_events,
                     "profile": text.getvalue()})
        print(f"{args.model} {args.plan} batch {batch}: {seconds:.1f} s, {est.run.num_events} events")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "seq": args.seq, "plan": args.plan, "torch": torch.__version__,
              "cuda_available": torch.cuda.is_available(), "runs": rows}
    (out / "estimate_profile.json").write_text(json.dumps(result, indent=1))
    for row in rows:
        (out / f"estimate_profile_b{row['batch']}.txt").write_text(row["profile"])
    print(f"wrote {out / 'estimate_profile.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
