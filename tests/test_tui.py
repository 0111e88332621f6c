"""memdoctor tui: every screen driven through App.run_test() with key presses, on a run
traced from a small model that runs out of a simulated budget; the fast loader and the
index against Run.load and attribution.breakdown_at; a screen-text snapshot at 80x24."""
from __future__ import annotations

import asyncio
import gzip
import io
import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")

from rich.console import Console  # noqa: E402
from rich.text import Text  # noqa: E402
from textual import events  # noqa: E402
from textual.widgets import LoadingIndicator, OptionList, TabbedContent, Tree  # noqa: E402

from memdoctor.attribution import breakdown_at, peak  # noqa: E402
from memdoctor.cli import main  # noqa: E402
from memdoctor.diagnosis import diagnose, explain, facts_from_run  # noqa: E402
from memdoctor.run import OOM, Block, Mark, Run, RunFileError  # noqa: E402
from memdoctor.tui import loader  # noqa: E402
from memdoctor.tui.app import HelpScreen, MemdoctorApp  # noqa: E402
from memdoctor.tui.index import RunIndex  # noqa: E402
from memdoctor.tui.widgets import LivePlot  # noqa: E402
from memdoctor.units import format_bytes  # noqa: E402

SNAPSHOTS = Path(__file__).parent / "snapshots"
SIZE = (80, 24)


