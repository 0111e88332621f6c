"""Which layers LayerDrop skipped in each step of a seed's run on the GPU, its peaks, and the
estimate's peaks when its steps skip exactly those layers.

zoo_seeds.py shows a LayerDrop model's reserved peak differs from seed to seed. This asks
why: for each seed, one fresh process trains the configuration on the GPU (as
zoo_accuracy.py does) noting which encoder layers ran in each step, and another runs the
estimate with its steps' random branches taken as that seed's were (branch k of a step is
layer k's draw). Where the estimate with a seed's pattern reserves what that seed reserved,
the allocator model is right and what decides is which patterns the estimate tries.

    python benchmarks/zoo/layerdrop_patterns.py --seeds 12 --out DIR hubert/fp32/b4 wav2vec2/bf16/b4
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for path in (ROOT, ROOT / "benchmarks", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402
import zoo_accuracy  # noqa: E402
from zoo_seeds import child_result  # noqa: E402

TAG = "LAYERDROP "


def _layers(model):
    """The encoder's layer list: the ModuleList LayerDrop draws for."""
    for name, module in model.named_modules():
        if name.endswith("encoder.layers"):
            return module
    raise SystemExit("no encoder.layers in this model")


def measure(row: dict, seed: int) -> dict:
    """Train on the GPU with `seed`, noting the layers each step skipped."""
    import torch

    from memdoctor.predict.fake_step import train_step
    from memdoctor.remedies import prepare
    from zoo_models import build
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model, optimizer, batch, loss_fn = build(row["arch"], row["batch"], own_checkpointing=row["own_checkpointing"])
    prepared = None
    if row["plan"]:
        prepared = prepare(model, optimizer, row["plan"], device_type="cuda")
        optimizer = prepared.optimizer
    layers = _layers(model)
    ran: set[int] = set()
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: ran.add(i))
    skipped = []
    for _ in range(zoo_accuracy.STEPS):
        ran.clear()
        train_step(model, optimizer, batch, loss_fn, prepared)
        skipped.append(sorted(set(range(len(layers))) - ran))
    torch.cuda.synchronize()
    return {"skipped": skipped, "measured_reserved_bytes": torch.cuda.max_memory_reserved(),
            "measured_allocated_bytes": torch.cuda.max_memory_allocated()}


def estimate_with(row: dict, skipped: list[list[int]]) -> dict:
    """The default estimate with step i's branches taken otherwise where the seed skipped."""
    from memdoctor.predict import data_dependent
    from memdoctor.predict.config import estimate_config
    begin = data_dependent.DataDependent.begin_step

    def as_the_seed(self, flips=()):
        i = self.__dict__.setdefault("_pattern_step", 0)
        self._pattern_step = i + 1
        begin(self, frozenset(skipped[i]) if i < len(skipped) else frozenset())
    data_dependent.DataDependent.begin_step = as_the_seed
    est = estimate_config(script=str(zoo_accuracy.ZOO_SCRIPT), script_args=zoo_accuracy._script_args(row),
                          plan=row["plan"])
    return {"predicted_reserved_bytes": est.peak_reserved_bytes, "predicted_allocated_bytes": est.peak_allocated_bytes}


def _child(cmd_args: list[str]) -> dict:
    return child_result(str(Path(__file__).resolve()), cmd_args, TAG)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ids", nargs="*")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--estimate", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--skipped", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(TAG + json.dumps(measure(json.loads(args.measure), args.seed)), flush=True)
        return 0
    if args.estimate:
        print(TAG + json.dumps(estimate_with(json.loads(args.estimate), json.loads(args.skipped))), flush=True)
        return 0
    rows = {r["id"]: r for r in zoo_accuracy.configs(None, list(zoo_accuracy.MODES), "all")}
    jobs = [(i, s) for i in args.ids for s in range(args.seeds)]
    with cf.ThreadPoolExecutor(args.workers) as pool:
        measured = list(pool.map(lambda j: _child(["--measure", json.dumps(rows[j[0]]), "--seed", str(j[1])]), jobs))
        predicted = list(pool.map(lambda jm: _child(["--estimate", json.dumps(rows[jm[0][0]]), "--skipped",
                                                     json.dumps(jm[1].get("skipped", []))]), zip(jobs, measured)))
    out = []
    for (i, s), m, p in zip(jobs, measured, predicted):
        r = {"id": i, "seed": s, **m, **p}
        if m.get("measured_reserved_bytes") and p.get("predicted_reserved_bytes"):
            r["error_reserved_pct"] = round(100 * (p["predicted_reserved_bytes"] / m["measured_reserved_bytes"] - 1), 2)
        out.append(r)
        print(f"{i:<20} seed {s:>2}  skipped {m.get('skipped')}  measured {m.get('measured_reserved_bytes', 0) / 2**20:.0f}"
              f" MiB  estimate with this pattern {p.get('predicted_reserved_bytes', 0) / 2**20:.0f} MiB"
              f"  {r.get('error_reserved_pct')}%  {m.get('error') or p.get('error') or ''}", flush=True)
    path = resultfile.save("layerdrop_patterns", resultfile.hardware("cuda"), {"rows": out}, out=args.out)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
