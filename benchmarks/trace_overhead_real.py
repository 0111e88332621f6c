"""Tracing overhead on fast real training loops, on a GPU: ms per iteration plain, under
PyTorch's own `_record_memory_history` alone, and under memdoctor's modes, as ratios to plain.

Two workloads, each mode in a fresh process, modes interleaved over several rounds so that
drift hits every mode alike:
- nanogpt: nanoGPT's train.py shape (GPT-2 124M, bf16 autocast, batch 12 x 1024, fused
  AdamW, `loss.item()` every iteration), 40 iterations, median of iterations 6-40;
- cnn: a ResNet-18 (torchvision's when it imports, else an equivalent written here), bf16
  autocast, batch 64 at 128 px, SGD with momentum: a step under 20 ms.

Each run also reports the CPU's side: ms until the iteration's work is queued, before the
`.item()` waits for the GPU; while that stays under the GPU's time, hooks cost nothing.
`--modes full-allstacks full-savedhooks full-nometa full-roothooks full-stamp2 full-stamp0` time
full mode with one part changed (undone after its window): Python stacks at every step,
saved-tensor hooks on, no metadata tags, hooks on the outermost call only, module tags only
two calls deep or none.

`--in-process` measures every mode in one process per workload instead, the same model and
batch, mode after mode in windows of `--iters` iterations (the order rotated each round),
each window's ratio taken to the plain window of its own round: what differs between two
processes of one mode (the GPU's clocks, cuDNN's algorithm choice, the allocator's layout)
then drops out of the ratio. memdoctor's analysis at each window's end is not timed.

Run: python benchmarks/trace_overhead_real.py [--rounds 3] [--in-process] [--out DIR]
Writes trace_overhead_real_<hardware>_<date>.json under DIR (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resultfile  # noqa: E402

MODES = ("plain", "history", "full", "light", "dispatch")
WORKLOADS = ("nanogpt", "cnn")
# full mode with one part changed, to see what each part costs (not modes a user has)
ABLATIONS = ("full-allstacks", "full-savedhooks", "full-nometa", "full-roothooks", "full-stamp2", "full-stamp0")


@contextlib.contextmanager
def _ablate(mode: str):
    """Change one part of full mode while the block runs (not modes a user has)."""
    from memdoctor.capture import allocator, hooks
    saved = [(allocator, "STACKED_STEPS"), (hooks, "STAMP_DEPTH"), (hooks.OwnershipHooks, "__init__"),
             (allocator.AllocatorSource, "start")]
    before = [(owner, name, getattr(owner, name)) for owner, name in saved]
    init, start = hooks.OwnershipHooks.__init__, allocator.AllocatorSource.start
    if mode == "full-allstacks":        # Python stacks at every step, never paused
        allocator.STACKED_STEPS = 1 << 30
    elif mode == "full-savedhooks":     # saved-tensor hooks as the dispatch source has them
        hooks.OwnershipHooks.__init__ = lambda self, rec, light=False, saved_tensors=True: init(
            self, rec, light, saved_tensors=True)
    elif mode == "full-nometa":         # no per-mark metadata tags
        def start_untagged(self):
            self._metadata = False
            start(self)
        allocator.AllocatorSource.start = start_untagged
    elif mode == "full-roothooks":      # hooks on the model's outermost call only, as light mode
        hooks.OwnershipHooks.__init__ = lambda self, rec, light=False, saved_tensors=True: init(
            self, rec, True, saved_tensors)
    elif mode in ("full-stamp2", "full-stamp0"):     # module tags this deep only
        hooks.STAMP_DEPTH = int(mode[-1])
    try:
        yield
    finally:
        for owner, name, value in before:
            setattr(owner, name, value)


def _gpt(torch, nn, F):
    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.heads = heads

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, vocab=50304, block=1024, layers=12, heads=12, d=768):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
            self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.wte.weight = self.lm_head.weight

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    return GPT()


def _resnet18(torch, nn):
    try:
        import torchvision
        return torchvision.models.resnet18(num_classes=1000)
    except Exception:
        pass

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.down = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            y = self.b2(self.c2(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    return nn.Sequential(*layers)


def build(workload: str):
    """The workload's model, optimizer and a function of one iteration's loss, on the GPU."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(0)
    dev = "cuda"
    if workload == "nanogpt":
        model = _gpt(torch, nn, F).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
        x = torch.randint(0, 50304, (12, 1024), device=dev)
        y = torch.randint(0, 50304, (12, 1024), device=dev)

        def loss_of():
            return model(x, y)
    else:
        model = _resnet18(torch, nn).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(64, 3, 128, 128, device=dev)
        y = torch.randint(0, 1000, (64,), device=dev)

        def loss_of():
            return F.cross_entropy(model(x), y)
    return model, opt, loss_of


def timed(opt, loss_of, iters: int) -> tuple[list[float], list[float]]:
    """Seconds per iteration, and the CPU's side of each: until its ops are queued."""
    import torch
    times, launched = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        launched.append(time.perf_counter() - t0)     # the CPU's side: ops queued, no wait yet
        loss.item()                       # nanoGPT reads the loss every iteration
        times.append(time.perf_counter() - t0)
    return times, launched


