"""The HTML report: one self-contained file that opens offline.

    write_report(path, run, findings, facts)                      # as `diagnose` has them
    write_report(path, before, findings, facts, other_run=after,  # before and after
                 other_findings=..., other_facts=...)

The caller diagnoses; the report only draws what it is given. plotly.js is inlined (never
a CDN), the page's data sits in one JSON block, and a Content-Security-Policy allows only
the page's own scripts (by hash) and no network access at all. Every name that comes from
user code (module, tensor, script path, OOM message) is escaped where it appears:
html.escape in the markup; in the JSON block `<`, `>`, `&` and U+2028/U+2029 as \\u
escapes, so `</script>` cannot close it; and in chart labels (which plotly reads as a small
HTML subset) as entities too.
"""
from memdoctor.report.html.escape import esc, plot_text, script_json
from memdoctor.report.html.render import render_report, write_report

__all__ = ["write_report", "render_report", "esc", "plot_text", "script_json"]
