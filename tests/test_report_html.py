"""The HTML report: self-contained (plotly.js inline, nothing fetched), every user-supplied
name escaped, the downsampled timeline exact at the peak and the OOM, and every chart drawn
by a real browser (headless Chromium) without a script error, fast enough on 1,000,000
events.

The browser tests skip when Chromium is absent, except under CI=true where its absence is a
failure (.ci/run installs it: apt-get install -y chromium).
"""
from __future__ import annotations

import contextlib
import html
import importlib.util
import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from memdoctor import attribution as A
from memdoctor.cli import main
from memdoctor.report import downsample as ds
from memdoctor.report.html import plot_text, render_report, script_json, write_report
from memdoctor.diagnosis import diagnose, facts_from_run
from memdoctor.run import CATEGORIES, Run
from memdoctor.capture.session import Tracer

pytest.importorskip("plotly")
from plotly.offline import get_plotlyjs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("report_size_bench", ROOT / "benchmarks" / "report_size.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

EVIL_MODULE = "<script>alert(1)</script>"
EVIL_PATH = '/home/me/"><img src=x onerror=alert(1)>.py'
EVIL_ARG = "</script><script>alert(2)</script>"
EVIL_TENSOR = "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"
EVIL_LINE = "name\u2028with\u2029separators & </script>"


# ---- fixtures -----------------------------------------------------------------------------
def report(path, run: Run, other_run: Run | None = None) -> None:
    """Write the report as the CLI does: each run diagnosed first, the renderer given the findings."""
    facts = facts_from_run(run)
    after = {}
    if other_run is not None:
        other_facts = facts_from_run(other_run)
        after = {"other_run": other_run, "other_facts": other_facts, "other_findings": diagnose(other_facts)}
    write_report(path, run, diagnose(facts), facts, **after)


class Net(nn.Module):
    """A tiny model whose first layer is registered under a hostile name."""

    def __init__(self):
        super().__init__()
        self.add_module(EVIL_MODULE, nn.Linear(64, 256))
        self.head = nn.Linear(256, 8)

    def forward(self, x):
        return self.head(torch.tanh(getattr(self, EVIL_MODULE)(x)))


def _trace_tiny(budget: str | None, keep_losses: bool, steps: int = 30) -> Run:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    kept = []
    with pytest.raises(torch.OutOfMemoryError) if keep_losses else contextlib.nullcontext():
        with Tracer([model], [opt], budget=budget, source="dispatch") as tracer:
            for _ in range(steps):
                x = torch.randn(512, 64)
                loss = model(x).pow(2).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward(retain_graph=keep_losses)
                opt.step()
                kept.append(loss if keep_losses else loss.item())
    return tracer.run


@pytest.fixture(scope="module")
def oom_run() -> Run:
    """A traced run that keeps every step's loss (its graph stays alive) and runs out of a
    4 MiB budget; its script path and arguments and one tensor name are hostile too."""
    run = _trace_tiny("4MiB", keep_losses=True)
    assert run.ooms, "the tiny model must run out of its budget"
    run.script = EVIL_PATH
    run.argv = ["--name", EVIL_ARG]
    biggest = max(run.blocks.values(), key=lambda b: b.nbytes if b.category == "activations" else -1)
    biggest.name = EVIL_TENSOR
    return run


@pytest.fixture(scope="module")
def fixed_run() -> Run:
    return _trace_tiny("4MiB", keep_losses=False, steps=8)


@pytest.fixture(scope="module")
def oom_html(oom_run, tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("report") / "oom.html"
    report(path, oom_run)
    return path, path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def big_run() -> Run:
    return bench.synthetic_run(1_000_000)


@pytest.fixture(scope="module")
def big_html(big_run, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "big.html"
    report(path, big_run)
    return path


def _figures(text: str) -> list[dict]:
    found = re.search(r'<script type="application/json" id="memdoctor-data">(.*?)</script>', text, re.S)
    assert found, "the report has no data block"
    return json.loads(found.group(1))["figures"]


def _timeline(text: str) -> dict:
    for fig in _figures(text):
        if str(fig["layout"].get("title", {}).get("text", "")).startswith("live memory by category"):
            return fig
    raise AssertionError("no timeline figure")


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: dict[str, int] = {}
        self.attrs: list[tuple[str, str, str | None]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.attrs += [(tag, k, v) for k, v in attrs]

    def handle_data(self, data):
        self.text.append(data)


# ---- self-contained -------------------------------------------------------------------------
def test_report_inlines_plotly_and_fetches_nothing(oom_html):
    _, text = oom_html
    bundle = get_plotlyjs()
    assert bundle in text, "plotly.js must be inlined whole"
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I)
    assert not re.search(r"<link\b", text, re.I)
    # plotly.js itself carries default URLs (map tiles, topojson) for trace types the report
    # never uses; the CSP below blocks them anyway. Everything else in the page has none.
    rest = text.replace(bundle, "")
    assert "https://cdn" not in rest and not re.search(r"https?://", rest)
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)"', text).group(1)
    assert "default-src 'none'" in csp and "connect-src 'none'" in csp and "'unsafe-inline'" not in csp.split(
        "style-src")[0]


def test_report_names_categories_and_findings(oom_run, oom_html):
    _, text = oom_html
    findings = diagnose(facts_from_run(oom_run))
    assert findings and f'<code class="rule">{findings[0].rule}</code>' in text
    for f in findings:
        assert html.escape(f.title) in text
    names = {t["name"] for t in _timeline(text)["data"]}
    live = {c for c in CATEGORIES if A.at_peak(oom_run).by_category.get(c)}
    assert {"weights", "gradients", "activations", "inputs"} <= live
    assert live <= names
    for c in live:
        assert f"{c}</td>" in text
    assert "simulated out of memory" in text and "budget" in text


def test_the_report_draws_the_findings_it_is_given(oom_run, tmp_path):
    facts = facts_from_run(oom_run)
    findings = diagnose(facts)
    path = tmp_path / "given.html"
    write_report(path, oom_run, findings[1:], facts)
    text = path.read_text()
    assert f'<code class="rule">{findings[0].rule}</code>' not in text
    assert all(f'<code class="rule">{f.rule}</code>' in text for f in findings[1:])
    write_report(path, oom_run, [], facts)
    assert "No rule names a cause" in path.read_text()


def test_written_atomically(oom_run, tmp_path, monkeypatch):
    path = tmp_path / "r.html"
    report(path, oom_run)
    before = path.read_bytes()

    def broken(run):
        raise RuntimeError("boom")
    monkeypatch.setattr(ds, "curves", broken)
    with pytest.raises(RuntimeError):
        report(path, oom_run)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


# ---- escaping -------------------------------------------------------------------------------
def test_hostile_names_are_escaped_everywhere(oom_run, oom_html):
    _, text = oom_html
    for raw in (EVIL_MODULE, EVIL_PATH, EVIL_ARG, EVIL_TENSOR, "<img"):
        assert raw not in text.replace(get_plotlyjs(), "")
    parser = _Tags()
    parser.feed(text)
    parser.close()
    # guard, data block, plotly.js, the app: nothing else
    assert parser.tags.get("script") == 4
    assert parser.tags.get("img", 0) == 0 and parser.tags.get("iframe", 0) == 0
    assert not [a for a in parser.attrs if a[1].startswith("on")]
    # the names are there, as text
    assert html.escape(EVIL_MODULE) in text
    assert html.escape(EVIL_PATH) in text
    assert html.escape(EVIL_ARG) in text
    assert html.escape(EVIL_TENSOR) in text
    # in the chart data plotly reads, as entities (plotly decodes them for display)
    labels = [lab for fig in _figures(text) for t in fig["data"] for lab in (t.get("labels") or [])]
    assert f"module {plot_text(EVIL_MODULE)}" in labels
    assert any(plot_text(EVIL_TENSOR, 70)[:40] in lab for lab in labels)


def test_script_json_cannot_break_out():
    payload = {"a": "</script><script>alert(1)</script>", "b": EVIL_LINE, "c": "<!-- & -->"}
    out = script_json(payload)
    for bad in ("<", ">", "&", "\u2028", "\u2029"):
        assert bad not in out
    assert json.loads(out) == payload


def test_cli_report_escapes_a_hostile_script_name(oom_run, tmp_path):
    path = tmp_path / "evil.memrun.json.gz"
    oom_run.save(path)
    out = tmp_path / "out.html"
    assert main(["report", str(path), "-o", str(out)]) == 0
    assert EVIL_MODULE not in out.read_text().replace(get_plotlyjs(), "")


# ---- downsampling ---------------------------------------------------------------------------
def test_curves_match_attribution(oom_run):
    c = ds.curves(oom_run)
    assert c.total.tolist() == A.live_curve(oom_run)
    assert c.peak() == A.peak(oom_run)
    idx = np.arange(c.num_events)
    cats = c.categories_at(idx)
    assert (sum(cats.values()) == c.total).all()
    for seq in (0, c.num_events // 3, c.peak()[0], c.num_events - 1):
        assert c.by_category_at(seq) == A.breakdown_at(oom_run, seq).by_category


def test_small_runs_are_not_downsampled(oom_run):
    tl = ds.timeline(oom_run)
    assert not tl.downsampled and len(tl.seq) == oom_run.num_events


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-10**6, 10**6), min_size=1, max_size=3000),
       st.integers(8, 400), st.lists(st.integers(0, 2999), max_size=5))
