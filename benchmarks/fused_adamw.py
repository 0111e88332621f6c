"""Fused AdamW step time and achieved memory bandwidth, against the device's copy bandwidth.

    python benchmarks/fused_adamw.py [--models gpt2,gpt2-medium] [--repeats 30]

For GPT-2 small (124M parameters) and medium (355M) tensor lists, in fp32 with random
gradients: the copy bandwidth of the device (one large `copy_`, bytes read + written over
time), then the optimizer step of torch.optim.AdamW(fused=True), AdamW(foreach=True) and
memdoctor's FusedAdamW with fp32, bf16 and 8-bit states (each at its default launch
configuration and at the best of a small sweep). Step time is the median of `--repeats`
steps timed with CUDA events after a warm-up of at least a second; achieved bandwidth is the bytes an AdamW step
must move (parameters, gradients and states read, parameters and states written) over
that time:

    fp32 states  28 B a parameter  (p, g, m, v read: 16; p, m, v written: 12)
    bf16 states  20 B              (p, g 8 + m, v 4 read; p 4 + m, v 4 written)
    int8 states  16 B + scales     (p, g 8 + m, v 2 read; p 4 + m, v 2 written; 16 B / 256)

Prints a table and writes results/fused_adamw_<hardware>_<date>.json. A mode that fails
records its error and the run goes on. Targets: fp32 >= 80% of copy bandwidth and at
least as fast as torch fused; 8-bit within 1.3x of torch fused's time.
"""
from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import resultfile  # noqa: E402

MODELS = {
    # name: (layers, d_model, vocab, positions)
    "gpt2": (12, 768, 50257, 1024),
    "gpt2-medium": (24, 1024, 50257, 1024),
    "gpt2-large": (36, 1280, 50257, 1024),
}
BYTES_PER_PARAM = {"fp32": 28.0, "bf16": 20.0, "int8": 16.0 + 16.0 / 256}
SWEEP = {   # (BLOCK, CHUNK, num_warps)
    "fp32": [(512, 8192, 4), (1024, 8192, 4), (1024, 16384, 4), (2048, 16384, 8), (1024, 4096, 4), (2048, 8192, 4)],
    "bf16": [(512, 8192, 4), (1024, 8192, 4), (1024, 16384, 4), (2048, 16384, 8), (1024, 4096, 4), (2048, 8192, 4)],
    "int8": [(512, 8192, 4), (1024, 8192, 4), (1024, 16384, 4), (2048, 16384, 8), (1024, 4096, 4), (2048, 8192, 8)],
}


def gpt2_shapes(layers: int, d: int, vocab: int, positions: int) -> list[tuple[int, ...]]:
    shapes = [(vocab, d), (positions, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 20) -> dict:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    median = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 2 * nbytes, "median_s": median, "bandwidth_Bps": 2 * nbytes / median}


def time_steps(opt: torch.optim.Optimizer, warmup: int, repeats: int, warm_s: float = 1.0) -> list[float]:
    """Per-step times after `warmup` steps and at least `warm_s` seconds of steps: a GPU left
    idle while a kernel compiles drops its clocks, and a few steps do not bring them back."""
    start = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - start < warm_s:
        for _ in range(10):
            opt.step()
        done += 10
        torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        opt.step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def make_params(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=g) * 0.02)
        p.grad = torch.randn(shape, device="cuda", generator=g) * 1e-3
        params.append(p)
    return params


def run_mode(mode: str, shapes, args, config=None) -> dict:
    from memdoctor.cuda.kernels import adamw, adamw_triton

    params = make_params(shapes)
    numel = sum(p.numel() for p in params)
    kind = "fp32"
    saved = dict(adamw_triton.CONFIGS)
    try:
        if mode == "torch-fused":
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
        elif mode == "torch-foreach":
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)
        else:
            kind = mode.split("-")[1]
            if config is not None:
                adamw_triton.CONFIGS[kind] = config
            opt = adamw.FusedAdamW(params, lr=1e-4, weight_decay=0.1, state_dtype=kind, backend="triton")
        times = time_steps(opt, args.warmup, args.repeats)
        median = statistics.median(times)
        nbytes = BYTES_PER_PARAM[kind] * numel
        result = {
            "mode": mode, "state": kind, "params": numel, "tensors": len(params),
            "median_s": median, "min_s": min(times), "max_s": max(times),
            "bytes_per_step": nbytes, "bandwidth_Bps": nbytes / median,
            "state_bytes": adamw.state_bytes(opt),
            "config": list(adamw_triton.CONFIGS[kind]) if mode.startswith("triton") else None,
        }
        del opt
    finally:
        adamw_triton.CONFIGS.update(saved)
        del params
        gc.collect()
        torch.cuda.empty_cache()
    return result


