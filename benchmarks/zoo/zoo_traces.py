"""Where a zoo estimate's reserved peak parts from the GPU's: the GPU's own allocations and
frees of a configuration's training steps next to the estimate's, both replayed through
memdoctor's allocator model.

    python benchmarks/zoo/zoo_traces.py --out DIR llama/ckpt/b4 falcon/bf16/b8   # on a GPU
    python benchmarks/zoo/zoo_traces.py --seed 6 --out DIR hubert/fp32/b4       # a seed's draws (LayerDrop)

For each zoo id (ARCH/MODE/bBATCH), in a fresh process: the real steps under
torch.cuda.memory._record_memory_history, then the estimate with its allocator model's
requests logged. Writes DIR/<id>.json.gz (both request sequences, compact: [1, n, bytes]
for the n-th allocation, [0, n, 0] for its free; beside each, "labels": what made each
allocation, in order: on the GPU the innermost torch function and the first frame outside
torch, in the estimate the block's name, module, phase, shape and dtype; on the GPU also the
address of each segment the driver handed out) and prints, per id, the GPU's peaks, the
model's on the GPU's own requests (the allocator model alone), the estimate's, and the
first request where the two sequences differ. A model exact on the GPU's requests and an
estimate off says the fake step's order of allocations and frees differs from the GPU's.
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ZOO_DIR = ROOT / "benchmarks" / "zoo"
for path in (ROOT, ROOT / "benchmarks", ZOO_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from allocator_replay import compact  # noqa: E402
from memdoctor.cuda.allocator_model import replay_trace  # noqa: E402
from zoo_accuracy import STEPS, configs  # noqa: E402


def _row(cid: str) -> dict:
    arch, mode, _ = cid.split("/")
    for row in configs([arch], [mode]):
        if row["id"] == cid:
            return row
    raise SystemExit(f"no zoo configuration {cid}")


def train_steps(row: dict, device: str = "cuda") -> tuple:
    """Build the configuration on `device`, apply its plan and train its STEPS steps, as the
    zoo measures it: (model, optimizer, batch, prepared), for the caller to free."""
    import torch

    from memdoctor.predict.fake_step import train_step
    from memdoctor.remedies import prepare
    from zoo_models import build
    with torch.device(device):
        model, optimizer, batch, loss_fn = build(row["arch"], row["batch"], own_checkpointing=row["own_checkpointing"])
    prepared = prepare(model, optimizer, row["plan"], device_type=device) if row["plan"] else None
    if prepared is not None:
        optimizer = prepared.optimizer
    for _ in range(STEPS):
        train_step(model, optimizer, batch, loss_fn, prepared)
    return model, optimizer, batch, prepared


def recorded_trace() -> tuple[dict, list[dict]]:
    """Stop torch.cuda.memory._record_memory_history: (its snapshot, the device's allocator
    events as action, address, size)."""
    import torch
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snap, [{"action": e["action"], "addr": e["addr"], "size": e["size"]} for e in snap["device_traces"][0]]


def _real(row: dict, seed: int = 0) -> dict:
    import torch
    torch.manual_seed(seed)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=5_000_000)
    model, optimizer, batch, prepared = train_steps(row)
    snap, trace = recorded_trace()
    out = {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
           "segments": sum(1 for e in trace if e["action"] == "segment_alloc"), "events": compact(trace),
           "segment_addresses": _segment_addresses(trace),
           "labels": [_frame_label(e.get("frames") or []) for e in snap["device_traces"][0] if e["action"] == "alloc"]}
    del model, optimizer, batch, prepared
    torch.cuda.empty_cache()
    return out


def _segment_addresses(trace: list[dict]) -> list[list[int]]:
    """[allocation number, address, bytes] of each segment the driver handed out, the
    allocation number that of the request it was made for: where equal free blocks tie, the
    allocator takes the lowest address, so the driver's address order decides between them."""
    out, count = [], 0
    for e in trace:
        if e["action"] == "segment_alloc":
            out.append([count, e["addr"], e["size"]])
        elif e["action"] == "alloc":
            count += 1
    return out


def _frame_label(frames: list[dict]) -> str:
    """The innermost Python function that asked for the memory, and the first frame outside
    torch (the model's own line)."""
    inner = frames[0]["name"] if frames else "?"
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and "<" not in name:
            return f"{inner} <- {Path(name).name}:{f.get('line')} {f.get('name')}"
    return inner


