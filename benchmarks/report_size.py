"""How big the HTML report of a long run is, how long it takes to write, and how long
headless Chromium takes to draw it.

Builds a synthetic Run of 1,000,000 events shaped like a training run (weights, then per
step: inputs, forward activations and temporaries per layer, backward freeing them and
making gradients, an optimizer step with state made in step 0 and temporaries, a small
leak every step, an OOM at the end), writes its report with the findings computed, and, if
Chromium is installed, loads it headless and reads the time the page reports when every
chart is drawn (render_ms: from navigation start, so it includes parsing the 4.6 MiB of
plotly.js), over several loads. Prints the numbers and writes
results/report_size_<hardware>_<date>.json.

    python benchmarks/report_size.py [--events N] [--loads K] [--out FILE.html]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memdoctor.run import OOM, Action, Block, Mark, Run

HERE = Path(__file__).resolve().parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-extensions", "--disable-default-apps", "--mute-audio", "--disable-dev-shm-usage"]


def synthetic_run(events: int = 1_000_000, layers: int = 32, seed: int = 0) -> Run:
    """A Run of about `events` events (ending in one simulated OOM) built from the
    memdoctor.run dataclasses directly."""
    rng = random.Random(seed)
    run = Run(source="dispatch", device={"type": "cpu"}, script="/home/me/train_big.py",
              torch_version="synthetic")
    actions, ev_blocks, ev_bytes, blocks, marks = run.actions, run.event_blocks, run.event_bytes, run.blocks, run.marks
    state = {"id": 0, "phase": "other", "step": 0, "live": 0, "peak": 0}
    ALLOC, FREE = Action.ALLOC, Action.FREE

    def alloc(nbytes, category, name, shape, module):
        bid = state["id"]
        state["id"] += 1
        blocks[bid] = Block(bid, nbytes, category, name, shape, "float32", "cpu", module, state["phase"],
                            state["step"], len(actions), None, None)
        actions.append(ALLOC)
        ev_blocks.append(bid)
        ev_bytes.append(nbytes)
        state["live"] += nbytes
        if state["live"] > state["peak"]:
            state["peak"] = state["live"]
        return bid

    def free(bid):
        b = blocks[bid]
        b.free_seq = len(actions)
        actions.append(FREE)
        ev_blocks.append(bid)
        ev_bytes.append(b.nbytes)
        state["live"] -= b.nbytes

    def mark(phase, module=None):
        state["phase"] = phase
        marks.append(Mark(len(actions), phase, state["step"], module, float(len(actions))))

    mark("other")
    hidden = 256
    for i in range(layers):
        alloc(hidden * hidden * 4, "weights", f"layers.{i}.weight", [hidden, hidden], None)
    state_made = False
    step = 0
    budget = None
    while len(actions) < events - 700:
        state["step"] = step
        mark("other")
        batch = 64 + rng.randint(0, 8)
        x = alloc(batch * hidden * 4, "inputs", "input", [batch, hidden], None)
        mark("forward", "model")
        saved = []
        for i in range(layers):
            mod = f"layers.{i}"
            for op in ("aten.mm", "aten.gelu", "aten.layer_norm"):
                saved.append(alloc(batch * hidden * 4, "activations", op, [batch, hidden], mod))
            for op in ("aten.add", "aten.mul"):
                free(alloc(batch * hidden * 4, "temporaries", op, [batch, hidden], mod))
        mark("backward")
        grads = []
        for i in reversed(range(layers)):
            mod = f"layers.{i}"
            for _ in range(3):
                free(saved.pop())
            grads.append(alloc(hidden * hidden * 4, "gradients", f"layers.{i}.weight.grad", [hidden, hidden], None))
            for op in ("aten.mm", "aten.gelu_backward"):
                free(alloc(batch * hidden * 4, "temporaries", op, [batch, hidden], mod))
        mark("optimizer")
        if not state_made:
            for i in range(layers):
                alloc(hidden * hidden * 4, "optimizer_state", f"layers.{i}.weight:momentum_buffer",
                      [hidden, hidden], None)
            state_made = True
        for i in range(layers):
            free(alloc(hidden * hidden * 4, "temporaries", "aten._foreach_mul", [hidden, hidden], None))
        mark("forward", "model")
        alloc(16 * 1024, "activations", "aten.mse_loss", [4096], "model")     # the leak: kept every step
        mark("other")
        for g in grads:
            free(g)
        free(x)
        step += 1
    mark("forward", "model")
    if (events - 1 - len(actions)) % 2:           # exactly `events` with the OOM
        alloc(4096, "activations", "aten.add", [1024], "layers.0")
    while len(actions) < events - 1:
        free(alloc(4096, "temporaries", "aten.add", [1024], "layers.0"))
    live = state["live"]
    budget = state["peak"] + 2 * 1024 * 1024
    run.budget_bytes = budget
    requested = budget - live + 1024 * 1024
    run.ooms.append(OOM(len(actions), requested, f"CPU out of memory (memdoctor budget, simulated). Tried to "
                                                 f"allocate {requested} bytes. Budget of {budget} bytes.",
                        "forward", step, "layers.0", True, live))
    actions.append(Action.OOM)
    ev_blocks.append(-1)
    ev_bytes.append(requested)
    run.meta["optimizers"] = [{"class": "SGD", "momentum": 0.9, "param_bytes": layers * hidden * hidden * 4,
                               "num_params": layers, "foreach": None, "fused": None,
                               "largest_param_bytes": hidden * hidden * 4, "device": "cpu"}]
    return run


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium_dom(html_path: str | os.PathLike, timeout: float = 120, extra: list[str] | None = None) -> dict:
    """Load a file in headless Chromium and return what the page recorded on <body>:
    rendered / expected figure counts, render_ms, errors, blocked requests; plus the DOM,
    the count of plotly's svg.main-svg elements and the wall time."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium is not installed")
    url = Path(html_path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="memdoctor-chromium-") as profile:
        start = time.perf_counter()
        proc = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *(extra or []),
                               "--dump-dom", url], capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - start
    dom = proc.stdout
    body = re.search(r"<body([^>]*)>", dom)
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1))) if body else {}
    return {"returncode": proc.returncode, "dom": dom, "body_attrs": attrs, "stderr": proc.stderr[-4000:], "wall_s": wall,
            "rendered": int(attrs["rendered"]) if "rendered" in attrs else None,
            "expected": int(attrs["expected"]) if "expected" in attrs else None,
            "render_ms": int(attrs["render-ms"]) if "render-ms" in attrs else None,
            "errors": attrs.get("errors"), "blocked": attrs.get("blocked"),
            "main_svgs": len(re.findall(r'<svg[^>]*class="main-svg"', dom))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--out", help="keep the report here (default: a temporary file)")
    ap.add_argument("--loads", type=int, default=5, help="how many times Chromium loads the report")
    ap.add_argument("--no-save", action="store_true", help="print the result only")
    ns = ap.parse_args(argv)
    from memdoctor.attribution import peak
    from memdoctor.diagnosis import diagnose, facts_from_run
    from memdoctor.report.html import write_report

    t0 = time.perf_counter()
    run = synthetic_run(ns.events)
    build_s = time.perf_counter() - t0
    tmp = None
    out = ns.out
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="memdoctor-report-")
        out = os.path.join(tmp.name, "big.html")
    t0 = time.perf_counter()
    facts = facts_from_run(run)        # timed with the report, as `memdoctor report` runs them
    write_report(out, run, diagnose(facts), facts)
    write_s = time.perf_counter() - t0
    size = os.path.getsize(out)
    result = {
        "benchmark": "report_size",
        "events": run.num_events, "blocks": len(run.blocks), "marks": len(run.marks), "steps": run.steps,
        "peak_bytes": peak(run)[1],
        "build_run_s": round(build_s, 3),
        "write_report_s": round(write_s, 3),
        "report_bytes": size,
        "report_mib": round(size / 2**20, 2),
    }
    if find_chromium():
        loads = [chromium_dom(out) for _ in range(max(ns.loads, 1))]
        ms = sorted(g["render_ms"] for g in loads if g["render_ms"] is not None)
        got = loads[-1]
        result.update(chromium_render_ms_min=ms[0] if ms else None,
                      chromium_render_ms_median=ms[len(ms) // 2] if ms else None,
                      chromium_render_ms_all=[g["render_ms"] for g in loads],
                      chromium_wall_s_min=round(min(g["wall_s"] for g in loads), 3),
                      charts_drawn=got["rendered"], charts_expected=got["expected"],
                      js_errors=[g["errors"] for g in loads if g["errors"]] or None,
                      blocked_requests=[g["blocked"] for g in loads if g["blocked"]] or None,
                      load_average_1min=round(os.getloadavg()[0], 2))
    else:
        result["chromium_render_ms_min"] = None
    result.update(machine=platform.machine(), cpus=os.cpu_count(), when=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    print(json.dumps(result, indent=2))
    if not ns.no_save:
        sys.path.insert(0, str(HERE))
        import resultfile
        print("wrote", resultfile.save("report_size", resultfile.hardware("cpu"), result))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
