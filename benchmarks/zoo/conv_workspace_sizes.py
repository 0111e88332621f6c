"""Every distinct convolution of zoo configurations with the cuDNN workspaces this machine's
GPU gives it, as the estimate's probe measures them (memdoctor/predict/op_probe.py).

A CPU-only estimate has no GPU to ask. This collects, per call, forward or backward, its
tensors (shapes, strides, dtype), its other arguments and the scratch the GPU took, to see
whether a rule of the shapes could stand in. On the H200 (conv_workspace_sizes_h200_2026-12-04_c8a17dc.json,
2,168 distinct calls, 29 architectures surveyed) the workspaces run from none to 1.3 GiB. One bound
is above all of them: 6 bytes per input and output element, 256 per weight element and 1 MiB,
plus 48 per element for grouped convolutions; the twenty largest take 4-71% of theirs
(`--check-bound`). Put in each call's place in CPU estimates of 72 zoo configurations (at
39bf8e6, the command in the result) the allocated peak was -0.3% to +105%, but the reserved peak was still under on 16 of them (down to -28%) and
over by up to 221%: the cache splits otherwise with other sizes
(zoo_cpu_conv_bound_trial_cpu2_2026-12-04_39bf8e6.json, against the same configurations'
estimates without it in zoo_cpu_estimates_transformers525_cpu2_2026-12-03_91a8d97.json). So
the estimate keeps the workspaces out without a GPU, and says so.

    python benchmarks/zoo/conv_workspace_sizes.py [--workers 6] [--out DIR] ID [ID ...]
    python benchmarks/zoo/conv_workspace_sizes.py --check-bound RESULT    # the bound above, no GPU

Each ID (ARCH/MODE/bBATCH) is estimated in a fresh process on an otherwise idle GPU (cuDNN
takes smaller workspaces when memory is short). Writes conv_workspace_sizes_<hardware>_<date>.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ZOO_DIR = ROOT / "benchmarks" / "zoo"
for path in (ROOT, ROOT / "benchmarks", ZOO_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def estimate_probes(cid: str) -> list[dict]:
    """The estimate's probe results after the configuration's default estimate in this process."""
    from memdoctor.predict import op_probe
    from memdoctor.predict.config import estimate_config
    from zoo_accuracy import ZOO_SCRIPT, _script_args
    from zoo_traces import _row
    row = _row(cid)
    estimate_config(script=str(ZOO_SCRIPT), script_args=_script_args(row), plan=row["plan"])
    out = []
    for (_, key), scratch in op_probe.MEASURED.items():
        leaves = key[1]
        out.append({"tensors": [[list(x[1]), list(x[2]), x[3]] for x in leaves if x[0] == "tensor"],
                    "values": [x[1] for x in leaves if x[0] == "value"],
                    # convolution_backward's output_mask adds three bools to `transposed`
                    "backward": sum(1 for x in leaves if x[0] == "value" and isinstance(x[1], bool)) > 1,
                    "scratch": [s.nbytes for s in scratch]})
    return out


def bound_bytes(x: int, out: int, w: int, groups: int) -> int:
    """The rule above, for a call's input, output and weight element counts."""
    return 6 * (x + out) + 256 * w + (1 << 20) + (48 * max(x, out) if groups > 1 else 0)


def check_bound(path: str) -> int:
    """Each distinct call of a result against bound_bytes: how many, of how many
    architectures, the highest share of its bound, and how loose it is on the largest."""
    import math
    results = json.loads(Path(path).read_text())["results"]
    calls = {json.dumps([c["tensors"], c["values"]]): (r["id"], c) for r in results for c in r.get("convolutions", [])}
    outputs = {(tuple(c["tensors"][1][0]), c["tensors"][1][2], tuple(c["tensors"][2][0])): c["tensors"][0][0]
               for _, c in calls.values() if c["backward"]}         # a forward's output: its backward's grad_output
    rows = []
    for cid, c in calls.values():
        x, w = c["tensors"][1:3] if c["backward"] else c["tensors"][:2]
        out = outputs.get((tuple(x[0]), x[2], tuple(w[0])))
        if out is not None:
            groups = c["values"][-4 if c["backward"] else -1]       # before output_mask's three bools
            bound = bound_bytes(math.prod(x[0]), math.prod(out), math.prod(w[0]), groups)
            rows.append((max(c["scratch"], default=0) / bound, max(c["scratch"], default=0), cid))
    largest = sorted(rows, key=lambda r: -r[1])[:20]
    print(f"{len(rows)} distinct calls of {len({r[2].split('/')[0] for r in rows})} architectures, workspaces "
          f"{min(r[1] for r in rows) / 2**30:.2f}-{max(r[1] for r in rows) / 2**30:.2f} GiB; over the bound: "
          f"{sum(r[0] > 1 for r in rows)}; highest share of it {max(r[0] for r in rows):.2f}; the 20 largest "
          f"take {min(r[0] for r in largest):.2f}-{max(r[0] for r in largest):.2f} of theirs")
    return 0


def _child(cid: str) -> dict:
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", cid],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"id": cid, "error": ["timed out after 300 s"]}
    if proc.returncode:
        return {"id": cid, "error": proc.stderr.strip().splitlines()[-1:] or ["exit %d" % proc.returncode]}
    return {"id": cid, "convolutions": json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ids", nargs="*")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out")
    ap.add_argument("--check-bound", metavar="RESULT", help="the bound against a result's workspaces")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.check_bound:
        return check_bound(args.check_bound)
    if args.child:
        print(json.dumps(estimate_probes(args.child)))
        return 0
    import resultfile
    hw = resultfile.hardware("cuda")
    results = []

    def save():
        return resultfile.save("conv_workspace_sizes", hw, {"results": results}, out=args.out)
    with cf.ThreadPoolExecutor(args.workers) as pool:
        for r in pool.map(_child, args.ids):        # saved as each comes, so a cut-short run keeps its rows
            results.append(r)
            convs = r.get("convolutions") or []
            print(r["id"], r.get("error") or f"{len(convs)} distinct convolutions, largest workspace "
                  f"{max((max(c['scratch'], default=0) for c in convs), default=0) / 2**20:.2f} MiB", flush=True)
            save()
    print("written:", save())
    return 0


if __name__ == "__main__":
    sys.exit(main())
