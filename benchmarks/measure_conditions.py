"""Does recording the allocator change what it reserves? The same estimate_accuracy
configuration measured in fresh processes, plainly (twice: is a plain run repeatable?), under
torch's allocator history as allocator_trace_capture.py records it, under memdoctor's watch
setting (stacks at allocations only), and under that script's per-op log. Needs a GPU.

    python benchmarks/measure_conditions.py gpt2-774m/ckpt/b4 vit-b16/bf16/b256
                                                   # -> $OUT/measure_conditions.json
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

CONDITIONS = ("plain", "plain-again", "history", "history-alloc", "oplog")


@contextlib.contextmanager
def condition(name: str):
    import torch
    if name.startswith("history"):
        context = "alloc" if name == "history-alloc" else "all"
        torch.cuda.memory._record_memory_history(enabled="all", context=context, stacks="python",
                                                 max_entries=3_000_000)
        try:
            yield
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    elif name == "oplog":
        from allocator_trace_capture import OpLog
        with OpLog():
            yield
    else:
        yield


def child(cid: str, name: str) -> dict:
    from allocator_trace_capture import parse_id
    from estimate_accuracy import measure
    job = dict(parse_id(cid), gpu=None)
    with condition(name):
        got = measure(job)
    return {"id": cid, "condition": name, **{k: got.get(k) for k in
            ("ok", "peak_allocated_bytes", "peak_reserved_bytes", "segments_peak", "error")}}


def main() -> int:
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return 0
    rows = []
    for cid in sys.argv[1:]:
        for name in CONDITIONS:
            proc = subprocess.run([sys.executable, __file__, "--child", cid, name], cwd=ROOT, capture_output=True,
                                  text=True, timeout=300)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"id": cid, "condition": name, "ok": False,
                                                       "error": proc.stderr[-2000:]}
            rows.append(row)
            print(f"{cid:<22} {name:<14} allocated {row.get('peak_allocated_bytes')} reserved "
                  f"{row.get('peak_reserved_bytes')} segments {row.get('segments_peak')} {row.get('error') or ''}",
                  flush=True)
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("CONDITIONS_TAG", "")
    (out / f"measure_conditions{tag}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
