"""Where the planner's time goes on a many-core machine: each estimate's start and end in its
worker process (and the process's own import), against the planner's wall time, for GPT-2
1.5B at batch 8, seq 1024 under 32 GiB (the issue's case); then one estimate of the plan on
the critical path (bf16,micro=1,opt=adamw-bf16) alone, for the slowdown that running beside
the others brings.

    python benchmarks/plan_speed.py [--out DIR]      # -> DIR/plan_speed_timeline.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T_IMPORTED = time.time()
from memdoctor.predict import planner  # noqa: E402

_REAL_JOB = planner._estimate_job


def timed_job(job: tuple):
    """planner._estimate_job, logging when it ran and in which process (a JSON line a job)."""
    start = time.time()
    result = _REAL_JOB(job)
    with open(os.environ["PLAN_SPEED_LOG"], "a") as fh:
        fh.write(json.dumps({"plan": job[3], "pid": os.getpid(), "process_ready": T_IMPORTED,
                             "start": start, "end": time.time()}) + "\n")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "out")
    ap.add_argument("--model", default="gpt2-1.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget-gib", type=float, default=32)
    ap.add_argument("--alone", default="bf16,micro=1,opt=adamw-bf16",
                    help="the plan to estimate alone after ('' for none)")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp()) / "jobs.jsonl"
    os.environ["PLAN_SPEED_LOG"] = str(log)
    planner._estimate_job = timed_job
    t0 = time.time()
    cands = planner.plan_for_budget(args.model, args.batch, args.seq, int(args.budget_gib * 2**30))
    wall = time.time() - t0
    jobs = [json.loads(line) for line in log.read_text().splitlines()]
    for j in jobs:
        for key in ("process_ready", "start", "end"):
            j[key] = round(j[key] - t0, 2)
    jobs.sort(key=lambda j: j["start"])
    t = time.time()
    planner._estimate_job = _REAL_JOB
    if args.alone:
        from memdoctor.predict.estimate import estimate_config
        estimate_config(args.model, batch=args.batch, seq=args.seq, plan=args.alone)
    alone = time.time() - t if args.alone else None
    result = {"planner_wall_s": round(wall, 2), "cores": len(os.sched_getaffinity(0)),
              "workers": planner._worker_count(len(jobs)), "jobs": jobs,
              "first_choice": str(cands[0].plan), "alone_plan": args.alone, "alone_s": alone and round(alone, 2)}
    for j in jobs:
        print(f"{j['plan']:<36} ready {j['process_ready']:6.1f}  start {j['start']:6.1f}  end {j['end']:6.1f}  "
              f"({j['end'] - j['start']:.1f} s, pid {j['pid']})")
    print(f"planner {wall:.1f} s" + (f"; {args.alone} alone in this process {alone:.1f} s" if args.alone else ""))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "plan_speed_timeline.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
