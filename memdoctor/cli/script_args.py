"""Which arguments of a command line are memdoctor's and which the training script's.

    memdoctor diagnose [OPTIONS] train.py [OPTIONS] ARGS...    # ARGS go to train.py
    memdoctor diagnose [OPTIONS] train.py [OPTIONS] -- ARGS...

After SCRIPT, memdoctor reads its own options up to the first argument it does not take;
that argument and everything after it go to the script, as they would after `python
train.py`. `--` ends memdoctor's options explicitly (a script option spelled like one of
memdoctor's, `-o` say, needs it, or memdoctor's options before SCRIPT).
"""
from __future__ import annotations

import argparse


def split(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(memdoctor's arguments, the script's) for a command line whose first argument names
    a command of `parser`."""
    end = _script_end(parser, argv)
    if end is None:             # no SCRIPT before `--`: all before `--` is memdoctor's
        if "--" in argv:
            cut = argv.index("--")
            return argv[:cut], argv[cut + 1:]
        return argv, []
    command = _command_parser(parser, argv)
    i = end
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1:]
        taken = _option_length(command, argv, i)
        if taken is None:
            return argv[:i], argv[i:]
        i += taken
    return argv, []


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv and argv[0] in action.choices:
            return action.choices[argv[0]]
    return None


def _script_end(parser: argparse.ArgumentParser, argv: list[str]) -> int | None:
    """The index just after SCRIPT (the command's positional `script`), or None when the
    command takes no script or none is given before `--`."""
    command = _command_parser(parser, argv)
    if command is None or not any(a.dest == "script" and not a.option_strings for a in command._actions):
        return None
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return None
        if token.startswith("-") and token != "-":
            taken = _option_length(command, argv, i)
            i += taken or 1         # an option memdoctor does not take: argparse says so
            continue
        return i + 1
    return None


def _option_length(command: argparse.ArgumentParser, argv: list[str], i: int) -> int | None:
    """How many arguments from argv[i] one of the command's options takes (itself and its
    values); None when argv[i] is not one of its options."""
    token = argv[i]
    if not token.startswith("-") or token == "-":
        return None
    name, eq, _ = token.partition("=")
    action = command._option_string_actions.get(name)
    if action is None:
        return None
    if eq or action.nargs == 0:
        return 1
    if action.nargs is None or action.nargs == argparse.OPTIONAL:
        if action.nargs == argparse.OPTIONAL and (i + 1 >= len(argv) or argv[i + 1].startswith("-")):
            return 1
        return 2
    if isinstance(action.nargs, int):
        return 1 + action.nargs
    j = i + 1                       # "+" or "*": values up to the next option
    while j < len(argv) and not argv[j].startswith("-"):
        j += 1
    return j - i
