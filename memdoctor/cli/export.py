"""`memdoctor export`: a saved run in another tool's format; today PyTorch's memory_viz."""
from __future__ import annotations

import os

from memdoctor.cli.common import EXIT_OK, UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a saved run in another tool's format (PyTorch's memory_viz)",
                       epilog="open the snapshot at pytorch.org/memory_viz, or with "
                              "`python -m torch.cuda._memory_viz trace_plot SNAPSHOT -o plot.html`")
    p.add_argument("run", metavar="RUN", help="a saved *.memrun.json.gz run")
    p.add_argument("--memory-viz", metavar="SNAPSHOT", required=True,
                   help="write a memory snapshot (a pickle, as torch.cuda.memory._dump_snapshot writes) here")
    p.set_defaults(execute=execute)


def execute(ns) -> int:
    from memdoctor.run import Run
    check_output(ns.memory_viz)
    run = Run.load(ns.run)
    write_snapshot(run, ns.memory_viz)
    print(f"memory_viz snapshot written to {ns.memory_viz}")
    return EXIT_OK


def check_output(path: str) -> None:
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder; give a file name for the snapshot")


def write_snapshot(run, path: str) -> None:
    from memdoctor.report.memory_viz import write_memory_viz
    write_memory_viz(run, path)