def window(model, opt, loss_of, mode: str, iters: int) -> dict:
    """`iters` iterations under `mode`; ms per iteration (median of the 6th on)."""
    import torch

    def loop():
        profile_to = os.environ.get("TRACE_OVERHEAD_PROFILE")     # a path: profile the loop there
        if not profile_to:
            return timed(opt, loss_of, iters)
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
        try:
            return timed(opt, loss_of, iters)
        finally:
            prof.disable()
            prof.dump_stats(profile_to)

    post = None
    if mode == "plain":
        times, launched = loop()
    elif mode == "history":
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        times, launched = loop()
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        import memdoctor
        kwargs = {"dispatch": {"source": "dispatch"}, "light": {"mode": "light"}}.get(mode, {})
        with _ablate(mode) if mode in ABLATIONS else contextlib.nullcontext():
            try:
                doc = memdoctor.watch(model, opt, **kwargs)
            except TypeError as exc:
                return {"error": f"{mode}: {exc}"}
            with doc:
                times, launched = loop()
                t_exit = time.perf_counter()
            post = time.perf_counter() - t_exit
    return {"ms": 1000 * statistics.median(times[5:]), "cpu_ms": 1000 * statistics.median(launched[5:]),
            "post_s": post, "peak_allocated": torch.cuda.max_memory_allocated()}


def worker(workload: str, mode: str, iters: int) -> dict:
    """Train `iters` iterations as the user's loop would, in this fresh process."""
    model, opt, loss_of = build(workload)
    return window(model, opt, loss_of, mode, iters)


def in_process(workload: str, modes: list[str], rounds: int, iters: int) -> dict[str, list[dict]]:
    """Every mode in this one process, window after window, the order rotated each round;
    each run carries its ratio to the plain window of its round."""
    model, opt, loss_of = build(workload)
    timed(opt, loss_of, 10)                             # warm-up: kernels chosen, caches filled
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        this_round = {m: window(model, opt, loss_of, m, iters) for m in order}
        base = this_round.get("plain", {}).get("ms")
        for m, res in this_round.items():
            if base and "ms" in res:
                res["ratio_in_round"] = res["ms"] / base
            runs[m].append(res)
            print(f"round {r} {workload:8s} {m:9s} {res}", flush=True)
    return runs


def summarize(results: dict) -> dict:
    """Per workload and mode: median ms per iteration over the rounds, its ratio to plain."""
    summary = {}
    for w, by_mode in results.items():
        plain = [x["ms"] for x in by_mode.get("plain", []) if "ms" in x]
        base = statistics.median(plain) if plain else None
        summary[w] = {}
        for m, runs in by_mode.items():
            ms = [x["ms"] for x in runs if "ms" in x]
            if not ms or not base:
                summary[w][m] = {"error": next((x.get("error") for x in runs if "error" in x), "no runs")}
                continue
            cpu = [x["cpu_ms"] for x in runs if "cpu_ms" in x]
            paired = [x["ratio_in_round"] for x in runs if "ratio_in_round" in x]
            summary[w][m] = {"ms_median": round(statistics.median(ms), 3), "ms_runs": [round(v, 3) for v in ms],
                             "cpu_ms_median": round(statistics.median(cpu), 3) if cpu else None,
                             # in one process: the median of each round's ratio to its own plain window
                             "ratio_to_plain": round(statistics.median(paired) if paired
                                                     else statistics.median(ms) / base, 4)}
            if paired:
                summary[w][m]["ratios_by_round"] = [round(v, 4) for v in paired]
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES + ABLATIONS)
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--out", help="folder for the result file (default benchmarks/results)")
    ap.add_argument("--in-process", action="store_true",
                    help="every mode in one process per workload, windows interleaved (see the docstring)")
    ap.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--in-process-worker", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.iters)))
        return 0
    if args.in_process_worker:
        print(json.dumps(in_process(args.in_process_worker, args.modes, args.rounds, args.iters)))
        return 0
    import torch
    results: dict = {w: {m: [] for m in args.modes} for w in args.workloads}
    hardware = resultfile.hardware("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    def save(rounds_done: int):
        summary = summarize(results)        # saved as it goes: a run cut short keeps what it has
        return summary, resultfile.save("trace_overhead_real", hardware, {
            "bench": "trace_overhead_real", "device": device, "rounds_done": rounds_done,
            "in_process": args.in_process, "summary": summary, "runs": results}, args.out)

    if args.in_process:
        for w in args.workloads:
            out = subprocess.run([sys.executable, __file__, "--iters", str(args.iters), "--rounds", str(args.rounds),
                                  "--modes", *args.modes, "--in-process-worker", w], capture_output=True, text=True)
            print(out.stdout.strip().rsplit("\n", 1)[0] if out.stdout.strip() else "", flush=True)
            try:
                results[w] = json.loads(out.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                results[w] = {m: [{"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}]
                              for m in args.modes}
            summary, path = save(args.rounds)
    for r in range(0 if args.in_process else args.rounds):
        for w in args.workloads:
            for m in args.modes:
                out = subprocess.run([sys.executable, __file__, "--iters", str(args.iters), "--worker", w, m],
                                     capture_output=True, text=True)
                try:
                    res = json.loads(out.stdout.strip().splitlines()[-1])
                except (IndexError, ValueError):
                    res = {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
                results[w][m].append(res)
                print(f"round {r} {w:8s} {m:9s} {res}", flush=True)
        summary, path = save(r + 1)
    print("\nworkload  mode            ms/iter  x plain  CPU ms/iter (queued before .item())")
    for w, by_mode in summary.items():
        for m, s in by_mode.items():
            if "error" in s:
                print(f"{w:9s} {m:9s}  {s['error']}")
            else:
                print(f"{w:9s} {m:14s}  {s['ms_median']:7.2f}  {s['ratio_to_plain']:.3f}    {s['cpu_ms_median']:7.2f}")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
