"""What memory-efficient attention's backward takes from the allocator and gives back inside
the call, for the ways models lay out q, k and v, with the C++ frames of each allocation:
the material for memdoctor.cuda.kernel_scratch's rule. Needs a GPU.

    python benchmarks/attention_scratch_probe.py      # -> $OUT/attention_scratch_probe.json

Layouts: q, k, v as views of one packed [B, M, 3, H, K] projection (GPT-2, ViT's in_proj),
three separate [B, M, H, K] tensors transposed (BERT, Llama), three contiguous [B, H, M, K]
tensors, and one [B, H, M, K] tensor passed as all three; the output gradient as the
forward's output is laid out, or contiguous [B, H, M, K].
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from memdoctor.predict.op_probe import recorded_trace  # noqa: E402

aten = torch.ops.aten
B, H, M, K = 8, 16, 1024, 64


def qkv(layout: str, dtype):
    if layout == "packed":
        x = torch.randn(B, M, 3, H, K, device="cuda", dtype=dtype)
        return [x[:, :, i].transpose(1, 2) for i in range(3)]
    if layout == "separate-bmhk":
        return [torch.randn(B, M, H, K, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3)]
    if layout == "separate-bhmk":
        return [torch.randn(B, H, M, K, device="cuda", dtype=dtype) for _ in range(3)]
    t = torch.randn(B, H, M, K, device="cuda", dtype=dtype)
    return [t, t, t]


def _frames(entry) -> list[str]:
    names = [f.get("name", "") for f in entry.get("frames") or []]
    keep = [n for n in names if "c10::" not in n and "Allocator" not in n and n]
    return keep[:10]


def scratch(func, *args) -> list[dict]:
    trace = recorded_trace(lambda: func(*args), frames=True)
    live, rows = {}, []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = {"bytes": e["size"], "freed": False, "frames": _frames(e)}
            rows.append(live[e["addr"]])
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            live.pop(e["addr"])["freed"] = True
    return rows


def main() -> int:
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("packed", "separate-bmhk", "separate-bhmk", "same"):
            for grad_layout in ("as-output", "bhmk"):
                q, k, v = qkv(layout, dtype)
                out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
                grad = torch.randn_like(out) if grad_layout == "as-output" else torch.randn(B, H, M, K, device="cuda",
                                                                                            dtype=dtype)
                rows = scratch(aten._scaled_dot_product_efficient_attention_backward.default, grad, q, k, v, None,
                               out, lse, seed, offset, 0.0, [True, True, True, False], False)
                rec = {"dtype": str(dtype), "layout": layout, "grad": grad_layout, "allocations": rows}
                results.append(rec)
                freed = [r["bytes"] for r in rows if r["freed"]]
                kept = [r["bytes"] for r in rows if not r["freed"]]
                print(f"{dtype} {layout:14} grad {grad_layout:9}: freed {freed} kept {kept}", flush=True)
                for r in rows:
                    print(f"    {r['bytes']:>10} {'freed' if r['freed'] else 'kept '} {' < '.join(r['frames'][:4])}")
                del q, k, v, out, lse, grad
    out_dir = Path(os.environ.get("OUT") or "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention_scratch_probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
