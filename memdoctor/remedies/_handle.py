"""The undo handle every applied remedy returns."""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("memdoctor")


class Handle:
    """What one remedy changed, and how to change it back.

    `undo()` is idempotent so that a composer undoing in reverse order after a failure
    and a user undoing by hand cannot undo a remedy twice.
    """

    def __init__(self, description: str, undo: Callable[[], None] | None = None) -> None:
        self.description = description
        self._undo = undo
        self.undone = False

    def undo(self) -> None:
        if self.undone:
            return
        self.undone = True
        if self._undo is not None:
            self._undo()
        log.debug("undid: %s", self.description)

    def __repr__(self) -> str:
        state = "undone" if self.undone else "applied"
        return f"<{type(self).__name__} {self.description!r} {state}>"
