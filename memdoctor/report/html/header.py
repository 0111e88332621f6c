"""The report's header (script, device, peak, budget, OOM, the headline) and footer."""
from __future__ import annotations

from memdoctor.report import downsample as ds
from memdoctor.report.html.escape import esc, inline_code
from memdoctor.report.text import headline
from memdoctor.run import Run
from memdoctor.units import format_bytes
from memdoctor.version import __version__


def header(run: Run, facts, findings, tl: ds.Timeline, focus_seq: int) -> str:
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
    return (f"<header><h1>memdoctor report</h1><p class=\"{cls}\">{inline_code(headline(findings, facts))}</p>"
            f"<dl class=\"facts\">{dl}</dl>{oom_html}</header>")


def footer(tl: ds.Timeline) -> str:
    sampled = (f"The timeline draws {len(tl.seq):,} of {tl.num_events:,} events (lowest and highest "
               "live total per bucket; the peak and every OOM exact)" if tl.downsampled
               else "The timeline draws every event")
    return (f"<footer>memdoctor {esc(__version__)}. Self-contained: plotly.js is inlined and the page "
            f"loads nothing from the network. {sampled}.</footer>")
