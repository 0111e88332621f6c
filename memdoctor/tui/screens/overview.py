"""The Overview tab: what was run, the peak against the budget, the OOM, memory by category
at the peak, and the diagnosis in two lines."""
from __future__ import annotations

import os

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static, TabPane

from memdoctor.tui.index import RunIndex
from memdoctor.tui.widgets import Busy, category_table
from memdoctor.units import format_bytes


class OverviewPane(TabPane):
    """A busy line until the index is built, then the summary; the headline says
    "diagnosing…" until the findings arrive."""

    TAB_ID, TAB_TITLE = "overview", "1 Overview"

    def __init__(self, busy_message: str) -> None:
        super().__init__(self.TAB_TITLE, id=self.TAB_ID)
        self._busy_message = busy_message

    def compose(self) -> ComposeResult:
        yield Busy(self._busy_message, id="ov-busy")
        with VerticalScroll(id="ov-body", classes="pane-body"):
            yield Static(id="ov-summary")
            yield Static(id="ov-bars")
            yield Static(id="ov-headline")

    def on_mount(self) -> None:
        self.query_one("#ov-body").display = False

    @property
    def focus_target(self) -> Widget:
        return self.query_one("#ov-body")

    def say(self, message: str) -> None:
        self.query_one("#ov-busy", Busy).say(message)

    def show_index(self, ix: RunIndex, path: str | None, script_error: str | None) -> None:
        """The summary and the bars at the peak; `script_error`: a traced script's failure
        that was not an OOM."""
        self.query_one("#ov-busy").display = False
        self.query_one("#ov-body").display = True
        h = ix.header
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        what = os.path.basename(h.script) if h.script else (os.path.basename(path) if path else "run")
        steps = max((m.step for m in h.marks), default=-1) + 1
        grid.add_row("run", f"{what} · {h.source} on {h.device.get('type', 'cpu')} · "
                            f"{ix.num_events:,} events · {steps} step{'s' if steps != 1 else ''}")
        mark = ix.mark_at(ix.peak_seq)
        where = f"in {mark.phase} of step {mark.step}" if mark else ""
        grid.add_row("peak", Text.assemble((format_bytes(ix.peak_bytes), "bold"), f"  {where} (event {ix.peak_seq:,})"))
        limit = h.budget_bytes or h.device.get("capacity_bytes")
        if limit:
            kind = "budget" if h.budget_bytes else "capacity"
            grid.add_row(kind, f"{format_bytes(limit)} · the peak is {100 * ix.peak_bytes / limit:.0f}% of it")
        else:
            grid.add_row("budget", Text("none set", style="dim"))
        if h.ooms:
            o = h.ooms[0]
            kind = "simulated " if o.simulated else ""
            inside = f" in module {o.module}" if o.module else ""
            grid.add_row(Text("OOM", style="bold red"),
                         Text(f"{kind}out of memory in {o.phase} of step {o.step}{inside}: tried to allocate "
                              f"{format_bytes(o.requested_bytes)} with {format_bytes(o.live_bytes)} live",
                              style="red"))
        else:
            grid.add_row("OOM", Text("none", style="green"))
        if script_error:
            grid.add_row(Text("script", style="bold red"), Text(script_error, style="red"))
        self.query_one("#ov-summary", Static).update(grid)
        bars = category_table(ix.by_category(ix.peak_seq), ix.total_at(ix.peak_seq), bar_width=30)
        self.query_one("#ov-bars", Static).update(Group(Text("memory at the peak", style="bold underline"), bars))
        self.query_one("#ov-headline", Static).update(Text("diagnosing…", style="dim italic"))

    def show_diagnosis(self, findings: list, facts) -> None:
        from memdoctor.report.text import headline
        lines = [Text(headline(findings, facts), style="bold red" if facts.oom else "bold")]
        if findings:
            top = findings[0]
            more = f" · {len(findings) - 1} more finding{'s' if len(findings) != 2 else ''}" \
                if len(findings) > 1 else ""
            lines.append(Text(f"accounts for {format_bytes(top.accounts_for_bytes)} · "
                              f"{len(top.remedies)} remed{'ies' if len(top.remedies) != 1 else 'y'}{more} · "
                              "4 Findings, 5 Remedies", style="dim"))
        self.query_one("#ov-headline", Static).update(Group(Text("diagnosis", style="bold underline"), *lines))

    def show_error(self, line: Text, indexed: bool) -> None:
        """Under the summary when it was shown, else in place of the busy line."""
        if indexed:
            self.query_one("#ov-headline", Static).update(Text.assemble(line, "\npress q to quit"))
        else:
            self.query_one("#ov-busy", Busy).fail(line)
