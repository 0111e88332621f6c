"""Why a checkpointed chunked cross-entropy failed on CUDA under memdoctor.watch: the s06 loop
with its remedy, on the GPU, with the chunked loss written in several ways, each in a fresh
process, with the full traceback of any failure.

    python benchmarks/chunked_ce_cuda_probe.py      # -> $OUT/chunked_ce_cuda_probe.json

Variants: memdoctor's chunked_cross_entropy (an autograd Function); each chunk's loss under
torch.utils.checkpoint (non-reentrant), watched and unwatched, with the early stop off, and
reentrant. What the first run found (torch 2.11, H200; benchmarks/results/gpu/h200_pass5):
the non-reentrant checkpoint failed under watch in backward with "SystemError: ... returned
NULL without setting an exception" at the loss's last ops (cross_entropy, or logsumexp -
gather written out), ran unwatched, and ran reentrant. memdoctor's chunked loss is since an
autograd Function: no recompute, nothing raised through it. The last two variants tell
apart memdoctor's watch (its dispatch source) from torch's allocator history with Python
stacks, which the allocator source turns on, as the cause (pass 6 again: only the early-stop
variant under watch fails).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
VARIANTS = ("memdoctor-watched", "checkpoint-watched", "checkpoint-unwatched", "checkpoint-noearlystop-watched",
            "checkpoint-reentrant-watched",
            # which part of the watch: its dispatch source, or torch's own allocator history alone
            "checkpoint-dispatch-watched", "checkpoint-history-unwatched",
            # torch's history with Python stacks at allocations only (what the watch records since)
            "checkpoint-history-alloc-unwatched")


def checkpointed_chunked_ce(hidden, weight, targets, chunks=8, reentrant=False, early_stop=True):
    """Each chunk's projection and loss under torch.utils.checkpoint (the mean over tokens)."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    def chunk_loss(h, w, t):
        return F.cross_entropy(F.linear(h, w), t, reduction="sum")
    flat, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    size = -(-flat.shape[0] // chunks)
    total = 0
    for h, t in zip(flat.split(size), flat_t.split(size)):
        ctx = contextlib.nullcontext() if early_stop else set_checkpoint_early_stop(False)
        with ctx:
            total = total + checkpoint(chunk_loss, h, weight, t, use_reentrant=reentrant)
    return total / flat.shape[0]


def child(variant: str) -> dict:
    import torch

    import memdoctor
    from tests import test_remedy_memory as cases
    if variant.startswith("checkpoint"):
        cases.chunked_cross_entropy = lambda h, w, t, chunks=8: checkpointed_chunked_ce(
            h, w, t, chunks, reentrant="reentrant" in variant, early_stop="noearlystop" not in variant)
    cases.DEVICE = device = os.environ.get("PROBE_DEVICE", "cuda")    # cpu: a smoke test
    case = cases.CASES["s06_language_model_head.py"]
    model, optimizer = case.build()
    model.to(device)
    try:
        if variant.startswith("checkpoint-history") and device == "cuda":
            context = "alloc" if "-alloc-" in variant else "all"
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=context, stacks="python")
            try:
                case.loop(model, optimizer, True)
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        elif variant.endswith("unwatched"):
            case.loop(model, optimizer, True)
        elif variant.endswith("dispatch-watched"):
            with memdoctor.watch(model, optimizer, source="dispatch"):
                case.loop(model, optimizer, True)
        else:
            with memdoctor.watch(model, optimizer):
                case.loop(model, optimizer, True)
        cuda = device == "cuda"
        return {"variant": variant, "ok": True, "peak_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
                "peak_reserved": torch.cuda.max_memory_reserved() if cuda else 0}
    except BaseException as exc:
        return {"variant": variant, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500],
                "trace": traceback.format_exc()[-6000:]}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return 0
    rows = []
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--child", variant], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"variant": variant, "ok": False, "error": f"exit {proc.returncode}",
                                                     "trace": proc.stderr[-6000:]}
        rows.append(row)
        print(variant, "ok" if row["ok"] else row["error"][:200], flush=True)
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunked_ce_cuda_probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
