"""The timeline: live memory stacked by category over the events, with phases, steps, the
peak, the OOMs and the budget."""
from __future__ import annotations

import math

import numpy as np

from memdoctor.attribution import step_ranges
from memdoctor.report import downsample as ds
from memdoctor.report.html.escape import esc, plot_text
from memdoctor.report.html.page import Page
from memdoctor.report.html.style import (BUDGET_COLOR, CATEGORY_COLORS, OOM_COLOR, PEAK_COLOR, PHASE_COLORS,
                                         scaled)
from memdoctor.run import CATEGORIES, Run
from memdoctor.units import format_bytes

MAX_BANDS = 600                # phase bands drawn; beyond it the phases are resampled
BAND_GRID = 1200               # about one band a pixel: finer is invisible
MAX_STEP_LINES = 120            # more steps than this: labels only, lines would be a texture
MAX_STEP_LABELS = 12


def _phase_bands(run: Run, n: int) -> list[tuple[int, int, str]]:
    """(start, end, phase) runs of one phase, merged; resampled when there are too many."""
    if not run.marks or n == 0:
        return []
    seqs = [m.seq for m in run.marks]
    phases = [m.phase for m in run.marks]
    bands: list[list] = []
    for i, (s, p) in enumerate(zip(seqs, phases)):
        end = seqs[i + 1] if i + 1 < len(seqs) else n
        if end <= s:
            continue
        if bands and bands[-1][2] == p and bands[-1][1] >= s:
            bands[-1][1] = end
        else:
            bands.append([s, end, p])
    if len(bands) > MAX_BANDS:     # narrower than a pixel: the phase at each grid point
        grid = np.linspace(0, n, BAND_GRID + 1)
        pos = np.clip(np.searchsorted(np.asarray(seqs), grid[:-1], side="right") - 1, 0, len(seqs) - 1)
        bands = []
        for g, k in enumerate(pos.tolist()):
            a, b, p = int(grid[g]), int(grid[g + 1]), phases[k]
            if bands and bands[-1][2] == p:
                bands[-1][1] = b
            else:
                bands.append([a, b, p])
    return [(a, b, p) for a, b, p in bands]


