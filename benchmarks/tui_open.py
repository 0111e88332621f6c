"""How fast `memdoctor tui` opens a 1,000,000-event run, and whether keys wait on it.

Builds a synthetic Run from memdoctor.run's dataclasses (a model's weights, then steps of
forward / backward / optimizer with activations saved for backward, temporaries, inputs,
gradients, optimizer state, a few tensors leaked per step, and a simulated OOM at the end),
saves it as a *.memrun.json.gz, then opens it in the textual app headless at 80x24 and
measures:

- open_to_overview_s: from the app's start to the overview showing the peak, budget, OOM
  and breakdown (the run read and indexed in a worker thread);
- open_to_findings_s: to the findings shown (the full Run built and the rules run, also in
  the worker, while the overview is already usable);
- key latency while loading: a key ("2"/"1", switching screens) every 50 ms from the start
  until the findings are shown, timed from the key event to the screen having switched;
- scrub latency: left-arrow presses on the timeline once loaded, key to cursor moved;
- index_scrub_us: the index's breakdown + top tensors for one instant, without the UI.

Prints the numbers and writes results/tui_open_<hardware>_<date>.json.

    python benchmarks/tui_open.py [--events N] [--repeat R]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from memdoctor.attribution import peak
from memdoctor.run import OOM, Block, Mark, Run

sys.path.insert(0, str(Path(__file__).resolve().parent))
import resultfile  # noqa: E402

MiB = 1 << 20


def synthetic_run(events: int, seed: int = 0) -> Run:
    """About `events` events, half as many blocks, shaped like a transformer's training."""
    rng = random.Random(seed)
    run = Run(source="dispatch", device={"type": "cpu"}, budget_bytes=None, script="/bench/train.py",
              torch_version="2.13.0")
    acts, blks, nbs = run.actions, run.event_blocks, run.event_bytes
    blocks = run.blocks
    layers = [f"layers.{i}.{part}" for i in range(24) for part in ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")]
    next_id = 0

    def alloc(nbytes, cat, name, module, phase, step, shape):
        nonlocal next_id
        b = Block(next_id, nbytes, cat, name, shape, "float32", "cpu", module, phase, step, len(acts))
        blocks[next_id] = b
        acts.append(0)
        blks.append(next_id)
        nbs.append(nbytes)
        next_id += 1
        return b

    def free(b):
        b.free_seq = len(acts)
        acts.append(1)
        blks.append(b.id)
        nbs.append(b.nbytes)

    params = [alloc(2 * MiB, "weights", f"{m}.weight", None, "other", 0, [1024, 512]) for m in layers]
    steps = 40
    per_step = (events - len(acts) - 10) // steps
    leaked = []
    for step in range(steps):
        start = len(acts)
        run.marks.append(Mark(len(acts), "forward", step, "model"))
        batch = alloc(4 * MiB, "inputs", "batch", None, "forward", step, [64, 16384])
        saved = []
        while len(acts) - start < per_step * 0.45:
            module = layers[(len(saved) // 3) % len(layers)]
            n = rng.choice((64, 128, 256, 512)) * 1024
            if rng.random() < 0.4:
                saved.append(alloc(n, "activations", "aten.mm", module, "forward", step, [64, n // 256]))
            else:
                free(alloc(n, "temporaries", "aten.gelu", module, "forward", step, [64, n // 256]))
        run.marks.append(Mark(len(acts), "backward", step, "model"))
        grads = [alloc(p.nbytes, "gradients", p.name + ".grad", None, "backward", step, p.shape) for p in params]
        keep = saved.pop() if saved else None           # one activation a step is kept: a leak
        for b in reversed(saved):
            tmp = alloc(b.nbytes, "temporaries", "aten.mm_backward", b.module, "backward", step, b.shape)
            free(tmp)
            free(b)
        run.marks.append(Mark(len(acts), "optimizer", step, None))
        if step == 0:
            for p in params:
                alloc(p.nbytes, "optimizer_state", p.name + ":exp_avg", None, "optimizer", 0, p.shape)
                alloc(p.nbytes, "optimizer_state", p.name + ":exp_avg_sq", None, "optimizer", 0, p.shape)
        while len(acts) - start < per_step - 2 * len(grads) - 4:
            free(alloc(64 * 1024, "temporaries", "aten._foreach_mul", None, "optimizer", step, [16384]))
        for g in grads:
            free(g)
        free(batch)
        if keep is not None:
            leaked.append(keep)
    while len(acts) < events - 2:               # round up to exactly `events` with the OOM
        free(alloc(4096, "temporaries", "aten.copy_", None, "other", steps - 1, [1024]))
    if len(acts) < events - 1:
        alloc(4096, "other", "aten.empty", None, "other", steps - 1, [1024])
    # the budget sits just above the peak so far; the next step's first big request fails
    live = sum(b.nbytes for b in blocks.values() if b.free_seq is None)
    _, top = peak(run)
    run.budget_bytes = top + 8 * MiB
    request = run.budget_bytes - live + 16 * MiB
    run.marks.append(Mark(len(acts), "forward", steps, "model"))
    run.ooms.append(OOM(len(acts), request, "CPU out of memory (memdoctor budget, simulated)", "forward", steps,
                        layers[0], True, live))
    acts.append(2)
    blks.append(-1)
    nbs.append(request)
    return run


async def measure_open(path: Path) -> dict:
    from textual import events

    from memdoctor.tui.app import MemdoctorApp

    app = MemdoctorApp(path)
    app.animation_level = "none"
    latencies: list[float] = []
    scrubs: list[float] = []
    async with app.run_test(size=(80, 24)) as pilot:
        tabs = None
        want = "timeline"
        while app.stage not in ("diagnosed", "error"):
            await asyncio.sleep(0.05)
            try:
                tabs = tabs or app.query_one("#tabs")
            except Exception:
                continue
            key = "2" if want == "timeline" else "1"
            t = time.perf_counter()
            app.post_message(events.Key(key, key))
            while tabs.active != want and time.perf_counter() - t < 10:
                await asyncio.sleep(0.001)
            latencies.append(time.perf_counter() - t)
            want = "overview" if want == "timeline" else "timeline"
        if app.stage == "error":
            raise SystemExit(f"the app could not open the run: {app.error}")
        await pilot.press("2")
        await pilot.pause(0.2)
        plot = app.query_one("#tl-plot")
        for _ in range(20):
            seq = plot.seq
            t = time.perf_counter()
            app.post_message(events.Key("left", None))
            while plot.seq == seq and time.perf_counter() - t < 5:
                await asyncio.sleep(0.001)
            scrubs.append(time.perf_counter() - t)
            await asyncio.sleep(0.02)
        index = app.index
        t = time.perf_counter()
        for s in range(0, index.num_events, max(index.num_events // 1000, 1)):
            index.by_category(s)
            index.top(s, 7)
        per_instant = (time.perf_counter() - t) / len(range(0, index.num_events, max(index.num_events // 1000, 1)))
        await pilot.press("q")
    return {
        "open_to_overview_s": app.overview_shown_at - app.started_at,
        "open_to_findings_s": app.diagnosed_at - app.started_at,
        "keys_while_loading": len(latencies),
        "key_latency_while_loading_max_s": max(latencies) if latencies else None,
        "key_latency_while_loading_median_s": statistics.median(latencies) if latencies else None,
        "scrub_latency_median_s": statistics.median(scrubs),
        "scrub_latency_max_s": max(scrubs),
        "index_scrub_us": per_instant * 1e6,
        "findings": [f.rule for f in app.findings],
        "peak_bytes": app.index.peak_bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    t = time.perf_counter()
    run = synthetic_run(args.events)
    build_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.memrun.json.gz"
        run.save(path)
        size = path.stat().st_size
        num_events, num_blocks = run.num_events, len(run.blocks)
        del run
        t = time.perf_counter()
        Run.load(path)
        run_load_s = time.perf_counter() - t
        rounds = [asyncio.run(measure_open(path)) for _ in range(args.repeat)]

    def med(key):
        return round(statistics.median(r[key] for r in rounds), 4)

    def worst(key):
        return round(max(r[key] for r in rounds), 4)
    result = {
        "benchmark": "tui_open",
        "events": num_events,
        "blocks": num_blocks,
        "file_bytes": size,
        "build_s": round(build_s, 3),
        "run_load_s": round(run_load_s, 3),
        "repeat": args.repeat,
        "open_to_overview_s": med("open_to_overview_s"),
        "open_to_overview_max_s": worst("open_to_overview_s"),
        "open_to_findings_s": med("open_to_findings_s"),
        "keys_while_loading": sum(r["keys_while_loading"] for r in rounds),
        "key_latency_while_loading_median_s": med("key_latency_while_loading_median_s"),
        "key_latency_while_loading_max_s": worst("key_latency_while_loading_max_s"),
        "scrub_latency_median_s": med("scrub_latency_median_s"),
        "scrub_latency_max_s": worst("scrub_latency_max_s"),
        "index_scrub_us": med("index_scrub_us"),
        "findings": rounds[0]["findings"],
        "peak_bytes": rounds[0]["peak_bytes"],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import textual
        result["textual"] = textual.__version__
    except (ImportError, AttributeError):
        pass
    json.dump(result, sys.stdout, indent=2)
    print()
    print("wrote", resultfile.save("tui_open", resultfile.hardware("cpu"), result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
