"""`memdoctor` command line. Imports torch only inside the commands that need it, so
`memdoctor --help` stays instant.

Exit codes: 0 ran and fit; 1 the script failed for a reason other than memory;
2 bad input or usage; 3 out of memory (diagnosed); 4 memdoctor's own failure.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

EXIT_OK, EXIT_SCRIPT_FAILED, EXIT_USAGE, EXIT_OOM, EXIT_INTERNAL = 0, 1, 2, 3, 4


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit 2."""


def _size(text: str) -> int:
    from .units import SizeError, parse_size
    try:
        return parse_size(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memdoctor",
        description="Find out why PyTorch training runs out of GPU memory, and fix it.",
        epilog="exit codes: 0 fit, 1 script failed, 2 bad input, 3 out of memory, 4 internal error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("trace", help="run a script under the tracer and show its memory at the peak")
    _script_args(p)
    p.add_argument("-o", "--output", metavar="RUN", help="where to save the run (default: STEM.memrun.json.gz)")
    return parser


def _script_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", help="the training script, run as `python SCRIPT ARGS`")
    p.add_argument("--budget", type=_size, metavar="SIZE", help="memory budget, e.g. 16GiB or 224MiB")
    p.add_argument("--source", choices=("auto", "dispatch", "allocator"), default="auto",
                   help="allocator (CUDA caching allocator) or dispatch (any device); auto picks")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.epilog = "arguments after -- are passed to the script"


def _script_argv(ns) -> list[str]:
    return list(getattr(ns, "script_args", []))


def _check_script(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"no such script: {path}")
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder, not a script")
    if not os.access(path, os.R_OK):
        raise UsageError(f"cannot read script: {path}")


def cmd_trace(ns) -> int:
    _check_script(ns.script)
    from .attribution import at_peak
    from .report.json import dumps, trace_json
    from .trace.session import trace_script
    result = _traced(ns)
    run = result.run
    peak = at_peak(run)
    out = ns.output or os.path.splitext(os.path.basename(ns.script))[0] + ".memrun.json.gz"
    run.save(out)
    if ns.json:
        print(dumps(trace_json(run, peak)))
    else:
        from .report.text import print_trace
        print_trace(run, peak)
        print(f"run saved to {out}")
    return _exit_for(result)


def _traced(ns):
    from .trace.session import trace_script
    try:
        stream = sys.stderr if ns.json else sys.stdout
        with contextlib.redirect_stdout(stream):
            return trace_script(ns.script, _script_argv(ns), budget=ns.budget, source=ns.source)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _exit_for(result) -> int:
    if result.oom:
        return EXIT_OOM
    if result.exit_code not in (0, None):
        if result.error:
            print(f"memdoctor: the script failed: {result.error}", file=sys.stderr)
        return EXIT_SCRIPT_FAILED
    return EXIT_OK


COMMANDS = {"trace": cmd_trace}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:        # everything after `--` belongs to the user's script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    ns = parser.parse_args(argv)
    ns.script_args = script_args
    if not ns.command:
        parser.print_help()
        return EXIT_USAGE
    try:
        return COMMANDS[ns.command](ns)
    except UsageError as exc:
        print(f"memdoctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:   # one line, never a traceback, for memdoctor's own failures
        from .run import RunFileError
        if isinstance(exc, RunFileError):
            print(f"memdoctor: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"memdoctor: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("MEMDOCTOR_DEBUG"):
            raise
        return EXIT_INTERNAL
