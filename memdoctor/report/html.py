"""The HTML report: one self-contained file that opens offline.

    write_report("reports/run.html", run)                      # findings computed here
    write_report(path, run, findings=..., facts=...)            # as `diagnose` has them
    write_report(path, before_run, other_run=after_run)         # before and after

plotly.js is inlined (never a CDN), the page's data sits in one JSON block, and a
Content-Security-Policy allows only the page's own scripts (by hash) and no network access
at all. Every name that comes from user code (module, tensor, script path, OOM message) is
escaped where it appears: html.escape in the markup; in the JSON block `<`, `>`, `&` and
U+2028/U+2029 as \\u escapes, so `</script>` cannot close it; and in chart labels (which
plotly reads as a small HTML subset) as entities too.
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import os
import re
from functools import lru_cache
from typing import Any

import numpy as np

from memdoctor.attribution import module_of, step_ranges
from memdoctor.run import CATEGORIES, Block, Phase, Run, write_atomic
from memdoctor.units import format_bytes
from memdoctor.report import downsample as ds

CATEGORY_COLORS = {
    "weights": "#4e79a7", "gradients": "#f28e2b", "optimizer_state": "#b07aa1",
    "activations": "#59a14f", "temporaries": "#edc948", "inputs": "#76b7b2", "other": "#bab0ac",
}
PHASE_COLORS = {
    Phase.FORWARD.value: "rgba(78,121,167,0.10)",
    Phase.BACKWARD.value: "rgba(242,142,43,0.12)",
    Phase.OPTIMIZER.value: "rgba(176,122,161,0.16)",
    Phase.FORWARD_NO_BACKWARD.value: "rgba(214,39,40,0.16)",
}
OOM_COLOR, BUDGET_COLOR, PEAK_COLOR = "#d62728", "#7f0000", "#222222"
MAX_BANDS = 600                # phase bands drawn; beyond it the phases are resampled
BAND_GRID = 1200               # about one band a pixel: finer is invisible
MAX_STEP_LINES = 120            # more steps than this: labels only, lines would be a texture
MAX_STEP_LABELS = 12
TREE_MODULES = 25              # modules per category in the treemap, the rest summed
TREE_TENSORS = 12              # tensors per module in the treemap, the rest summed
TOP_TENSORS = 15
MAX_SEGMENTS = 80
MAX_LABEL = 120


# ---- escaping ---------------------------------------------------------------------------
def esc(value: Any) -> str:
    """Text for HTML markup (element content and quoted attributes)."""
    return html.escape("" if value is None else str(value), quote=True)


def plot_text(value: Any, limit: int = MAX_LABEL) -> str:
    """Text for a plotly label or hover: plotly reads a subset of HTML in them and decodes
    entities, so `<`, `>` and `&` go in as entities and show as themselves."""
    text = "" if value is None else str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return html.escape(text, quote=False)


def script_json(obj: Any) -> str:
    """JSON safe inside <script>: no `<`, `>`, `&`, U+2028 or U+2029 left unescaped."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _inline_code(text: str) -> str:
    """Escape, then show `backticked` parts as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(text))


# ---- units ------------------------------------------------------------------------------
def _unit(top: float) -> tuple[str, int]:
    if top >= 2 * 1024**3:
        return "GiB", 1024**3
    if top >= 1024**2:
        return "MiB", 1024**2
    return "KiB", 1024


def _scaled(values, scale: int) -> list:
    arr = np.asarray(values, dtype=np.float64) / scale
    return np.round(arr, 4).tolist()


# ---- the report ---------------------------------------------------------------------------
def write_report(path: str | os.PathLike, run: Run, findings=None, facts=None, other_run: Run | None = None,
                 max_points: int = ds.DEFAULT_MAX_POINTS) -> None:
    """Write the report for `run` to `path` atomically. With `other_run`, `run` is shown as
    before and `other_run` as after, side by side. Findings and facts are computed when
    not given."""
    write_atomic(path, render_report(run, findings, facts, other_run, max_points).encode("utf-8"))


def render_report(run: Run, findings=None, facts=None, other_run: Run | None = None,
                  max_points: int = ds.DEFAULT_MAX_POINTS) -> str:
    """The report as one HTML string."""
    from memdoctor.diagnosis import diagnose, facts_from_run
    if facts is None:
        facts = facts_from_run(run)
    if findings is None:
        findings = diagnose(facts)
    page = _Page()
    curves = ds.curves(run)
    tl = ds.timeline(run, max_points, curves)
    focus_seq = max(run.ooms[0].seq - 1, 0) if run.ooms else tl.peak_seq
    steps = facts.steps if facts.steps else ds.step_peaks(run, curves.total)

    other = None
    if other_run is not None:
        oc = ds.curves(other_run)
        half = max(max_points // 2, 100)
        other = {"run": other_run, "curves": oc, "timeline": ds.timeline(other_run, half, oc), "max_points": half,
                 "steps": ds.step_peaks(other_run, oc.total)}
        try:
            other["facts"] = facts_from_run(other_run)
            other["findings"] = diagnose(other["facts"])
        except Exception:           # the after run's diagnosis is a bonus
            other["facts"] = other["findings"] = None

    limit = facts.limit_bytes or run.budget_bytes
    top_bytes = max(_top(run, tl), _top(other_run, other["timeline"]) if other else 0)
    if facts.limit_bytes and facts.limit_bytes <= 1.5 * top_bytes:   # a capacity far above would flatten it
        top_bytes = max(top_bytes, facts.limit_bytes)
    unit, scale = _unit(max(top_bytes, 1))
    ymax = top_bytes * 1.15 or 1

    body = [_header(run, facts, findings, tl, focus_seq)]
    if other:
        body.append(_compare(page, run, tl, curves, other, unit, scale, ymax))
    body.append(_findings_section(page, findings, facts, unit, scale))
    body.append(_timeline_section(page, run, tl, unit, scale, ymax, other is not None))
    body.append(_focus_section(page, run, focus_seq))
    body.append(_steps_section(page, steps, facts.growth_per_step, unit, scale, limit, other))
    if run.segments or (run.samples and run.source == "allocator"):
        body.append(_segments_section(page, run, tl, max_points))
    body.append(_footer(tl))
    title = "memdoctor report: " + (os.path.basename(run.script) if run.script else "run")
    return page.html(title, "\n".join(body))


def _top(run: Run, tl: ds.Timeline) -> int:
    """The highest value the timeline draws: peak, budget, an OOM's request, reserved."""
    return max([tl.peak_bytes, run.budget_bytes or 0]
               + [(o.live_bytes or 0) + (o.requested_bytes or 0) for o in run.ooms]
               + [max((s.reserved for s in run.samples), default=0)])