# ---- fixtures ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced() -> Run:
    """A small model with named submodules whose loop keeps every loss (and so every step's
    graph) alive, traced under a 6 MiB budget: it runs out of memory in step 7."""
    import torch
    from torch import nn

    from memdoctor.capture.session import Tracer

    class Block2(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self, d=64):
            super().__init__()
            self.embed = nn.Linear(32, d)
            self.blocks = nn.Sequential(Block2(d), Block2(d))
            self.head = nn.Linear(d, 1)

        def forward(self, x):
            return self.head(self.blocks(self.embed(x)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tracer = Tracer(models=[model], optimizers=[opt], budget="6MiB", source="dispatch")
    kept = []
    with pytest.raises(torch.OutOfMemoryError):
        with tracer:
            for _ in range(30):
                x, y = torch.randn(256, 32), torch.randn(256, 1)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward(retain_graph=True)
                opt.step()
                kept.append(loss)
    run = tracer.run
    assert run.ooms and run.ooms[0].simulated
    return run


@pytest.fixture(scope="module")
def run_file(traced, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tui") / "small.memrun.json.gz"
    traced.save(path)
    return path


@pytest.fixture(scope="module")
def diagnosis(traced):
    facts = facts_from_run(traced)
    return facts, diagnose(facts)


def synthetic_run() -> Run:
    """A fixed little run: four steps, every category, a leak, a budget and an OOM."""
    run = Run(source="dispatch", device={"type": "cpu"}, budget_bytes=64 << 20, script="/x/train.py",
              torch_version="2.13.0")
    events = []

    def alloc(bid, nbytes, cat, name, module, phase, step, shape):
        run.blocks[bid] = Block(bid, nbytes, cat, name, shape, "float32", "cpu", module, phase, step,
                                alloc_seq=len(events))
        events.append((0, bid, nbytes))

    def free(bid):
        run.blocks[bid].free_seq = len(events)
        events.append((1, bid, run.blocks[bid].nbytes))

    mib = 1 << 20
    alloc(1, 8 * mib, "weights", "enc.weight", None, "other", 0, [2048, 1024])
    alloc(2, 4 * mib, "weights", "head.weight", None, "other", 0, [1024, 1024])
    bid = 10
    for step in range(4):
        run.marks.append(Mark(len(events), "forward", step, "model"))
        alloc(bid, 2 * mib, "inputs", "batch", None, "forward", step, [512, 1024])
        alloc(bid + 1, 6 * mib, "activations", "aten.mm", "enc", "forward", step, [1536, 1024])
        alloc(bid + 2, 1 * mib, "temporaries", "aten.relu", "enc", "forward", step, [256, 1024])
        free(bid + 2)
        run.marks.append(Mark(len(events), "backward", step, "model"))
        alloc(bid + 3, 8 * mib, "gradients", "enc.weight.grad", None, "backward", step, [2048, 1024])
        alloc(bid + 4, 4 * mib, "gradients", "head.weight.grad", None, "backward", step, [1024, 1024])
        run.marks.append(Mark(len(events), "optimizer", step, None))
        alloc(bid + 5, 3 * mib, "optimizer_state", "enc.weight:exp_avg", None, "optimizer", step, [768, 1024])
        if step < 3:                   # the last step's gradients stay into the next forward
            free(bid + 3)
            free(bid + 4)
        free(bid)                      # the activations (bid + 1) are kept: a leak
        bid += 10
    run.marks.append(Mark(len(events), "forward", 4, "model"))
    alloc(bid, 2 * mib, "inputs", "batch", None, "forward", 4, [512, 1024])
    run.ooms.append(OOM(seq=len(events), requested_bytes=24 * mib, message="simulated", phase="forward",
                        step=4, module="enc", simulated=True, live_bytes=62 * mib))
    events.append((2, -1, 24 * mib))
    run.actions, run.event_blocks, run.event_bytes = (list(c) for c in zip(*events))
    return run


# ---- helpers -------------------------------------------------------------------------------
def plain(renderable, width: int = 78) -> str:
    """What a Static shows, as plain text."""
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(Text.from_markup(renderable) if isinstance(renderable, str) else renderable)
    return console.export_text(styles=False)


def static_text(app, selector: str) -> str:
    return plain(app.query_one(selector).content)


def screen_text(app) -> str:
    """The whole screen as text, the way a person sees it."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True,
                      force_terminal=True, color_system=None, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines())


async def settle(app, pilot, stage: str = "diagnosed", timeout: float = 20.0) -> None:
    order = ["loading", "indexed", "diagnosed"]
    start = time.perf_counter()

    def reached() -> bool:
        if stage == "error" or app.stage == "error":
            return app.stage == "error"
        return order.index(app.stage) >= order.index(stage)
    while not reached() and time.perf_counter() - start < timeout:
        await pilot.pause(0.02)
    assert reached() and (app.stage == "error") == (stage == "error"), f"stage {app.stage}: {app.error}"
    await pilot.pause()


async def key_takes_effect(app, key: str, done, limit: float = 5.0) -> bool:
    """Whether a key event has its visible effect (`done()` true) within `limit` seconds,
    polled every 2 ms. (pilot.press waits for the whole process to go idle, which a loading
    worker never is.) How fast is measured by benchmarks/tui_open.py."""
    start = time.perf_counter()
    app.post_message(events.Key(key, key if len(key) == 1 else None))
    while not done() and time.perf_counter() - start < limit:
        await asyncio.sleep(0.002)
    return done()


def drive(app: MemdoctorApp, script):
    """Run `script(app, pilot)` inside app.run_test at 80x24; return the app's exit code."""
    app.animation_level = "none"          # no tab-underline animations for pilot to wait on

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await script(app, pilot)
        return app.return_code
    return asyncio.run(go())


# ---- the screens -----------------------------------------------------------------------------
def test_overview_shows_peak_budget_oom_and_headline(run_file, traced, diagnosis):
    facts, findings = diagnosis
    _, peak_bytes = peak(traced)

    async def script(app, pilot):
        await settle(app, pilot)
        summary = static_text(app, "#ov-summary")
        assert format_bytes(peak_bytes) in summary
        assert "6.00 MiB" in summary and "budget" in summary
        assert "simulated out of memory" in summary and "forward of step" in summary
        bars = static_text(app, "#ov-bars")
        at_peak = breakdown_at(traced, peak(traced)[0])
        assert format_bytes(at_peak.by_category["activations"]) in bars
        headline = static_text(app, "#ov-headline")
        assert findings[0].rule in headline
        shown = screen_text(app)
        assert "1 Overview" in shown and "5 Remedies" in shown and "q Quit" in shown
        assert format_bytes(peak_bytes) in shown
        await pilot.press("q")
    assert drive(MemdoctorApp(run_file), script) == 3      # the run ran out of memory


def test_timeline_scrubbing_matches_breakdown_at(run_file, traced):
    seen = []

    async def script(app, pilot):
        await settle(app, pilot)
        await pilot.press("2")
        assert app.query_one("#tabs", TabbedContent).active == "timeline"
        plot = app.query_one("#tl-plot", LivePlot)
        assert app.focused is plot
        assert plot.seq == peak(traced)[0]
        for keys in (["left"], ["left", "left"], ["shift+left"], ["pageup"], ["home"], ["full_stop"],
                     ["right"], ["shift+right"], ["pagedown"], ["comma"], ["end"], ["p"], ["o"]):
            before = plot.seq
            for key in keys:
                await pilot.press(key)
            await pilot.pause()
            seq = plot.seq
            seen.append((keys[0], before, seq))
            expected = breakdown_at(traced, seq)
            where = static_text(app, "#tl-where")
            assert f"event {seq:,}/" in where
            assert format_bytes(expected.total_bytes) in where
            cats = static_text(app, "#tl-cats")
            for cat, n in expected.by_category.items():
                if n:
                    assert cat in cats and format_bytes(n) in cats
            top = static_text(app, "#tl-top")
            assert format_bytes(expected.top[0].nbytes) in top
        await pilot.press("q")
    drive(MemdoctorApp(run_file), script)
    moves = {k: (a, b) for k, a, b in seen}
    assert moves["left"][1] < moves["left"][0]
    assert moves["home"][1] == 0 and moves["full_stop"][1] == 1
    assert moves["end"][1] == traced.num_events - 1
    assert moves["p"][1] == peak(traced)[0]
    assert moves["o"][1] == traced.ooms[0].seq - 1


def test_modules_tree_has_the_models_modules(run_file, traced):
    async def script(app, pilot):
        await settle(app, pilot)
        await pilot.press("3")
        tree = app.query_one("#mod-tree", Tree)
        assert app.focused is tree
        paths, labels = set(), {}

        def walk(node):
            if node.data:
                paths.add(node.data[0])
                labels[node.data[0]] = str(node.label)
            for child in node.children:
                walk(child)
        walk(tree.root)
        assert {"embed", "blocks", "blocks.0", "blocks.0.fc1", "blocks.1.fc2", "head"} <= paths
        by_module = breakdown_at(traced, peak(traced)[0]).by_module
        assert format_bytes(by_module["blocks.0.fc1"]) in labels["blocks.0.fc1"]
        blocks_total = sum(n for m, n in by_module.items() if m == "blocks" or m.startswith("blocks."))
        assert format_bytes(blocks_total) in labels["blocks"]
        # walk down to a leaf: the detail line follows the cursor
        await pilot.press("down", "down", "down")
        await pilot.pause()
        detail = static_text(app, "#mod-detail")
        assert tree.cursor_node.data[0] in detail
        await pilot.press("enter")          # expand blocks.0
        await pilot.pause()
        assert any("fc1" in str(c.label) for c in tree.cursor_node.children)
        await pilot.press("q")
    drive(MemdoctorApp(run_file), script)


def test_findings_list_and_explain(run_file, diagnosis):
    _, findings = diagnosis

    async def script(app, pilot):
        await settle(app, pilot)
        await pilot.press("4")
        options = app.query_one("#fd-list", OptionList)
        assert app.focused is options
        assert options.option_count == len(findings)
        first = str(options.get_option_at_index(0).prompt)
        assert findings[0].rule in first
        text = static_text(app, "#fd-text")
        assert findings[0].title.split(":")[0] in text
        for line in findings[0].evidence:
            assert line[:40] in text.replace("\n", " ").replace("  ", " ") or line[:20] in text
        assert explain(findings[0].rule).splitlines()[0][:40] in text.replace("\n", " ")
        await pilot.press("enter")
        assert app.focused.id == "fd-detail"
        await pilot.press("escape")
        assert app.focused is options
        await pilot.press("q")
    drive(MemdoctorApp(run_file), script)


def test_remedies_show_predicted_peak_and_fit(run_file, diagnosis):
    facts, findings = diagnosis

    async def script(app, pilot):
        await settle(app, pilot)
        await pilot.press("5")
        head = static_text(app, "#rm-head")
        assert findings[0].rule in head
        assert format_bytes(facts.peak_bytes) in head
        table = static_text(app, "#rm-table", )
        for r in findings[0].remedies:
            assert r.title[:30] in table
            assert format_bytes(r.predicted_peak_bytes) in table
            fits = r.predicted_peak_bytes <= facts.limit_bytes
            assert ("yes" if fits else "no") in table
        await pilot.press("q")
    drive(MemdoctorApp(run_file), script)


def test_remedies_follow_the_selected_finding():
    run = synthetic_run()
    findings = diagnose(facts_from_run(run))
    if len(findings) < 2:
        pytest.skip("the synthetic run has a single finding")

    async def script(app, pilot):
        await settle(app, pilot)
        await pilot.press("4", "down", "5")
        assert app.selected_finding == 1
        assert findings[1].rule in static_text(app, "#rm-head")
        await pilot.press("q")
    drive(MemdoctorApp(run=run), script)


def test_keys_tab_cycles_help_and_quit(run_file):
    async def script(app, pilot):
        await settle(app, pilot)
        tabs = app.query_one("#tabs", TabbedContent)
        order = []
        for _ in range(5):
            await pilot.press("tab")
            order.append(tabs.active)
        assert order == ["timeline", "modules", "findings", "remedies", "overview"]
        await pilot.press("shift+tab")
        assert tabs.active == "remedies"
        for key, tab in zip("12345", ["overview", "timeline", "modules", "findings", "remedies"]):
            await pilot.press(key)
            assert tabs.active == tab
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "shift+" in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("question_mark", "q")      # q closes the help first
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
    assert drive(MemdoctorApp(run_file), script) == 3


# ---- bad input -----------------------------------------------------------------------------
BAD_FILES = [
    (b"this is not a run", "not a readable run file"),
    (gzip.compress(b'{"format": "memdoctor.run", "version": 99}', mtime=0), "version 99"),
    (gzip.compress(b'{"format": "something else"}', mtime=0), "not a memdoctor run file"),
    (gzip.compress(b"\x00" * 10, mtime=0)[:12], "not a readable run file"),
    (gzip.compress(b'{"format": "memdoctor.run", "version": 1, "events": {}}', mtime=0), "damaged"),
]


@pytest.mark.parametrize("payload, words", BAD_FILES)
def test_bad_run_file_is_one_clear_error(tmp_path, payload, words):
    path = tmp_path / "bad.memrun.json.gz"
    path.write_bytes(payload)
    with pytest.raises(RunFileError, match=words) as caught:
        loader.load(path)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("payload, words", BAD_FILES[:2])
def test_bad_run_file_says_so_on_screen(tmp_path, payload, words):
    path = tmp_path / "bad.memrun.json.gz"
    path.write_bytes(payload)

    async def script(app, pilot):
        await settle(app, pilot, stage="error")
        assert words in app.error
        shown = screen_text(app)
        assert "memdoctor:" in shown and words in shown.replace("\n", " ")
        assert "press q to quit" in shown
        await pilot.press("2")                 # keys still work
        await pilot.press("q")
    assert drive(MemdoctorApp(path), script) == 2


def test_error_after_the_overview_shows_under_it(run_file, monkeypatch):
    def damaged(self, tick=None):
        raise RunFileError("run file is damaged: blocks.step does not hold int")
    monkeypatch.setattr(loader.Loaded, "build_run", damaged)

    async def script(app, pilot):
        await settle(app, pilot, stage="error")
        assert app.index is not None                      # the overview was shown first
        assert "blocks.step" in static_text(app, "#ov-headline")
        assert "peak" in static_text(app, "#ov-summary")
        await pilot.press("4")
        assert "blocks.step" in screen_text(app)
        await pilot.press("q")
    assert drive(MemdoctorApp(run_file), script) == 2


def test_cli_tui_bad_input_is_one_line(tmp_path, capsys):
    assert main(["tui", str(tmp_path / "missing.memrun.json.gz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memdoctor: no such run file") and err.count("\n") == 1
    assert main(["tui"]) == 2
    assert "RUN file or --script" in capsys.readouterr().err
    path = tmp_path / "x.memrun.json.gz"
    synthetic_run().save(path)
    assert main(["tui", str(path), "--budget", "1GiB"]) == 2
    assert "go with --script" in capsys.readouterr().err
    assert main(["tui", str(path)]) == 2            # pytest's stdout is no terminal
    assert "needs a terminal" in capsys.readouterr().err


# ---- loading off the UI thread ------------------------------------------------------------------
def test_loading_never_blocks_keys(run_file, monkeypatch):
    real = loader.load

    def slow(path, tick=None):
        time.sleep(8.0)
        return real(path, tick)
    monkeypatch.setattr(loader, "load", slow)

    async def script(app, pilot):
        await pilot.pause()
        assert app.stage == "loading"
        busy = app.query_one("#ov-busy")
        assert busy.display and busy.query_one(LoadingIndicator).display
        assert "reading" in static_text(app, ".busy-message")
        tabs = app.query_one("#tabs", TabbedContent)
        assert await key_takes_effect(app, "2", lambda: tabs.active == "timeline")
        assert await key_takes_effect(app, "tab", lambda: tabs.active == "modules")
        assert await key_takes_effect(app, "question_mark", lambda: isinstance(app.screen, HelpScreen))
        assert await key_takes_effect(app, "escape", lambda: not isinstance(app.screen, HelpScreen))
        assert app.stage == "loading"              # keys were handled while loading
        assert app.query_one("#tabs", TabbedContent).active == "modules"
        await settle(app, pilot)
        await pilot.press("q")
    drive(MemdoctorApp(run_file), script)


def test_script_mode_traces_live_then_shows(tmp_path):
    script_path = tmp_path / "train.py"
    script_path.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nkept = []\n"
        "for step in range(50):\n"
        "    loss = model(torch.randn(512, 64)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(retain_graph=True); opt.step(); kept.append(loss)\n"
        "    print('step', step)\n")
    out = tmp_path / "live.memrun.json.gz"

    async def script(app, pilot):
        await pilot.pause()
        assert "running" in static_text(app, ".busy-message")
        await settle(app, pilot, timeout=60)
        assert "out of memory" in static_text(app, "#ov-summary")
        assert app.findings and app.findings[0].rule in static_text(app, "#ov-headline")
        assert app.script_result.oom and any("step" in line for line in app.script_result.output)
        await pilot.press("q")
    app = MemdoctorApp(script=str(script_path), budget="4MiB", source="dispatch", output=str(out))
    assert drive(app, script) == 3
    assert Run.load(out).ooms


# ---- the loader and the index ----------------------------------------------------------------
def test_fast_loader_reads_what_run_load_reads(tmp_path, traced):
    for run in (traced, synthetic_run()):
        path = tmp_path / "r.memrun.json.gz"
        run.save(path)
        loaded = loader.load(path)
        assert loaded.run is None and loaded.text is not None          # the fast path was taken
        assert loaded.build_run().to_dict() == Run.load(path).to_dict()


def test_fast_loader_falls_back_on_unusual_layouts(tmp_path):
    run = synthetic_run()
    data = run.to_dict()
    path = tmp_path / "indented.memrun.json"
    path.write_text(json.dumps(data, indent=1))                        # whitespace everywhere
    loaded = loader.load(path)
    assert loaded.run is not None                                      # Run.load read it
    assert loaded.build_run().to_dict() == data
    data["blocks"]["shape"][0] = ["s0", 4]                             # a symbolic size
    path.write_text(json.dumps(data))
    with pytest.raises(RunFileError, match="shape"):                   # Run.load's own message
        loader.load(path)


def test_index_agrees_with_breakdown_at(traced):
    ix = RunIndex.from_run(traced)
    seqs = sorted({0, 1, ix.peak_seq, traced.num_events - 1, *range(0, traced.num_events, 37)})
    for seq in seqs:
        expected = breakdown_at(traced, seq)
        assert ix.total_at(seq) == expected.total_bytes
        assert ix.by_category(seq) == expected.by_category
        assert [ix.tensor(r).nbytes for r in ix.top(seq, 10)] == [t.nbytes for t in expected.top]
        mark = traced.mark_at(seq)
        assert ix.mark_at(seq) is mark
    assert (ix.peak_seq, ix.peak_bytes) == peak(traced)
    grouped = {m: sum(c.values()) for m, c in ix.by_module(ix.peak_seq).items()}
    assert grouped == breakdown_at(traced, ix.peak_seq).by_module


def test_a_large_run_opens_fast(tmp_path):
    """100,000 events: the overview within 2 s (benchmarks/tui_open.py measures 1,000,000)."""
    run = Run(source="dispatch", device={"type": "cpu"}, budget_bytes=1 << 30)
    acts, blks, nbs = run.actions, run.event_blocks, run.event_bytes
    cats = ["activations", "temporaries", "gradients", "inputs"]
    for i in range(60_000):
        n = 4096 * (1 + i % 7)
        freed = i % 3 != 0
        if i % 500 == 0:
            run.marks.append(Mark(len(acts), "forward", i // 5000))
        run.blocks[i] = Block(i, n, cats[i % 4], "aten.mm", [32, n // 128], "float32", "cpu", f"layer.{i % 12}",
                              "forward", i // 5000, len(acts), len(acts) + 1 if freed else None)
        for action in ((0, 1) if freed else (0,)):
            acts.append(action)
            blks.append(i)
            nbs.append(n)
    assert run.num_events == 100_000
    path = tmp_path / "big.memrun.json.gz"
    run.save(path)

    async def script(app, pilot):
        await settle(app, pilot, stage="indexed", timeout=10)
        assert app.overview_shown_at - app.started_at < 2.0
        assert format_bytes(peak(run)[1]) in static_text(app, "#ov-summary")
        await settle(app, pilot)
        await pilot.press("q")
    drive(MemdoctorApp(path), script)


# ---- the screen at 80x24, as text -------------------------------------------------------------
SCREENS = [([], "overview"), (["2", "left"], "timeline"), (["3"], "modules"), (["4"], "findings"),
           (["5"], "remedies")]
SNAPSHOT = {"overview", "timeline", "modules"}     # the last two are mostly the rules' own words


def test_screen_snapshots_80x24(tmp_path):
    """Each screen of a fixed run at 80x24, as text, against tests/snapshots/; set
    MEMDOCTOR_UPDATE_SNAPSHOTS=1 to rewrite them after a deliberate change."""
    path = tmp_path / "fixed.memrun.json.gz"
    synthetic_run().save(path)
    shots = {}

    async def script(app, pilot):
        await settle(app, pilot)
        for keys, name in SCREENS:
            for key in keys:
                await pilot.press(key)
            await pilot.pause()
            shots[name] = screen_text(app)
        await pilot.press("q")
    drive(MemdoctorApp(path), script)
    update = os.environ.get("MEMDOCTOR_UPDATE_SNAPSHOTS")
    written = []
    for _, name in SCREENS:
        text = shots[name] + "\n"
        lines = text.splitlines()
        assert len(lines) == 24 and max(len(line) for line in lines) <= 80, name
        if name not in SNAPSHOT:
            continue
        snap = SNAPSHOTS / f"tui_{name}_80x24.txt"
        if update or not snap.exists():
            SNAPSHOTS.mkdir(exist_ok=True)
            snap.write_text(text)
            written.append(snap.name)
            continue
        assert text == snap.read_text(), f"{name} differs from {snap}"
    if written and not update:
        pytest.fail(f"{', '.join(written)} were missing and are now written: check them and run again")
