"""What the CUDA driver maps besides the caching allocator's segments while a zoo
configuration trains, and when: the device memory in use (cudaMemGetInfo) less what the
allocator reserved, read before and after every aten op of the steps, each op synchronised.

    python benchmarks/zoo/driver_maps.py --out DIR hubert/ckpt/b4 bert/fp32/b16     # on a GPU
    python benchmarks/zoo/driver_maps.py --out DIR --first-uses                     # single ops

For each zoo id, in a fresh process (a module is loaded once per process): the steps under
torch.cuda.memory._record_memory_history, and a dispatch mode that notes each op after which
the memory outside the allocator grew: the op, by how many bytes, and how many allocations
the allocator had made by then. Writes DIR/<id>.json.gz with those growths beside the
allocator's requests and the address of each segment (as benchmarks/zoo/zoo_traces.py), so
that a replay can put the driver's own mappings among the segments where they happened.
`--first-uses` runs single ops, each first in its own fresh process, and prints what each
maps: the size of a library's first mapping by the op that triggers it.
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

MiB = 1 << 20

FIRST_USES = {
    "empty": "torch.empty(1, device='cuda')",
    "add": "torch.ones(4, device='cuda') + 1",
    "mm_fp32": "torch.ones(512, 512, device='cuda') @ torch.ones(512, 512, device='cuda')",
    "mm_bf16": "torch.ones(512, 512, device='cuda', dtype=torch.bfloat16) @ torch.ones(512, 512, device='cuda', dtype=torch.bfloat16)",
    "addmm_fp32": "torch.nn.functional.linear(torch.ones(64, 512, device='cuda'), torch.ones(256, 512, device='cuda'), torch.ones(256, device='cuda'))",
    "bmm_fp32": "torch.ones(8, 64, 64, device='cuda') @ torch.ones(8, 64, 64, device='cuda')",
    "conv2d_fp32": "torch.nn.functional.conv2d(torch.ones(2, 16, 32, 32, device='cuda'), torch.ones(32, 16, 3, 3, device='cuda'))",
    "conv1d_fp32": "torch.nn.functional.conv1d(torch.ones(2, 1, 16000, device='cuda'), torch.ones(512, 1, 10, device='cuda'), stride=5)",
    "sdpa_bf16": "torch.nn.functional.scaled_dot_product_attention(*[torch.ones(2, 8, 128, 64, device='cuda', dtype=torch.bfloat16)] * 3)",
    "sdpa_fp32": "torch.nn.functional.scaled_dot_product_attention(*[torch.ones(2, 8, 128, 64, device='cuda')] * 3)",
    "layer_norm": "torch.nn.functional.layer_norm(torch.ones(64, 512, device='cuda'), [512])",
    "randn": "torch.randn(1024, device='cuda')",
    "lstm": "torch.nn.LSTM(64, 64).cuda()(torch.ones(10, 2, 64, device='cuda'))",
}


def _outside() -> int:
    """Device memory in use that the caching allocator did not reserve."""
    import torch
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def _allocations() -> int:
    import torch
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


class _Watch:
    """A dispatch mode that notes each op after which the memory outside the allocator grew."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        import torch
        growths = self.growths = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                torch.cuda.synchronize()
                before, count = _outside(), _allocations()
                out = func(*args, **(kwargs or {}))
                torch.cuda.synchronize()
                after = _outside()
                if after != before:
                    growths.append({"op": str(func), "bytes": after - before, "allocations_before": count,
                                    "allocations_after": _allocations()})
                return out
        self.mode = Mode()


def child(cid: str, out: Path, seed: int) -> dict:
    import torch

    from allocator_replay import compact
    from zoo_traces import _row, _segment_addresses, recorded_trace, train_steps
    row = _row(cid)
    torch.manual_seed(seed)
    torch.cuda.init()
    start = _outside()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=5_000_000)
    watch = _Watch()
    with watch.mode:
        kept = train_steps(row)         # freed after the trace, as in zoo_traces
    _snap, trace = recorded_trace()
    del kept
    real = {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
            "events": compact(trace), "segment_addresses": _segment_addresses(trace),
            "outside_at_start": start, "outside_growths": watch.growths}
    out.mkdir(parents=True, exist_ok=True)
    name = cid.replace("/", "_") + (f"_seed{seed}" if seed else "") + ".json.gz"
    (out / name).write_bytes(gzip.compress(json.dumps({"id": cid, "seed": seed, "real": real},
                                                      separators=(",", ":")).encode()))
    return {"id": cid, "seed": seed, "reserved": real["max_reserved"], "outside_at_start_mib": start / MiB,
            "growths": [(g["op"], round(g["bytes"] / MiB, 2), g["allocations_before"]) for g in watch.growths]}


def first_use(name: str) -> dict:
    """What one op maps the first time it runs in a process."""
    import torch
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    before = _outside()
    eval(FIRST_USES[name], {"torch": torch})
    torch.cuda.synchronize()
    first = _outside() - before
    eval(FIRST_USES[name], {"torch": torch})
    torch.cuda.synchronize()
    return {"op": name, "first_mib": first / MiB, "second_mib": (_outside() - before - first) / MiB}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ids", nargs="*")
    ap.add_argument("--out", default=".")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-uses", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--first-use", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first_use:
        print("MAPS_RESULT " + json.dumps(first_use(args.first_use)))
        return 0
    if args.child:
        print("MAPS_RESULT " + json.dumps(child(args.ids[0], Path(args.out), args.seed)))
        return 0
    jobs = [["--first-use", n] for n in FIRST_USES] if args.first_uses else []
    jobs += [["--child", "--out", args.out, "--seed", str(args.seed), cid] for cid in args.ids]
    for job in jobs:
        proc = subprocess.run([sys.executable, __file__, *job], capture_output=True, text=True, timeout=400)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MAPS_RESULT ")]
        print(lines[-1][12:] if lines else f"{job[-1]}: failed: {proc.stderr.strip()[-2000:]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