class _Page:
    """Collects the figures; renders the document with its scripts and their CSP hashes."""

    def __init__(self) -> None:
        self.figures: list[dict] = []

    def figure(self, data: list, layout: dict, height: int = 420, css: str = "chart") -> str:
        div = f"fig{len(self.figures)}"
        layout = {"height": height, "margin": {"l": 70, "r": 30, "t": 50, "b": 50},
                  "paper_bgcolor": "#ffffff", "plot_bgcolor": "#ffffff",
                  "font": {"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12}, **layout}
        self.figures.append({"div": div, "data": data, "layout": layout})
        return f'<div id="{div}" class="{css}" style="min-height:{height}px"></div>'

    def html(self, title: str, body: str) -> str:
        guard = _GUARD_JS
        plotly = _plotly_js()
        app = _APP_JS
        hashes = " ".join(f"'sha256-{_sha256(s)}'" for s in (guard, plotly, app))
        csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
               "img-src data: blob:; font-src data:; connect-src 'none'; frame-src 'none'; "
               "object-src 'none'; base-uri 'none'; form-action 'none'")
        data = script_json({"figures": self.figures})
        return (
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            f"<script>{guard}</script>\n<main>\n{body}\n</main>\n"
            f"<script type=\"application/json\" id=\"memdoctor-data\">{data}</script>\n"
            f"<script>{plotly}</script>\n<script>{app}</script>\n</body>\n</html>\n")


@lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs
    js = get_plotlyjs().replace("\r\n", "\n").replace("\r", "\n")   # as the HTML parser sees it
    if "</script" in js.lower():      # never expected; refuse rather than break the page
        raise RuntimeError("plotly.js contains '</script', cannot inline it")
    return js


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()


# ---- header -------------------------------------------------------------------------------
def _header(run: Run, facts, findings, tl: ds.Timeline, focus_seq: int) -> str:
    from memdoctor.report.text import headline
    dev = run.device or {}
    device = dev.get("type", "?")
    if dev.get("name"):
        device += f" ({dev['name']})"
    if dev.get("capacity_bytes"):
        device += f", {format_bytes(dev['capacity_bytes'])}"
    mark = run.mark_at(tl.peak_seq)
    rows = [
        ("script", esc(run.script or "(not a script)") + (
            " " + " ".join(esc(a) for a in run.argv) if run.argv else "")),
        ("device", esc(device)),
        ("source", esc(run.source) + (f", torch {esc(run.torch_version)}" if run.torch_version else "")),
        ("events", f"{tl.num_events:,} events, {len(run.blocks):,} tensors, {run.steps} steps"),
        ("peak", f"<b>{esc(format_bytes(tl.peak_bytes))}</b> ({tl.peak_bytes:,} bytes) at event "
                 f"{tl.peak_seq:,}" + (f", {esc(mark.phase)} of step {mark.step}" if mark else "")),
        ("budget", esc(format_bytes(run.budget_bytes)) if run.budget_bytes else "none"),
    ]
    if facts.limit_bytes and facts.limit_bytes != run.budget_bytes:
        rows.append(("limit", esc(format_bytes(facts.limit_bytes))))
    oom_html = ""
    if run.ooms:
        o = run.ooms[0]
        kind = "simulated " if o.simulated else ""
        where = f"{esc(o.phase)} of step {o.step}" + (f", in module <code>{esc(o.module)}</code>" if o.module else "")
        rows.append(("OOM", f"<span class=\"bad\">{kind}out of memory</span> at event {o.seq:,} in {where}: "
                            f"tried to allocate {esc(format_bytes(o.requested_bytes))} with "
                            f"{esc(format_bytes(o.live_bytes))} live"
                            + (f" ({len(run.ooms)} OOMs)" if len(run.ooms) > 1 else "")))
        oom_html = f"<pre class=\"oom\">{esc(o.message)}</pre>"
    else:
        rows.append(("OOM", "none"))
    if run.meta.get("script_error") and not run.ooms:
        rows.append(("script error", esc(run.meta["script_error"])))
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    cls = "headline bad" if facts.oom else "headline"
    return (f"<header><h1>memdoctor report</h1><p class=\"{cls}\">{_inline_code(headline(findings, facts))}</p>"
            f"<dl class=\"facts\">{dl}</dl>{oom_html}</header>")


def _footer(tl: ds.Timeline) -> str:
    from memdoctor import __version__
    sampled = (f"The timeline draws {len(tl.seq):,} of {tl.num_events:,} events (lowest and highest "
               "live total per bucket; the peak and every OOM exact)" if tl.downsampled
               else "The timeline draws every event")
    return (f"<footer>memdoctor {esc(__version__)}. Self-contained: plotly.js is inlined and the page "
            f"loads nothing from the network. {sampled}.</footer>")


# ---- findings -----------------------------------------------------------------------------
def _findings_section(page: _Page, findings, facts, unit: str, scale: int) -> str:
    limit = facts.limit_bytes
    parts = ["<section id=\"findings\"><h2>Findings</h2>"]
    if not findings:
        parts.append("<p>No rule names a cause.</p>")
    for i, f in enumerate(findings):
        fits = ""
        if f.fits_after_fix is True:
            fits = "<span class=\"good\">fixing it alone fits</span>"
        elif f.fits_after_fix is False:
            fits = "<span class=\"bad\">fixing it alone does not fit</span>"
        ev = "".join(f"<li>{_inline_code(e)}</li>" for e in f.evidence)
        rows = []
        for r in f.remedies:
            verdict = ""
            if r.predicted_peak_bytes is not None and limit:
                verdict = ("<span class=\"good\">fits</span>" if r.predicted_peak_bytes <= limit
                           else "<span class=\"bad\">does not fit</span>")
            rows.append(f"<tr><td>{esc(r.title)}</td><td>{_inline_code(r.how)}</td>"
                        f"<td class=\"num\">{esc(format_bytes(r.predicted_peak_bytes))}</td><td>{verdict}</td>"
                        f"<td>{'<code>' + esc(r.plan) + '</code>' if r.plan else ''}</td></tr>")
        table = ("<table class=\"remedies\"><thead><tr><th>fix</th><th>how</th><th>predicted peak</th>"
                 f"<th>vs limit</th><th>plan</th></tr></thead><tbody>{''.join(rows)}</tbody></table>" if rows else "")
        parts.append(
            f"<article class=\"finding{' first' if i == 0 else ''}\"><h3><code class=\"rule\">{esc(f.rule)}</code> "
            f"{esc(f.title)}</h3><p>accounts for <b>{esc(format_bytes(f.accounts_for_bytes))}</b> {fits}</p>"
            f"<ul>{ev}</ul>{table}</article>")
    bars = [(f"{f.rule}: {r.title}", r.predicted_peak_bytes) for f in findings for r in f.remedies
            if r.predicted_peak_bytes is not None][:20]
    if bars:
        now = facts.focus_bytes or facts.peak_bytes
        labels = ["now" + (" (at the OOM, with the request)" if facts.oom else " (peak)")] + [b[0] for b in bars]
        values = [now] + [b[1] for b in bars]
        colors = ["#888888"] + ["#59a14f" if (not limit or v <= limit) else OOM_COLOR for _, v in bars]
        data = [{"type": "bar", "orientation": "h", "y": [plot_text(x, 70) for x in labels][::-1],
                 "x": _scaled(values, scale)[::-1], "marker": {"color": colors[::-1]},
                 "customdata": [format_bytes(v) for v in values][::-1],
                 "hovertemplate": "%{y}<br>%{customdata}<extra></extra>", "name": "peak"}]
        shapes = []
        if limit:
            shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": limit / scale, "x1": limit / scale,
                           "y0": 0, "y1": 1, "line": {"color": BUDGET_COLOR, "dash": "dash", "width": 2}})
        layout = {"title": {"text": "predicted peak after each fix" + (
                      f" (dashed: limit {plot_text(format_bytes(limit))})" if limit else "")},
                  "xaxis": {"title": {"text": unit}, "rangemode": "tozero"},
                  "yaxis": {"automargin": True}, "shapes": shapes, "showlegend": False,
                  "margin": {"l": 20, "r": 30, "t": 50, "b": 50}}
        parts.append(page.figure(data, layout, height=110 + 30 * len(values)))
    parts.append("</section>")
    return "".join(parts)


