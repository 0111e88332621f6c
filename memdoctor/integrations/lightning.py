"""memdoctor in Lightning: a Callback that runs `trainer.fit(...)` under `memdoctor.watch`.

    trainer = L.Trainer(callbacks=[MemdoctorCallback(budget="16GiB", report="oom.html")])
    trainer.fit(model, data)   # on an OOM: the report is written, the diagnosis rides on the error

Tracing starts at `on_fit_start` (the optimizers exist by then) and ends at `on_fit_end`,
or at `on_exception`, which Lightning calls with the error it then re-raises. The callback
is built on `lightning.pytorch` where it is installed, else on `pytorch_lightning`.
"""
from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:
    from pytorch_lightning import Callback

from memdoctor.watching import watch


class MemdoctorCallback(Callback):
    """Trace each `trainer.fit()` with memdoctor.watch(budget, report, source, **options).

    After a fit: `.doc` is the watch (its `.run`, `.findings`, `.diagnosis`)."""

    def __init__(self, budget=None, report=None, source: str = "auto", **options):
        super().__init__()
        self.options = dict(budget=budget, report=report, source=source, **options)
        self.doc: watch | None = None
        self._open = False

    def on_fit_start(self, trainer, pl_module) -> None:
        self._close(None)
        self.doc = watch(pl_module, list(trainer.optimizers), **self.options)
        self.doc.__enter__()
        self._open = True

    def on_fit_end(self, trainer, pl_module) -> None:
        self._close(None)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close(exception)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close(None)

    def _close(self, exc: BaseException | None) -> None:
        """End the watch once; with the error, so an OOM gets the diagnosis as a note."""
        if not self._open:
            return
        self._open = False
        self.doc.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)
