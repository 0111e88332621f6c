"""`memdoctor tui`: explore a saved run, or a script traced live, in the terminal."""
from __future__ import annotations

import os
import sys

from memdoctor.cli.common import UsageError, check_script, script_argv, size


def add_parser(sub) -> None:
    p = sub.add_parser("tui", help="explore a run in the terminal: overview, timeline, modules, findings, remedies",
                       epilog="with --script, arguments after -- are passed to the script")
    p.add_argument("run", nargs="?", metavar="RUN", help="a saved *.memrun.json.gz run")
    p.add_argument("--script", metavar="SCRIPT", help="trace this training script live, then show it")
    p.add_argument("--budget", type=size, metavar="SIZE", help="with --script: memory budget, e.g. 224MiB")
    p.add_argument("--source", choices=("auto", "dispatch", "allocator"), default="auto",
                   help="with --script: allocator (CUDA) or dispatch (any device); auto picks")
    p.add_argument("-o", "--output", metavar="RUN", help="with --script: also save the traced run here")
    p.set_defaults(execute=execute)


def execute(ns) -> int:
    if bool(ns.run) == bool(ns.script):
        raise UsageError("give a RUN file or --script SCRIPT, one of them")
    if not ns.script and (ns.budget or ns.output):
        raise UsageError("--budget and -o go with --script")
    if ns.script:
        check_script(ns.script)
    elif not os.path.isfile(ns.run):
        raise UsageError(f"no such run file: {ns.run}")
    if not sys.stdout.isatty():
        raise UsageError("the tui needs a terminal; `memdoctor diagnose --run RUN` prints the same diagnosis")
    try:
        import textual  # noqa: F401
    except ImportError:
        raise UsageError("the tui needs textual: pip install 'memdoctor[tui]'") from None
    from memdoctor.tui import run_app
    if ns.script:
        return run_app(script=ns.script, script_args=script_argv(ns), budget=ns.budget,
                       source=ns.source, output=ns.output)
    return run_app(ns.run)
