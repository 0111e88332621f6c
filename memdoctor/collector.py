"""The garbage collector held off while memdoctor alone makes many objects (marks turned
into objects, a run turned into JSON): no user code runs meanwhile, so nothing collectable
is made, and each collection would walk every object of the recorded run again."""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic collection inside the block; the collector as it was afterwards."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Leave the objects alive now out of every collection until the block ends. Before a
    script runs under the tracer they are the interpreter's, torch's and memdoctor's own,
    all long-lived; each full collection the recorded run brings about would walk them
    again. Garbage among them waits for the first collection after the block. Where some
    objects are frozen already, the caller manages freezing: nothing is changed."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
