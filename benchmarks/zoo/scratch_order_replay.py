"""What putting kernel scratch in the order the ops ran does to recorded estimates, without a
GPU: each trace's estimate requests (benchmarks/zoo/zoo_traces.py, "predicted") replayed
through the allocator model as recorded and with a layer norm's input copy moved after the
convolution workspaces that directly follow it (the previous op's scratch after its
outputs, which the GPU makes first: memdoctor.predict.kernel_watch.scratch_events).

    python benchmarks/zoo/scratch_order_replay.py benchmarks/results/zoo_traces_h200_2026-12-02/*.json.gz \\
        benchmarks/results/holdout_traces_h200_2026-12-03/*.json.gz

Writes scratch_order_replay_<hardware>_<date>.json: per trace, the GPU's reserved peak, the
recorded estimate's and the reordered one's, and how many copies moved.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402
from memdoctor.cuda.allocator_model import replay_trace  # noqa: E402

COPY = "layer norm: contiguous copy"
WORKSPACE = "cuDNN convolution workspace"
MiB = 2 ** 20


def reordered(events: list, labels: list[str]) -> tuple[list, int]:
    """The events with each layer-norm copy moved after the workspace events right after it."""
    out, moved, i = list(events), 0, 0
    while i < len(out):
        action, n, _ = out[i]
        j = i + 1
        if action == 1 and labels[n].startswith(COPY):
            while j < len(out) and labels[out[j][1]].startswith(WORKSPACE):
                j += 1
        if j > i + 1 and out[i + 1][0] == 1:
            out = out[:i] + out[i + 1:j] + [out[i]] + out[j:]
            moved += 1
            i = j
        else:
            i += 1
    return out, moved


def row(path: Path) -> dict | None:
    data = json.loads(gzip.decompress(path.read_bytes()))
    predicted = data.get("predicted", {})
    if "events" not in predicted:
        return None
    events, moved = reordered(predicted["events"], predicted["labels"])
    return {"trace": path.name, "gpu_reserved": data["real"]["max_reserved"],
            "estimate_reserved": replay_trace(predicted["events"]).peak_reserved,
            "reordered_reserved": replay_trace(events).peak_reserved, "copies_moved": moved}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", help="folder for the results file (default benchmarks/results)")
    args = ap.parse_args(argv)
    rows = [r for r in (row(Path(p)) for p in args.traces) if r is not None]
    for r in rows:
        print(f"{r['trace']:42s} GPU {r['gpu_reserved'] / MiB:8.0f} MiB  recorded estimate "
              f"{r['estimate_reserved'] / MiB:8.0f}  reordered {r['reordered_reserved'] / MiB:8.0f}  "
              f"({r['copies_moved']} moved)")
    print("written:", resultfile.save("scratch_order_replay", resultfile.hardware("cpu"), {"rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
