"""The textual app: `memdoctor tui [RUN]`. The app lives in memdoctor.tui.app; this package
itself imports nothing heavy, so `memdoctor --help` stays instant."""
from __future__ import annotations

import sys


def run_app(*args, **kwargs) -> int:
    """Run MemdoctorApp (arguments as its constructor's) in this terminal; return its exit
    code. A run that could not be opened is also said in one line once the screen is back."""
    from memdoctor.tui.app import MemdoctorApp
    app = MemdoctorApp(*args, **kwargs)
    code = app.run()
    if app.error:
        print(f"memdoctor: {app.error}", file=sys.stderr)
    return code if isinstance(code, int) else 0
