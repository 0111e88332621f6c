"""The remedies' memory claim on the CPU: for each shared scenario whose fix memdoctor
builds, the measured peak as written (it runs out of its CPU budget), the measured peak
with the remedy, and the peak the finding predicted for that remedy.

The scenarios are the ones tests/test_remedy_memory.py re-states (the same models, data,
seeds and optimizers as the scripts in ../shared/scenarios); each runs twice under
memdoctor.watch(budget=<budget.cpu>). Peaks are memdoctor.attribution.peak of the watched
run: live tensor bytes under the dispatch tracer.

    python benchmarks/remedy_memory_cpu.py [-o benchmarks/results/remedy_memory_cpu.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", default=os.path.join(HERE, "results", "remedy_memory_cpu.json"))
    p.add_argument("--only", nargs="*", help="scenario file names (default: all)")
    ns = p.parse_args(argv)

    import torch
    from tests import test_remedy_memory as cases
    from memdoctor.units import format_bytes

    names = ns.only or list(cases.CASES)
    rows = []
    for name in names:
        start = time.perf_counter()
        m = cases.measure(name)
        row = {**dataclasses.asdict(m), "seconds": round(time.perf_counter() - start, 1)}
        rows.append(row)
        print(m.line(), flush=True)
    result = {
        "what": "peak live tensor bytes under memdoctor.watch(budget=<budget.cpu>), as written and with the "
                "remedy, next to the finding's predicted peak for that remedy",
        "notes": [
            "s02 runs 2 of the script's 3 steps and s05 1 of its 2 epochs: the later ones repeat the "
            "earlier ones' tensors (after the first optimizer step), so they reach the same peak",
            "s04: on the CPU emb.detach().cpu() is the same storage, so the kept copy goes to NumPy "
            "memory, which the simulated budget does not count, as a GPU's does not count host RAM",
            "before_peak_bytes is the peak up to the OOM: the failed request is not in it",
        ],
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "scenarios": rows,
        "summary": {r["scenario"]: {
            "budget": format_bytes(r["budget_bytes"]),
            "before": format_bytes(r["before_peak_bytes"]) + (" OOM" if r["before_oom"] else ""),
            "after": format_bytes(r["after_peak_bytes"]) + (" OOM" if r["after_oom"] else ""),
            "predicted": format_bytes(r["predicted_peak_bytes"]),
            "remedy": r["remedy"]} for r in rows},
    }
    os.makedirs(os.path.dirname(os.path.abspath(ns.output)), exist_ok=True)
    with open(ns.output, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    print(f"written to {ns.output}")
    return 0 if all(r["before_oom"] and not r["after_oom"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
