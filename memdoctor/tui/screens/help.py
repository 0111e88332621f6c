"""The help screen: every key of the TUI, over whatever tab is showing."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]memdoctor tui[/b]: why a PyTorch run ran out of memory

[b]screens[/b]
  [b]1[/b]-[b]5[/b], [b]tab[/b] / [b]shift+tab[/b]   Overview, Timeline, Modules, Findings, Remedies
  [b]q[/b]                     quit        [b]?[/b]  this help

[b]timeline[/b]
  [b]← →[/b]           one column (lands on the column's highest instant)
  [b]shift+← →[/b]     ten columns      [b]pgup pgdn[/b]  a quarter of the run
  [b], .[/b]           one event        [b]home end[/b]   start, end
  [b]p[/b]             the peak         [b]o[/b]          the OOM

[b]modules[/b]    [b]↑ ↓[/b] move, [b]enter[/b]/[b]space[/b] expand or fold
[b]findings[/b]   [b]↑ ↓[/b] pick (Remedies follows), [b]enter[/b] read it, [b]esc[/b] back

[dim]press ? or esc to close[/dim]"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss_help", "Close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help-body")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)