def _predicted(row: dict) -> dict:
    """The estimate, with the requests of each of its replays under the driver's placement
    logged (the budget checks' and the other placements' aside: the same requests): "events"
    and "labels" the first's, "varied" the others' (the steps with random draws varied, where
    the model has LayerDrop)."""
    from memdoctor.cuda import allocator_model
    from memdoctor.predict.config import estimate_config
    from zoo_accuracy import ZOO_SCRIPT, _script_args
    from memdoctor.predict import replay as replay_module
    logs: dict[int, tuple[list, list]] = {}     # id of an allocator model -> (its requests, their labels)
    current: list = [None, None]        # the Run being replayed, and the block of the event now
    real_events = replay_module._events

    def events(run, *args, **kwargs):
        current[0] = run
        for item in real_events(run, *args, **kwargs):
            current[1] = item[3]
            yield item
    numbers: dict[int, int] = {}        # id of a live block -> its allocation number
    models: list = []
    real_malloc, real_free = allocator_model.CachingAllocatorModel.malloc, allocator_model.CachingAllocatorModel.free

    def malloc(self, nbytes):
        block = real_malloc(self, nbytes)
        if self.capacity is None and self.driver.first_chunk and block is not None:   # the estimate's driver rule
            models.append(self)                 # kept, so that no later model reuses its id
            log, labels = logs.setdefault(id(self), ([], []))
            numbers[id(block)] = len(labels)
            log.append([1, len(labels), int(nbytes)])
            blk = current[0].blocks.get(current[1]) if current[0] is not None else None
            labels.append(f"{blk.name} {blk.module} {blk.phase} {blk.shape} {blk.dtype}" if blk else "?")
        return block

    def free(self, block):
        if block is not None and id(self) in logs and id(block) in numbers:
            logs[id(self)][0].append([0, numbers.pop(id(block)), 0])
        return real_free(self, block)
    allocator_model.CachingAllocatorModel.malloc, allocator_model.CachingAllocatorModel.free = malloc, free
    replay_module._events = events
    try:
        est = estimate_config(script=str(ZOO_SCRIPT), script_args=_script_args(row), plan=row["plan"])
    finally:
        allocator_model.CachingAllocatorModel.malloc, allocator_model.CachingAllocatorModel.free = real_malloc, real_free
        replay_module._events = real_events
    runs = [{"events": log, "labels": labels} for log, labels in logs.values()]
    return {"allocated": est.peak_allocated_bytes, "reserved": est.peak_reserved_bytes, "events": runs[0]["events"],
            "labels": runs[0]["labels"], "varied": runs[1:], "notes": est.notes}


def first_difference(real: list, predicted: list) -> int | None:
    """Index of the first allocation whose size differs, counting allocations only."""
    a = [e[2] for e in real if e[0] == 1]
    b = [e[2] for e in predicted if e[0] == 1]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def child(cid: str, out: Path, seed: int = 0) -> dict:
    row = _row(cid)
    real = _real(row, seed)
    pred = _predicted(row)
    model = replay_trace(real["events"])
    at_gpu_addresses = replay_trace(real["events"], [addr for _, addr, _ in real["segment_addresses"]])
    out.mkdir(parents=True, exist_ok=True)
    (out / (cid.replace("/", "_") + (f"_seed{seed}" if seed else "") + ".json.gz")).write_bytes(
        gzip.compress(json.dumps({"id": cid, "seed": seed, "real": real, "predicted": pred}, separators=(",", ":")).encode()))
    return {"id": cid, "gpu": [real["max_allocated"], real["max_reserved"]],
            "model_on_gpu_requests": [model.peak_allocated, model.peak_reserved],
            "model_on_gpu_requests_and_addresses": [at_gpu_addresses.peak_allocated, at_gpu_addresses.peak_reserved],
            "estimate": [pred["allocated"], pred["reserved"]],
            "allocations": [sum(1 for e in real["events"] if e[0] == 1), sum(1 for e in pred["events"] if e[0] == 1)],
            "first_difference": first_difference(real["events"], pred["events"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ids", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0, help="the seed of the GPU's run (default 0)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("TRACE_RESULT " + json.dumps(child(args.ids[0], Path(args.out), args.seed)))
        return 0
    for cid in args.ids:
        proc = subprocess.run([sys.executable, __file__, "--child", "--out", args.out, "--seed", str(args.seed), cid],
                              capture_output=True,
                              text=True, timeout=300)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRACE_RESULT ")]
        print(lines[-1][13:] if lines else f"{cid}: failed: {proc.stderr.strip()[-3000:]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
