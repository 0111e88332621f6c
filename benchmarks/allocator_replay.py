"""Replay the real CUDA allocator's traces (from allocator_trace_capture.py) through
memdoctor's model of the caching allocator, and compare the peaks and segment counts with
what the GPU reported. Tests the allocator model alone: the requests are the GPU's own.

    python benchmarks/allocator_replay.py DIR [--out FILE.md] [--fixture-dir DIR --fixtures ID...]

`--fixtures` also writes those configurations' traces in a compact form (allocations and
frees by number, no addresses) for tests/test_allocator_replay.py.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memdoctor.cuda.allocator_model import replay_trace  # noqa: E402

MiB = 1024 ** 2


def compact(trace: list[dict]) -> list[list[int]]:
    """[[1, n, bytes] for the n-th allocation, [0, n, 0] for its free], addresses dropped."""
    live: dict[int, int] = {}
    out = []
    count = 0
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = count
            out.append([1, count, e["size"]])
            count += 1
        elif e["action"] == "free_completed" and e["addr"] in live:
            out.append([0, live.pop(e["addr"]), 0])
    return out


def replay(events: list[list[int]]) -> dict:
    model = replay_trace(events)
    return {"peak_allocated": model.peak_allocated, "peak_reserved": model.peak_reserved,
            "segments": model.num_segment_allocs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--out")
    ap.add_argument("--fixture-dir")
    ap.add_argument("--fixtures", nargs="*", default=[])
    args = ap.parse_args(argv)
    lines = ["| configuration | allocated, GPU | model | reserved, GPU | model | segments, GPU | model |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for path in sorted(Path(args.dir).glob("*.json")):
        rec = json.loads(path.read_text())
        m = rec["measured"]
        events = compact(m["real_trace"])
        got = replay(events)
        real_segments = sum(1 for e in m["real_trace"] if e["action"] == "segment_alloc")
        cid = rec["job"]["id"]
        lines.append(f"| {cid} | {m['max_allocated'] / MiB:,.1f} MiB | {got['peak_allocated'] / MiB:,.1f} | "
                     f"{m['max_reserved'] / MiB:,.1f} MiB | {got['peak_reserved'] / MiB:,.1f} | "
                     f"{real_segments} | {got['segments']} |")
        if cid in args.fixtures and args.fixture_dir:
            out = Path(args.fixture_dir) / (cid.replace("/", "_") + ".json.gz")
            out.parent.mkdir(parents=True, exist_ok=True)
            data = {"id": cid, "device": "NVIDIA H200", "torch": rec["torch"],
                    "max_allocated": m["max_allocated"], "max_reserved": m["max_reserved"],
                    "segments": real_segments, "events": events}
            out.write_bytes(gzip.compress(json.dumps(data, separators=(",", ":")).encode(), mtime=0))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
