"""The Findings tab: the ranked findings as a list, and the highlighted one in full (its
evidence and its rule's explanation)."""
from __future__ import annotations

from rich.console import Group
from rich.padding import Padding
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import OptionList, Static, TabPane
from textual.widgets.option_list import Option

from memdoctor.tui.widgets import Busy
from memdoctor.units import format_bytes


def explain_renderables(doc: str) -> list:
    """A rule's docstring for a narrow screen: headings bold, prose re-wrapped to the width,
    the example kept line for line."""
    out: list = []
    heading, para = None, []

    def flush() -> None:
        if not para:
            return
        if heading and heading.lower().startswith("example"):
            out.append(Padding(Text("\n".join(para), style="#87d7af", no_wrap=True, overflow="ellipsis"),
                               (0, 0, 0, 2)))
        else:
            out.append(Padding(Text(" ".join(para)), (0, 0, 0, 2)))
        para.clear()

    for line in doc.splitlines():
        if not line.strip():
            flush()
        elif line[:1].isspace():
            para.append(line.strip() if not (heading or "").lower().startswith("example") else line[4:])
        else:
            flush()
            if heading is None and not out:
                out.append(Text(line))          # the summary line
                heading = ""
            else:
                heading = line
                out.append(Text(line, style="bold"))
    flush()
    return out


class FindingsPane(TabPane):
    """A busy line until the rules have run. Highlighting a finding posts Picked, so that
    the Remedies tab follows; enter reads it, escape goes back to the list."""

    TAB_ID, TAB_TITLE = "findings", "4 Findings"

    class Picked(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self) -> None:
        super().__init__(self.TAB_TITLE, id=self.TAB_ID)
        self.findings: list = []
        self.facts = None

    def compose(self) -> ComposeResult:
        yield Busy("diagnosing…", id="fd-busy")
        yield OptionList(id="fd-list")
        with VerticalScroll(id="fd-detail", classes="pane-body"):
            yield Static(id="fd-text")

    def on_mount(self) -> None:
        for wid in ("#fd-list", "#fd-detail"):
            self.query_one(wid).display = False

    @property
    def focus_target(self) -> Widget:
        return self.query_one("#fd-list")

    def show(self, findings: list, facts) -> None:
        self.findings, self.facts = findings, facts
        self.query_one("#fd-busy").display = False
        for wid in ("#fd-list", "#fd-detail"):
            self.query_one(wid).display = True
        options = self.query_one("#fd-list", OptionList)
        options.clear_options()
        if findings:
            options.add_options([
                Option(Text.assemble((f"{i + 1}. ", "dim"), (f.rule, "bold"), "  ",
                                     (format_bytes(f.accounts_for_bytes), "#ffd75f"), "  ", f.title), id=str(i))
                for i, f in enumerate(findings)])
            options.highlighted = 0
        else:
            options.add_option(Option("no findings", disabled=True))
        self._render_finding(0)

    def show_error(self, line: Text) -> None:
        self.query_one("#fd-busy", Busy).fail(line)

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        if event.option_list.id == "fd-list" and event.option.id is not None:
            index = int(event.option.id)
            self._render_finding(index)
            self.post_message(self.Picked(index))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option_list.id == "fd-list":
            # at once, not widget.focus() (deferred): see MemdoctorApp.focus_pane
            self.screen.set_focus(self.query_one("#fd-detail"))

    def key_escape(self) -> None:
        focused = self.app.focused
        if focused is not None and focused.id == "fd-detail":
            self.screen.set_focus(self.query_one("#fd-list"))

    def _render_finding(self, i: int) -> None:
        from memdoctor.diagnosis.registry import explain
        target = self.query_one("#fd-text", Static)
        if not self.findings:
            from memdoctor.report.text import headline
            target.update(headline(self.findings, self.facts))
            return
        f = self.findings[i]
        parts: list = [Text.assemble((f.rule, "bold #ffd75f"), (" · accounts for ", "dim"),
                                     (format_bytes(f.accounts_for_bytes), "bold"))]
        if f.fits_after_fix is not None:
            parts[0].append(" · fixing it alone ", style="dim")
            parts[0].append("fits" if f.fits_after_fix else "does not fit",
                            style="green" if f.fits_after_fix else "red")
        parts.append(Text(f.title, style="bold"))
        if f.evidence:
            parts.append(Text("evidence", style="bold underline"))
            parts += [Text(f"• {e}") for e in f.evidence]
        parts.append(Text(f"{len(f.remedies)} remed{'ies' if len(f.remedies) != 1 else 'y'}: see 5 Remedies",
                          style="dim"))
        try:
            doc = explain(f.rule)
        except KeyError:
            doc = ""
        if doc:
            parts.append(Text(f"memdoctor explain {f.rule}", style="bold underline"))
            parts += explain_renderables(doc)
        target.update(Group(*parts))
        self.query_one("#fd-detail", VerticalScroll).scroll_home(animate=False)
