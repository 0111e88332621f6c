"""memdoctor: why PyTorch training runs out of GPU memory, in bytes, and the fix.

The public API is imported lazily so that `memdoctor --help` never imports torch.
"""
from __future__ import annotations

from memdoctor.version import __version__  # noqa: F401  (re-exported)

__all__ = ["watch", "Tracer", "Run", "diagnose", "Plan", "prepare", "estimate"]


def __getattr__(name: str):
    if name == "watch":
        from memdoctor.watching import watch
        return watch
    if name == "Tracer":
        from memdoctor.capture.session import Tracer
        return Tracer
    if name == "Run":
        from memdoctor.run import Run
        return Run
    if name == "diagnose":
        from memdoctor.diagnosis import diagnose
        return diagnose
    if name in ("Plan", "prepare"):
        from memdoctor import remedies
        return getattr(remedies, name)
    if name == "estimate":
        from memdoctor.predict.estimate import estimate
        return estimate
    raise AttributeError(f"module 'memdoctor' has no attribute {name!r}")
