"""A spinner with the elapsed time on stderr while a command works (trace, estimate, plan,
--try): rich's progress display, shown only when stderr is a terminal and the output is not
--json, and gone when the work ends."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


def wanted(ns) -> bool:
    """Progress is for a person watching: not under --json, not into a pipe or a file, and
    under a launcher (torchrun sets RANK) from rank 0 only."""
    return not getattr(ns, "json", False) and sys.stderr.isatty() and os.environ.get("RANK", "0") in ("", "0")


@contextlib.contextmanager
def working(ns, description: str) -> Iterator[None]:
    """Show `description` with a spinner and the time so far until the block ends."""
    if not wanted(ns):
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.markup import escape
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with progress:
        progress.add_task(escape(description), total=None)
        yield
