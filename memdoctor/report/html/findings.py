"""The findings section: each finding's evidence and fixes, and the predicted peak after each fix."""
from __future__ import annotations

from memdoctor.report.html.escape import esc, inline_code, plot_text
from memdoctor.report.html.page import Page
from memdoctor.report.html.style import BUDGET_COLOR, OOM_COLOR, scaled
from memdoctor.units import format_bytes


def _source(finding) -> str:
    """The user's line of a finding (and where what it keeps alive was made)."""
    src = getattr(finding, "source", None)
    if not src:
        return ""
    out = (f"<p class=\"source\">at <code>{esc(src['label'])}</code> <code>{esc(src['text'])}</code> "
           f"({esc(src['role'])})")
    made = src.get("made_at")
    if made:
        out += f"; made at <code>{esc(made['label'])}</code> <code>{esc(made['text'])}</code>"
    return out + "</p>"


def findings_section(page: Page, findings, facts, unit: str, scale: int) -> str:
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
        ev = "".join(f"<li>{inline_code(e)}</li>" for e in f.evidence)
        rows = []
        for r in f.remedies:
            verdict = ""
            if r.predicted_peak_bytes is not None and limit:
                verdict = ("<span class=\"good\">fits</span>" if r.predicted_peak_bytes <= limit
                           else "<span class=\"bad\">does not fit</span>")
            rows.append(f"<tr><td>{esc(r.title)}</td><td>{inline_code(r.how)}</td>"
                        f"<td class=\"num\">{esc(format_bytes(r.predicted_peak_bytes))}</td><td>{verdict}</td>"
                        f"<td>{'<code>' + esc(r.plan) + '</code>' if r.plan else ''}</td></tr>")
        table = ("<table class=\"remedies\"><thead><tr><th>fix</th><th>how</th><th>predicted peak</th>"
                 f"<th>vs limit</th><th>plan</th></tr></thead><tbody>{''.join(rows)}</tbody></table>" if rows else "")
        parts.append(
            f"<article class=\"finding{' first' if i == 0 else ''}\"><h3><code class=\"rule\">{esc(f.rule)}</code> "
            f"{esc(f.title)}</h3><p>accounts for <b>{esc(format_bytes(f.accounts_for_bytes))}</b> {fits}</p>"
            f"{_source(f)}<ul>{ev}</ul>{table}</article>")
    bars = [(f"{f.rule}: {r.title}", r.predicted_peak_bytes) for f in findings for r in f.remedies
            if r.predicted_peak_bytes is not None][:20]
    if bars:
        now = facts.focus_bytes or facts.peak_bytes
        labels = ["now" + (" (at the OOM, with the request)" if facts.oom else " (peak)")] + [b[0] for b in bars]
        values = [now] + [b[1] for b in bars]
        colors = ["#888888"] + ["#59a14f" if (not limit or v <= limit) else OOM_COLOR for _, v in bars]
        data = [{"type": "bar", "orientation": "h", "y": [plot_text(x, 70) for x in labels][::-1],
                 "x": scaled(values, scale)[::-1], "marker": {"color": colors[::-1]},
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
