"""`memdoctor` command line: builds the parser from the commands (one module each) and runs
the one asked for. Commands import torch only when they run, so `memdoctor --help` stays
instant.

Exit codes: 0 ran and fit; 1 the script failed for a reason other than memory;
2 bad input or usage; 3 out of memory (diagnosed); 4 memdoctor's own failure.
"""
from __future__ import annotations

import argparse
import os
import sys

from memdoctor.cli import diagnose, estimate, explain, export, plan, report, script_args, trace, tui
from memdoctor.cli.common import EXIT_INTERNAL, EXIT_PIPE_CLOSED, EXIT_USAGE, UsageError
from memdoctor.version import __version__

COMMANDS = (trace, diagnose, explain, tui, report, estimate, plan, export)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (the command's parsers are made of
    this class too)."""

    def error(self, message: str):
        from memdoctor.sanitize import printable
        self.exit(EXIT_USAGE, f"memdoctor: {printable(self.prog)}: {printable(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memdoctor",
        description="Find out why PyTorch training runs out of GPU memory, and fix it.",
        epilog="exit codes: 0 fit, 1 script failed, 2 bad input, 3 out of memory, 4 internal error")
    parser.add_argument("--version", action="version", version=f"memdoctor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, for_script = script_args.split(parser, argv)     # the training script's own arguments
    ns = parser.parse_args(argv)
    ns.script_args = for_script
    if not ns.command:
        parser.print_help()
        return EXIT_USAGE
    try:
        return ns.execute(ns)
    except UsageError as exc:
        _say(exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:     # the reader (`| head`) stopped reading: stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())    # nothing left to flush at exit
        return EXIT_PIPE_CLOSED
    except Exception as exc:   # one line, never a traceback, for memdoctor's own failures
        from memdoctor.limits import ReadLimitError
        from memdoctor.run import RunFileError
        if isinstance(exc, (RunFileError, ReadLimitError)):
            _say(exc)
            return EXIT_USAGE
        _say(f"internal error: {type(exc).__name__}: {exc}")
        if os.environ.get("MEMDOCTOR_DEBUG"):
            raise
        return EXIT_INTERNAL


def _say(message: object) -> None:
    """One line on stderr; a file's name or content in it cannot reach the terminal raw."""
    from memdoctor.sanitize import printable
    print(f"memdoctor: {printable(message)}", file=sys.stderr)