def test_pick_indices_keeps_extremes_and_requested(deltas, max_points, keep):
    total = np.cumsum(np.array(deltas, dtype=np.int64))
    idx = ds.pick_indices(total, max_points, keep)
    assert (np.diff(idx) > 0).all() and idx[0] >= 0 and idx[-1] < len(total)
    assert int(np.argmax(total)) in idx
    assert total[idx].max() == total.max() and total[idx].min() == total.min()
    assert {k for k in keep if k < len(total)} <= set(idx.tolist())
    assert len(idx) <= max(max_points, len(keep) + 5)


def test_million_event_run_keeps_peak_and_oom_exact(big_run, big_html):
    assert big_run.num_events == 1_000_000 and len(big_run.blocks) > 200_000
    peak_seq, peak_bytes = A.peak(big_run)
    oom_seq = big_run.ooms[0].seq
    tl = ds.timeline(big_run)
    assert tl.downsampled and len(tl.seq) <= ds.DEFAULT_MAX_POINTS
    assert int(tl.total.max()) == peak_bytes and tl.peak_bytes == peak_bytes
    assert peak_seq in tl.seq and oom_seq in tl.seq and oom_seq - 1 in tl.seq
    assert (sum(tl.by_category.values()) == tl.total).all()
    # at the peak the stacks are what attribution says is alive there
    at = int(np.searchsorted(tl.seq, peak_seq))
    expected = A.breakdown_at(big_run, peak_seq).by_category
    assert {k: int(v[at]) for k, v in tl.by_category.items()} == expected

    path = big_html
    size = path.stat().st_size
    assert size < 10 * 1024**2, f"report is {size / 2**20:.1f} MiB"
    fig = _timeline(path.read_text())
    total = next(t for t in fig["data"] if t["name"].startswith("total live (highest"))
    assert len(total["x"]) <= ds.DEFAULT_MAX_POINTS
    assert max(total["y"]) == round(peak_bytes / 2**20, 4)
    assert peak_seq in total["x"] and oom_seq in total["x"]
    stacks = [t for t in fig["data"] if t.get("stackgroup")]
    assert stacks and all(t["x"] == total["x"] for t in stacks)
    at = total["x"].index(peak_seq)
    assert abs(sum(t["y"][at] for t in stacks) - total["y"][at]) < 1e-3
    oom = next(t for t in fig["data"] if t["name"].startswith("OOM"))
    assert oom["x"] == [oom_seq, oom_seq]


