"""Each convolution's scratch in a zoo model's real forward next to what the estimate's probe
(memdoctor/predict/op_probe.py) measures for the same shapes, on this machine's GPU.

    python benchmarks/zoo/conv_probe_check.py upernet/bf16/b8 [--out FILE]
    python benchmarks/zoo/conv_probe_check.py upernet/bf16/b8 --layouts FILE   # no GPU needed

In a fresh process: one real training step of the configuration, each convolution, forward
and backward, under the allocator's trace (its scratch: the allocations freed before it
returned), with its arguments (shapes, strides, dtypes). Then, in a second
fresh process, the probe on those arguments, as the estimate runs it; and in the first
process again, after the real step, the same probe (cuDNN's plan cache warm); and, in a third,
the configuration's estimate, with what its own probe measured for the same arguments. A row whose
sizes differ names a convolution where the estimate's workspace is not the GPU's.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ZOO_DIR = ROOT / "benchmarks" / "zoo"
for path in (ROOT, ROOT / "benchmarks", ZOO_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def _describe(args) -> list:
    import torch
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(["tensor", list(a.shape), list(a.stride()), str(a.dtype).replace("torch.", ""),
                        a.storage_offset(), a.data_ptr() % 4096])
        else:
            out.append(["value", list(a) if isinstance(a, (list, tuple)) else a])
    return out


def _probe(op: str, spec: list, grad: bool = False) -> list[int]:
    """The scratch of one call of aten.`op` on uninitialised tensors of `spec`, as the
    estimate's probe runs it (`grad`: with the tensors requiring grad, under grad mode)."""
    import torch

    from memdoctor.predict.op_probe import _materialize, recorded_trace, scratch_from_trace
    args = _materialize([tuple(s[:5]) if s[0] == "tensor" else tuple(s) for s in spec], torch.device("cuda"))
    if grad:
        args = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    func = getattr(torch.ops.aten, op).default

    def call():
        with torch.set_grad_enabled(grad):
            return func(*args)
    return [s.nbytes for s in scratch_from_trace(recorded_trace(call))]


