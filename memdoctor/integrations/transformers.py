"""memdoctor in transformers' Trainer: a TrainerCallback that runs `trainer.train()` under
`memdoctor.watch`.

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[MemdoctorCallback(budget="16GiB", report="oom.html")])
    trainer.train()     # on an OOM: the report is written, the diagnosis rides on the error

Trainer has no callback event for an exception, so the callback wraps the Trainer's own
`train` when the Trainer is built (its `on_init_end` event) and catches the OOM there. A
callback added later with `trainer.add_callback` needs `callback.attach(trainer)`.
"""
from __future__ import annotations

import functools
import logging
import sys

from transformers import Trainer, TrainerCallback

from memdoctor.watching import watch

log = logging.getLogger("memdoctor")

_FRAMES_UP = 12         # Trainer.__init__ -> CallbackHandler.on_init_end -> call_event -> here


class MemdoctorCallback(TrainerCallback):
    """Trace each `trainer.train()` with memdoctor.watch(budget, report, source, **options).

    After a train(): `.doc` is the watch (its `.run`, `.findings`, `.diagnosis`)."""

    def __init__(self, budget=None, report=None, source: str = "auto", **options):
        self.options = dict(budget=budget, report=report, source=source, **options)
        self.doc: watch | None = None
        self._watching = False
        self._warned = False

    def attach(self, trainer: Trainer) -> None:
        """Run `trainer.train()` under memdoctor.watch from now on."""
        original = trainer.train
        if getattr(original, "_memdoctor_callback", None) is self:
            return

        @functools.wraps(original)
        def train(*args, **kwargs):
            self.doc = watch(trainer.model, trainer.optimizer, **self.options)
            self._watching = True
            try:
                with self.doc:
                    return original(*args, **kwargs)
            finally:
                self._watching = False
        train._memdoctor_callback = self
        trainer.train = train

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer()
        if trainer is not None:
            self.attach(trainer)
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        if not self._watching and not self._warned:
            self._warned = True
            log.warning("memdoctor: MemdoctorCallback is not tracing: it was added after the Trainer was "
                        "built; pass it as Trainer(callbacks=[...]) or call callback.attach(trainer) "
                        "before trainer.train()")
        return control


def _calling_trainer() -> Trainer | None:
    """The Trainer whose constructor is calling its callbacks' on_init_end."""
    frame = sys._getframe(2)
    for _ in range(_FRAMES_UP):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None
