"""memdoctor's model of the CUDA caching allocator against the real one: the GPU's own
allocations and frees of two training steps, replayed through the model, give the GPU's
peaks and segment count. Tests the allocator model alone: the requests are the GPU's own.

    python benchmarks/allocator_replay.py                  # on a GPU: record and replay the ten configurations
    python benchmarks/allocator_replay.py --traces DIR     # replay traces saved with --save-traces (no GPU)

Each configuration is an estimate_accuracy id ("model/mode/bBATCH"); its two training steps
run with torch.cuda.memory._record_memory_history on. Writes
results/allocator_replay_<hardware>_<date>.json. `--fixtures ID...` also writes those
configurations' traces in a compact form (allocations and frees by number, no addresses)
for tests/test_allocator_replay.py.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402
from memdoctor.cuda.allocator_model import replay_trace  # noqa: E402

MiB = 1024 ** 2
CONFIGS = ["resnet50/fp32/b64", "resnet50/bf16/b64", "resnet50/fp32/b256", "vit-b16/fp32/b64", "vit-b16/bf16/b64",
           "vit-b16/ckpt/b64", "gpt2-355m/fp32/b8", "bert-base/ckpt/b32", "llama-1b/fp32/b2", "gpt2-1.5b/ckpt/b4"]


def record(cid: str) -> dict:
    """Two training steps of one configuration on the GPU, with the allocator's trace."""
    import torch
    from estimate_accuracy import MODELS, MODES, _reset_cuda
    from memdoctor.predict.fake_step import train_step
    from memdoctor.predict.models import get
    from memdoctor.remedies import prepare
    name, mode, b = cid.split("/")
    seq = next(seq for model, seq, _ in MODELS if model == name)
    _reset_cuda()
    torch.cuda.reset_peak_memory_stats()
    build = get(name).builder(batch=int(b[1:]), seq=seq)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=3_000_000)
    with torch.device("cuda"):
        model, optimizer, batch, loss_fn = build()
    prepared = prepare(model, optimizer, MODES[mode], device_type="cuda") if MODES[mode] else None
    if prepared is not None:
        optimizer = prepared.optimizer
    for _ in range(2):
        train_step(model, optimizer, batch, loss_fn, prepared)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [{"action": e["action"], "addr": e["addr"], "size": e["size"]} for e in snap["device_traces"][0]]
    rec = {"job": {"id": cid}, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "hardware": resultfile.hardware("cuda"),
           "measured": {"real_trace": trace, "max_allocated": torch.cuda.max_memory_allocated(),
                        "max_reserved": torch.cuda.max_memory_reserved()}}
    del model, optimizer, batch, prepared
    gc.collect()
    _reset_cuda()
    return rec


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


def compare(rec: dict) -> dict:
    """The GPU's peaks and segment count next to the model's, replaying the same trace."""
    m = rec["measured"]
    model = replay_trace(compact(m["real_trace"]))
    gpu = {"allocated": m["max_allocated"], "reserved": m["max_reserved"],
           "segments": sum(1 for e in m["real_trace"] if e["action"] == "segment_alloc")}
    got = {"allocated": model.peak_allocated, "reserved": model.peak_reserved, "segments": model.num_segment_allocs}
    return {"id": rec["job"]["id"], "gpu": gpu, "model": got, "exact": gpu == got}


def write_fixture(rec: dict, folder: Path) -> None:
    m = rec["measured"]
    cid = rec["job"]["id"]
    data = {"id": cid, "device": rec.get("device"), "torch": rec["torch"], "max_allocated": m["max_allocated"],
            "max_reserved": m["max_reserved"],
            "segments": sum(1 for e in m["real_trace"] if e["action"] == "segment_alloc"),
            "events": compact(m["real_trace"])}
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / (cid.replace("/", "_") + ".json.gz")
    out.write_bytes(gzip.compress(json.dumps(data, separators=(",", ":")).encode(), mtime=0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=CONFIGS, help="estimate_accuracy ids (default: the ten)")
    ap.add_argument("--traces", help="replay the traces saved in this folder instead of recording")
    ap.add_argument("--save-traces", help="keep the recorded traces in this folder")
    ap.add_argument("--fixtures", nargs="*", default=[], help="write these configurations as test fixtures")
    ap.add_argument("--fixture-dir", default=str(ROOT / "tests" / "fixtures" / "allocator_traces"))
    ap.add_argument("--hardware", help="where the traces were recorded (default: as recorded in them)")
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.traces:
        records = (json.loads(p.read_text()) for p in sorted(Path(args.traces).glob("*.json")))
    else:
        records = (record(cid) for cid in args.configs)
    rows, recorded_on, recorded_with = [], set(), set()
    for rec in records:
        recorded_on.add(rec.get("hardware"))
        recorded_with.add(rec.get("torch"))
        if args.save_traces:
            folder = Path(args.save_traces)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / (rec["job"]["id"].replace("/", "_") + ".json")).write_text(json.dumps(rec))
        if rec["job"]["id"] in args.fixtures:
            write_fixture(rec, Path(args.fixture_dir))
        row = compare(rec)
        rows.append(row)
        g, m = row["gpu"], row["model"]
        print(f"{row['id']:<20} allocated {g['allocated'] / MiB:>10,.1f} / {m['allocated'] / MiB:>10,.1f} MiB  "
              f"reserved {g['reserved'] / MiB:>10,.1f} / {m['reserved'] / MiB:>10,.1f} MiB  "
              f"segments {g['segments']:>4} / {m['segments']:<4} {'exact' if row['exact'] else ''}", flush=True)
    exact = sum(r["exact"] for r in rows)
    print(f"GPU / model: exact in {exact} of {len(rows)}")
    hw = args.hardware or "+".join(sorted(h for h in recorded_on if h)) or "unknown"
    data = {"exact": exact, "configurations": len(rows), "rows": rows}
    if args.traces:
        data["traces"] = {"folder": args.traces, "torch": sorted(v for v in recorded_with if v)}
    print("wrote", resultfile.save("allocator_replay", hw, data, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
