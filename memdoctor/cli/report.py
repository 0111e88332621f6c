"""`memdoctor report`: a self-contained HTML report of a saved run, or of two (before and after)."""
from __future__ import annotations

import os

from memdoctor.cli.common import EXIT_OK, UsageError, need_extra


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="write a self-contained HTML report of a saved run (of two: before and after)")
    p.add_argument("run", metavar="RUN", help="a saved *.memrun.json.gz run")
    p.add_argument("run2", nargs="?", metavar="RUN2", help="a second run, shown as after, with RUN as before")
    p.add_argument("-o", "--output", metavar="HTML", help="where to write the report (default: STEM.html)")
    p.set_defaults(execute=execute)


def execute(ns) -> int:
    from memdoctor.run import Run
    need_extra("plotly", "report", "the HTML report")
    from memdoctor.report.html import write_report
    from memdoctor.diagnosis import diagnose, facts_from_run
    run = Run.load(ns.run)
    other = Run.load(ns.run2) if ns.run2 else None
    out = ns.output
    if not out:
        stem = os.path.basename(ns.run)
        for suffix in (".gz", ".json", ".memrun"):
            stem = stem.removesuffix(suffix)
        out = (stem or "report") + ".html"
    if os.path.isdir(out):
        raise UsageError(f"{out} is a folder; give a file name for the report")
    facts = facts_from_run(run)
    other_facts = other_findings = None
    if other is not None:
        try:
            other_facts = facts_from_run(other)
            other_findings = diagnose(other_facts)
        except Exception:           # the after run's diagnosis is a bonus: the report draws it without
            other_facts = other_findings = None
    write_report(out, run, diagnose(facts), facts, other_run=other, other_findings=other_findings,
                 other_facts=other_facts)
    print(f"report written to {out}")
    return EXIT_OK
