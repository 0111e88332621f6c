"""Where the estimate on a CPU-only torch (fake CPU tensors standing in for CUDA) parts from
the estimate a GPU made of the same configuration: both estimates' labelled allocation
requests (op, module, phase, shape, dtype, bytes), aligned op by op.

    python benchmarks/zoo/standin_diff.py TRACE.json.gz [--out DIFF.txt]

TRACE is a file benchmarks/zoo/zoo_traces.py wrote on the GPU (its "predicted" requests are
the GPU's estimate). Every hunk is an op the CPU stand-in runs otherwise than CUDA (another
kernel, another dtype under autocast, another order of casts), or a change to the estimate
made after the trace. Prints both estimates' peaks, the GPU's measured ones, and the hunks
(all of them with --out).
"""
from __future__ import annotations

import argparse
import difflib
import gzip
import json
import sys
from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(ZOO_DIR))

from zoo_traces import _predicted, _row  # noqa: E402

MiB = 1 << 20


def labelled(requests: dict) -> list[str]:
    """Each allocation's label and size, in order."""
    sizes = [e[2] for e in requests["events"] if e[0] == 1]
    return [f"{label} |{size}" for label, size in zip(requests["labels"], sizes)]


def hunks(gpu: list[str], cpu: list[str]) -> list[str]:
    """The differing stretches, each with its indices in both sequences."""
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, gpu, cpu, autojunk=False).get_opcodes():
        if tag != "equal":
            out.append(f"== {tag} gpu[{i1}:{i2}] cpu[{j1}:{j2}]\n"
                       + "".join(f"  gpu {x}\n" for x in gpu[i1:i2]) + "".join(f"  cpu {x}\n" for x in cpu[j1:j2]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    try:
        trace = json.loads(gzip.decompress(Path(args.trace).read_bytes()))
    except (OSError, ValueError) as exc:
        print(f"cannot read {args.trace}: {exc}", file=sys.stderr)
        return 2
    gpu = trace["predicted"]
    cpu = _predicted(_row(trace["id"]))
    real = trace["real"]
    for name, a, r in (("cpu estimate", cpu["allocated"], cpu["reserved"]),
                       ("gpu estimate", gpu["allocated"], gpu["reserved"]),
                       ("gpu measured", real["max_allocated"], real["max_reserved"])):
        print(f"{trace['id']} {name}: allocated {a / MiB:.0f} MiB, reserved {r / MiB:.0f} MiB")
    found = hunks(labelled(gpu), labelled(cpu))
    print(f"{len(found)} differing stretches")
    if args.out:
        Path(args.out).write_text("".join(found))
    else:
        print("".join(found[:20]), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