def guarded(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # a failing mode is recorded, the run goes on
        gc.collect()
        torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,gpt2-medium")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-sweep", action="store_true", help="only the default launch configurations")
    parser.add_argument("--out", help="output folder (default benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    try:
        import triton
        triton_version = triton.__version__
    except Exception as exc:
        triton_version = f"not importable: {exc}"
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
        "repeats": args.repeats, "warmup": args.warmup,
        "copy": guarded(copy_bandwidth),
        "models": {},
    }
    copy_bw = report["copy"].get("bandwidth_Bps")
    print(f"{report['device']}  torch {report['torch']}  triton {triton_version}")
    if copy_bw:
        print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + written)")
    modes = ["torch-fused", "torch-foreach", "triton-fp32", "triton-bf16", "triton-int8"]
    for name in args.models.split(","):
        shapes = gpt2_shapes(*MODELS[name])
        results = {}
        for mode in modes:
            t0 = time.perf_counter()
            results[mode] = guarded(run_mode, mode, shapes, args)
            if mode.startswith("triton") and not args.no_sweep:
                kind = mode.split("-")[1]
                sweep = [guarded(run_mode, mode, shapes, args, config=tuple(c)) for c in SWEEP[kind]]
                results[mode]["sweep"] = sweep
                good = [r for r in sweep if "median_s" in r]
                if good:
                    results[mode]["best"] = min(good, key=lambda r: r["median_s"])
            results[mode]["wall_s"] = time.perf_counter() - t0
        fused = results["torch-fused"].get("median_s")
        for r in results.values():
            if "median_s" in r:
                if copy_bw:
                    r["fraction_of_copy"] = r["bandwidth_Bps"] / copy_bw
                if fused:
                    r["time_vs_torch_fused"] = r["median_s"] / fused
        report["models"][name] = results
        params = next((r["params"] for r in results.values() if "params" in r), 0)
        print(f"\n{name}: {params / 1e6:.1f}M parameters, {len(shapes)} tensors")
        print(f"{'mode':16s} {'step ms':>9s} {'GB/s':>7s} {'of copy':>8s} {'vs fused':>9s} {'state MiB':>10s}  best config")
        for mode, r in results.items():
            if "median_s" not in r:
                print(f"{mode:16s} FAILED {r.get('error', '')[:100]}")
                continue
            best = r.get("best")
            best_text = (f"{best['median_s'] * 1e3:.3f} ms {best['config']}" if best else "")
            print(f"{mode:16s} {r['median_s'] * 1e3:9.3f} {r['bandwidth_Bps'] / 1e9:7.0f} "
                  f"{r.get('fraction_of_copy', float('nan')):8.1%} {r.get('time_vs_torch_fused', float('nan')):9.2f} "
                  f"{r['state_bytes'] / 2**20:10.1f}  {best_text}")
    checks = {}
    for name, results in report["models"].items():
        def best_time(r):
            return min([r["median_s"]] + [r["best"]["median_s"]] if r.get("best") else [r["median_s"]])
        fp32, int8, fused = results.get("triton-fp32", {}), results.get("triton-int8", {}), results.get("torch-fused", {})
        if "median_s" in fp32 and "median_s" in fused and copy_bw:
            checks[f"{name}: fp32 >= 80% of copy bandwidth (default config)"] = fp32["bandwidth_Bps"] / copy_bw >= 0.8
            checks[f"{name}: fp32 at least as fast as torch fused (default config)"] = fp32["median_s"] <= fused["median_s"]
            checks[f"{name}: fp32 at least as fast as torch fused (best config)"] = best_time(fp32) <= fused["median_s"]
        if "median_s" in int8 and "median_s" in fused:
            checks[f"{name}: 8-bit within 1.3x of torch fused (default config)"] = int8["median_s"] <= 1.3 * fused["median_s"]
    report["targets"] = checks
    print()
    for text, ok in checks.items():
        print(f"{'PASS' if ok else 'MISS'}  {text}")
    print("\nwrote", resultfile.save("fused_adamw", resultfile.hardware("cuda"), report, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