def real_pass(cid: str) -> list[dict]:
    """The first step's convolutions, forward and backward, each under the allocator's trace:
    a dispatch mode sees each aten call (cuDNN picks its algorithm the same under it)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from memdoctor.predict.fake_step import train_step
    from memdoctor.predict.op_probe import PROBED_OPS, recorded_trace, scratch_from_trace
    from memdoctor.remedies import prepare
    from zoo_models import build
    from zoo_traces import _row
    row = _row(cid)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, optimizer, batch, loss_fn = build(row["arch"], row["batch"], own_checkpointing=row["own_checkpointing"])
    prepared = prepare(model, optimizer, row["plan"], device_type="cuda") if row["plan"] else None
    if prepared is not None:
        optimizer = prepared.optimizer
    rows: list[dict] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in PROBED_OPS:
                return func(*args, **(kwargs or {}))
            held = {}

            def call():
                held["out"] = func(*args, **(kwargs or {}))
                return held["out"]
            scratch = [s.nbytes for s in scratch_from_trace(recorded_trace(call))]
            rows.append({"op": func.__name__.split(".")[0], "spec": _describe(args), "real": scratch})
            return held["out"]

    with Watch():
        train_step(model, optimizer, batch, loss_fn, prepared)
    torch.cuda.synchronize()
    for r in rows:
        r["probe_same_process"] = _probe(r["op"], r["spec"])
    return rows


def estimate_pass(cid: str) -> list[dict]:
    """The estimate's own probe results (memdoctor.predict.op_probe.MEASURED) after the
    configuration's default estimate in this process: each distinct call's tensors and scratch."""
    from memdoctor.predict import op_probe
    from memdoctor.predict.config import estimate_config
    from zoo_accuracy import ZOO_SCRIPT, _script_args
    from zoo_traces import _row
    row = _row(cid)
    estimate_config(script=str(ZOO_SCRIPT), script_args=_script_args(row), plan=row["plan"])
    out = []
    for (_, key), scratch in op_probe.MEASURED.items():
        tensors = [[list(x[1]), list(x[2]), x[3]] for x in key[1] if x[0] == "tensor"]
        out.append({"tensors": tensors, "scratch": [s.nbytes for s in scratch]})
    return out


def estimate_layouts(cid: str, result: str) -> int:
    """Without a GPU: the convolutions the configuration's estimate would probe (shapes,
    strides, dtypes), against those of the real step in an earlier result of this script.
    A convolution of the real step missing here is one the fake step lays out otherwise."""
    from memdoctor.predict import estimate as estimate_module, op_probe
    from memdoctor.predict.config import estimate_config
    from zoo_accuracy import ZOO_SCRIPT, _script_args
    from zoo_traces import _row
    probed: set[str] = set()

    def measure(self, device="cuda"):
        probed.update(json.dumps([[list(x[1]), list(x[2]), x[3]] for x in key[1] if x[0] == "tensor"])
                      for key in self.keys)
        return {key: [] for key in self.keys}
    can_probe, real_measure = estimate_module._Target.can_probe, op_probe.ConvProbe.measure
    estimate_module._Target.can_probe = property(lambda self: True)
    op_probe.ConvProbe.measure = measure
    try:
        row = _row(cid)
        estimate_config(script=str(ZOO_SCRIPT), script_args=_script_args(row), plan=row["plan"])
    finally:
        estimate_module._Target.can_probe, op_probe.ConvProbe.measure = can_probe, real_measure
    rows = json.loads(Path(result).read_text())["rows"]
    real = {json.dumps([s[1:4] for s in r["spec"] if s[0] == "tensor"]) for r in rows}
    for missing in sorted(real - probed):
        print("laid out otherwise in the fake step:", missing)
    print(f"{cid}: {len(real)} distinct convolutions in the real step, {len(real & probed)} of them in the "
          f"estimate's, {len(probed - real)} of the estimate's not in the real step")
    return 0 if real == probed else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("id")
    ap.add_argument("--out")
    ap.add_argument("--layouts", metavar="RESULT", help="no GPU: compare the estimate's convolutions with a result's")
    ap.add_argument("--child", choices=["real", "probe", "estimate"], help=argparse.SUPPRESS)
    ap.add_argument("--spec-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.layouts:
        return estimate_layouts(args.id, args.layouts)
    if args.child == "real":
        print(json.dumps(real_pass(args.id)))
        return 0
    if args.child == "estimate":
        print(json.dumps(estimate_pass(args.id)))
        return 0
    if args.child == "probe":
        rows = json.loads(Path(args.spec_file).read_text())
        print(json.dumps([[_probe(r["op"], r["spec"]), _probe(r["op"], r["spec"], grad=True)] for r in rows]))
        return 0
    me = [sys.executable, str(Path(__file__).resolve())]
    real = subprocess.run(me + [args.id, "--child", "real"], capture_output=True, text=True)
    if real.returncode:
        sys.stderr.write(real.stderr[-4000:])
        return 1
    rows = json.loads(real.stdout.strip().splitlines()[-1])
    spec_file = Path(args.out or "conv_probe_check").with_suffix(".specs.json")
    spec_file.write_text(json.dumps(rows))
    probe = subprocess.run(me + [args.id, "--child", "probe", "--spec-file", str(spec_file)],
                           capture_output=True, text=True)
    if probe.returncode:
        sys.stderr.write(probe.stderr[-4000:])
        return 1
    fresh = json.loads(probe.stdout.strip().splitlines()[-1])
    est = subprocess.run(me + [args.id, "--child", "estimate"], capture_output=True, text=True)
    if est.returncode:
        sys.stderr.write(est.stderr[-4000:])
        return 1
    in_estimate = {json.dumps(r["tensors"]): r["scratch"] for r in json.loads(est.stdout.strip().splitlines()[-1])}
    mib = 1 << 20
    differ = 0
    for n, (r, (no_grad, grad)) in enumerate(zip(rows, fresh)):
        r["probe_fresh"], r["probe_fresh_grad"] = no_grad, grad
        r["estimate_probe"] = in_estimate.get(json.dumps([s[1:4] for s in r["spec"] if s[0] == "tensor"]))
        same = r["real"] == no_grad
        differ += not same
        if not same or r["real"] != r["probe_same_process"] or r["real"] != r["estimate_probe"]:
            sizes = {k: [round(s / mib, 3) for s in (r[k] or [])]
                     for k in ("real", "probe_fresh", "probe_fresh_grad", "probe_same_process", "estimate_probe")}
            print(n, r["op"], [s[1:4] + s[5:] for s in r["spec"][:3]], sizes)
    print(f"{args.id}: {len(rows)} convolutions, {differ} whose fresh probe differs from the real forward")
    if args.out:
        Path(args.out).write_text(json.dumps({"id": args.id, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
