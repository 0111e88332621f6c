"""`memdoctor trace`: run a script under the tracer, show its memory at the peak, save the run."""
from __future__ import annotations

import contextlib
import os
import sys

from memdoctor.cli.common import (EXIT_OK, EXIT_OOM, EXIT_SCRIPT_FAILED, UsageError, add_script_args, check_script,
                                  script_argv)
from memdoctor.cli.export import check_output, write_snapshot
from memdoctor.cli.launcher import done, launched, release_peers, speaks, wait_for_rank0
from memdoctor.cli.progress import working
from memdoctor.collector import paused_gc


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="run a script under the tracer and show its memory at the peak")
    add_script_args(p)
    p.add_argument("-o", "--output", metavar="RUN", help="where to save the run (default: STEM.memrun.json.gz)")
    p.add_argument("--memory-viz", metavar="SNAPSHOT", help="also write the run as a snapshot PyTorch's memory_viz opens")
    p.set_defaults(execute=execute)


def execute(ns) -> int:
    check_script(ns.script)
    if ns.memory_viz:
        check_output(ns.memory_viz)
    result = traced(ns)
    with paused_gc():       # only memdoctor's own objects are made from here on
        code = show_and_save(ns, result)
        # freed here by its reference counts: the collector's first collection once it is
        # back on would otherwise walk every object of the run
        del result
    return code


def show_and_save(ns, result) -> int:
    """Save the traced run and print its memory at the peak; the exit code."""
    from memdoctor.attribution import at_peak
    from memdoctor.capture.ranks import path_for
    from memdoctor.report.json import dumps, trace_json
    run = result.run
    peak = at_peak(run)
    base = ns.output or default_run_path(ns.script)
    out = path_for(run, base)
    run.save(out)
    if ns.memory_viz:
        write_snapshot(run, path_for(run, ns.memory_viz))
    if not speaks(run):
        if run.ooms:                      # the others may wait in a collective this rank left:
            release_peers()               # leave now, with 0, and let rank 0 run on to print
            return 0
        wait_for_rank0(base)              # rank 0 prints; a launcher stops all ranks when one fails
        return exit_for(result)
    try:
        if ns.json:
            print(dumps(trace_json(run, peak)))
        else:
            from memdoctor.report.text import print_trace
            print_trace(run, peak)
            print(f"run saved to {out}")
    finally:
        if launched(run):
            done(base)
    return exit_for(result)


def default_run_path(script: str) -> str:
    """Where a traced script's run goes when no -o says: STEM.memrun.json.gz here."""
    return os.path.splitext(os.path.basename(script))[0] + ".memrun.json.gz"


def traced(ns):
    """Run ns.script under the tracer; its output goes to stderr under --json."""
    from memdoctor.capture.script import trace_script
    try:
        stream = sys.stderr if ns.json else sys.stdout
        with working(ns, f"tracing {ns.script}"), contextlib.redirect_stdout(stream):
            return trace_script(ns.script, script_argv(ns), budget=ns.budget, source=ns.source,
                                mode="light" if getattr(ns, "light", False) else "full")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def exit_for(result) -> int:
    """A traced script's exit code: out of memory (an OOM the script caught and ran on
    after, skipping a batch, counts), failed for another reason, or ran."""
    if result.oom or getattr(result.run, "ooms", None):
        return EXIT_OOM
    if result.exit_code not in (0, None):
        if result.error:
            print(f"memdoctor: the script failed: {result.error}", file=sys.stderr)
        return EXIT_SCRIPT_FAILED
    return EXIT_OK
