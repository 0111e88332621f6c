"""`memdoctor tui`: a run file (or a script traced live) in five screens: Overview,
Timeline, Modules, Findings, Remedies.

The run is read, indexed and diagnosed in a worker thread, in stages: the overview and the
timeline show as soon as the index is built; tensor names, shapes and the modules tree a
moment later; findings and remedies when the rules have run. The UI thread only ever does
O(log n) work per key press.
"""
from __future__ import annotations

import contextlib
import gc
import io
import os
import threading
import time
from typing import Any

from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import (Footer, Header, LoadingIndicator, OptionList, Static, TabbedContent, TabPane,
                             Tree)
from textual.widgets.option_list import Option

from memdoctor.run import Run, RunFileError
from memdoctor.units import format_bytes
from memdoctor.tui.index import RunIndex
from memdoctor.tui.widgets import CATEGORY_STYLE, LivePlot, category_table

TABS = ["overview", "timeline", "modules", "findings", "remedies"]
TAB_TITLES = ["1 Overview", "2 Timeline", "3 Modules", "4 Findings", "5 Remedies"]
EXIT_OK, EXIT_USAGE, EXIT_OOM = 0, 2, 3

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


def tensor_cells(t) -> tuple[Text, Text, str]:
    """(who: module and op or parameter name, shape, bytes) for one live tensor."""
    name = t.name or "?"
    if t.module and name.startswith(t.module + "."):
        name = name[len(t.module) + 1:]
    name = name.removeprefix("aten.")
    who = Text(t.module or "-", style=CATEGORY_STYLE.get(t.category, ""))
    who.append(f" {name}", style="dim")
    shape = "x".join(map(str, t.shape)) if t.shape else ("()" if t.shape is not None else "")
    return who, Text(shape, style="dim"), format_bytes(t.nbytes)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss_help", "Close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help-body")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)


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


class Screens(TabbedContent):
    """TabbedContent that follows focus only while the focus is still in the pane: a focus
    message that arrives after a quick switch onward would otherwise switch back."""

    def _on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        event.stop()
        event.prevent_default()
        focused = self.app.focused
        if event.tab_pane.id and focused is not None and event.tab_pane in focused.ancestors_with_self:
            self.active = event.tab_pane.id


