"""Step time of GPT-2 124M (bs 8, seq 1024, fp32, AdamW) untraced vs traced, on a GPU.

    python benchmarks/trace_overhead_gpu.py [--steps 20] [--out DIR]

Prints a table and writes results/trace_overhead_gpu_<hardware>_<date>.json.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import transformers

from memdoctor.attribution import at_peak
from memdoctor.diagnosis import diagnose, facts_from_run
from memdoctor.capture.session import Tracer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resultfile  # noqa: E402


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
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
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
    for name in rounds:
        print(f"{name:10s} median {results[name]['median_step_s'] * 1000:8.2f} ms  ratio {results[name]['ratio']:.4f}")
    for name in post:
        print(f"{name:10s} attribution+diagnosis after the run {results[name]['attribution_after_run_s']:.2f} s, "
              f"overall ratio {results[name]['ratio_with_attribution']:.4f}")
    print("wrote", resultfile.save("trace_overhead_gpu", resultfile.hardware("cuda"), results, args.out))


if __name__ == "__main__":
    main()
