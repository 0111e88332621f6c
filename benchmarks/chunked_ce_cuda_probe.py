"""Why s06's chunked cross-entropy fails on CUDA (SystemError from cross_entropy_loss during
the checkpoint's recompute in backward): the s06 loop with the remedy, on the GPU, in
variants, each in a fresh process, with the full traceback of any failure.

    python benchmarks/chunked_ce_cuda_probe.py      # -> $OUT/chunked_ce_cuda_probe.json

Variants: as memdoctor has it (no early stop), under memdoctor.watch (allocator source) and
without it; with the checkpoint's early stop on; with a reentrant checkpoint; with the loss
written as logsumexp - gather. Found with early stop on (first pass of this probe): failed
under watch whatever the loss's ops (cross_entropy, or logsumexp - gather: the SystemError
came from the op during which the recompute was stopped), ran unwatched and reentrant.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
VARIANTS = ("as-is-watched", "earlystop-watched", "as-is-unwatched", "reentrant-watched")


def child(variant: str) -> dict:
    import torch
    import torch.nn.functional as F

    import memdoctor
    import memdoctor.remedies.chunked_ce as cce
    from tests import test_remedy_memory as cases
    if variant.startswith("reentrant"):
        real = cce.checkpoint
        cce.checkpoint = lambda fn, *a, use_reentrant=False, **k: real(fn, *a, use_reentrant=True, **k)
    if variant.startswith("earlystop"):      # the early stop memdoctor turns off, back on
        import contextlib
        cce.set_checkpoint_early_stop = lambda enable: contextlib.nullcontext()
    if variant.startswith("logsumexp"):
        def loss(hidden, weight, bias, targets, ignore_index):
            logits = F.linear(hidden, weight, bias).float()
            keep = targets != ignore_index
            picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            return ((torch.logsumexp(logits, dim=-1) - picked) * keep).sum()
        cce._chunk_loss = loss
    cases.DEVICE = device = os.environ.get("PROBE_DEVICE", "cuda")    # cpu: a smoke test
    case = cases.CASES["s06_language_model_head.py"]
    model, optimizer = case.build()
    model.to(device)
    try:
        if variant.endswith("unwatched"):
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