# ---- timeline -----------------------------------------------------------------------------
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


def _timeline_traces(run: Run, tl: ds.Timeline, scale: int, ymax: float, legend: bool = True,
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
        traces.append({"type": "scatter", "mode": "lines", "x": x, "y": _scaled(ys[pos], scale), "name": cat,
                       "stackgroup": "live", "line": {"width": 0.5, "shape": shape, "color": CATEGORY_COLORS[cat]},
                       "fillcolor": CATEGORY_COLORS[cat], "legendgroup": cat, "showlegend": legend,
                       "hovertemplate": "%{y:.2f}"})
    if n:
        labels = _phase_step_labels(run, tl.seq[pos])
        name = "total live (highest per bucket)" if tl.downsampled else "total live"
        traces.append({"type": "scatter", "mode": "lines", "x": x, "y": _scaled(tl.total[pos], scale), "name": name,
                       "line": {"width": 1, "color": PEAK_COLOR, "shape": shape},
                       "text": labels, "hovertemplate": "<b>%{y:.2f}</b> (%{text})", "showlegend": legend})
        if tl.downsampled:
            low = tl.lower
            traces.append({"type": "scatter", "mode": "lines", "x": tl.seq[low].tolist(),
                           "y": _scaled(tl.total[low], scale), "name": "total live (lowest per bucket)",
                           "line": {"width": 0.8, "color": "rgba(0,0,0,0.4)", "dash": "dot"},
                           "hovertemplate": "low %{y:.2f}", "showlegend": legend})
    if run.samples:
        sx = np.array([s.seq for s in run.samples], dtype=np.int64)
        sr = np.array([s.reserved for s in run.samples], dtype=np.int64)
        sx, got = ds.downsample_series(sx, {"reserved": sr}, "reserved")
        traces.append({"type": "scatter", "mode": "lines", "x": sx.tolist(), "y": _scaled(got["reserved"], scale),
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


def _timeline_layout(unit: str, ymax: float, scale: int, title: str, shapes, annotations, n: int) -> dict:
    return {"title": {"text": title, "y": 0.98, "yanchor": "top"},
            "xaxis": {"title": {"text": "event (allocations and frees, in order)"},
                      "range": [0, max(n - 1, 1) + max(2, 0.015 * n)],
                      "showgrid": False},
            "yaxis": {"title": {"text": unit}, "range": [0, ymax / scale], "gridcolor": "#eee"},
            "hovermode": "x unified", "shapes": shapes, "annotations": annotations,
            "legend": {"orientation": "h", "y": -0.18, "traceorder": "normal"},
            "margin": {"l": 70, "r": 30, "t": 70, "b": 90}}


def _timeline_section(page: _Page, run: Run, tl: ds.Timeline, unit: str, scale: int, ymax: float,
                      compared: bool) -> str:
    traces, shapes, annotations = _timeline_traces(run, tl, scale, ymax)
    note = (f"{tl.num_events:,} events in {len(tl.upper):,} buckets: the stacks at each bucket's highest live "
            "total (solid line), the lowest as a dotted line; the peak and every OOM exact"
            if tl.downsampled else f"All {tl.num_events:,} events drawn")
    layout = _timeline_layout(unit, ymax, scale, "live memory by category" + (" (before)" if compared else ""),
                              shapes, annotations, tl.num_events)
    return ("<section id=\"timeline\"><h2>Memory over time</h2>"
            "<p class=\"note\">Stacked by category; shaded: forward (blue), backward (orange), optimizer "
            "(purple), forward without backward (red); dotted: step starts; dashed: the budget; red: the OOM. "
            f"{esc(note)}.</p>{page.figure(traces, layout, height=520)}</section>")


# ---- what was alive at the peak / OOM -----------------------------------------------------
def _live_at(run: Run, seq: int) -> list[Block]:
    return [b for b in run.blocks.values() if b.alloc_seq <= seq and (b.free_seq is None or b.free_seq > seq)]


def _module_label(mod: str | None) -> str:
    return "(outside modules)" if mod is None else "(root)" if mod == "" else mod


def _tensor_detail(b: Block) -> str:
    shape = "×".join(map(str, b.shape)) if b.shape else "()"
    return f"{shape} {b.dtype}".strip() + f" · {b.phase}, step {b.step}"


def _treemap(blocks: list[Block], title: str) -> tuple[list, dict]:
    by_cat: dict[str, dict[str, list[Block]]] = {}
    for b in blocks:
        by_cat.setdefault(b.category, {}).setdefault(_module_label(module_of(b)), []).append(b)
    ids, parents, labels, values, colors, custom = [], [], [], [], [], []
    total = sum(b.nbytes for b in blocks)

    def node(i, parent, label, value, color, info):
        ids.append(i)
        parents.append(parent)
        labels.append(label)
        values.append(int(value))
        colors.append(color)
        custom.append([format_bytes(value), info])

    node("all", "", f"alive: {format_bytes(total)}", total, "#ffffff", f"{len(blocks):,} tensors")
    order = [c for c in CATEGORIES if c in by_cat] + [c for c in by_cat if c not in CATEGORIES]
    for ci, cat in enumerate(order):
        mods = by_cat[cat]
        color = CATEGORY_COLORS.get(cat, "#bab0ac")
        cat_total = sum(b.nbytes for bs in mods.values() for b in bs)
        if cat_total <= 0:
            continue
        cid = f"c{ci}"
        node(cid, "all", plot_text(cat), cat_total, color, f"category · {sum(len(v) for v in mods.values()):,} tensors")
        ranked = sorted(mods.items(), key=lambda kv: -sum(b.nbytes for b in kv[1]))
        shown, rest = ranked[:TREE_MODULES], ranked[TREE_MODULES:]
        for mi, (mod, bs) in enumerate(shown):
            mid = f"{cid}/m{mi}"
            mod_total = sum(b.nbytes for b in bs)
            if mod_total <= 0:
                continue
            label = mod if mod.startswith("(") else f"module {mod}"
            node(mid, cid, plot_text(label), mod_total, color, f"module · {len(bs):,} tensors")
            bs = sorted(bs, key=lambda b: -b.nbytes)
            for ti, b in enumerate(bs[:TREE_TENSORS]):
                if b.nbytes > 0:
                    shape = "×".join(map(str, b.shape)) if b.shape else ""
                    node(f"{mid}/t{ti}", mid, plot_text(f"{b.name or '?'} {shape}".strip(), 70), b.nbytes, color,
                         plot_text(_tensor_detail(b)))
            more = bs[TREE_TENSORS:]
            more_bytes = sum(b.nbytes for b in more)
            if more_bytes > 0:
                node(f"{mid}/more", mid, f"({len(more):,} more tensors)", more_bytes, color, "smaller tensors")
        rest_bytes = sum(b.nbytes for _, bs in rest for b in bs)
        if rest_bytes > 0:
            node(f"{cid}/more", cid, f"({len(rest):,} more modules)", rest_bytes, color, "smaller modules")
    data = [{"type": "treemap", "ids": ids, "parents": parents, "labels": labels, "values": values,
             "branchvalues": "total", "marker": {"colors": colors, "line": {"color": "#fff", "width": 1}},
             "customdata": custom, "maxdepth": -1,
             "texttemplate": "<b>%{label}</b><br>%{customdata[0]}",
             "hovertemplate": "<b>%{label}</b><br>%{customdata[0]} (%{percentRoot:.1%})<br>%{customdata[1]}"
                              "<extra></extra>", "textinfo": "label+value"}]
    layout = {"title": {"text": title}, "margin": {"l": 10, "r": 10, "t": 50, "b": 10}}
    return data, layout


def _focus_section(page: _Page, run: Run, focus_seq: int) -> str:
    blocks = _live_at(run, focus_seq) if run.num_events else []
    where = "at the OOM" if run.ooms else "at the peak"
    mark = run.mark_at(focus_seq)
    when = f"event {focus_seq:,}" + (f", {mark.phase} of step {mark.step}" if mark else "")
    total = sum(b.nbytes for b in blocks)
    by_cat = {k: 0 for k in CATEGORIES}
    for b in blocks:
        by_cat[b.category] = by_cat.get(b.category, 0) + b.nbytes
    cat_rows = "".join(
        f"<tr><td><span class=\"swatch\" style=\"background:{CATEGORY_COLORS.get(k, '#bab0ac')}\"></span>{esc(k)}"
        f"</td><td class=\"num\">{esc(format_bytes(v))}</td><td class=\"num\">{100 * v / (total or 1):.1f}%</td></tr>"
        for k, v in by_cat.items() if v)
    cat_table = (f"<table class=\"cats\"><thead><tr><th>category</th><th>bytes</th><th>share</th></tr></thead>"
                 f"<tbody>{cat_rows}<tr class=\"total\"><td>total</td><td class=\"num\">{esc(format_bytes(total))}"
                 f"</td><td></td></tr></tbody></table>")
    top = sorted(blocks, key=lambda b: -b.nbytes)[:TOP_TENSORS]
    trs = "".join(
        f"<tr><td>{esc(b.name or '?')}</td><td>{esc(b.category)}</td><td class=\"num\">{esc(format_bytes(b.nbytes))}"
        f"</td><td>{esc('×'.join(map(str, b.shape)) if b.shape else '()')}</td><td>{esc(b.dtype)}</td>"
        f"<td>{esc(_module_label(module_of(b)))}</td><td>{esc(b.phase)}</td><td class=\"num\">{b.step}</td></tr>"
        for b in top)
    top_table = ("<table class=\"tensors\"><thead><tr><th>tensor</th><th>category</th><th>bytes</th><th>shape</th>"
                 "<th>dtype</th><th>module</th><th>made in</th><th>step</th></tr></thead>"
                 f"<tbody>{trs}</tbody></table>")
    fig = ""
    if blocks:
        data, layout = _treemap(blocks, f"alive {where} ({when}): category → module → tensor")
        fig = page.figure(data, layout, height=560)
    return (f"<section id=\"alive\"><h2>What was alive {where}</h2><p class=\"note\">{esc(when)}; "
            f"{len(blocks):,} tensors, {esc(format_bytes(total))}. Click a box to zoom in.</p>{fig}"
            f"<div class=\"cols\"><div>{cat_table}</div><div class=\"grow\"><h3>largest tensors</h3>{top_table}"
            "</div></div></section>")


# ---- per step -----------------------------------------------------------------------------
def _steps_section(page: _Page, steps: list[dict], growth: float, unit: str, scale: int, limit, other) -> str:
    if len(steps) < 2 and not (other and len(other["steps"]) >= 2):
        return ""                # one step has no slope to show
    data = []
    series = [("before" if other else "peak", steps, "#4e79a7", "#1f3a5f")]
    if other:
        series.append(("after", other["steps"], "#59a14f", "#1e5631"))
    for name, rows, color, dark in series:
        if not rows:
            continue
        data.append({"type": "bar", "x": [r["step"] for r in rows], "y": _scaled([r["peak_bytes"] for r in rows], scale),
                     "name": f"{name}: peak in step", "marker": {"color": color},
                     "hovertemplate": "step %{x}: peak %{y:.2f} " + unit + "<extra></extra>"})
        data.append({"type": "scatter", "mode": "lines+markers", "x": [r["step"] for r in rows],
                     "y": _scaled([r["end_bytes"] for r in rows], scale), "name": f"{name}: live at step end",
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


# ---- allocator segments -------------------------------------------------------------------
def _segments_section(page: _Page, run: Run, tl: ds.Timeline, max_points: int) -> str:
    parts = ["<section id=\"segments\"><h2>Allocator segments</h2>"]
    segs = run.segments or []
    if segs:
        reserved = sum(int(s.get("total_size") or 0) for s in segs)
        allocated = sum(int(s.get("allocated_size") or 0) for s in segs)
        free = sum(int(s.get("inactive_size") or 0) for s in segs)
        largest = max((int(s.get("largest_inactive") or 0) for s in segs), default=0)
        parts.append(f"<p class=\"note\">{len(segs):,} segments: {esc(format_bytes(reserved))} reserved, "
                     f"{esc(format_bytes(allocated))} allocated, {esc(format_bytes(free))} free inside segments "
                     f"(largest free piece {esc(format_bytes(largest))}). A request larger than the largest free "
                     "piece needs a new segment even when the free total would hold it.</p>")
    if run.samples:
        # reserved from the allocator's samples; allocated is the live curve itself (exact
        # at every event, where samples are only taken when a segment comes or goes)
        sx = np.array([s.seq for s in run.samples], dtype=np.int64)
        sx, cols = ds.downsample_series(sx, {"reserved": np.array([s.reserved for s in run.samples],
                                                                   dtype=np.int64)}, "reserved", max_points)
        top = max(int(cols["reserved"].max(initial=0)), tl.peak_bytes, 1)
        sunit, sscale = _unit(top)
        data = [{"type": "scatter", "mode": "lines", "x": sx.tolist(), "y": _scaled(cols["reserved"], sscale),
                 "name": "reserved", "line": {"shape": "hv", "color": "#9c9c9c"}, "fill": "tozeroy",
                 "hovertemplate": "%{y:.2f} " + sunit},
                {"type": "scatter", "mode": "lines", "x": tl.seq.tolist(), "y": _scaled(tl.total, sscale),
                 "name": "allocated", "line": {"shape": "hv", "color": "#4e79a7"}, "fill": "tozeroy",
                 "hovertemplate": "%{y:.2f} " + sunit}]
        layout = {"title": {"text": "reserved vs allocated (the gap is cached, unallocated memory)"},
                  "xaxis": {"title": {"text": "event"}}, "yaxis": {"title": {"text": sunit}, "rangemode": "tozero"},
                  "hovermode": "x unified", "legend": {"orientation": "h", "y": -0.2}}
        parts.append(page.figure(data, layout, height=360))
    if segs:
        ranked = sorted(range(len(segs)), key=lambda i: (-(segs[i].get("inactive_size") or 0),
                                                         -(segs[i].get("total_size") or 0)))[:MAX_SEGMENTS]
        data, layout = _segment_layout([segs[i] for i in ranked], ranked, len(segs))
        parts.append(page.figure(data, layout, height=150 + 20 * len(ranked)))
    parts.append("</section>")
    return "".join(parts)


BLOCK_STATES = {"active_allocated": ("allocated", "#4e79a7"), "inactive": ("free", "#f28e2b"),
                "active_pending_free": ("freed, still in use by a stream", "#b07aa1"),
                "active_awaiting_free": ("freed, still in use by a stream", "#b07aa1")}


def _segment_layout(shown: list[dict], index: list[int], count: int) -> tuple[list, dict]:
    """Each segment as a bar of its blocks in address order, coloured by state: the free
    fragments between allocated blocks are visible as such."""
    gunit, gscale = _unit(max(int(s.get("total_size") or 0) for s in shown) or 1)
    labels, pieces = [], []
    for i, s in zip(index, shown):
        total = int(s.get("total_size") or 0)
        labels.append(plot_text(f"#{i} {s.get('segment_type') or ''} {format_bytes(total)}"
                                + (" expandable" if s.get("is_expandable") else "")))
        blocks = [(int(b.get("size") or 0), b.get("state") or "") for b in s.get("blocks") or []]
        if not blocks:      # no layout recorded: the totals
            a, f = int(s.get("allocated_size") or 0), int(s.get("inactive_size") or 0)
            blocks = [(a, "active_allocated"), (f, "inactive")]
        rest = total - sum(n for n, _ in blocks)
        if rest > 0:
            blocks.append((rest, f"not listed ({s.get('blocks_omitted', 0):,} blocks)"))
        pieces.append(blocks)
    data = []
    for k in range(max(len(p) for p in pieces)):
        xs, colors, hover = [], [], []
        for blocks in pieces:
            size, state = blocks[k] if k < len(blocks) else (0, "")
            name, color = BLOCK_STATES.get(state, (state or "-", "#cccccc"))
            xs.append(size)
            colors.append(color)
            hover.append(f"block {k}: {format_bytes(size)} {plot_text(name)}")
        data.append({"type": "bar", "orientation": "h", "y": labels[::-1], "x": _scaled(xs, gscale)[::-1],
                     "marker": {"color": colors[::-1], "line": {"color": "#ffffff", "width": 1}},
                     "text": hover[::-1], "textposition": "none", "showlegend": False,
                     "hovertemplate": "%{y}<br>%{text}<extra></extra>"})
    seen = {}
    for name, color in BLOCK_STATES.values():
        seen.setdefault(name, color)
    for name, color in seen.items():     # the legend: one entry per state
        data.append({"type": "bar", "orientation": "h", "y": [labels[0]], "x": [0], "name": name,
                     "marker": {"color": color}, "hoverinfo": "skip", "showlegend": True})
    layout = {"title": {"text": f"segments with the most free space (of {count:,}): blocks in address order, {gunit}",
                        "x": 0.01, "xanchor": "left"},
              "barmode": "stack", "bargap": 0.25, "yaxis": {"automargin": True}, "xaxis": {"rangemode": "tozero"},
              "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom",
                         "traceorder": "normal"},
              "hovermode": "closest", "margin": {"l": 20, "r": 30, "t": 60, "b": 40}}
    return data, layout


# ---- before / after -----------------------------------------------------------------------
def _compare(page: _Page, run: Run, tl: ds.Timeline, c: ds.Curves, other: dict, unit: str, scale: int,
             ymax: float) -> str:
    from memdoctor.report.text import headline
    orun, otl, oc = other["run"], other["timeline"], other["curves"]
    figs = []
    half = other["max_points"]
    for name, r, t in (("before", run, ds.timeline(run, half, c) if tl.num_events > half else tl),
                       ("after", orun, otl)):
        traces, shapes, ann = _timeline_traces(r, t, scale, ymax, legend=False, steps=False)
        status = "out of memory" if r.ooms else "no OOM"
        layout = _timeline_layout(unit, ymax, scale, f"<b>{name}</b> · peak {plot_text(format_bytes(t.peak_bytes))}"
                                  f" · {status}", shapes, ann, t.num_events)
        layout["title"] = {"text": layout["title"]["text"], "x": 0.01, "xanchor": "left", "y": 0.97,
                           "font": {"size": 14}}
        layout["showlegend"] = False
        layout["margin"] = {"l": 60, "r": 20, "t": 70, "b": 50}
        figs.append(page.figure(traces, layout, height=400, css="chart half"))
    before = c.by_category_at(tl.peak_seq)
    after = oc.by_category_at(otl.peak_seq)
    rows = []
    for k in CATEGORIES:
        b, a = before.get(k, 0), after.get(k, 0)
        if b or a:
            rows.append(f"<tr><td><span class=\"swatch\" style=\"background:{CATEGORY_COLORS[k]}\"></span>{esc(k)}</td>"
                        f"<td class=\"num\">{esc(format_bytes(b))}</td><td class=\"num\">{esc(format_bytes(a))}</td>"
                        f"<td class=\"num\">{_delta(b, a)}</td></tr>")
    rows.append(f"<tr class=\"total\"><td>peak (total)</td><td class=\"num\">{esc(format_bytes(tl.peak_bytes))}</td>"
                f"<td class=\"num\">{esc(format_bytes(otl.peak_bytes))}</td>"
                f"<td class=\"num\">{_delta(tl.peak_bytes, otl.peak_bytes)}</td></tr>")
    rows.append(f"<tr><td>OOM</td><td>{'yes' if run.ooms else 'no'}</td><td>{'yes' if orun.ooms else 'no'}</td><td></td></tr>")
    rows.append(f"<tr><td>budget</td><td>{esc(format_bytes(run.budget_bytes))}</td>"
                f"<td>{esc(format_bytes(orun.budget_bytes))}</td><td></td></tr>")
    rows.append(f"<tr><td>steps</td><td class=\"num\">{run.steps}</td><td class=\"num\">{orun.steps}</td><td></td></tr>")
    rows.append(f"<tr><td>events</td><td class=\"num\">{run.num_events:,}</td><td class=\"num\">{orun.num_events:,}"
                "</td><td></td></tr>")
    table = ("<table class=\"compare\"><thead><tr><th>at each run's peak</th><th>before</th><th>after</th>"
             f"<th>change</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")
    names = (f"<p class=\"note\">before: <code>{esc(run.script or 'run')}</code>; after: "
             f"<code>{esc(orun.script or 'run')}</code></p>")
    after_head = ""
    if other.get("facts") is not None:
        after_head = f"<p>after: {_inline_code(headline(other['findings'], other['facts']))}</p>"
    return (f"<section id=\"compare\"><h2>Before and after</h2>{names}{after_head}"
            f"{_html_legend()}<div class=\"pair\">{''.join(figs)}</div>{table}</section>")


def _html_legend() -> str:
    items = [f"<span><span class=\"swatch\" style=\"background:{c}\"></span>{esc(k)}</span>"
             for k, c in CATEGORY_COLORS.items()]
    items += [f"<span><span class=\"swatch band\" style=\"background:{c}\"></span>{esc(k)}</span>"
              for k, c in PHASE_COLORS.items()]
    items.append(f"<span><span class=\"swatch\" style=\"background:{OOM_COLOR}\"></span>OOM</span>")
    return f"<p class=\"legend\">{''.join(items)}</p>"


def _delta(before: int, after: int) -> str:
    d = after - before
    if d == 0:
        return "0"
    pct = f" ({100 * d / before:+.0f}%)" if before else ""
    cls = "good" if d < 0 else "bad"
    return f"<span class=\"{cls}\">{'+' if d > 0 else ''}{esc(format_bytes(d))}{pct}</span>"


# ---- static parts -------------------------------------------------------------------------
_CSS = """
:root { --fg:#1d1d1f; --muted:#666; --line:#e3e3e3; --bad:#c62828; --good:#2e7d32; }
body { margin:0; color:var(--fg); background:#f6f7f9; font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif; }
main { max-width:1280px; margin:0 auto; padding:16px 24px 40px; }
header, section { background:#fff; border:1px solid var(--line); border-radius:8px; padding:14px 18px; margin:14px 0; }
h1 { font-size:20px; margin:0 0 6px; } h2 { font-size:17px; margin:0 0 8px; } h3 { font-size:14px; margin:10px 0 6px; }
.headline { font-size:16px; font-weight:600; margin:4px 0 10px; }
.bad { color:var(--bad); } .good { color:var(--good); }
dl.facts { display:grid; grid-template-columns:max-content 1fr; gap:3px 14px; margin:0; }
dl.facts dt { color:var(--muted); } dl.facts dd { margin:0; overflow-wrap:anywhere; }
pre.oom { white-space:pre-wrap; overflow-wrap:anywhere; background:#fff5f5; border-left:3px solid var(--bad);
          padding:8px 10px; margin:10px 0 0; font-size:12px; }
code { font:12px ui-monospace,SFMono-Regular,Menlo,monospace; background:#f1f1f3; padding:0 3px; border-radius:3px; }
.note { color:var(--muted); margin:2px 0 8px; }
article.finding { border-top:1px solid var(--line); padding:6px 0 8px; }
article.finding.first { border-top:none; }
article.finding h3 { font-size:15px; } code.rule { font-size:13px; background:#fde7e7; color:#8e1b1b; }
table { border-collapse:collapse; margin:6px 0; font-size:13px; }
th, td { text-align:left; padding:3px 10px 3px 0; border-bottom:1px solid var(--line); vertical-align:top; }
td.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
tr.total td { font-weight:600; }
table.tensors td:first-child, table.tensors td:nth-child(6) { overflow-wrap:anywhere; max-width:280px; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:6px; }
.cols { display:flex; gap:28px; flex-wrap:wrap; align-items:flex-start; } .cols .grow { flex:1; min-width:420px; }
.pair { display:flex; gap:12px; flex-wrap:wrap; } .chart.half { flex:1 1 560px; min-width:0; }
p.legend { display:flex; flex-wrap:wrap; gap:4px 16px; font-size:12px; color:var(--muted); margin:4px 0; }
.swatch.band { border:1px solid #ccc; }
footer { color:var(--muted); font-size:12px; margin:10px 2px; }
"""

# Runs first: records script errors, blocked network requests and unhandled rejections on
# <body data-*> so a headless browser (and a curious reader) can see them.
_GUARD_JS = """(function(){
var b=document.body;function rec(k,m){var p=b.getAttribute('data-'+k);b.setAttribute('data-'+k,(p?p+' | ':'')+String(m).slice(0,300));}
window.addEventListener('error',function(e){rec('errors',e.message||e);});
window.addEventListener('unhandledrejection',function(e){rec('errors',e.reason&&e.reason.message||e.reason);});
document.addEventListener('securitypolicyviolation',function(e){rec('blocked',e.violatedDirective+' '+e.blockedURI);});
window.__memdoctorRecord=rec;})();"""

# Draws every figure of the JSON block; marks <body data-rendered=N data-expected=M
# data-render-ms=T> when all are drawn.
_APP_JS = """(function(){
var b=document.body,rec=window.__memdoctorRecord;
try{
var data=JSON.parse(document.getElementById('memdoctor-data').textContent);
var config={displaylogo:false,responsive:true,showLink:false,showSendToCloud:false,
modeBarButtonsToRemove:['sendDataToCloud','lasso2d','select2d']};
b.setAttribute('data-expected',String(data.figures.length));
var jobs=data.figures.map(function(f){var div=document.getElementById(f.div);
return Plotly.newPlot(div,f.data,f.layout,config).then(function(){return div.querySelector('svg.main-svg')?1:0;});});
Promise.all(jobs).then(function(r){
b.setAttribute('data-rendered',String(r.reduce(function(a,x){return a+x;},0)));
b.setAttribute('data-render-ms',String(Math.round(performance.now())));
},function(e){rec('errors',e&&e.message||e);});
}catch(e){rec('errors',e&&e.message||e);}
})();"""