# ---- before / after, segments, CLI ----------------------------------------------------------
def test_before_and_after(oom_run, fixed_run, tmp_path):
    path = tmp_path / "ba.html"
    report(path, oom_run, other_run=fixed_run)
    text = path.read_text()
    assert "Before and after" in text and "<p>after: " in text
    titles = [str(f["layout"]["title"]["text"]) for f in _figures(text)]
    assert any(t.startswith("<b>before</b>") for t in titles) and any(t.startswith("<b>after</b>") for t in titles)
    peak_before, peak_after = A.peak(oom_run)[1], A.peak(fixed_run)[1]
    from memdoctor.units import format_bytes
    row = re.search(r"<td>peak \(total\)</td>(.*?)</tr>", text).group(1)
    assert format_bytes(peak_before) in row and format_bytes(peak_after) in row


def _snapshot() -> dict:
    mib = 1024**2
    seg_a, seg_b = 0x1000_0000, 0x2000_0000
    trace = [
        {"action": "segment_alloc", "addr": seg_a, "size": 20 * mib, "stream": 0},
        {"action": "alloc", "addr": seg_a, "size": 8 * mib, "stream": 0},
        {"action": "alloc", "addr": seg_a + 8 * mib, "size": 6 * mib, "stream": 0},
        {"action": "free_requested", "addr": seg_a, "size": 8 * mib, "stream": 0},
        {"action": "free_completed", "addr": seg_a, "size": 8 * mib, "stream": 0},
        {"action": "segment_alloc", "addr": seg_b, "size": 2 * mib, "stream": 0},
        {"action": "alloc", "addr": seg_b, "size": 512 * 1024, "stream": 0},
        {"action": "oom", "size": 12 * mib, "device_free": 3 * mib, "stream": 0},
    ]
    segments = [
        {"device": 0, "address": seg_a, "total_size": 20 * mib, "allocated_size": 6 * mib, "stream": 0,
         "segment_type": "large", "blocks": [
             {"address": seg_a, "size": 8 * mib, "state": "inactive"},
             {"address": seg_a + 8 * mib, "size": 6 * mib, "state": "active_allocated", "requested_size": 6 * mib},
             {"address": seg_a + 14 * mib, "size": 6 * mib, "state": "inactive"}]},
        {"device": 0, "address": seg_b, "total_size": 2 * mib, "allocated_size": 512 * 1024, "stream": 0,
         "segment_type": "small", "blocks": [
             {"address": seg_b, "size": 512 * 1024, "state": "active_allocated", "requested_size": 512 * 1024},
             {"address": seg_b + 512 * 1024, "size": 1536 * 1024, "state": "inactive"}]},
    ]
    return {"segments": segments, "device_traces": [trace]}


