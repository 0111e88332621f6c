"""Terminal output for people: tables (with rich) and plain lines, for every command."""
from __future__ import annotations

import functools
import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memdoctor.attribution import Breakdown
from memdoctor.run import Run
from memdoctor.sanitize import printable
from memdoctor.units import format_bytes


PIPE_WIDTH = 120      # a table's width when the output is no terminal (a log, a pipe, CI)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader (`| head`) left: the CLI stops quietly with the shell's code for it (rich
        would exit 1)."""
        raise BrokenPipeError


def terminal_console() -> Console:
    """A console on stdout; into a file or a pipe, PIPE_WIDTH columns wide (or $COLUMNS),
    so that tables keep readable columns instead of rich's 80."""
    if sys.stdout.isatty():
        return _Console()
    columns = os.environ.get("COLUMNS", "")
    return _Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else PIPE_WIDTH)


def _cell(value) -> str:
    """A name from a run or a file, for a rich table or markup: control characters out
    (memdoctor.sanitize), brackets shown as themselves rather than read as markup."""
    return escape(printable(value))


def _printable_lines(make_lines):
    """Lines built from names a file holds: each passed through memdoctor.sanitize."""
    @functools.wraps(make_lines)
    def wrapper(*args, **kwargs) -> list[str]:
        return [printable(line) for line in make_lines(*args, **kwargs)]
    return wrapper


def breakdown_table(b: Breakdown, title: str) -> Table:
    table = Table(title=title, title_justify="left", min_width=len(title))   # the title on one line
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = b.total_bytes or 1
    for cat, n in b.by_category.items():
        if n:
            table.add_row(_cell(cat), format_bytes(n), f"{100 * n / total:.1f}%")
    table.add_row("[bold]total[/bold]", f"[bold]{format_bytes(b.total_bytes)}[/bold]", "")
    return table


