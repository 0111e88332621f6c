"""Terminal output with rich: the breakdown table and the findings."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memdoctor.attribution import Breakdown
from memdoctor.run import Run
from memdoctor.units import format_bytes


def breakdown_table(b: Breakdown, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = b.total_bytes or 1
    for cat, n in b.by_category.items():
        if n:
            table.add_row(cat, format_bytes(n), f"{100 * n / total:.1f}%")
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
    for t in b.top[:limit]:
        shape = "x".join(map(str, t.shape)) or "()"
        table.add_row(t.name or "?", t.category, format_bytes(t.nbytes), f"{shape} {t.dtype}",
                      t.module or "-", f"{t.phase} {t.step}")
    return table


def module_table(b: Breakdown, limit: int = 8) -> Table:
    table = Table(title="by module", title_justify="left")
    table.add_column("module")
    table.add_column("bytes", justify="right")
    for name, n in list(b.by_module.items())[:limit]:
        table.add_row(name, format_bytes(n))
    return table


def print_trace(run: Run, peak: Breakdown, console: Console | None = None) -> None:
    console = console or Console()
    budget = f" (budget {format_bytes(run.budget_bytes)})" if run.budget_bytes else ""
    if run.ooms:
        o = run.ooms[0]
        kind = "simulated " if o.simulated else ""
        console.print(f"[bold red]{kind}out of memory[/bold red] in {o.phase} of step {o.step}"
                      f"{' in ' + o.module if o.module else ''}: tried to allocate "
                      f"{format_bytes(o.requested_bytes)} with {format_bytes(o.live_bytes)} live{budget}")
    console.print(f"peak {format_bytes(peak.total_bytes)} in {peak.phase} of step {peak.step}{budget}")
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
    return f"{top.rule}: {top.title}"


def finding_body_lines(finding, facts) -> list[str]:
    """A finding's evidence and its fixes with their predicted peaks, against the limit."""
    lines = [f"  - {e}" for e in finding.evidence]
    if finding.remedies:
        lines.append("  fixes (predicted peak):")
        for r in finding.remedies:
            fits = "" if facts.limit_bytes is None or r.predicted_peak_bytes is None else (
                " fits" if r.predicted_peak_bytes <= facts.limit_bytes else " does not fit")
            lines.append(f"    * {r.title}: {r.how} -> {format_bytes(r.predicted_peak_bytes)}{fits}")
    return lines


def diagnosis_lines(findings, facts) -> list[str]:
    """The diagnosis as plain lines: headline, evidence, remedies, other findings."""
    lines = [headline(findings, facts)]
    if not findings:
        return lines
    lines += finding_body_lines(findings[0], facts)
    for other in findings[1:]:
        lines.append(f"also: {other.rule}: {other.title}")
    return lines


def print_diagnosis(findings, facts, console: Console | None = None) -> None:
    console = console or Console()
    lines = diagnosis_lines(findings, facts)
    style = "bold red" if facts.oom else "bold"
    console.print(f"[{style}]{lines[0]}[/{style}]", highlight=False, soft_wrap=True)
    for line in lines[1:]:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    focus = facts.focus
    if focus is not None:
        where = "at the OOM" if facts.oom else "at the peak"
        console.print(breakdown_table(focus, f"memory {where} ({focus.phase}, step {focus.step})"))
        console.print(top_table(focus))


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
