"""Predictions made elsewhere (a `--dry-run` of estimate_accuracy.py, e.g. on a machine
without a GPU) against the peaks a GPU pass measured, configuration by configuration: what a
change to the estimate does to the table before the next GPU pass, where the predictions do
not depend on the GPU (a CPU-only torch runs CUDA's fp32 kernels' memory the same, but not
bf16 autocast, CUDA attention kernels or cuDNN's workspaces).

    python benchmarks/predictions_vs_measured.py MEASURED.json NEW.json [--before OLD.json] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MiB = 1024 ** 2


def _configs(path: str) -> dict:
    return {r["id"]: r for r in json.loads(Path(path).read_text())["configs"]}


def _cell(pred: dict | None, meas: int, key: str) -> str:
    if pred is None or pred.get(key) is None:
        return "-"
    diff = pred[key] - meas
    return f"{100 * diff / meas:+.3f}% ({diff / MiB:+.0f} MiB)"


def table(measured: dict, new: dict, before: dict | None) -> list[str]:
    cols = ["config", "measured reserved (GiB)"]
    if before is not None:
        cols += ["before: allocated", "before: reserved"]
    cols += ["now: allocated", "now: reserved"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for cid, p in new.items():
        m = measured.get(cid)
        if m is None or m.get("measured_reserved_bytes") is None:
            continue
        if p.get("peak_reserved_bytes") is None:
            lines.append(f"| {cid} | - | {p.get('status') or 'not predicted'} |")
            continue
        ma, mr = m["measured_allocated_bytes"], m["measured_reserved_bytes"]
        row = [cid, f"{mr / 1024 ** 3:.2f}"]
        if before is not None:
            row += [_cell(before.get(cid), ma, "peak_allocated_bytes"), _cell(before.get(cid), mr, "peak_reserved_bytes")]
        row += [_cell(p, ma, "peak_allocated_bytes"), _cell(p, mr, "peak_reserved_bytes")]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", help="estimate_accuracy.json of a GPU pass")
    ap.add_argument("new", help="estimate_accuracy.json of a --dry-run with the estimate as it is now")
    ap.add_argument("--before", help="the same --dry-run with the estimate before the change")
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args(argv)
    try:
        measured, new = _configs(args.measured), _configs(args.new)
        before = _configs(args.before) if args.before else None
    except (OSError, ValueError, KeyError) as exc:
        print(f"predictions_vs_measured: {exc}", file=sys.stderr)
        return 2
    text = "\n".join(table(measured, new, before)) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