class MemdoctorApp(App[int]):
    """Open a run with `MemdoctorApp(path=...)`, `MemdoctorApp(run=...)` or
    `MemdoctorApp(script=..., script_args=[...], budget=...)`."""

    CSS_PATH = "app.tcss"
    TITLE = "memdoctor"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("tab", "cycle(1)", "Next", priority=True),
        Binding("shift+tab", "cycle(-1)", "Prev", show=False, priority=True),
        *[Binding(str(i + 1), f"show_tab('{t}')", TAB_TITLES[i][2:], show=False, priority=True)
          for i, t in enumerate(TABS)],
    ]

    def __init__(self, path: str | os.PathLike | None = None, run: Run | None = None, *,
                 script: str | None = None, script_args: list[str] | None = None,
                 budget: int | str | None = None, source: str = "auto", output: str | None = None) -> None:
        super().__init__()
        given = sum(x is not None for x in (path, run, script))
        if given != 1:
            raise ValueError("give exactly one of path, run or script")
        self.path = os.fspath(path) if path is not None else None
        self.given_run = run
        self.script, self.script_args, self.budget = script, list(script_args or []), budget
        self.source, self.output = source, output
        self.index: RunIndex | None = None
        self.run_obj: Run | None = None
        self.facts = None
        self.findings: list = []
        self.selected_finding = 0
        self.error: str | None = None
        self.stage = "loading"          # loading -> indexed -> diagnosed, or error
        self.started_at = time.perf_counter()
        self.overview_shown_at: float | None = None
        self.diagnosed_at: float | None = None
        self.script_result = None
        self._script_thread: threading.Thread | None = None
        if self.path:
            self.sub_title = os.path.basename(self.path)
        elif script:
            self.sub_title = f"{os.path.basename(script)} (live)"
        else:
            self.sub_title = os.path.basename(run.script) if run and run.script else "run"

    # ---- layout ----------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Screens(initial="overview", id="tabs"):
            with TabPane(TAB_TITLES[0], id="overview"):
                yield Busy(self._busy_message(), id="ov-busy")
                with VerticalScroll(id="ov-body", classes="pane-body"):
                    yield Static(id="ov-summary")
                    yield Static(id="ov-bars")
                    yield Static(id="ov-headline")
            with TabPane(TAB_TITLES[1], id="timeline"):
                yield Static("loading…", id="tl-caption")
                yield LivePlot(id="tl-plot")
                yield Static(id="tl-where")
                with Horizontal(id="tl-details"):
                    yield Static(id="tl-cats")
                    yield Static(id="tl-top")
            with TabPane(TAB_TITLES[2], id="modules"):
                yield Tree("modules", id="mod-tree")
                yield Static(id="mod-detail")
            with TabPane(TAB_TITLES[3], id="findings"):
                yield Busy("diagnosing…", id="fd-busy")
                yield OptionList(id="fd-list")
                with VerticalScroll(id="fd-detail", classes="pane-body"):
                    yield Static(id="fd-text")
            with TabPane(TAB_TITLES[4], id="remedies"):
                yield Busy("diagnosing…", id="rm-busy")
                with VerticalScroll(id="rm-body", classes="pane-body"):
                    yield Static(id="rm-head")
                    yield Static(id="rm-table")
        yield Footer()

    def _busy_message(self) -> str:
        if self.path:
            try:
                size = f" ({format_bytes(os.path.getsize(self.path))})"
            except OSError:
                size = ""
            return f"reading {self.path}{size}…"
        if self.script:
            budget = f" with a {self.budget_label()} budget" if self.budget else ""
            return f"running {self.script} under the tracer{budget}…"
        return "indexing the run…"

    def budget_label(self) -> str:
        return format_bytes(self.budget) if isinstance(self.budget, int) else str(self.budget)

    def _q(self, selector: str, expect_type=None):
        """query_one on the main screen, whatever screen (help) is on top of it."""
        screen = self.screen_stack[0] if self.screen_stack else self.screen
        return screen.query_one(selector, expect_type) if expect_type else screen.query_one(selector)

    def on_mount(self) -> None:
        for wid in ("#ov-body", "#fd-list", "#fd-detail", "#rm-body"):
            self._q(wid).display = False
        self._q("#mod-tree", Tree).loading = True
        self._q("#tl-plot", LivePlot).loading = True
        if self.script:
            self._start_script()
        else:
            self.load_worker()
        self.call_after_refresh(self._focus_pane)

    # ---- navigation ------------------------------------------------------------------
    def action_show_tab(self, tab: str) -> None:
        while isinstance(self.screen, HelpScreen):
            self.pop_screen()
        self._q("#tabs", TabbedContent).active = tab
        self._focus_pane()

    def action_cycle(self, step: int) -> None:
        tabs = self._q("#tabs", TabbedContent)
        self.action_show_tab(TABS[(TABS.index(tabs.active) + step) % len(TABS)])

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._focus_pane()

    def _focus_pane(self) -> None:
        if not self.is_running or isinstance(self.screen, HelpScreen):
            return
        try:
            tabs = self._q("#tabs", TabbedContent)
        except NoMatches:          # the app is closing
            return
        target = {"overview": "#ov-body", "timeline": "#tl-plot", "modules": "#mod-tree",
                  "findings": "#fd-list", "remedies": "#rm-body"}[tabs.active]
        widget = self._q(target)
        if widget.display and widget.focusable and self.focused is not widget:
            # at once, not widget.focus() (deferred): a late focus of the pane just left
            # would switch TabbedContent back to it
            self.screen.set_focus(widget)

    # ---- loading, off the UI thread -----------------------------------------------------
    @work(thread=True, exclusive=True, group="load")
    def load_worker(self) -> None:
        """Read, index and diagnose, in three steps, each shown as soon as it is done. The
        collector is paused meanwhile (its full passes over a million new objects would
        hold the GIL, and so the keys, for a second at a time) and what was read is then
        frozen out of its reach: a viewer keeps it to the end."""
        from memdoctor.tui import loader
        yield_gil = lambda: time.sleep(0)      # noqa: E731  let the UI thread in between pieces
        collecting = gc.isenabled()
        gc.disable()
        try:
            if self.given_run is not None:
                loaded = loader.from_run(self.given_run)
            else:
                loaded = loader.load(self.path, tick=yield_gil)
            self.call_from_thread(self._show_index, loaded.index)
            loaded.parse_details(yield_gil)
            modules = loaded.index.by_module(loaded.index.peak_seq)
            self.call_from_thread(self._show_details, modules)
            run = loaded.build_run(yield_gil)
            from memdoctor.diagnosis import diagnose, facts_from_run
            facts = facts_from_run(run)
            findings = diagnose(facts)
            self.call_from_thread(self._show_findings, run, facts, findings)
        except RunFileError as exc:
            self.call_from_thread(self._show_error, str(exc))
        except Exception as exc:         # one line on screen, never a traceback over the UI
            self.call_from_thread(self._show_error, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            gc.freeze()
            if collecting:
                gc.enable()

    def _start_script(self) -> None:
        def target() -> None:
            from memdoctor.capture.session import trace_script
            sink = io.StringIO()
            try:
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    result = trace_script(self.script, self.script_args, budget=self.budget, source=self.source)
                result.output = sink.getvalue().splitlines()[-20:]
                if self.output:
                    result.run.save(self.output)
            except ValueError as exc:
                self.call_from_thread(self._show_error, str(exc))
                return
            except Exception as exc:
                self.call_from_thread(self._show_error, f"internal error: {type(exc).__name__}: {exc}")
                return
            self.call_from_thread(self._script_done, result)
        # a plain daemon thread: quitting while the script still runs must not wait for it
        self._script_thread = threading.Thread(target=target, name="memdoctor-script", daemon=True)
        self._script_thread.start()
        self.set_interval(1.0, self._tick_script)

    def _tick_script(self) -> None:
        if self.stage == "loading":
            elapsed = time.perf_counter() - self.started_at
            self._q("#ov-busy", Busy).say(f"{self._busy_message()} {elapsed:.0f} s")

    def _script_done(self, result) -> None:
        self.script_result = result
        self.given_run = result.run
        self.load_worker()

    # ---- stage 1: the index -----------------------------------------------------------
    def _show_index(self, index: RunIndex) -> None:
        self.index = index
        self.stage = "indexed"
        self._q("#ov-busy").display = False
        self._q("#ov-body").display = True
        self._render_overview()
        plot = self._q("#tl-plot", LivePlot)
        plot.loading = False
        plot.set_index(index)
        self._render_caption()
        self._focus_pane()
        self.overview_shown_at = time.perf_counter()

    def _show_details(self, modules: dict[str, dict[str, int]]) -> None:
        self._render_modules(modules)
        self._refresh_timeline()

    def _render_overview(self) -> None:
        ix = self.index
        h = ix.header
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        what = os.path.basename(h.script) if h.script else (os.path.basename(self.path) if self.path else "run")
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
        if self.script_result is not None and self.script_result.error and not self.script_result.oom:
            grid.add_row(Text("script", style="bold red"), Text(self.script_result.error, style="red"))
        self._q("#ov-summary", Static).update(grid)
        bars = category_table(ix.by_category(ix.peak_seq), ix.total_at(ix.peak_seq), bar_width=30)
        self._q("#ov-bars", Static).update(Group(Text("memory at the peak", style="bold underline"), bars))
        self._render_headline()

    def _render_headline(self) -> None:
        target = self._q("#ov-headline", Static)
        if self.stage == "indexed":
            target.update(Text("diagnosing…", style="dim italic"))
            return
        from memdoctor.report.text import headline
        lines = [Text(headline(self.findings, self.facts), style="bold red" if self.facts.oom else "bold")]
        if self.findings:
            top = self.findings[0]
            more = f" · {len(self.findings) - 1} more finding{'s' if len(self.findings) != 2 else ''}" \
                if len(self.findings) > 1 else ""
            lines.append(Text(f"accounts for {format_bytes(top.accounts_for_bytes)} · "
                              f"{len(top.remedies)} remed{'ies' if len(top.remedies) != 1 else 'y'}{more} · "
                              "4 Findings, 5 Remedies", style="dim"))
        target.update(Group(Text("diagnosis", style="bold underline"), *lines))

    # ---- timeline -----------------------------------------------------------------------
    def _render_caption(self) -> None:
        ix = self.index
        budget = ix.header.budget_bytes or ix.header.device.get("capacity_bytes")
        caption = Text.assemble(("live bytes", "bold"), f" over {ix.num_events:,} events · max ",
                                (format_bytes(ix.peak_bytes), "bold"))
        if budget:
            caption.append(" · ")
            caption.append("┄ ", style="red")
            caption.append(f"{'budget' if ix.header.budget_bytes else 'capacity'} {format_bytes(budget)}")
        self._q("#tl-caption", Static).update(caption)

    def on_live_plot_moved(self, event: LivePlot.Moved) -> None:
        self._render_instant(event.seq)

    def _refresh_timeline(self) -> None:
        if self.index is not None:
            self._render_instant(self._q("#tl-plot", LivePlot).seq)

    def _render_instant(self, seq: int) -> None:
        ix = self.index
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
        self._q("#tl-where", Static).update(where)
        self._q("#tl-cats", Static).update(category_table(ix.by_category(seq), total, bar_width=6,
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
        self._q("#tl-top", Static).update(Group(Text("largest alive", style="bold"), top))

    # ---- modules ------------------------------------------------------------------------
    def _render_modules(self, modules: dict[str, dict[str, int]]) -> None:
        tree = self._q("#mod-tree", Tree)
        tree.loading = False
        tree.clear()
        nested: dict[str, Any] = {}
        for key, cats in modules.items():
            if key.startswith("("):
                parts = [key]
            else:
                parts = key.split(".")
            node = nested
            for part in parts:
                node = node.setdefault(part, {"_children": {}, "_own": {}})
                last = node
                node = node["_children"]
            for c, n in cats.items():
                last["_own"][c] = last["_own"].get(c, 0) + n

        def totals(entry: dict) -> dict[str, int]:
            sums = dict(entry["_own"])
            for child in entry["_children"].values():
                for c, n in totals(child).items():
                    sums[c] = sums.get(c, 0) + n
            entry["_sums"] = sums
            return sums

        grand: dict[str, int] = {}
        for entry in nested.values():
            for c, n in totals(entry).items():
                grand[c] = grand.get(c, 0) + n
        peak = sum(grand.values()) or 1
        tree.root.set_label(Text.assemble(("at the peak ", "bold"), format_bytes(sum(grand.values()))))
        tree.root.data = ("model", grand)

        def add(parent, children: dict, prefix: str) -> None:
            for name, entry in sorted(children.items(), key=lambda kv: -sum(kv[1]["_sums"].values())):
                total = sum(entry["_sums"].values())
                path = f"{prefix}.{name}" if prefix else name
                label = Text.assemble((name, "bold"), "  ", format_bytes(total), (f"  {100 * total / peak:.0f}%", "dim"))
                if entry["_children"]:
                    node = parent.add(label, data=(path, entry["_sums"]))
                    add(node, entry["_children"], path)
                    own = sum(entry["_own"].values())
                    if own:            # what the module holds outside its children
                        node.add_leaf(Text.assemble(("(itself)", "italic"), "  ", format_bytes(own),
                                                    (f"  {100 * own / peak:.0f}%", "dim")),
                                      data=(f"{path} (itself)", entry["_own"]))
                else:
                    parent.add_leaf(label, data=(path, entry["_sums"]))

        add(tree.root, nested, "")
        tree.root.expand()
        for child in tree.root.children:
            child.expand()
        self._render_module_detail(tree.root.data)

    def on_tree_node_highlighted(self, event: Tree.NodeHighlighted) -> None:
        if event.node.data:
            self._render_module_detail(event.node.data)

    def _render_module_detail(self, data) -> None:
        path, sums = data
        parts = [Text(path, style="bold"), Text(f" {format_bytes(sum(sums.values()))}: ")]
        shown = [(c, n) for c, n in sorted(sums.items(), key=lambda kv: -kv[1]) if n]
        for i, (c, n) in enumerate(shown):
            parts.append(Text(f"{c} {format_bytes(n)}", style=CATEGORY_STYLE.get(c, "")))
            if i < len(shown) - 1:
                parts.append(Text(", "))
        self._q("#mod-detail", Static).update(Text.assemble(*parts))

    # ---- stage 2: findings ------------------------------------------------------------------
    def _show_findings(self, run: Run, facts, findings: list) -> None:
        self.run_obj, self.facts, self.findings = run, facts, findings
        self.stage = "diagnosed"
        self._render_headline()
        for wid in ("#fd-busy", "#rm-busy"):
            self._q(wid).display = False
        for wid in ("#fd-list", "#fd-detail", "#rm-body"):
            self._q(wid).display = True
        options = self._q("#fd-list", OptionList)
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
        self._render_remedies()
        self._focus_pane()
        self.diagnosed_at = time.perf_counter()

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        if event.option_list.id == "fd-list" and event.option.id is not None:
            self.selected_finding = int(event.option.id)
            self._render_finding(self.selected_finding)
            self._render_remedies()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option_list.id == "fd-list":
            self.screen.set_focus(self._q("#fd-detail"))     # at once: see _focus_pane

    def key_escape(self) -> None:
        if self.focused is not None and self.focused.id == "fd-detail":
            self.screen.set_focus(self._q("#fd-list"))

    def _render_finding(self, i: int) -> None:
        from memdoctor.diagnosis.registry import explain
        target = self._q("#fd-text", Static)
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
        self._q("#fd-detail", VerticalScroll).scroll_home(animate=False)

    # ---- remedies ---------------------------------------------------------------------------
    def _render_remedies(self) -> None:
        head = self._q("#rm-head", Static)
        body = self._q("#rm-table", Static)
        facts = self.facts
        if not self.findings:
            head.update(Text("no findings, so nothing to remedy", style="dim"))
            body.update("")
            return
        f = self.findings[self.selected_finding]
        limit = facts.limit_bytes
        head.update(Group(
            Text.assemble(("for ", "dim"), (f"{self.selected_finding + 1}. {f.rule}", "bold #ffd75f"),
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

    # ---- errors -------------------------------------------------------------------------------
    def _show_error(self, message: str) -> None:
        """One line, in red, wherever the run could not be shown: in place of the overview
        when nothing could be read, else under what was read (and in the panes still
        waiting). q quits with exit code 2."""
        self.error = message
        indexed = self.stage != "loading"
        self.stage = "error"
        line = Text(f"memdoctor: {message}", style="bold red")
        busy_panes = ["#fd-busy", "#rm-busy"] + ([] if indexed else ["#ov-busy"])
        for wid in busy_panes:
            busy = self._q(wid, Busy)
            busy.query_one(LoadingIndicator).display = False
            busy.say(Text.assemble(line, "\n\npress q to quit"))
        if indexed:
            self._q("#ov-headline", Static).update(Text.assemble(line, "\npress q to quit"))
        else:
            self._q("#tl-caption", Static).update(line)
            self._q("#tl-plot", LivePlot).loading = False
        tree = self._q("#mod-tree", Tree)
        if tree.loading:
            tree.loading = False
            tree.root.set_label(line)
        self.action_show_tab("overview")

    def on_unmount(self) -> None:
        gc.unfreeze()          # what the loader froze is ordinary garbage again at exit

    def action_quit(self) -> None:
        if self.error:
            code = EXIT_USAGE
        elif self.index is not None and self.index.header.ooms:
            code = EXIT_OOM
        else:
            code = EXIT_OK
        self.exit(code, return_code=code)