def timeline_traces(run: Run, tl: ds.Timeline, scale: int, ymax: float, legend: bool = True,
                    bands: bool = True, steps: bool = True) -> tuple[list, list, list]:
    traces: list[dict] = []
    shapes: list[dict] = []
    annotations: list[dict] = []
    top = ymax / scale
    n = tl.num_events
    if bands:
        by_phase: dict[str, tuple[list, list]] = {}
        for a, b, p in _phase_bands(run, n):
            if p not in PHASE_COLORS:
                continue
            xs, ys = by_phase.setdefault(p, ([], []))
            xs += [a, a, b, b, a, None]
            ys += [0, top, top, 0, 0, None]
        for p, (xs, ys) in by_phase.items():
            traces.append({"type": "scatter", "mode": "lines", "x": xs, "y": ys, "fill": "toself",
                           "fillcolor": PHASE_COLORS[p], "line": {"width": 0}, "hoverinfo": "skip",
                           "name": f"phase: {p}", "legendgroup": "phases", "showlegend": legend,
                           "legendrank": 900})
    # Downsampled, the stacks are drawn at each bucket's highest total (the peak and every
    # OOM among them): a stack zigzagging through both extremes of every bucket fills the
    # band between them with the colour of the top category. The lowest total per bucket is
    # a line of its own.
    pos = tl.upper if tl.downsampled else np.arange(len(tl.seq))
    x = tl.seq[pos].tolist()
    shape = "linear" if tl.downsampled else "hv"
    for cat in CATEGORIES:
        ys = tl.by_category.get(cat)
        if ys is None or not np.any(ys):
            continue
        traces.append({"type": "scatter", "mode": "lines", "x": x, "y": scaled(ys[pos], scale), "name": cat,
                       "stackgroup": "live", "line": {"width": 0.5, "shape": shape, "color": CATEGORY_COLORS[cat]},
                       "fillcolor": CATEGORY_COLORS[cat], "legendgroup": cat, "showlegend": legend,
                       "hovertemplate": "%{y:.2f}"})
    if n:
        labels = _phase_step_labels(run, tl.seq[pos])
        name = "total live (highest per bucket)" if tl.downsampled else "total live"
        traces.append({"type": "scatter", "mode": "lines", "x": x, "y": scaled(tl.total[pos], scale), "name": name,
                       "line": {"width": 1, "color": PEAK_COLOR, "shape": shape},
                       "text": labels, "hovertemplate": "<b>%{y:.2f}</b> (%{text})", "showlegend": legend})
        if tl.downsampled:
            low = tl.lower
            traces.append({"type": "scatter", "mode": "lines", "x": tl.seq[low].tolist(),
                           "y": scaled(tl.total[low], scale), "name": "total live (lowest per bucket)",
                           "line": {"width": 0.8, "color": "rgba(0,0,0,0.4)", "dash": "dot"},
                           "hovertemplate": "low %{y:.2f}", "showlegend": legend})
    if run.samples:
        sx = np.array([s.seq for s in run.samples], dtype=np.int64)
        sr = np.array([s.reserved for s in run.samples], dtype=np.int64)
        sx, got = ds.downsample_series(sx, {"reserved": sr}, "reserved")
        traces.append({"type": "scatter", "mode": "lines", "x": sx.tolist(), "y": scaled(got["reserved"], scale),
                       "name": "reserved (allocator)", "line": {"width": 1.5, "color": "#555", "dash": "dot",
                                                                "shape": "hv"},
                       "hovertemplate": "%{y:.2f}", "showlegend": legend})
    if steps:
        ranges = step_ranges(run)
        if 1 < len(ranges) <= MAX_STEP_LINES:
            xs, ys = [], []
            for step, start, _ in ranges[1:]:
                xs += [start, start, None]
                ys += [0, top, None]
            traces.append({"type": "scatter", "mode": "lines", "x": xs, "y": ys, "name": "step starts",
                           "line": {"width": 1, "color": "rgba(0,0,0,0.35)", "dash": "dot"},
                           "hoverinfo": "skip", "showlegend": legend, "legendrank": 950})
        if len(ranges) > 1:
            label_every = max(1, math.ceil(len(ranges) / MAX_STEP_LABELS))
            for step, start, _ in ranges[::label_every]:
                annotations.append({"x": start, "y": 1.0, "xref": "x", "yref": "paper", "yanchor": "bottom",
                                    "xanchor": "left", "text": f"step {step}", "showarrow": False,
                                    "font": {"size": 10, "color": "#666"}})
    if n:
        mark = run.mark_at(tl.peak_seq)
        annotations.append({"x": tl.peak_seq, "y": tl.peak_bytes / scale, "xref": "x", "yref": "y",
                            "text": f"peak {plot_text(format_bytes(tl.peak_bytes))}"
                                    + (f" ({plot_text(mark.phase)}, step {mark.step})" if mark else ""),
                            "showarrow": True, "arrowhead": 2, "ax": -110 if tl.peak_seq > n / 2 else 110, "ay": -12,
                            "font": {"color": PEAK_COLOR}, "bgcolor": "rgba(255,255,255,0.8)"})
    for i, o in enumerate(run.ooms):
        pos = int(np.searchsorted(tl.seq, o.seq)) if n else 0
        if n and pos < len(tl.seq) and int(tl.seq[pos]) == o.seq:
            live = int(tl.total[pos])           # the curve drawn, so the request starts on it
        else:
            live = o.live_bytes or 0
        need = live + (o.requested_bytes or 0)
        text = plot_text(o.message, 300)
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": o.seq, "x1": o.seq, "y0": 0, "y1": 1,
                       "line": {"color": OOM_COLOR, "width": 2}})
        traces.append({"type": "scatter", "mode": "lines+markers", "x": [o.seq, o.seq],
                       "y": [live / scale, need / scale], "name": "OOM: failed request" if i == 0 else "OOM",
                       "line": {"color": OOM_COLOR, "width": 4}, "marker": {"symbol": "x", "size": [0, 12],
                                                                            "color": OOM_COLOR},
                       "text": [text, text], "showlegend": legend and i == 0, "legendgroup": "oom",
                       "hovertemplate": "OOM: %{y:.2f} needed<br>%{text}<extra></extra>"})
        if i < 5:
            annotations.append({"x": o.seq, "y": need / scale, "xref": "x", "yref": "y",
                                "text": f"OOM: +{plot_text(format_bytes(o.requested_bytes))}",
                                "showarrow": True, "arrowhead": 2, "ax": -30, "ay": -34,
                                "font": {"color": OOM_COLOR}, "bgcolor": "rgba(255,255,255,0.8)"})
    line_at, what = run.budget_bytes, "budget"
    if not line_at and (run.device or {}).get("capacity_bytes", 0) and run.device["capacity_bytes"] <= ymax:
        line_at, what = run.device["capacity_bytes"], "device capacity"
    if line_at:
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1,
                       "y0": line_at / scale, "y1": line_at / scale,
                       "line": {"color": BUDGET_COLOR, "dash": "dash", "width": 2}})
        annotations.append({"x": 0, "xref": "paper", "xanchor": "left", "y": line_at / scale, "yref": "y",
                            "yanchor": "bottom", "showarrow": False,
                            "text": f"{what} {plot_text(format_bytes(line_at))}",
                            "font": {"color": BUDGET_COLOR}})
    return traces, shapes, annotations


