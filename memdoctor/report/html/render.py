"""Page assembly: the report's sections, in order, from a run and its findings."""
from __future__ import annotations

import os

from memdoctor.report import downsample as ds
from memdoctor.report.html.alive import alive_section
from memdoctor.report.html.compare import compare_section
from memdoctor.report.html.findings import findings_section
from memdoctor.report.html.header import footer, header
from memdoctor.report.html.page import Page
from memdoctor.report.html.segments import segments_section
from memdoctor.report.html.steps import steps_section
from memdoctor.report.html.style import axis_unit
from memdoctor.report.html.timeline import timeline_section
from memdoctor.run import Run, write_atomic


def write_report(path: str | os.PathLike, run: Run, findings, facts, other_run: Run | None = None,
                 other_findings=None, other_facts=None, max_points: int = ds.DEFAULT_MAX_POINTS) -> None:
    """Write the report for `run` to `path` atomically. With `other_run`, `run` is shown as
    before and `other_run` as after, side by side; the after run's findings and facts, when
    given, add its headline."""
    write_atomic(path, render_report(run, findings, facts, other_run, other_findings, other_facts,
                                     max_points).encode("utf-8"))


def render_report(run: Run, findings, facts, other_run: Run | None = None, other_findings=None,
                  other_facts=None, max_points: int = ds.DEFAULT_MAX_POINTS) -> str:
    """The report as one HTML string, from findings and facts the caller diagnosed."""
    page = Page()
    curves = ds.curves(run)
    tl = ds.timeline(run, max_points, curves)
    focus_seq = max(run.ooms[0].seq - 1, 0) if run.ooms else tl.peak_seq
    steps = facts.steps if facts.steps else ds.step_peaks(run, curves.total)

    other = None
    if other_run is not None:
        oc = ds.curves(other_run)
        half = max(max_points // 2, 100)
        other = {"run": other_run, "curves": oc, "timeline": ds.timeline(other_run, half, oc), "max_points": half,
                 "steps": ds.step_peaks(other_run, oc.total), "facts": other_facts, "findings": other_findings}

    limit = facts.limit_bytes or run.budget_bytes
    top_bytes = max(_top(run, tl), _top(other_run, other["timeline"]) if other else 0)
    if facts.limit_bytes and facts.limit_bytes <= 1.5 * top_bytes:   # a capacity far above would flatten it
        top_bytes = max(top_bytes, facts.limit_bytes)
    unit, scale = axis_unit(max(top_bytes, 1))
    ymax = top_bytes * 1.15 or 1

    body = [header(run, facts, findings, tl, focus_seq)]
    if other:
        body.append(compare_section(page, run, tl, curves, other, unit, scale, ymax))
    body.append(findings_section(page, findings, facts, unit, scale))
    body.append(timeline_section(page, run, tl, unit, scale, ymax, other is not None))
    body.append(alive_section(page, run, focus_seq))
    body.append(steps_section(page, steps, facts.growth_per_step, unit, scale, limit, other))
    if run.segments or (run.samples and run.source == "allocator"):
        body.append(segments_section(page, run, tl, max_points))
    body.append(footer(tl))
    title = "memdoctor report: " + (os.path.basename(run.script) if run.script else "run")
    return page.html(title, "\n".join(body))


def _top(run: Run, tl: ds.Timeline) -> int:
    """The highest value the timeline draws: peak, budget, an OOM's request, reserved."""
    return max([tl.peak_bytes, run.budget_bytes or 0]
               + [(o.live_bytes or 0) + (o.requested_bytes or 0) for o in run.ooms]
               + [max((s.reserved for s in run.samples), default=0)])
