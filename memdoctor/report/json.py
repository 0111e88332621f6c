"""Every `--json` shape: versioned by one JSON_VERSION, stable keys, bytes as integers."""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from memdoctor.attribution import Breakdown
from memdoctor.run import Run
from memdoctor.sanitize import printable_data

JSON_VERSION = 1


def oom_dict(oom, run: Run | None = None) -> dict[str, Any]:
    """An OOM; its `source` is the user's line that asked (file, line, label, text), or None."""
    out = {k: v for k, v in asdict(oom).items() if k != "seq"}
    line = run.source_at(oom.source) if run is not None else None
    out["source"] = line.to_dict() if line is not None else None
    return out


def trace_json(run: Run, peak: Breakdown) -> dict[str, Any]:
    return {
        "version": JSON_VERSION,
        "oom": bool(run.ooms),
        "ooms": [oom_dict(o, run) for o in run.ooms],
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
    """The JSON text; every string in it passed through memdoctor.sanitize."""
    return json.dumps(printable_data(payload), indent=2, default=str)


def diagnosis_json(findings, facts, run: Run | None = None, ooms: list | None = None) -> dict[str, Any]:
    """The DESIGN contract: version, oom, ooms, peak_bytes, budget_bytes, breakdown, findings."""
    focus = facts.focus
    if ooms is None:
        ooms = [oom_dict(o, run) for o in run.ooms] if run is not None else []
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


def log_without_oom_json() -> dict[str, Any]:
    """`diagnose --log` on a log holding no OOM message."""
    return {"version": JSON_VERSION, "oom": False, "ooms": [], "findings": []}


def ranks_json(diagnosed, merged, first) -> dict[str, Any]:
    """Several ranks diagnosed together: the merged findings, the first OOM, each rank's own.
    `diagnosed`: (rank, run, path, facts, findings) per rank; `first`: (rank, oom) or None."""
    return {
        "version": JSON_VERSION, "ranks": [r for r, *_ in diagnosed],
        "oom": first is not None, "first_oom_rank": first[0] if first else None,
        "first_oom": oom_dict(first[1]) if first else None,
        "findings": [m.to_dict() for m in merged],
        "per_rank": [{"rank": r, "run": path, **diagnosis_json(findings, facts, run)}
                     for r, run, path, facts, findings in diagnosed],
    }


def _comparison_side(run: Run, facts, findings) -> dict[str, Any]:
    """One side of the before/after table."""
    first = findings[0] if findings else None
    return {
        "peak_bytes": int(facts.peak_bytes),
        "oom": bool(run.ooms),
        "exit_code": run.meta.get("exit_code"),
        "error": run.meta.get("script_error"),
        "first_finding": None if first is None else {
            "rule": first.rule, "title": first.title, "accounts_for_bytes": int(first.accounts_for_bytes)},
    }


def comparison_json(tried, before: tuple, after: tuple, budget: int | None) -> dict[str, Any]:
    """`diagnose SCRIPT --try FIX`: the script as written and with the fix injected.
    `tried`: remedies.inject.Tried; `before`, `after`: (run, facts, findings) each."""
    return {"version": JSON_VERSION, "fix": str(tried.fix), "budget_bytes": budget,
            "before": _comparison_side(*before),
            "after": {**_comparison_side(*after), "injected": tried.applied, "not_injected": tried.problems}}


def estimate_json(est) -> dict[str, Any]:
    """`memdoctor estimate --json`: a predict.result.Estimate."""
    return {"version": JSON_VERSION, **est.to_dict()}


def plan_json(candidates) -> dict[str, Any]:
    """`memdoctor plan --json`: the planner's candidates, first choice first."""
    return {"version": JSON_VERSION, "plans": [c.to_dict() for c in candidates]}
