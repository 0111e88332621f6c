"""Running or loading a user's script as `python script.py args...` would: sys.argv and sys.path
as the script expects them, for a trace of the whole script (trace_script) or for the build()
an estimate calls (script_build)."""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from memdoctor.capture.session import Tracer
from memdoctor.collector import frozen_gc
from memdoctor.run import Run

__all__ = ["as_script", "ScriptResult", "trace_script", "script_build"]


@contextlib.contextmanager
def as_script(path: str, args: Sequence[str] = ()) -> Iterator[list[str]]:
    """sys.argv = [path, *args] and the script's folder first on sys.path, until the block
    ends; yields that sys.argv."""
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        yield argv
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


@dataclass
class ScriptResult:
    """A traced script: its Run, how it exited, and its error (an OOM's first line)."""
    run: Run
    exit_code: int = 0
    error: str | None = None
    oom: bool = False
    output: list[str] = field(default_factory=list)


def trace_script(path: str, args: list[str] | None = None, budget=None, source: str = "auto",
                 mode: str = "full") -> ScriptResult:
    """Run a script as `python path args...` would, under the tracer, with no change to it."""
    tracer = Tracer(budget=budget, source=source, mode=mode)
    code, error, oom = 0, None, False
    with as_script(path, args or []) as argv:
        try:
            with frozen_gc(), tracer:
                runpy.run_path(path, run_name="__main__")
        except torch.OutOfMemoryError as exc:
            oom, code, error = True, 1, str(exc).strip().splitlines()[0]
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            code, error = 130, "interrupted"
        except BaseException as exc:    # the script's own failure: report it, keep the run
            code, error = 1, "".join(traceback.format_exception_only(type(exc), exc)).strip()
    run = tracer.run
    run.script, run.argv = os.path.abspath(path), argv[1:]
    if error:
        run.meta["script_error"] = error
    run.meta["exit_code"] = code
    return ScriptResult(run, code, error, oom)


@contextlib.contextmanager
def script_build(path: str, args: Sequence[str] = ()) -> Iterator[Callable]:
    """The build() of a script, with sys.argv and sys.path as `python path args...` gives them
    until the block ends: a build() (or the loss it returns) that reads sys.argv when called
    sees the script's arguments. build() returns (model, optimizer, batch, loss_fn), or a
    dict with those keys, and is called with no arguments. The script is loaded as a module
    (not as __main__), so its `if __name__ == "__main__":` training loop does not run."""
    if not os.path.isfile(path):
        raise ValueError(f"no such script: {path}")
    with as_script(path, args):
        namespace = runpy.run_path(path, run_name="__memdoctor_estimate__")
        build = namespace.get("build")
        if not callable(build):
            raise ValueError(f"{path} has no build() function returning (model, optimizer, batch, loss_fn)")

        def without_arguments():
            return build()
        yield without_arguments
