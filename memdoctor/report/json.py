"""The `--json` contract: versioned, stable keys, bytes as integers."""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from memdoctor.attribution import Breakdown
from memdoctor.run import Run

JSON_VERSION = 1


def oom_dict(oom) -> dict[str, Any]:
    return {k: v for k, v in asdict(oom).items() if k != "seq"}


def trace_json(run: Run, peak: Breakdown) -> dict[str, Any]:
    return {
        "version": JSON_VERSION,
        "oom": bool(run.ooms),
        "ooms": [oom_dict(o) for o in run.ooms],
        "peak_bytes": peak.total_bytes,
        "budget_bytes": run.budget_bytes,
        "breakdown": peak.by_category,
        "by_module": peak.by_module,
        "top_tensors": [t.__dict__ for t in peak.top],
        "phase_at_peak": peak.phase,
        "step_at_peak": peak.step,
        "source": run.source,
        "device": run.device.get("type"),
    }


def dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, indent=2, default=str)


def diagnosis_json(findings, facts, run: Run | None = None, ooms: list | None = None) -> dict[str, Any]:
    """The DESIGN contract: version, oom, ooms, peak_bytes, budget_bytes, breakdown, findings."""
    focus = facts.focus
    if ooms is None:
        ooms = [oom_dict(o) for o in run.ooms] if run is not None else []
    return {
        "version": JSON_VERSION,
        "oom": facts.oom,
        "ooms": ooms,
        "peak_bytes": facts.peak_bytes if run is not None else None,
        "budget_bytes": facts.budget_bytes,
        "limit_bytes": facts.limit_bytes,
        "breakdown": focus.by_category if focus is not None else None,
        "breakdown_at": ("oom" if facts.oom else "peak") if focus is not None else None,
        "findings": [f.to_dict() for f in findings],
    }
