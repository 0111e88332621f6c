"""Libraries that change their code path when they see a fake tensor are told they run
eagerly while the fake step runs, so that the step the estimate measures is the one a GPU runs.

transformers asks `is_tracing(tensor)` (transformers.utils.import_utils) before reading a
value: a FakeTensor counts as tracing, and then an all-ones attention mask is never dropped
(the real run drops it and calls attention with is_causal, and with grouped-query heads
enable_gqa=True), so the fake step would run other attention kernels than the GPU does.
While `eager()` is active that check says no for fake tensors; the values it then reads
come from memdoctor.predict.data_dependent (known, or assumed and noted).
"""
from __future__ import annotations

import contextlib
import sys

__all__ = ["eager"]


class _Eager:
    """The patches in place, and how to undo them."""

    def __init__(self) -> None:
        self.undo: list = []

    def refresh(self) -> None:
        """Patch the libraries imported since (a build imports them inside the estimate)."""
        utils = sys.modules.get("transformers.utils.import_utils")
        if utils is not None and getattr(utils, "is_fake_tensor", None) is not None \
                and not getattr(utils.is_fake_tensor, "_memdoctor_eager", False):
            original = utils.is_fake_tensor

            def is_fake_tensor(x) -> bool:
                return False
            is_fake_tensor._memdoctor_eager = True
            utils.is_fake_tensor = is_fake_tensor
            self.undo.append(lambda: setattr(utils, "is_fake_tensor", original))

    def restore(self) -> None:
        while self.undo:
            self.undo.pop()()


@contextlib.contextmanager
def eager():
    """Until the block ends, libraries see eager tensors where they look for fake ones; call
    `.refresh()` on what it yields after importing more of them."""
    state = _Eager()
    state.refresh()
    try:
        yield state
    finally:
        state.restore()
