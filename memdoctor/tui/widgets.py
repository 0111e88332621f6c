"""The TUI's own widgets: the live-bytes plot with its cursor, the tabs, a loading line,
and small renderers."""
from __future__ import annotations

import numpy as np
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import LoadingIndicator, Static, TabbedContent, TabPane

from memdoctor.units import format_bytes
from memdoctor.tui.index import RunIndex

_EIGHTHS = " ▁▂▃▄▅▆▇█"
_HBAR = "▏▎▍▌▋▊▉█"
CATEGORY_STYLE = {
    "weights": "#5fafff", "gradients": "#d787ff", "optimizer_state": "#ffaf5f",
    "activations": "#5fd75f", "temporaries": "#d7d75f", "inputs": "#5fd7d7", "other": "#a8a8a8",
}


def hbar(fraction: float, width: int) -> str:
    """A horizontal bar of `width` cells filled to `fraction`, in eighths of a cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (_HBAR[part - 1] if part else "")
    return text.ljust(width)


def category_table(by_category: dict[str, int], total: int, bar_width: int = 20,
                   show_zero: bool = True) -> Table:
    """category | bar | bytes | share, with a total row."""
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, min_width=15)
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    denom = total or 1
    for cat, n in by_category.items():
        if not n and not show_zero:
            continue
        style = CATEGORY_STYLE.get(cat, "white")
        table.add_row(Text(cat, style=style if n else "dim"), Text(hbar(n / denom, bar_width), style=style),
                      Text(format_bytes(n), style="" if n else "dim"),
                      Text(f"{100 * n / denom:.1f}%" if n else "-", style="" if n else "dim"))
    table.add_row(Text("total", style="bold"), "", Text(format_bytes(total), style="bold"), "")
    return table


class Busy(Vertical):
    """A loading indicator with a line saying what is being waited for."""

    def __init__(self, message: str, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="busy")
        self._message = message

    def compose(self) -> ComposeResult:
        yield Static(Text(self._message), classes="busy-message")     # Text: a path is no markup
        yield LoadingIndicator()

    def say(self, message: str | Text) -> None:
        self.query_one(".busy-message", Static).update(Text(message) if isinstance(message, str) else message)

    def fail(self, line: Text) -> None:
        """Stop spinning and say why, with how to leave."""
        self.query_one(LoadingIndicator).display = False
        self.say(Text.assemble(line, "\n\npress q to quit"))


class Panes(TabbedContent):
    """TabbedContent that follows focus only while the focus is still in the pane: a focus
    message that arrives after a quick switch onward would otherwise switch back."""

    def _on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        event.stop()
        event.prevent_default()
        focused = self.app.focused
        if event.tab_pane.id and focused is not None and event.tab_pane in focused.ancestors_with_self:
            self.active = event.tab_pane.id


class LivePlot(Widget, can_focus=True):
    """Live bytes over the run, one column per slice of events (the slice's maximum), the
    budget as a dotted line and a cursor column. The cursor is an event index (seq)."""

    BINDINGS = [
        Binding("left", "move(-1)", "Scrub", key_display="←→"),
        Binding("right", "move(1)", "Scrub", show=False),
        Binding("shift+left", "move(-10)", "Jump", key_display="⇧←→"),
        Binding("shift+right", "move(10)", "Jump", show=False),
        Binding("pageup", "page(-1)", "Page", show=False),
        Binding("pagedown", "page(1)", "Page", show=False),
        Binding("home", "goto('start')", "Start", show=False),
        Binding("end", "goto('end')", "End", show=False),
        Binding("comma", "step(-1)", "Event", show=False),
        Binding("full_stop", "step(1)", "Event", show=False),
        Binding("p", "goto('peak')", "Peak"),
        Binding("o", "goto('oom')", "OOM"),
    ]

    seq: reactive[int] = reactive(0)

    class Moved(Message):
        def __init__(self, seq: int) -> None:
            super().__init__()
            self.seq = seq

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.index: RunIndex | None = None
        self._width = -1
        self._maxes = self._where = self._starts = np.zeros(1, dtype=np.int64)

    def set_index(self, index: RunIndex) -> None:
        self.index = index
        self._width = -1
        self.seq = index.peak_seq
        self.post_message(self.Moved(self.seq))
        self.refresh()

    # ---- geometry ---------------------------------------------------------------
    def _columns(self) -> None:
        # a pane just switched to has no size until its next layout: keep the last width
        width = self.size.width or (self._width if self._width > 0 else max(self.app.size.width - 2, 1))
        if self.index is not None and width != self._width:
            self._maxes, self._where, self._starts = self.index.buckets(width)
            self._width = width

    def column_of(self, seq: int) -> int:
        self._columns()
        return max(int(np.searchsorted(self._starts, seq, "right")) - 1, 0)

    # ---- actions -----------------------------------------------------------------
    def _set(self, seq: int) -> None:
        if self.index is None:
            return
        seq = self.index.clamp(seq)
        if seq != self.seq:
            self.seq = seq
            self.post_message(self.Moved(seq))

    def action_move(self, columns: int) -> None:
        """Move by whole columns, landing on the highest instant of the column."""
        if self.index is None:
            return
        last = len(self._where) - 1
        col = min(max(self.column_of(self.seq) + columns, 0), last)
        step = 1 if columns > 0 else -1
        while 0 < col < last and int(self._where[col]) == self.seq:   # an event wider than a column
            col += step
        self._set(int(self._where[col]))

    def action_page(self, direction: int) -> None:
        self._columns()
        self.action_move(direction * max(len(self._where) // 4, 1))

    def action_step(self, events: int) -> None:
        self._set(self.seq + events)

    def action_goto(self, where: str) -> None:
        ix = self.index
        if ix is None:
            return
        if where == "start":
            self._set(0)
        elif where == "end":
            self._set(ix.num_events - 1)
        elif where == "peak":
            self._set(ix.peak_seq)
        elif where == "oom":
            if ix.header.ooms:
                self._set(max(ix.header.ooms[0].seq - 1, 0))
            else:
                self.notify("this run did not run out of memory", timeout=2)

    def watch_seq(self, _old: int, _new: int) -> None:
        self.refresh()

    def on_resize(self) -> None:
        self._columns()

    # ---- drawing -----------------------------------------------------------------
    def render(self) -> Text:
        height = max(self.size.height, 1)
        if self.index is None or not self.index.num_events:
            return Text("no events", style="dim")
        self._columns()
        ix = self.index
        budget = ix.header.budget_bytes or ix.header.device.get("capacity_bytes")
        top = max(int(self._maxes.max()), budget or 0, 1)
        levels = np.round(self._maxes / top * height * 8).astype(np.int64)
        first = int(np.searchsorted(self._starts, self.seq, "left"))
        cursor_cols = range(min(first, self.column_of(self.seq)), self.column_of(self.seq) + 1)
        oom_col = self.column_of(ix.header.ooms[0].seq) if ix.header.ooms else -1
        budget_row = height - 1 - min(int(budget / top * height), height - 1) if budget else -1
        out = Text(no_wrap=True, overflow="crop")
        bar_style, cur_style = "#5f87d7", "bold #ffd75f on #3a3a3a"
        for row in range(height):
            base = (height - 1 - row) * 8
            line = []
            for col, level in enumerate(levels.tolist()):
                fill = min(max(level - base, 0), 8)
                ch = _EIGHTHS[fill]
                if col in cursor_cols:
                    style = cur_style
                    if fill == 0:
                        ch = "│"
                elif fill == 0 and row == budget_row:
                    ch, style = "┄", "red"
                elif col == oom_col:
                    style = "bold red"
                else:
                    style = bar_style
                line.append((ch, style))
            run_text, run_style = "", None
            for ch, style in line:                  # one span per run of a style, not per cell
                if style != run_style and run_text:
                    out.append(run_text, run_style)
                    run_text = ""
                run_text, run_style = run_text + ch, style
            out.append(run_text, run_style)
            if row < height - 1:
                out.append("\n")
        return out
