"""Step time of GPT-2 124M (bs 8, seq 1024, fp32, AdamW) untraced vs traced, on a GPU.

Run: OUT=benchmarks/results python benchmarks/trace_overhead_gpu.py [--steps 20]
Prints a table and writes trace_overhead_gpu.json under $OUT.
"""
import argparse
import json
import os
import statistics
import time

import torch
import transformers

from memdoctor.attribution import at_peak
from memdoctor.diagnosis import diagnose, facts_from_run
from memdoctor.capture.session import Tracer


def step_times(model, optimizer, ids, steps):
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    step_times(model, optimizer, ids, 3)   # warm-up
    results = {}
    rounds = {"untraced": [], "allocator": [], "dispatch": []}
    post = {"allocator": [], "dispatch": []}
    for _ in range(2):     # interleave so drift hits every mode alike
        rounds["untraced"] += step_times(model, optimizer, ids, args.steps // 2)
        for source in ("allocator", "dispatch"):
            tracer = Tracer(models=[model], optimizers=[optimizer], source=source)
            with tracer:
                rounds[source] += step_times(model, optimizer, ids, args.steps // 2)
            t0 = time.perf_counter()
            run = tracer.run
            at_peak(run)
            diagnose(facts_from_run(run))
            post[source].append(time.perf_counter() - t0)
            results[f"{source}_events"] = run.num_events
    base = statistics.median(rounds["untraced"])
    for name, times in rounds.items():
        med = statistics.median(times)
        results[name] = {"median_step_s": med, "ratio": med / base}
    for name, times in post.items():
        results[name]["attribution_after_run_s"] = statistics.median(times)
        results[name]["ratio_with_attribution"] = (
            statistics.median(rounds[name]) * (args.steps // 2) + statistics.median(times)) / (base * (args.steps // 2))
    results["torch"] = torch.__version__
    results["device"] = torch.cuda.get_device_name()
    results["command"] = "OUT=benchmarks/results python benchmarks/trace_overhead_gpu.py --steps %d" % args.steps
    for name in rounds:
        print(f"{name:10s} median {results[name]['median_step_s'] * 1000:8.2f} ms  ratio {results[name]['ratio']:.4f}")
    for name in post:
        print(f"{name:10s} attribution+diagnosis after the run {results[name]['attribution_after_run_s']:.2f} s, "
              f"overall ratio {results[name]['ratio_with_attribution']:.4f}")
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "trace_overhead_gpu.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
