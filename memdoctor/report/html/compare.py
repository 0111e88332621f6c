"""Before and after: the two timelines side by side and the breakdowns at each run's peak."""
from __future__ import annotations

from memdoctor.report import downsample as ds
from memdoctor.report.html.escape import esc, inline_code, plot_text
from memdoctor.report.html.page import Page
from memdoctor.report.html.style import CATEGORY_COLORS, OOM_COLOR, PHASE_COLORS
from memdoctor.report.html.timeline import timeline_layout, timeline_traces
from memdoctor.report.text import headline
from memdoctor.run import CATEGORIES, Run
from memdoctor.units import format_bytes


def compare_section(page: Page, run: Run, tl: ds.Timeline, c: ds.Curves, other: dict, unit: str, scale: int,
                    ymax: float) -> str:
    orun, otl, oc = other["run"], other["timeline"], other["curves"]
    figs = []
    half = other["max_points"]
    for name, r, t in (("before", run, ds.timeline(run, half, c) if tl.num_events > half else tl),
                       ("after", orun, otl)):
        traces, shapes, ann = timeline_traces(r, t, scale, ymax, legend=False, steps=False)
        status = "out of memory" if r.ooms else "no OOM"
        layout = timeline_layout(unit, ymax, scale, f"<b>{name}</b> · peak {plot_text(format_bytes(t.peak_bytes))}"
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
    if other["facts"] is not None and other["findings"] is not None:
        after_head = f"<p>after: {inline_code(headline(other['findings'], other['facts']))}</p>"
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
