"""How long a large PyTorch memory snapshot takes to read safely and turn into a Run.

Builds a synthetic snapshot of 1,000,000 trace entries shaped like the ones
`torch.cuda.memory._dump_snapshot()` writes (alloc / free_requested / free_completed
triples, segment events, an OOM at the end, stacks shared between entries as torch shares
them), pickles it, then times `load_snapshot` (against plain `pickle.load`, which would run
code from the file) and `snapshot_to_run`. Prints the numbers and writes
benchmarks/results/snapshot_convert.json.

    python benchmarks/snapshot_convert.py [--entries N]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from memdoctor.capture.snapshot import load_snapshot, snapshot_to_run

RESULTS = Path(__file__).resolve().parent / "results" / "snapshot_convert.json"


def synthetic_snapshot(entries: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    stacks = []
    for s in range(200):
        frames = [{"filename": "??", "line": 0, "name": f"c10::cuda::alloc_{k}"} for k in range(6)]
        frames += [{"filename": "/usr/lib/python3.11/site-packages/torch/nn/functional.py",
                    "line": 100 + k, "name": "linear"} for k in range(6)]
        frames += [{"filename": f"/home/me/model_{s % 7}.py", "line": 10 + s, "name": "forward"},
                   {"filename": "/home/me/train.py", "line": 42, "name": "main"}]
        stacks.append(frames)
    trace, live, t = [], [], 1_700_000_000_000_000
    base = 0x7F00_0000_0000
    next_addr = base
    segment_every = 1000
    while len(trace) < entries - 1:
        t += rng.randint(1, 50)
        if len(trace) % segment_every == 0:
            trace.append({"action": "segment_alloc", "addr": next_addr, "size": 20 * 2**20,
                          "stream": 0, "time_us": t, "frames": rng.choice(stacks)})
            next_addr += 20 * 2**20
            continue
        if live and (len(live) > 2000 or rng.random() < 0.5):
            addr, size = live.pop(rng.randrange(len(live)))
            frames = rng.choice(stacks)
            trace.append({"action": "free_requested", "addr": addr, "size": size, "stream": 0,
                          "time_us": t, "frames": frames})
            trace.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0,
                          "time_us": t, "frames": frames})
        else:
            size = rng.choice((512, 4096, 2**20, 3 * 2**20 + 512, 16 * 2**20))
            addr = next_addr
            next_addr += size
            live.append((addr, size))
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                          "time_us": t, "frames": rng.choice(stacks)})
    trace.append({"action": "oom", "device_free": 1 << 20, "size": 2**31, "stream": 0,
                  "time_us": t + 1, "frames": stacks[0]})
    segments = [{"device": 0, "address": addr, "total_size": size, "allocated_size": size,
                 "active_size": size, "requested_size": size, "stream": 0,
                 "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                 "blocks": [{"address": addr, "size": size, "requested_size": size,
                             "state": "active_allocated", "frames": []}]}
                for addr, size in live]
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    args = parser.parse_args()

    t0 = time.perf_counter()
    snapshot = synthetic_snapshot(args.entries)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snapshot.pickle")
        with open(path, "wb") as fh:
            pickle.dump(snapshot, fh)      # what _dump_snapshot does
        file_bytes = os.path.getsize(path)
        del snapshot

        t0 = time.perf_counter()
        with open(path, "rb") as fh:
            plain = pickle.load(fh)
        plain_load_s = time.perf_counter() - t0
        del plain

        t0 = time.perf_counter()
        loaded = load_snapshot(path)
        load_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    run = snapshot_to_run(loaded)
    convert_s = time.perf_counter() - t0

    result = {
        "benchmark": "snapshot_convert",
        "trace_entries": len(loaded["device_traces"][0]),
        "segments": len(loaded["segments"]),
        "file_bytes": file_bytes,
        "build_s": round(build_s, 3),
        "plain_pickle_load_s": round(plain_load_s, 3),
        "load_snapshot_s": round(load_s, 3),
        "snapshot_to_run_s": round(convert_s, 3),
        "load_and_convert_s": round(load_s + convert_s, 3),
        "run_events": run.num_events,
        "run_blocks": len(run.blocks),
        "run_ooms": len(run.ooms),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
