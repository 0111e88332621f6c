"""Request sequences replayed through the GPU's own caching allocator: where memdoctor's
allocator model cannot know what decides (the driver's segment addresses break ties between
equal free blocks), the real allocator, asked the same requests in the same order on the
same GPU, can.

Each trace file (json.gz from benchmarks/zoo/zoo_traces.py or tests/fixtures/zoo_traces)
holds `real` (the GPU's own requests of a training run, with its measured peaks) and maybe
`predicted` (the estimate's requests). Each sequence is replayed in a fresh process by
allocating and freeing uint8 tensors of the requested sizes; the peaks it reaches are
printed beside the measured ones and the allocator model's replay.

    python benchmarks/allocator_replay_gpu.py TRACE.json.gz ...   # on a GPU
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402

MiB = 1024 ** 2


def load(path: str) -> dict:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return json.load(f)


def replay_here(events) -> dict:
    """The events through this process's CUDA caching allocator: its peaks."""
    import torch
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    live = {}
    try:
        for action, n, size in events:
            if action == 1:
                live[n] = torch.empty(size, dtype=torch.uint8, device="cuda")
            else:
                live.pop(n, None)
    except torch.OutOfMemoryError as exc:
        return {"error": str(exc).splitlines()[0]}
    return {"allocated": torch.cuda.max_memory_allocated() - base_alloc,
            "reserved": torch.cuda.max_memory_reserved() - base_res,
            "segments": torch.cuda.memory_stats().get("segment.all.peak", 0)}


def replay_fresh(path: str, which: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", path, which], capture_output=True, text=True)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--out", help="folder for the result file (default benchmarks/results)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(replay_here(load(args.worker[0])[args.worker[1]]["events"])))
        return 0
    from memdoctor.cuda.allocator_model import replay_trace
    rows = []
    for path in args.traces:
        data = load(path)
        real = data["real"]
        row = {"trace": Path(path).name, "measured": {"allocated": real.get("max_allocated"),
                                                      "reserved": real.get("max_reserved")}}
        for which in ("real", "predicted"):
            if "events" not in data.get(which, {}):
                continue
            model = replay_trace(data[which]["events"])
            row[which] = {"gpu_replay": replay_fresh(path, which),
                          "model_replay": {"allocated": model.peak_allocated, "reserved": model.peak_reserved}}
        rows.append(row)
        m = row["measured"]["reserved"] or 0
        parts = [f"{row['trace']:45s} measured {m / MiB:9.1f}"]
        for which in ("real", "predicted"):
            if which in row:
                g, mo = row[which]["gpu_replay"], row[which]["model_replay"]
                parts.append(f"{which}: gpu {g.get('reserved', 0) / MiB:9.1f} model {mo['reserved'] / MiB:9.1f}"
                             + (f" ({g['error']})" if "error" in g else ""))
        print("  ".join(parts), flush=True)
    import torch
    hw = resultfile.hardware("cuda" if torch.cuda.is_available() else "cpu")
    print("wrote", resultfile.save("allocator_replay_gpu", hw, {"rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