def _phase_step_labels(run: Run, seqs: np.ndarray) -> list[str]:
    if not run.marks:
        return [""] * len(seqs)
    mseq = np.array([m.seq for m in run.marks], dtype=np.int64)
    pos = np.searchsorted(mseq, seqs, side="right") - 1
    names = [f"{plot_text(m.phase)}, step {m.step}" for m in run.marks]
    return ["" if k < 0 else names[k] for k in pos.tolist()]


def timeline_layout(unit: str, ymax: float, scale: int, title: str, shapes, annotations, n: int) -> dict:
    return {"title": {"text": title, "y": 0.98, "yanchor": "top"},
            "xaxis": {"title": {"text": "event (allocations and frees, in order)"},
                      "range": [0, max(n - 1, 1) + max(2, 0.015 * n)],
                      "showgrid": False},
            "yaxis": {"title": {"text": unit}, "range": [0, ymax / scale], "gridcolor": "#eee"},
            "hovermode": "x unified", "shapes": shapes, "annotations": annotations,
            "legend": {"orientation": "h", "y": -0.18, "traceorder": "normal"},
            "margin": {"l": 70, "r": 30, "t": 70, "b": 90}}


def timeline_section(page: Page, run: Run, tl: ds.Timeline, unit: str, scale: int, ymax: float,
                     compared: bool) -> str:
    traces, shapes, annotations = timeline_traces(run, tl, scale, ymax)
    note = (f"{tl.num_events:,} events in {len(tl.upper):,} buckets: the stacks at each bucket's highest live "
            "total (solid line), the lowest as a dotted line; the peak and every OOM exact"
            if tl.downsampled else f"All {tl.num_events:,} events drawn")
    layout = timeline_layout(unit, ymax, scale, "live memory by category" + (" (before)" if compared else ""),
                             shapes, annotations, tl.num_events)
    return ("<section id=\"timeline\"><h2>Memory over time</h2>"
            "<p class=\"note\">Stacked by category; shaded: forward (blue), backward (orange), optimizer "
            "(purple), forward without backward (red); dotted: step starts; dashed: the budget; red: the OOM. "
            f"{esc(note)}.</p>{page.figure(traces, layout, height=520)}</section>")
