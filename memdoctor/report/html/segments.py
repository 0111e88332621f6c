"""The allocator segments section: reserved against allocated, and the blocks of the segments
with the most free space."""
from __future__ import annotations

import numpy as np

from memdoctor.report import downsample as ds
from memdoctor.report.html.escape import esc, plot_text
from memdoctor.report.html.page import Page
from memdoctor.report.html.style import axis_unit, scaled
from memdoctor.run import Run
from memdoctor.units import format_bytes

MAX_SEGMENTS = 80


def segments_section(page: Page, run: Run, tl: ds.Timeline, max_points: int) -> str:
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
        sunit, sscale = axis_unit(top)
        data = [{"type": "scatter", "mode": "lines", "x": sx.tolist(), "y": scaled(cols["reserved"], sscale),
                 "name": "reserved", "line": {"shape": "hv", "color": "#9c9c9c"}, "fill": "tozeroy",
                 "hovertemplate": "%{y:.2f} " + sunit},
                {"type": "scatter", "mode": "lines", "x": tl.seq.tolist(), "y": scaled(tl.total, sscale),
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
    gunit, gscale = axis_unit(max(int(s.get("total_size") or 0) for s in shown) or 1)
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
        data.append({"type": "bar", "orientation": "h", "y": labels[::-1], "x": scaled(xs, gscale)[::-1],
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
