"""`memdoctor trace`: run a script under the tracer, show its memory at the peak, save the run."""
from __future__ import annotations

import contextlib
import os
import sys

from memdoctor.cli.common import (EXIT_OK, EXIT_OOM, EXIT_SCRIPT_FAILED, UsageError, add_script_args, check_script,
                                  script_argv)


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="run a script under the tracer and show its memory at the peak")
    add_script_args(p)
    p.add_argument("-o", "--output", metavar="RUN", help="where to save the run (default: STEM.memrun.json.gz)")
    p.set_defaults(execute=execute)


def execute(ns) -> int:
    check_script(ns.script)
    from memdoctor.attribution import at_peak
    from memdoctor.capture.ranks import path_for
    from memdoctor.report.json import dumps, trace_json
    result = traced(ns)
    run = result.run
    peak = at_peak(run)
    out = path_for(run, ns.output or os.path.splitext(os.path.basename(ns.script))[0] + ".memrun.json.gz")
    run.save(out)
    if ns.json:
        print(dumps(trace_json(run, peak)))
    else:
        from memdoctor.report.text import print_trace
        print_trace(run, peak)
        print(f"run saved to {out}")
    return exit_for(result)


def traced(ns):
    """Run ns.script under the tracer; its output goes to stderr under --json."""
    from memdoctor.capture.script import trace_script
    try:
        stream = sys.stderr if ns.json else sys.stdout
        with contextlib.redirect_stdout(stream):
            return trace_script(ns.script, script_argv(ns), budget=ns.budget, source=ns.source)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def exit_for(result) -> int:
    """A traced script's exit code: out of memory, failed for another reason, or ran."""
    if result.oom:
        return EXIT_OOM
    if result.exit_code not in (0, None):
        if result.error:
            print(f"memdoctor: the script failed: {result.error}", file=sys.stderr)
        return EXIT_SCRIPT_FAILED
    return EXIT_OK
