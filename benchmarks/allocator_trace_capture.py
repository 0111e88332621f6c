"""Capture, for a few estimate_accuracy configurations, what the real CUDA allocator did and
what the estimate predicted, op by op: the material for finding what the estimate misses
(kernel workspaces, extra small segments). Needs a GPU.

For each configuration it writes `<id>.json` (slashes as underscores) with
- `real_ops`: every aten op of the measured training step (forward, backward, optimizer), its
  argument shapes and dtypes and the range of allocator allocations it made;
- `real_trace`: the allocator's trace (`torch.cuda.memory._record_memory_history`): alloc, free,
  segment_alloc, segment_free with sizes, in order;
- `predicted`: the estimate's events (alloc/free, bytes, block name, category, phase).

    python benchmarks/allocator_trace_capture.py --out DIR resnet50/fp32/b64 vit-b16/bf16/b64
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from estimate_accuracy import MODELS, MODES, _reset_cuda  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from memdoctor.units import parse_size  # noqa: E402

def parse_id(cid: str) -> dict:
    """An estimate_accuracy configuration id ("model/mode/bBATCH") as that benchmark's job; the
    mode may also be any plan ("gpt2-1.5b/bf16,ckpt=full,opt=in-backward-8bit/b2")."""
    model, mode, b = cid.split("/")
    seq = next(seq for name, seq, _ in MODELS if name == model)
    plan = MODES[mode] if mode in MODES else mode
    return {"id": cid, "model": model, "mode": mode, "plan": plan, "batch": int(b[1:]), "seq": seq}


def _describe(args) -> list:
    out = []
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor):
            out.append([list(a.shape), str(a.dtype).replace("torch.", "")])
    return out


class OpLog(TorchDispatchMode):
    """Each op's name, arguments and the allocator's allocation count before and after it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n0 = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        out = func(*args, **(kwargs or {}))
        n1 = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        backward = torch._C._current_graph_task_id() != -1
        self.ops.append({"op": str(func), "args": _describe((args, kwargs)), "out": _describe(out),
                         "allocs": [n0, n1], "backward": backward})
        return out


def _frames(entry: dict) -> list[str]:
    """An allocation's innermost frames past the allocator's own (C++ and Python)."""
    names = [f.get("name", "") + (f":{f['line']}" if f.get("filename", "").endswith(".py") else "")
             for f in entry.get("frames") or ()]
    skip = ("unwind", "gather", "c10::", "Allocator", "at::detail::empty", "at::empty", "at::native::empty")
    return [n[:160] for n in names if n and not any(k in n for k in skip)][:8]


def measure(job: dict, oplog: bool = True, frames: bool = False) -> dict:
    from memdoctor.predict.estimate import train_step
    from memdoctor.predict.models import get
    from memdoctor.remedies import prepare
    from memdoctor.capture.budget import cap_cuda
    _reset_cuda()
    if job.get("cap"):
        cap_cuda(job["cap"])
    torch.cuda.reset_peak_memory_stats()
    build = get(job["model"]).builder(batch=job["batch"], seq=job["seq"])
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc" if frames else None,
                                             stacks="all" if frames else "python", max_entries=3_000_000)
    base = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    with torch.device("cuda"):
        model, optimizer, batch, loss_fn = build()
    prepared = None
    if job["plan"]:
        prepared = prepare(model, optimizer, job["plan"], device_type="cuda")
        optimizer = prepared.optimizer
    log = OpLog()
    oom = None
    try:
        with log if oplog else contextlib.nullcontext():
            for step in range(job.get("steps", 2)):
                train_step(model, optimizer, batch, loss_fn, prepared)
    except torch.OutOfMemoryError as exc:   # under --cap: the trace up to it, and the segments at it
        oom = {"step": step, "message": str(exc).splitlines()[0]}
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    if oom is not None:
        oom["segments"] = [{"address": seg["address"], "total_size": seg["total_size"],
                            "allocated_size": seg["allocated_size"], "pool": seg["segment_type"],
                            "blocks": [[b["size"], b["state"]] for b in seg["blocks"]]}
                           for seg in snap["segments"]]
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [{"action": e["action"], "addr": e["addr"], "size": e["size"], "stream": e.get("stream", 0),
              **({"frames": _frames(e)} if frames and e["action"] == "alloc" else {})}
             for e in snap["device_traces"][0]]
    result = {"base_alloc_count": base, "real_ops": log.ops, "real_trace": trace, "oom": oom,
              "max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
              "stats": {k: v for k, v in torch.cuda.memory_stats().items()
                        if k.startswith(("segment.", "allocation.", "num_"))}}
    del model, optimizer, batch, prepared, log
    return result


def predict(job: dict) -> dict:
    from memdoctor.predict.estimate import estimate
    from memdoctor.predict.models import get, make_optimizer
    spec = get(job["model"])
    est = estimate(lambda: spec.build_model(job["seq"]), lambda m: make_optimizer("adamw", m),
                   lambda: spec.make_batch(job["batch"], job["seq"]), spec.loss_fn,
                   plan=job["plan"], device="cuda", steps=job.get("steps", 2), budget=job.get("cap"),
                   settle=False)   # the steps the GPU ran, as it ran them
    run = est.run
    events = []
    for action, bid, nbytes in zip(run.actions, run.event_blocks, run.event_bytes):
        b = run.blocks[bid]
        events.append([int(action), bid, nbytes, b.name, b.category, b.phase, b.device])
    return {"peak_allocated": est.peak_allocated_bytes, "peak_reserved": est.peak_reserved_bytes,
            "allocator": est.allocator, "events": events}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ids", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plain", action="store_true",
                    help="no per-op log: a Python dispatch mode changes some allocations (pass 12)")
    ap.add_argument("--frames", action="store_true", help="each allocation's innermost C++ and Python frames")
    ap.add_argument("--seq", type=int, help="the sequence length (default: estimate_accuracy's for the model)")
    ap.add_argument("--steps", type=int, default=2, help="training steps measured and estimated (default 2)")
    ap.add_argument("--cap", help="cap the allocator at this size (as plan_apply's --budget) and record "
                                  "the trace up to an OOM, with the segments at it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for cid in args.ids:
        job = parse_id(cid)
        job.update(steps=args.steps, cap=parse_size(args.cap) if args.cap else None,
                   **({"seq": args.seq} if args.seq else {}))
        t0 = time.perf_counter()
        rec = {"job": job, "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
        run = lambda job: measure(job, oplog=not args.plain, frames=args.frames)  # noqa: E731
        for name, fn in (("measured", run), ("predicted", predict)):
            try:
                rec[name] = fn(job)
            except Exception as exc:
                rec[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            gc.collect()
            torch.cuda.empty_cache()
        (out / (cid.replace("/", "_") + ".json")).write_text(json.dumps(rec))
        m = rec["measured"]
        p = rec["predicted"]
        print(f"{cid}: measured {m.get('max_allocated')} / {m.get('max_reserved')}, predicted "
              f"{p.get('peak_allocated')} / {p.get('peak_reserved')}, {time.perf_counter() - t0:.1f} s",
              m.get("error", ""), p.get("error", ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
