"""`memdoctor tui`: the App that opens a run file (or traces a script live) and hands what
it gets to five tabs: Overview, Timeline, Modules, Findings, Remedies (memdoctor.tui.screens).

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

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Footer, Header, TabbedContent

import memdoctor.tui.loader as loader
from memdoctor.run import Run, RunFileError
from memdoctor.tui.index import RunIndex
from memdoctor.tui.screens.findings import FindingsPane
from memdoctor.tui.screens.help import HelpScreen
from memdoctor.tui.screens.modules import ModulesPane
from memdoctor.tui.screens.overview import OverviewPane
from memdoctor.tui.screens.remedies import RemediesPane
from memdoctor.tui.screens.timeline import TimelinePane
from memdoctor.tui.widgets import Panes
from memdoctor.units import format_bytes

PANES = [OverviewPane, TimelinePane, ModulesPane, FindingsPane, RemediesPane]     # in the order of their keys
TABS = [p.TAB_ID for p in PANES]
EXIT_OK, EXIT_USAGE, EXIT_OOM = 0, 2, 3


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
        *[Binding(str(i + 1), f"show_tab('{p.TAB_ID}')", p.TAB_TITLE[2:], show=False, priority=True)
          for i, p in enumerate(PANES)],
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
        with Panes(initial=OverviewPane.TAB_ID, id="tabs"):
            yield OverviewPane(self._busy_message())
            yield TimelinePane()
            yield ModulesPane()
            yield FindingsPane()
            yield RemediesPane()
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

    def _q(self, selector, expect_type=None):
        """query_one on the main screen, whatever screen (help) is on top of it."""
        screen = self.screen_stack[0] if self.screen_stack else self.screen
        return screen.query_one(selector, expect_type) if expect_type else screen.query_one(selector)

    def on_mount(self) -> None:
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
        widget: Widget = self._q(f"#{tabs.active}").focus_target
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
            from memdoctor.capture.script import trace_script
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
            self._q(OverviewPane).say(f"{self._busy_message()} {elapsed:.0f} s")

    def _script_done(self, result) -> None:
        self.script_result = result
        self.given_run = result.run
        self.load_worker()

    # ---- each stage, handed to the tabs -------------------------------------------------
    def _show_index(self, index: RunIndex) -> None:
        self.index = index
        self.stage = "indexed"
        r = self.script_result
        script_error = r.error if r is not None and r.error and not r.oom else None
        self._q(OverviewPane).show_index(index, self.path, script_error)
        self._q(TimelinePane).show_index(index)
        self._focus_pane()
        self.overview_shown_at = time.perf_counter()

    def _show_details(self, modules: dict[str, dict[str, int]]) -> None:
        self._q(ModulesPane).show(modules)
        self._q(TimelinePane).show_details()

    def _show_findings(self, run: Run, facts, findings: list) -> None:
        self.run_obj, self.facts, self.findings = run, facts, findings
        self.stage = "diagnosed"
        self._q(OverviewPane).show_diagnosis(findings, facts)
        self._q(FindingsPane).show(findings, facts)
        self._q(RemediesPane).show(findings, self.selected_finding, facts)
        self._focus_pane()
        self.diagnosed_at = time.perf_counter()

    def on_findings_pane_picked(self, event: FindingsPane.Picked) -> None:
        self.selected_finding = event.index
        self._q(RemediesPane).show(self.findings, self.selected_finding, self.facts)

    def _show_error(self, message: str) -> None:
        """One line, in red, wherever the run could not be shown: in place of the overview
        when nothing could be read, else under what was read (and in the panes still
        waiting). q quits with exit code 2."""
        self.error = message
        indexed = self.stage != "loading"
        self.stage = "error"
        line = Text(f"memdoctor: {message}", style="bold red")
        self._q(OverviewPane).show_error(line, indexed)
        if not indexed:
            self._q(TimelinePane).show_error(line)
        self._q(ModulesPane).show_error(line)
        self._q(FindingsPane).show_error(line)
        self._q(RemediesPane).show_error(line)
        self.action_show_tab(OverviewPane.TAB_ID)

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
