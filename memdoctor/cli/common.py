"""What every command shares: exit codes, UsageError, the size argument type and the
arguments that name a training script."""
from __future__ import annotations

import argparse
import os

EXIT_OK, EXIT_SCRIPT_FAILED, EXIT_USAGE, EXIT_OOM, EXIT_INTERNAL = 0, 1, 2, 3, 4


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit 2."""


def size(text: str) -> int:
    """An argparse type: "16GiB", "224MiB" -> bytes."""
    from memdoctor.units import SizeError, parse_size
    try:
        return parse_size(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_script_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    """SCRIPT, --budget, --source and --json, as `trace` and `diagnose` take them."""
    p.add_argument("script", nargs="?" if optional else None, help="the training script, run as `python SCRIPT ARGS`")
    p.add_argument("--budget", type=size, metavar="SIZE", help="memory budget, e.g. 16GiB or 224MiB")
    p.add_argument("--source", choices=("auto", "dispatch", "allocator"), default="auto",
                   help="allocator (CUDA caching allocator) or dispatch (any device); auto picks")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.epilog = "arguments after -- are passed to the script"


def script_argv(ns) -> list[str]:
    """The arguments after `--`, for the user's script."""
    return list(getattr(ns, "script_args", []))


def check_script(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"no such script: {path}")
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder, not a script")
    if not os.access(path, os.R_OK):
        raise UsageError(f"cannot read script: {path}")
