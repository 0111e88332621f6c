"""`memdoctor.watch`: the context manager for training scripts. (The module is named
watching so that the package attribute `memdoctor.watch` stays the context manager.)

    with memdoctor.watch(model, optimizer, budget="16GiB", report="oom.html") as doc:
        train()

On an OOM inside it: diagnose, write the report atomically, and re-raise the original
error with the diagnosis added as a note. A failure of memdoctor's own never reaches the
training loop: it is logged and the loop runs on untraced.
"""
from __future__ import annotations

import logging

log = logging.getLogger("memdoctor")


class watch:
    def __init__(self, model=None, optimizer=None, budget=None, report=None, source: str = "auto",
                 mode: str = "full"):
        self.model, self.optimizer = model, optimizer
        self.budget, self.report, self.source = budget, report, source
        self.mode = mode        # "light": for jobs that run for days (the allocator's history, few hooks)
        self.tracer = None
        self._open = False
        self.run = None
        self.facts = None
        self.findings: list = []
        self.diagnosis: str | None = None

    def __enter__(self) -> "watch":
        """Start tracing; a tracer that cannot start has removed whatever it installed,
        and the block runs untraced (a KeyboardInterrupt goes on, as it would anyway)."""
        self._open = False
        try:
            from memdoctor.capture.session import Tracer
            models = self.model if isinstance(self.model, (list, tuple)) else [self.model]
            optims = self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]
            self.tracer = Tracer(models, optims, budget=self.budget, source=self.source, mode=self.mode)
            self.tracer.__enter__()
            self._open = True
        except Exception as exc:
            log.warning("memdoctor: not tracing, could not start: %s", exc)
            self._abandon()
        return self

    def _abandon(self) -> None:
        """A tracer that failed part-way: whatever it still has installed goes."""
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            try:
                tracer.abandon()
            except Exception as exc:
                log.warning("memdoctor: could not remove all of the trace's hooks: %r", exc)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.tracer is None or not self._open:
            return False
        self._open = False
        try:
            self.tracer.__exit__(exc_type, exc, tb)     # removes its hooks whatever happens
        except BaseException as err:
            self._abandon()
            if not isinstance(err, Exception):
                raise                                   # a KeyboardInterrupt goes on
            log.warning("memdoctor: the trace could not be finished, nothing to diagnose: %r", err)
            return False
        try:
            self.run = self.tracer.run
            self._diagnose()
            if exc is not None and _is_oom(exc) and self.diagnosis:
                _add_note(exc, self.diagnosis)      # first: a report that fails keeps the note
            if self.report:
                self._write_report()
        except Exception as err:
            log.warning("memdoctor: diagnosis failed: %r", err)
        return False

    def _diagnose(self) -> None:
        from memdoctor.report.text import diagnosis_lines
        from memdoctor.diagnosis import diagnose, facts_from_run
        self.facts = facts_from_run(self.run)
        self.findings = diagnose(self.facts)
        rank = self.run.meta.get("rank")
        who = f"memdoctor (rank {rank} of {self.run.meta.get('world_size')}): " if isinstance(rank, int) else "memdoctor: "
        self.diagnosis = who + "\n".join(diagnosis_lines(self.findings, self.facts))

    def _write_report(self) -> None:
        from memdoctor.capture.ranks import path_for
        path = path_for(self.run, str(self.report))   # one of several ranks: each writes its own file
        if path.endswith(".html"):
            import importlib.util
            if importlib.util.find_spec("plotly") is None:
                log.warning("memdoctor: no HTML report: it needs plotly: pip install 'memdoctor[report]'")
                return
            from memdoctor.report.html import write_report
            write_report(path, self.run, findings=self.findings, facts=self.facts)
        elif path.endswith(".json"):
            from memdoctor.report.json import diagnosis_json, dumps
            from memdoctor.run import write_atomic
            write_atomic(path, dumps(diagnosis_json(self.findings, self.facts, self.run)).encode())
        else:
            self.run.save(path)


def _is_oom(exc: BaseException) -> bool:
    try:
        import torch
        return isinstance(exc, torch.OutOfMemoryError)
    except Exception:
        return "out of memory" in str(exc).lower()


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
