"""What tracing costs on the CPU: one training step (forward, backward, AdamW) of a 4-layer
nn.TransformerEncoder, untraced, under memdoctor's dispatch tracer, and under PyTorch's own
MemTracker (torch.distributed._tools.mem_tracker), all in one process.

The modes are interleaved in rounds (each round runs every mode for a few steps, the first
of which is a warm-up and not timed) so that a machine shared with other work slows them
alike. Each step is timed twice: wall clock and this process's CPU time. On a busy machine
CPU time is the steadier of the two; by default torch uses one thread so that CPU time is
not inflated by threads spinning while they wait for a core.

    python benchmarks/trace_overhead.py --steps 30 --per-block 5   # -> results/trace_overhead_<hardware>_<date>.json
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import resultfile  # noqa: E402


def build(d_model: int, layers: int):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, 8, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def make_step(model, opt, batch: int, seq: int, d_model: int):
    def step():
        x = torch.randn(batch, seq, d_model)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def mode_contexts(model, opt):
    """name -> (enter a block of steps, called after each step)."""
    from memdoctor.capture.session import Tracer

    def untraced():
        return contextlib.nullcontext(), lambda ctx: None

    def dispatch():
        return Tracer(models=[model], optimizers=[opt], source="dispatch"), lambda ctx: None

    def memtracker():
        from torch.distributed._tools.mem_tracker import MemTracker
        mt = MemTracker()
        mt.track_external(model, opt)
        # MemTracker refuses a module's second forward unless its stats are reset
        return mt, lambda ctx: ctx.reset_mod_stats()

    return {"untraced": untraced, "dispatch": dispatch, "memtracker": memtracker}


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    model, opt = build(args.d_model, args.layers)
    step = make_step(model, opt, args.batch, args.seq, args.d_model)
    for _ in range(args.warmup):
        step()
    modes = mode_contexts(model, opt)
    names = [m for m in args.modes if m in modes]
    wall = {m: [] for m in names}
    cpu = {m: [] for m in names}
    per_block = args.per_block
    rounds = -(-args.steps // per_block)
    events = 0
    load_before = os.getloadavg()
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]       # no mode always runs first
        for name in order:
            ctx, after = modes[name]()
            with ctx:
                for i in range(per_block + 1):
                    w, c = time.perf_counter(), time.process_time()
                    step()
                    w, c = time.perf_counter() - w, time.process_time() - c
                    after(ctx)
                    if i:                                   # the block's first step warms up
                        wall[name].append(w)
                        cpu[name].append(c)
            if name == "dispatch":
                events += ctx.run.num_events
    load_after = os.getloadavg()

    def summary(xs):
        xs = xs[: args.steps]
        return {"median_ms": round(1000 * statistics.median(xs), 2), "min_ms": round(1000 * min(xs), 2),
                "max_ms": round(1000 * max(xs), 2), "steps": len(xs)}
    result = {
        "config": {"model": f"nn.TransformerEncoder({args.layers} layers, d_model {args.d_model}, 8 heads, "
                            f"ff {4 * args.d_model}, dropout 0.1)",
                   "batch": args.batch, "seq": args.seq, "optimizer": "AdamW (torch defaults: the per-parameter loop on the CPU)",
                   "threads": args.threads, "steps_per_mode": args.steps, "warmup_steps": args.warmup},
        "wall": {m: summary(wall[m]) for m in names},
        "cpu": {m: summary(cpu[m]) for m in names},
        "dispatch_events_per_step": round(events / (rounds * (per_block + 1))) if "dispatch" in names else None,
        "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
    }
    for kind in ("wall", "cpu"):
        base = result[kind]["untraced"]["median_ms"]
        result[f"ratio_{kind}"] = {m: round(result[kind][m]["median_ms"] / base, 3) for m in names}
    return result


def print_table(result: dict) -> None:
    names = list(result["cpu"])
    print(f"{result['config']['model']}, batch {result['config']['batch']} x seq {result['config']['seq']}, "
          f"{result['config']['threads']} thread(s), median of {result['config']['steps_per_mode']} steps")
    print(f"{'mode':<12}{'wall ms':>10}{'x untraced':>12}{'cpu ms':>10}{'x untraced':>12}")
    for m in names:
        print(f"{m:<12}{result['wall'][m]['median_ms']:>10.1f}{result['ratio_wall'][m]:>12.2f}"
              f"{result['cpu'][m]['median_ms']:>10.1f}{result['ratio_cpu'][m]:>12.2f}")
    print(f"load average before/after: {result['load_average_before_after']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per mode")
    p.add_argument("--per-block", type=int, default=3, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=["untraced", "dispatch", "memtracker"])
    p.add_argument("--out", help="output folder (default benchmarks/results)")
    args = p.parse_args(argv)
    result = measure(args)
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                         "python": platform.python_version(), "torch": torch.__version__}
    result["target"] = "dispatch at most 1.5x untraced"
    print_table(result)
    print("wrote", resultfile.save("trace_overhead", resultfile.hardware("cpu"), result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
