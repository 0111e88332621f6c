"""What every command shares: exit codes, UsageError, the size argument type, the
arguments that name a training script and the check for an optional extra."""
from __future__ import annotations

import argparse
import os

EXIT_OK, EXIT_SCRIPT_FAILED, EXIT_USAGE, EXIT_OOM, EXIT_INTERNAL = 0, 1, 2, 3, 4
EXIT_PIPE_CLOSED = 141     # 128 + SIGPIPE, as a shell reports a writer its reader left


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
    p.add_argument("--light", action="store_true",
                   help="CUDA: trace with the allocator's history and the model's own hooks only (cheapest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.epilog = ("SCRIPT's own arguments follow it: `memdoctor %s train.py --epochs 3`; memdoctor's options "
                "go before SCRIPT (or right after it, before the script's first argument); after --, every "
                "argument goes to the script" % p.prog.split()[-1])


def script_argv(ns) -> list[str]:
    """The user's script's own arguments (memdoctor.cli.script_args splits them off)."""
    return list(getattr(ns, "script_args", []))


def need_extra(module: str, extra: str, what: str) -> None:
    """UsageError naming the extra to install when `module` cannot be imported."""
    import importlib
    try:
        importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{what} needs {module}: pip install 'memdoctor[{extra}]'") from None


def check_script(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"no such script: {path}")
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder, not a script")
    if not os.access(path, os.R_OK):
        raise UsageError(f"cannot read script: {path}")
