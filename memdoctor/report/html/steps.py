"""The per-step section: the peak and the live bytes at the end of each step (a leak's slope)."""
from __future__ import annotations

from memdoctor.report.html.escape import esc
from memdoctor.report.html.page import Page
from memdoctor.report.html.style import BUDGET_COLOR, scaled
from memdoctor.units import format_bytes


def steps_section(page: Page, steps: list[dict], growth: float, unit: str, scale: int, limit, other) -> str:
    if len(steps) < 2 and not (other and len(other["steps"]) >= 2):
        return ""                # one step has no slope to show
    data = []
    series = [("before" if other else "peak", steps, "#4e79a7", "#1f3a5f")]
    if other:
        series.append(("after", other["steps"], "#59a14f", "#1e5631"))
    for name, rows, color, dark in series:
        if not rows:
            continue
        data.append({"type": "bar", "x": [r["step"] for r in rows], "y": scaled([r["peak_bytes"] for r in rows], scale),
                     "name": f"{name}: peak in step", "marker": {"color": color},
                     "hovertemplate": "step %{x}: peak %{y:.2f} " + unit + "<extra></extra>"})
        data.append({"type": "scatter", "mode": "lines+markers", "x": [r["step"] for r in rows],
                     "y": scaled([r["end_bytes"] for r in rows], scale), "name": f"{name}: live at step end",
                     "line": {"color": dark, "dash": "dot"}, "marker": {"size": 5, "color": dark},
                     "hovertemplate": "step %{x}: end %{y:.2f} " + unit + "<extra></extra>"})
    shapes = []
    if limit:
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": limit / scale,
                       "y1": limit / scale, "line": {"color": BUDGET_COLOR, "dash": "dash", "width": 2}})
    layout = {"title": {"text": "peak per step (a leak shows as a slope)"}, "barmode": "group",
              "xaxis": {"title": {"text": "step"}}, "yaxis": {"title": {"text": unit}, "rangemode": "tozero"},
              "shapes": shapes, "legend": {"orientation": "h", "y": -0.2}, "margin": {"l": 70, "r": 30, "t": 50, "b": 80}}
    slope = ""
    if growth > 0:
        slope = f" Live memory at the end of a step grows {esc(format_bytes(growth))} a step."
    return (f"<section id=\"steps\"><h2>Per step</h2><p class=\"note\">{len(steps)} step{'s' if len(steps) != 1 else ''}.{slope}</p>"
            f"{page.figure(data, layout, height=380)}</section>")
