"""What the dispatch source adds per op, on the CPU: a nanoGPT-shaped model (12 blocks,
scaled_dot_product_attention, GELU MLP, LayerNorm, tied lm_head) with tiny dims, so that a
step is almost nothing but per-op Python and dispatcher work, trained under
torch.autocast("cpu", bfloat16) with AdamW (foreach) and loss.item() each step.

Three modes, each step timed in this process's CPU time (steadier than wall clock on a
shared machine; torch runs one thread): plain, under a bare pass-through TorchDispatchMode
(the floor any dispatch mode pays) and under memdoctor's dispatch source (the Tracer a
`memdoctor.watch(..., source="dispatch")` starts). Ops per step come from a counting mode;
the figure reported is microseconds added per op over plain and over the bare mode. Modes
are interleaved in rounds (order alternating), each block's first step a warm-up.

On a GPU the CPU queues a step's ops while the GPU runs them: when tracing adds more CPU
time per op than the GPU takes, the step slows by that; the per-op cost is pure Python and
does not depend on the device, so it is measured here.

    python benchmarks/dispatch_per_op.py   # a run added to results/dispatch_per_op_<hardware>_<date>.json

`--baseline TREE` adds a fourth mode, the dispatch source of the memdoctor checkout at TREE
(e.g. `git worktree add /tmp/base <commit>`), in the same rounds: before and after, paired.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import resultfile  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight       # tied, as nanoGPT
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_step(model, opt, args):
    def step():
        idx = torch.randint(args.vocab, (args.batch, args.seq))
        targets = torch.randint(args.vocab, (args.batch, args.seq))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


class Bare(TorchDispatchMode):
    """The floor: a mode that only runs the op (with no dynamo wrapper around it, as
    memdoctor's own mode has none: `_skip_dynamo`)."""
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _skip_dynamo(mode_type) -> None:
    """Mark the bare mode's __torch_dispatch__ for dynamo to skip, as memdoctor marks its own
    (memdoctor.capture.lean_mode), so the floor is the mode's own cost."""
    from memdoctor.capture import lean_mode
    if lean_mode._SKIP_ALL is not None:
        lean_mode._set_code_exec_strategy(mode_type.__torch_dispatch__.__code__, lean_mode._SKIP_ALL)


def baseline_tracer(tree: str):
    """The Tracer of the memdoctor checkout at `tree` (another commit), loaded beside this
    one: its modules are imported under the same names, kept by the classes and functions
    that use them, and taken out of sys.modules again, so both run in one process and a
    machine shared with other work slows them alike. (The dispatch source imports nothing
    lazily while it traces; the allocator source would.)"""
    import importlib
    ours = {k: v for k, v in sys.modules.items() if k == "memdoctor" or k.startswith("memdoctor.")}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, os.path.abspath(tree))
    try:
        tracer = importlib.import_module("memdoctor.capture.session").Tracer
        where = os.path.dirname(sys.modules["memdoctor"].__file__)
    finally:
        sys.path.remove(os.path.abspath(tree))
        for k in [k for k in sys.modules if k == "memdoctor" or k.startswith("memdoctor.")]:
            del sys.modules[k]
        sys.modules.update(ours)
    if not os.path.abspath(where).startswith(os.path.abspath(tree)):
        raise SystemExit(f"--baseline {tree}: no memdoctor package there")
    return tracer


