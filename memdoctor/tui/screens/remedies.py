"""The Remedies tab: the remedies of the finding picked in Findings, each with the peak it is
predicted to give and whether that fits the limit."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static, TabPane

from memdoctor.tui.widgets import Busy
from memdoctor.units import format_bytes


class RemediesPane(TabPane):
    """A busy line until the rules have run."""

    TAB_ID, TAB_TITLE = "remedies", "5 Remedies"

    def __init__(self) -> None:
        super().__init__(self.TAB_TITLE, id=self.TAB_ID)

    def compose(self) -> ComposeResult:
        yield Busy("diagnosing…", id="rm-busy")
        with VerticalScroll(id="rm-body", classes="pane-body"):
            yield Static(id="rm-head")
            yield Static(id="rm-table")

    def on_mount(self) -> None:
        self.query_one("#rm-body").display = False

    @property
    def focus_target(self) -> Widget:
        return self.query_one("#rm-body")

    def show_error(self, line: Text) -> None:
        self.query_one("#rm-busy", Busy).fail(line)

    def show(self, findings: list, selected: int, facts) -> None:
        """The remedies of findings[selected]."""
        self.query_one("#rm-busy").display = False
        self.query_one("#rm-body").display = True
        head = self.query_one("#rm-head", Static)
        body = self.query_one("#rm-table", Static)
        if not findings:
            head.update(Text("no findings, so nothing to remedy", style="dim"))
            body.update("")
            return
        f = findings[selected]
        limit = facts.limit_bytes
        head.update(Group(
            Text.assemble(("for ", "dim"), (f"{selected + 1}. {f.rule}", "bold #ffd75f"),
                          (" (4 Findings to pick another)", "dim")),
            Text.assemble(("now: peak ", "dim"), (format_bytes(facts.peak_bytes), "bold"),
                          (f" · {'limit' if limit else 'no limit'} ", "dim"),
                          (format_bytes(limit) if limit else "", "bold"))))
        table = Table(expand=True, show_edge=False, pad_edge=False, box=None, header_style="bold dim")
        table.add_column("#", width=2, no_wrap=True)
        table.add_column("remedy", ratio=1)
        table.add_column("predicted", justify="right", no_wrap=True)
        table.add_column("fits", justify="center", no_wrap=True, width=4)
        for i, r in enumerate(f.remedies):
            what = Text(r.title, style="bold")
            what.append(f"\n{r.how}", style="")
            if r.plan:
                what.append(f"\nplan: {r.plan}", style="dim")
            if limit is None or r.predicted_peak_bytes is None:
                fit = Text("?", style="dim")
            elif r.predicted_peak_bytes <= limit:
                fit = Text("yes", style="bold green")
            else:
                fit = Text("no", style="bold red")
            table.add_row(str(i + 1), what, format_bytes(r.predicted_peak_bytes), fit)
        body.update(table if f.remedies else Text("this finding has no remedies", style="dim"))
