"""The held-out packed LSTM's estimate on a CPU standing in for CUDA, given the cuDNN sizes
the H200 measured, against the H200's own peaks: what the estimate's fake step makes of a
packed, bidirectional LSTM with dropout (packing, the packed call's outputs, the dropout
states, the weight buffer made anew at .to(), the backward of pack_padded_sequence's
index_select) when only cuDNN's choices come from the GPU.

    python benchmarks/zoo/rnn_sizes_replay.py

cuDNN's sizes for each configuration's RNN call, and its peaks, are read from the H200's
traces (benchmarks/results/holdout_traces_h200_2026-12-03/, recorded by
benchmarks/zoo/zoo_traces.py): the first forward call's allocations, in order, are the
dropout states, the output, h_n, c_n, the workspace and the reserve; the backward's
workspaces are the forward's size on an H200 (both measured). The estimate then runs with
those sizes where a GPU would measure them (memdoctor.predict.fused_rnn.measure).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "benchmarks", ROOT / "benchmarks" / "zoo"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402

TRACES = ROOT / "benchmarks" / "results" / "holdout_traces_h200_2026-12-03"
IDS = ("packed-lstm/fp32/b32", "packed-lstm/ckpt/b64")
RNN_CALL = "forward <- holdout_models.py:183 _recurrent"


def recorded(cid: str) -> dict:
    """The H200's peaks and cuDNN's sizes for `cid`'s RNN call, from its trace."""
    data = json.loads(gzip.decompress((TRACES / (cid.replace("/", "_") + ".json.gz")).read_bytes()))
    real = data["real"]
    sizes = [size for action, n, size in real["events"] if action == 1 and real["labels"][n] == RNN_CALL]
    # the call's allocations: h_0 and c_0 (zeros), the dropout seed, the states, the output,
    # h_n, c_n, the workspace, the reserve
    states, workspace, reserve = sizes[3], sizes[7], sizes[8]
    return {"allocated": real["max_allocated"], "reserved": real["max_reserved"],
            "sizes": {"reserve": reserve, "workspace": workspace, "dropout_state": states}}


def estimate_with(cid: str, sizes: dict) -> dict:
    import torch

    from memdoctor.predict import fused_rnn
    from memdoctor.predict.config import estimate_config
    from zoo_accuracy import ZOO_SCRIPT, _script_args
    from zoo_traces import _row
    measured = fused_rnn.RnnSizes(sizes["reserve"], sizes["workspace"], sizes["workspace"], sizes["workspace"],
                                  measured=True, dropout_state=sizes["dropout_state"])
    shapes = []

    def measure(shape, device="cuda"):
        shapes.append(shape)
        return measured
    init = fused_rnn._Sizes.__init__
    saved = fused_rnn.measure, torch.cuda.get_device_name
    fused_rnn.measure = measure
    fused_rnn._Sizes.__init__ = lambda self, probe: init(self, True)
    torch.cuda.get_device_name = lambda *a: "NVIDIA H200 (its recorded cuDNN sizes)"
    try:
        row = _row(cid)
        est = estimate_config(script=str(ZOO_SCRIPT), script_args=_script_args(row), plan=row["plan"])
    finally:
        fused_rnn.measure, torch.cuda.get_device_name = saved
        fused_rnn._Sizes.__init__ = init
    shape = shapes[0]
    return {"allocated": est.peak_allocated_bytes, "reserved": est.peak_reserved_bytes,
            "tokens": sum(shape.batch_sizes), "dropout": shape.dropout}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the result (default benchmarks/results)")
    args = ap.parse_args(argv)
    rows = []
    for cid in IDS:
        gpu = recorded(cid)
        est = estimate_with(cid, gpu["sizes"])
        row = {"id": cid, "gpu_allocated": gpu["allocated"], "gpu_reserved": gpu["reserved"],
               "cudnn_sizes": gpu["sizes"], **{f"estimate_{k}": v for k, v in est.items()},
               "error_allocated_pct": round(100 * (est["allocated"] - gpu["allocated"]) / gpu["allocated"], 2),
               "error_reserved_pct": round(100 * (est["reserved"] - gpu["reserved"]) / gpu["reserved"], 2)}
        rows.append(row)
        print(f"{cid:22} allocated {row['error_allocated_pct']:+.2f}%  reserved {row['error_reserved_pct']:+.2f}%  "
              f"(H200 {gpu['reserved'] / 2**20:.0f} MiB, estimate {est['reserved'] / 2**20:.0f} MiB)")
    print("written:", resultfile.save("rnn_sizes_replay", resultfile.hardware("cpu"), {"rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