def measure(args) -> dict:
    from memdoctor.capture.session import Tracer
    Baseline = baseline_tracer(args.baseline) if args.baseline else None
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.n_embd, args.heads, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step = make_step(model, opt, args)
    _skip_dynamo(Bare)
    for _ in range(args.warmup):
        step()
    counter = Counting()
    with counter:
        step()
    ops = counter.ops
    modes = {
        "plain": lambda: contextlib.nullcontext(),
        "bare_mode": lambda: Bare(),
        "dispatch": lambda: Tracer(models=[model], optimizers=[opt], source="dispatch"),
    }
    if Baseline is not None:
        modes["dispatch_baseline"] = lambda: Baseline(models=[model], optimizers=[opt], source="dispatch")
    names = [m for m in args.modes if m in modes] + (["dispatch_baseline"] if Baseline is not None else [])
    cpu = {m: [] for m in names}
    wall = {m: [] for m in names}
    blocks_per_step = None
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            ctx = modes[name]()
            with ctx:
                for i in range(args.per_block + 1):
                    w, c = time.perf_counter(), time.process_time()
                    step()
                    w, c = time.perf_counter() - w, time.process_time() - c
                    if i:
                        cpu[name].append(c)
                        wall[name].append(w)
            if name == "dispatch":
                blocks_per_step = round(len(ctx.run.blocks) / (args.per_block + 1))
    load_after = os.getloadavg()
    med = {m: statistics.median(v) for m, v in cpu.items()}
    medw = {m: statistics.median(v) for m, v in wall.items()}

    def ms(xs):
        return {"median_ms": round(1000 * statistics.median(xs), 3), "min_ms": round(1000 * min(xs), 3),
                "max_ms": round(1000 * max(xs), 3), "steps": len(xs)}
    result = {
        "config": {"model": f"nanoGPT-shaped: {args.layers} blocks, n_embd {args.n_embd}, {args.heads} heads, "
                            f"vocab {args.vocab}, tied lm_head, SDPA, GELU(tanh) MLP",
                   "batch": args.batch, "seq": args.seq, "autocast": "cpu bfloat16",
                   "optimizer": "AdamW(foreach=True)", "threads": args.threads, "rounds": args.rounds,
                   "steps_per_block": args.per_block},
        "ops_per_step": ops,
        "dispatch_blocks_per_step": blocks_per_step,
        "cpu": {m: ms(cpu[m]) for m in names},
        "wall": {m: ms(wall[m]) for m in names},
        "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
    }
    # medians, and minimums (the steps least disturbed by other work on the machine)
    for label, stat in (("", med), ("_min", {m: min(v) for m, v in cpu.items()})):
        per_op = {}
        for m in names:
            if m != "plain" and "plain" in stat:
                per_op[f"{m}_over_plain_us"] = round(1e6 * (stat[m] - stat["plain"]) / ops, 2)
        for m in ("dispatch", "dispatch_baseline"):
            if m in stat and "bare_mode" in stat:
                per_op[f"{m}_over_bare_us"] = round(1e6 * (stat[m] - stat["bare_mode"]) / ops, 2)
        if "dispatch_baseline" in stat and "plain" in stat:
            result["baseline"] = args.baseline
            result[f"dispatch_added_cpu_vs_baseline{label}"] = round(
                (stat["dispatch"] - stat["plain"]) / (stat["dispatch_baseline"] - stat["plain"]), 3)
        result[f"per_op_cpu{label}"] = per_op
    if "plain" in med:
        result["ratio_cpu"] = {m: round(med[m] / med["plain"], 3) for m in names}
        result["ratio_wall"] = {m: round(medw[m] / medw["plain"], 3) for m in names}
    return result


def print_table(result: dict) -> None:
    c = result["config"]
    print(f"{c['model']}, batch {c['batch']} x seq {c['seq']}, {result['ops_per_step']} ops/step, "
          f"{c['threads']} thread(s)")
    print(f"{'mode':<12}{'cpu ms':>10}{'x plain':>10}{'wall ms':>10}")
    for m, s in result["cpu"].items():
        print(f"{m:<12}{s['median_ms']:>10.2f}{result.get('ratio_cpu', {}).get(m, float('nan')):>10.2f}"
              f"{result['wall'][m]['median_ms']:>10.2f}")
    for k, v in result["per_op_cpu"].items():
        print(f"{k}: {v} us/op (medians), {result['per_op_cpu_min'][k]} (minimums)")
    if "dispatch_added_cpu_vs_baseline" in result:
        print(f"dispatch's added CPU time / the baseline's: {result['dispatch_added_cpu_vs_baseline']} (medians), "
              f"{result['dispatch_added_cpu_vs_baseline_min']} (minimums)")
    print(f"load average before/after: {result['load_average_before_after']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--per-block", type=int, default=4, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--modes", nargs="+", default=["plain", "bare_mode", "dispatch"])
    p.add_argument("--out", help="output folder (default benchmarks/results)")
    p.add_argument("--baseline", metavar="TREE",
                   help="another memdoctor checkout, measured as a fourth mode in the same rounds")
    p.add_argument("--label", help="what this run measures (\"before\", \"after\"), kept in the result")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    result = measure(args)
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    import memdoctor
    result["memdoctor"] = os.path.dirname(os.path.abspath(memdoctor.__file__))
    if args.label:
        result["label"] = args.label
    print_table(result)
    if not args.no_save:        # one run appended to today's file: several runs (trees, labels) side by side
        print("wrote", resultfile.add_run("dispatch_per_op", resultfile.hardware("cpu"), result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