@pytest.fixture(scope="module")
def segment_html(tmp_path_factory) -> Path:
    from memdoctor.capture.snapshot import snapshot_to_run
    run = snapshot_to_run(_snapshot())
    assert run.segments and run.samples
    path = tmp_path_factory.mktemp("seg") / "segments.html"
    report(path, run)
    return path


def test_segments_chart(segment_html):
    text = segment_html.read_text()
    assert "Allocator segments" in text
    titles = [str(f["layout"]["title"]["text"]) for f in _figures(text)]
    assert any(t.startswith("reserved vs allocated") for t in titles)
    seg = next(f for f in _figures(text) if str(f["layout"]["title"]["text"]).startswith("segments with"))
    names = {t.get("name") for t in seg["data"]}
    assert {"allocated", "free"} <= names
    # segment 0 in address order: 8 MiB free, 6 MiB allocated, 6 MiB free
    pieces = [(t["x"][-1], t["marker"]["color"][-1]) for t in seg["data"] if t.get("name") is None]
    assert [x for x, _ in pieces] == [8.0, 6.0, 6.0]
    assert pieces[0][1] == pieces[2][1] != pieces[1][1]
    assert "largest free piece 8.00 MiB" in text


def test_empty_run_renders():
    run = Run()
    facts = facts_from_run(run)
    text = render_report(run, diagnose(facts), facts)
    assert "memdoctor report" in text and "<script type=\"application/json\"" in text


def test_cli_report(oom_run, fixed_run, tmp_path, monkeypatch, capsys):
    a, b = tmp_path / "a.memrun.json.gz", tmp_path / "b.memrun.json.gz"
    oom_run.save(a)
    fixed_run.save(b)
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(a)]) == 0
    assert (tmp_path / "a.html").exists()
    assert main(["report", str(a), str(b), "-o", "reports/ba.html"]) == 0
    assert "Before and after" in (tmp_path / "reports" / "ba.html").read_text()
    capsys.readouterr()
    junk = tmp_path / "junk.memrun.json.gz"
    junk.write_bytes(b"\x1f\x8b garbage, not gzip at all")
    assert main(["report", str(junk), "-o", "x.html"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memdoctor: ") and "Traceback" not in err
    assert not (tmp_path / "x.html").exists()
    assert main(["report", str(tmp_path / "missing.memrun.json.gz")]) == 2


def test_watch_writes_the_report(tmp_path):
    import memdoctor
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = tmp_path / "watch.html"
    with memdoctor.watch(model, opt, source="dispatch", report=str(out)):
        for _ in range(3):
            loss = model(torch.randn(16, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert out.exists() and "live memory by category" in out.read_text()


# ---- in a real browser ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium() -> str:
    exe = bench.find_chromium()
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing: CI must install it (apt-get install -y chromium)")
        pytest.skip("chromium is not installed")
    return exe


def _assert_drawn(got: dict) -> None:
    assert got["errors"] is None, got["errors"]
    assert got["blocked"] is None, f"the page tried to load something: {got['blocked']}"
    assert got["expected"] and got["rendered"] == got["expected"], (got["rendered"], got["expected"],
                                                                    got["stderr"][-1500:])
    assert got["main_svgs"] >= got["expected"]
    assert "pwned" not in got["body_attrs"], "an injected handler ran"


def test_browser_draws_every_chart(chromium, oom_html):
    path, _ = oom_html
    got = bench.chromium_dom(path)
    _assert_drawn(got)
    assert got["expected"] >= 4         # fixes, timeline, treemap, per step


def test_browser_draws_before_after_and_segments(chromium, oom_run, fixed_run, segment_html, tmp_path):
    path = tmp_path / "ba.html"
    report(path, oom_run, other_run=fixed_run)
    got = bench.chromium_dom(path)
    _assert_drawn(got)
    assert got["expected"] >= 6
    got = bench.chromium_dom(segment_html)
    _assert_drawn(got)


def test_browser_draws_a_million_event_report(chromium, big_html):
    """Every chart of a long run's report is drawn. How fast is measured by
    benchmarks/report_size.py (render_ms), not here: a test's timing is the machine's."""
    path = big_html
    got = bench.chromium_dom(path)
    _assert_drawn(got)
    assert got["render_ms"] is not None
