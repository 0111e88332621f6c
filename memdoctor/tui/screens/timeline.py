"""The Timeline tab: live bytes over the run with a cursor, and at the cursor's event the
phase, the bytes by category and the largest tensors alive."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import Static, TabPane

from memdoctor.tui.index import RunIndex, Tensor
from memdoctor.tui.widgets import CATEGORY_STYLE, LivePlot, category_table
from memdoctor.units import format_bytes


def tensor_cells(t: Tensor) -> tuple[Text, Text, str]:
    """(who: module and op or parameter name, shape, bytes) for one live tensor."""
    name = t.name or "?"
    if t.module and name.startswith(t.module + "."):
        name = name[len(t.module) + 1:]
    name = name.removeprefix("aten.")
    who = Text(t.module or "-", style=CATEGORY_STYLE.get(t.category, ""))
    who.append(f" {name}", style="dim")
    shape = "x".join(map(str, t.shape)) if t.shape else ("()" if t.shape is not None else "")
    return who, Text(shape, style="dim"), format_bytes(t.nbytes)


class TimelinePane(TabPane):
    """The plot loads until the index is built; each move of its cursor redraws the lines
    under it in O(log n)."""

    TAB_ID, TAB_TITLE = "timeline", "2 Timeline"

    def __init__(self) -> None:
        super().__init__(self.TAB_TITLE, id=self.TAB_ID)
        self.run_index: RunIndex | None = None

    def compose(self) -> ComposeResult:
        yield Static("loading…", id="tl-caption")
        yield LivePlot(id="tl-plot")
        yield Static(id="tl-where")
        with Horizontal(id="tl-details"):
            yield Static(id="tl-cats")
            yield Static(id="tl-top")

    def on_mount(self) -> None:
        self.query_one("#tl-plot", LivePlot).loading = True

    @property
    def focus_target(self) -> Widget:
        return self.query_one("#tl-plot")

    def show_index(self, ix: RunIndex) -> None:
        self.run_index = ix
        plot = self.query_one("#tl-plot", LivePlot)
        plot.loading = False
        plot.set_index(ix)
        budget = ix.header.budget_bytes or ix.header.device.get("capacity_bytes")
        caption = Text.assemble(("live bytes", "bold"), f" over {ix.num_events:,} events · max ",
                                (format_bytes(ix.peak_bytes), "bold"))
        if budget:
            caption.append(" · ")
            caption.append("┄ ", style="red")
            caption.append(f"{'budget' if ix.header.budget_bytes else 'capacity'} {format_bytes(budget)}")
        self.query_one("#tl-caption", Static).update(caption)

    def show_details(self) -> None:
        """The tensors' names have arrived: redraw the cursor's lines with them."""
        if self.run_index is not None:
            self._render_instant(self.query_one("#tl-plot", LivePlot).seq)

    def show_error(self, line: Text) -> None:
        self.query_one("#tl-caption", Static).update(line)
        self.query_one("#tl-plot", LivePlot).loading = False

    def on_live_plot_moved(self, event: LivePlot.Moved) -> None:
        self._render_instant(event.seq)

    def _render_instant(self, seq: int) -> None:
        ix = self.run_index
        if ix is None:
            return
        total = ix.total_at(seq)
        mark = ix.mark_at(seq)
        where = Text.assemble(("event ", "dim"), (f"{seq:,}", "bold"), (f"/{ix.num_events:,}", "dim"))
        if mark:
            where.append(f" · {mark.phase} · step {mark.step}")
            if mark.module:
                where.append(f" · {mark.module}")
        where.append(" · live ")
        where.append(format_bytes(total), style="bold #ffd75f")
        if seq == ix.peak_seq:
            where.append(" (peak)", style="bold")
        for o in ix.header.ooms[:1]:
            if seq == max(o.seq - 1, 0):
                where.append(" (at the OOM)", style="bold red")
        self.query_one("#tl-where", Static).update(where)
        self.query_one("#tl-cats", Static).update(category_table(ix.by_category(seq), total, bar_width=6,
                                                                 show_zero=False))
        top = Table.grid(padding=(0, 1), expand=True)
        top.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        top.add_column(no_wrap=True, overflow="ellipsis", max_width=10)
        top.add_column(justify="right", no_wrap=True, min_width=10)
        for row in ix.top(seq, 7):
            if ix.has_details:
                top.add_row(*tensor_cells(ix.tensor(row)))
            else:
                top.add_row(Text("reading names…", style="dim italic"), "", format_bytes(int(ix.nbytes[row])))
        self.query_one("#tl-top", Static).update(Group(Text("largest alive", style="bold"), top))
