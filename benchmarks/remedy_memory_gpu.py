"""The remedies' memory claim on the GPU: each scenario tests/test_remedy_memory.py re-states,
as written and with its remedy, under memdoctor.watch with the caching allocator capped at
the scenario's `budget.cuda`; and the remedied run once more without a cap, for its natural
peak. Each run is a fresh process (a cap and cached blocks must not carry over).

    python benchmarks/remedy_memory_gpu.py [--only s05_validation_pass.py ...]

Prints a table and writes $OUT/remedy_memory_gpu.json (default ./out).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
MiB = 2 ** 20


def child(name: str, fixed: bool, capped: bool) -> dict:
    """One run of the case's loop on the GPU; what it used and how it ended."""
    import torch

    import memdoctor
    from memdoctor.units import parse_size
    from tests import test_remedy_memory as cases
    case = cases.CASES[name]
    budget = parse_size(cases.expected(name)["budget"]["cuda"])
    out = {"scenario": name, "fixed": fixed, "capped": capped, "budget": budget, "oom": False}
    cases.DEVICE = "cuda"
    model, optimizer = case.build()
    model.to("cuda")            # in place: the optimizer (no state yet) keeps the same parameters
    try:
        with memdoctor.watch(model, optimizer, budget=budget if capped else None) as doc:
            case.loop(model, optimizer, fixed)
    except torch.OutOfMemoryError as exc:
        out.update(oom=True, error=str(exc).splitlines()[0][:300])
    torch.cuda.synchronize()
    out.update(source=doc.run.source if doc.run else None,
               first_rule=doc.findings[0].rule if doc.findings else None,
               peak_allocated=torch.cuda.max_memory_allocated(),
               peak_reserved=torch.cuda.max_memory_reserved())
    return out


def run_child(name: str, fixed: bool, capped: bool = True) -> dict:
    cmd = [sys.executable, __file__, "--child", name, str(int(fixed)), str(int(capped))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"scenario": name, "fixed": fixed, "capped": capped, "failed": True,
                "error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out", default=os.environ.get("OUT") or "out")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        name, fixed, capped = args.child
        print(json.dumps(child(name, fixed == "1", capped == "1")))
        return 0
    from tests.test_remedy_memory import CASES
    rows = []
    for name in args.only or list(CASES):
        for fixed, capped in ((False, True), (True, True), (True, False)):
            r = run_child(name, fixed, capped)
            rows.append(r)
            peak = (f"alloc {r['peak_allocated'] / MiB:7.1f} reserved {r['peak_reserved'] / MiB:7.1f} MiB"
                    if "peak_allocated" in r else "")
            print(f"{name:34} {'remedy' if fixed else 'as is ':6} {'cap' if capped else 'no cap':6} "
                  f"budget {r.get('budget', 0) / MiB:5.0f} MiB  {peak}  "
                  f"{'OOM' if r.get('oom') else ('FAILED' if r.get('failed') else 'ok')}  {r.get('error', '')[:160]}",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "remedy_memory_gpu.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
