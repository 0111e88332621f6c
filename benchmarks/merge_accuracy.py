"""Merge estimate_accuracy.json results: configurations the first run did not measure (time
budget) are taken from the next run that did, marked in their status, and the summary is
computed again over the merged rows.

    python benchmarks/merge_accuracy.py FIRST.json SECOND.json [...] --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimate_accuracy import markdown, summarize  # noqa: E402


def measured(row: dict) -> bool:
    return row.get("measured_reserved_bytes") is not None and row.get("peak_reserved_bytes") is not None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--label", nargs="*", default=[], help="a name per run, for the status column")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    results = [json.loads(Path(p).read_text()) for p in args.runs]
    labels = args.label + [Path(p).parent.name for p in args.runs[len(args.label):]]
    merged = dict(results[0])
    rows = []
    for row in results[0]["configs"]:
        if not measured(row):
            for other, label in zip(results[1:], labels[1:]):
                alt = next((r for r in other["configs"] if r["id"] == row["id"] and measured(r)), None)
                if alt is not None:
                    row = dict(alt, status=f"from {label}")
                    break
        rows.append(row)
    merged["configs"] = rows
    merged["summary"] = summarize(rows)
    merged["merged_from"] = labels
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimate_accuracy.json").write_text(json.dumps(merged, indent=2, default=str))
    head, _, rest = markdown(merged).partition("\n")
    note = (f"\nMerged from {', '.join(labels)}: a configuration the first did not measure in its time "
            "budget is the next one's, named in the status column (`python benchmarks/merge_accuracy.py "
            + " ".join(args.runs) + "`).\n")
    (out / "estimate_accuracy.md").write_text(head + "\n" + note + rest)
    for name, s in merged["summary"].items():
        if s.get("count"):
            print(f"{name:<24} n={s['count']:<3} median |err| {s['median_abs_error_pct']:>6}%   worst "
                  f"{s['worst_error_pct']:+.2f}% ({s['worst_config']})   under-estimates {s['under_estimates']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