def top_table(b: Breakdown, limit: int = 8) -> Table:
    table = Table(title="largest tensors alive", title_justify="left")
    table.add_column("tensor", overflow="fold")
    table.add_column("category", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("shape dtype", overflow="fold")
    table.add_column("module", overflow="fold")
    table.add_column("made in", no_wrap=True)
    lines = any(getattr(t, "source", "") for t in b.top[:limit])
    if lines:
        table.add_column("line", overflow="fold")     # "train.py:25"; JSON has the text too
    for t in b.top[:limit]:
        shape = "x".join(map(str, t.shape)) or "()"
        table.add_row(_cell(t.name or "?"), _cell(t.category), format_bytes(t.nbytes), _cell(f"{shape} {t.dtype}"),
                      _cell(t.module or "-"), _cell(f"{t.phase} {t.step}"),
                      *([_cell(t.source.split(" ", 1)[0] or "-")] if lines else []))
    return table


def module_table(b: Breakdown, limit: int = 8) -> Table:
    table = Table(title="by module", title_justify="left")
    table.add_column("module")
    table.add_column("bytes", justify="right")
    for name, n in list(b.by_module.items())[:limit]:
        table.add_row(_cell(name), format_bytes(n))
    return table


def print_trace(run: Run, peak: Breakdown, console: Console | None = None) -> None:
    console = console or terminal_console()
    budget = f" (budget {format_bytes(run.budget_bytes)})" if run.budget_bytes else ""
    if run.ooms:
        o = run.ooms[0]
        kind = "simulated " if o.simulated else ""
        console.print(f"[bold red]{kind}out of memory[/bold red] in {_cell(o.phase)} of step {o.step}"
                      f"{' in ' + _cell(o.module) if o.module else ''}: tried to allocate "
                      f"{format_bytes(o.requested_bytes)} with {format_bytes(o.live_bytes)} live{budget}")
    console.print(f"peak {format_bytes(peak.total_bytes)} in {_cell(peak.phase)} of step {peak.step}{budget}")
    console.print(breakdown_table(peak, "memory at the peak"))
    console.print(module_table(peak))
    console.print(top_table(peak))


def headline(findings, facts) -> str:
    """The first line a person reads: the cause and what it costs."""
    if not findings:
        if facts.oom:
            return "out of memory, but no rule names a cause: see the breakdown below"
        return f"no memory problem found: peak {format_bytes(facts.peak_bytes)}" + (
            f" within the {format_bytes(facts.limit_bytes)} limit" if facts.limit_bytes else "")
    top = findings[0]
    if not facts.oom:       # it fits: say so first; the finding is what comes closest to the limit
        return (f"fits: peak {format_bytes(facts.peak_bytes)}"
                + (f" within the {format_bytes(facts.limit_bytes)} limit" if facts.limit_bytes else "")
                + f"; closest to it: {top.rule}: {top.title}")
    return f"{top.rule}: {top.title}"


def finding_body_lines(finding, facts) -> list[str]:
    """A finding's evidence and its fixes with their predicted peaks, against the limit."""
    lines = source_lines(finding)
    lines += [f"  - {e}" for e in finding.evidence]
    if finding.remedies:
        lines.append("  fixes (predicted peak):")
        for r in finding.remedies:
            fits = "" if facts.limit_bytes is None or r.predicted_peak_bytes is None else (
                " fits" if r.predicted_peak_bytes <= facts.limit_bytes else " does not fit")
            lines.append(f"    * {r.title}: {r.how} -> {format_bytes(r.predicted_peak_bytes)}{fits}")
            if r.in_framework:
                lines.append(f"      in {r.in_framework}")
    return lines


def source_lines(finding) -> list[str]:
    """The user's line of a finding: "  at train.py:25  history.append(loss)  (keeps them
    alive ...)", and where what it keeps was made."""
    src = getattr(finding, "source", None)
    if not src:
        return []
    lines = [f"  at {src['label']}  {src['text'] or src.get('function', '')}  ({src['role']})"]
    made = src.get("made_at")
    if made:
        lines.append(f"     made at {made['label']}  {made['text'] or made.get('function', '')}")
    return lines


@_printable_lines
def diagnosis_lines(findings, facts) -> list[str]:
    """The diagnosis as plain lines: headline, evidence, remedies, other findings."""
    lines = [headline(findings, facts)]
    if not findings:
        return lines
    lines += finding_body_lines(findings[0], facts)
    for other in findings[1:]:
        at = f" (at {other.source['label']})" if getattr(other, "source", None) else ""
        lines.append(f"also: {other.rule}: {other.title}{at}")
    return lines


def print_diagnosis(findings, facts, console: Console | None = None) -> None:
    console = console or terminal_console()
    lines = diagnosis_lines(findings, facts)
    style = "bold red" if facts.oom else "bold"
    console.print(f"[{style}]{escape(lines[0])}[/{style}]", highlight=False, soft_wrap=True)
    for line in lines[1:]:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    focus = facts.focus
    if focus is not None:
        where = "at the OOM" if facts.oom else "at the peak"
        phase, step = (facts.oom_phase, facts.oom_step) if facts.oom and facts.oom_phase else (focus.phase, focus.step)
        console.print(breakdown_table(focus, f"memory {where} ({_cell(phase)}, step {step})"))
        console.print(top_table(focus))


@_printable_lines
def ranks_lines(diagnosed, merged, first) -> list[str]:
    """A multi-rank diagnosis: who ran out first, then each cause with the ranks it was
    found on and its evidence and fixes from the rank where it weighs most.
    `diagnosed`: (rank, run, path, facts, findings) per rank."""
    facts_of = {rank: facts for rank, _, _, facts, _ in diagnosed}
    lines = [f"{len(diagnosed)} ranks: " + ", ".join(
        f"rank {rank} {'out of memory' if facts.oom else 'ran'} (peak {format_bytes(facts.peak_bytes)})"
        for rank, _, _, facts, _ in diagnosed)]
    if first is not None:
        rank, oom = first
        lines.append(f"rank {rank} ran out of memory first: {oom.phase} of step {oom.step}, tried to allocate "
                     f"{format_bytes(oom.requested_bytes)}")
    if not merged:
        lines.append("no rule names a cause on any rank")
        return lines
    for i, m in enumerate(merged):
        f = m.finding
        on = ("all ranks" if len(m.ranks) == len(diagnosed) else
              ("rank " if len(m.ranks) == 1 else "ranks ") + ", ".join(map(str, m.ranks)))
        lines.append(f"{'' if i == 0 else 'also: '}{f.rule} on {on}: {f.title}"
                     + (f" (evidence from rank {m.worst_rank})" if len(m.ranks) > 1 else ""))
        if i == 0:
            lines += finding_body_lines(f, facts_of[m.worst_rank])
    return lines


@_printable_lines
def comparison_lines(data: dict, script: str) -> list[str]:
    """`diagnose SCRIPT --try FIX`: before | after, side by side, then what was injected.
    `data`: report.json.comparison_json."""
    b, a = data["before"], data["after"]

    def rule(side):
        return side["first_finding"]["rule"] if side["first_finding"] else "none"

    def result(side):
        if side["oom"]:
            return "out of memory"
        return "ran" if side["exit_code"] in (0, None) else f"failed (exit {side['exit_code']})"
    budget = f" within {format_bytes(data['budget_bytes'])}" if data.get("budget_bytes") else ""
    rows = [("", "before", f"after --try {data['fix']}"),
            ("peak", format_bytes(b["peak_bytes"]), format_bytes(a["peak_bytes"])),
            ("OOM", "yes" if b["oom"] else "no", "yes" if a["oom"] else "no"),
            ("result", result(b), result(a)),
            ("first finding", rule(b), rule(a))]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"memdoctor: {os.path.basename(script)}{budget}, as written and with {data['fix']} injected"]
    lines += [f"  {r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}" for r in rows]
    for side, label in ((b, "before"), (a, "after")):
        if side["first_finding"]:
            lines.append(f"  {label}: {side['first_finding']['rule']}: {side['first_finding']['title']}")
        if side["error"] and not side["oom"]:
            lines.append(f"  {label}: the script failed: {side['error']}")
    lines += [f"  injected: {line}" for line in a.get("injected", [])]
    lines += [f"  not injected: {line}" for line in a.get("not_injected", [])]
    return lines


@_printable_lines
def plan_lines(model: str, batch: int, seq: int | None, budget: int, shown, fitting: bool) -> list[str]:
    """`memdoctor plan`: the plans that fit (first choice on top), or the closest ones."""
    lines = [f"{model} batch {batch}" + (f" seq {seq}" if seq else "") + f", budget {format_bytes(budget)}: " +
             (f"{len(shown)} plans fit, first choice on top" if fitting else "no plan fits; the closest ones:"),
             f"{'plan':<44} {'peak reserved':>13} {'cost':>6} {'H200 s':>7}  note"]
    for c in shown:
        lines.append(f"{str(c.plan):<44} {format_bytes(c.predicted_peak_reserved):>13} {c.cost:>6.2f} "
                     f"{c.step_seconds:>7.3f}  {c.note}")
    return lines
