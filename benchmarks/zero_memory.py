"""Per-rank model-state memory, peak memory and step time of ZeRO (memdoctor.remedies.zero)
against plain training and DDP, next to the ZeRO paper's formula.

    torchrun --nproc-per-node 2 benchmarks/zero_memory.py                       # 2 GPUs, GPT-2 355M
    torchrun --nproc-per-node 2 benchmarks/zero_memory.py --device cpu --model mlp   # gloo on CPU

One launch runs every configuration in turn, each on a fresh model with the same seed:
plain (rank 0 alone: N_d = 1), DDP, ZeRO-2 (memdoctor's flat buckets), ZeRO-2 through FSDP2
(reshard_after_forward=False) and ZeRO-3 (FSDP2), all over N_d = the world size. Default
model: GPT-2 355M (transformers' GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24,
n_head=16)), random init) in mixed precision: bf16 autocast over fp32 weights, fp32 AdamW
states (fused=True on CUDA). `--model mlp` is the s01 scenario's 4 x [Linear(2048, 2048),
GELU], batch 8, fp32.

Measured per rank, after the last optimizer step (before zero_grad, so no activations are
alive): on CUDA torch.cuda.memory_allocated(). That total is split into the storages of the
parameters (whole buckets for the flat ZeRO, local shards under FSDP2), gradients (model's
and optimizer's .grad), optimizer state and buffers; what remains is "other": DDP's
gradient buckets, FSDP2's all-gather buffers. ZeRO's flat gradient buckets live only during
backward, so they are bounded and shown apart (largest bucket x (in flight + 1)). Peak:
max_memory_allocated over the whole run of the configuration. Step time: mean of the timed
steps after warm-up.

On CPU (gloo) there is no allocator to ask, so three readings stand side by side: "after
step" is every storage a live Python tensor holds (a gc scan: it sees FSDP2's storage
resizes but not what C++ holds, such as DDP's buckets); "after step (tracer)" and "peak"
come from memdoctor's dispatch tracer on a twin run (it sees DDP's buckets, FSDP2's storage
resizes and DTensors' local shards); "peak (RSS)" is resident memory sampled every 0.5 ms by a thread, with glibc
made to map every allocation over 64 KiB on its own (the script re-executes itself with
MALLOC_MMAP_THRESHOLD_ set), which sees everything, gloo's internal buffers and the
process's own growth included (the first configuration run pays for the latter).

The paper's formula (mixed precision, Adam, K = 12): per rank 2Ψ (fp16 weights) + (2Ψ fp16
gradients + 12Ψ fp32 weights, momentum, variance) / N_d for ZeRO-2, i.e. 2Ψ + 14Ψ/N_d; 16Ψ
without ZeRO. bf16 autocast keeps fp32 weights and gradients and no second copy: the weights
(4Ψ) are both the forward copy and the master, gradients are 4Ψ, Adam 8Ψ, so ours is
4Ψ + 12Ψ/N_d for ZeRO-2 (16Ψ at N_d = 1, 10Ψ at 2 against the paper's 9Ψ), 16Ψ/N_d for
ZeRO-3, and DDP 16Ψ plus its gradient buckets (4Ψ, gradient_as_bucket_view=False).

Writes results/zero_memory_<hardware>_<date>.json ("h200x2" for two H200s) and prints the table.
Runs with torch 2.11 and 2.13.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memdoctor.remedies.zero import DEFAULT_BUCKET_BYTES, MAX_IN_FLIGHT, apply_zero  # noqa: E402

MiB = 2**20
CONFIGS = ("plain", "ddp", "zero2", "zero2-bf16-true", "zero2-fsdp", "zero3")


# ----------------------------------------------------------------------------- models
def build_model(name: str, device: torch.device):
    torch.manual_seed(0)
    if name == "gpt2-355m" or name == "gpt2-tiny":
        from transformers import GPT2Config, GPT2LMHeadModel
        if name == "gpt2-355m":
            cfg = GPT2Config(n_embd=1024, n_layer=24, n_head=16)
        else:
            cfg = GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1024, n_positions=256)
        model = GPT2LMHeadModel(cfg).to(device)
        vocab = cfg.vocab_size

        def batch(g, size, seq):
            return torch.randint(0, vocab, (size, seq), generator=g).to(device)

        def loss_fn(m, ids):
            return m(input_ids=ids, labels=ids).loss
        return model, batch, loss_fn
    if name == "mlp":
        width = 2048
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)]).to(device)

        def batch(g, size, seq):
            return torch.randn(size, width, generator=g).to(device)

        def loss_fn(m, x):
            return m(x).square().mean()
        return model, batch, loss_fn
    raise SystemExit(f"unknown model {name!r}: gpt2-355m, gpt2-tiny or mlp")


def make_optimizer(model: nn.Module, device: torch.device):
    kw = dict(lr=1e-4, weight_decay=0.01)
    if device.type == "cuda":
        return torch.optim.AdamW(model.parameters(), fused=True, **kw)
    return torch.optim.AdamW(model.parameters(), foreach=False, **kw)


# ----------------------------------------------------------------------------- accounting
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def breakdown(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params + opt_params]
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(grads),
        "optimizer_state": _storage_bytes(states),
        "buffers": _storage_bytes(model.buffers()),
    }


# ----------------------------------------------------------------------------- one configuration
def prepare(config: str, model: nn.Module, opt, device):
    """The model to call and a handle (or None), for one configuration."""
    if config == "plain":
        return model, None
    if config == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids), None
    if config == "zero2":
        return model, apply_zero(model, opt, stage=2)
    if config == "zero2-bf16-true":      # the paper's mixed precision: bf16 weights, fp32 master shards
        from memdoctor.remedies import Plan, prepare as prepare_plan
        prepared = prepare_plan(model, opt, Plan(precision="bf16-true", zero=2), device_type=device.type)
        return model, prepared.handles[-1]
    if config == "zero2-fsdp":
        return model, apply_zero(model, opt, stage=2, impl="fsdp")
    if config == "zero3":
        return model, apply_zero(model, opt, stage=3)
    raise ValueError(config)


def run_config(config: str, args, device: torch.device, traced: bool) -> dict:
    from memdoctor.capture.session import Tracer
    rank = dist.get_rank()
    tracer = Tracer(source="dispatch") if traced else contextlib.nullcontext()
    # bf16-true computes in bf16 whatever --precision says (its weights are bf16)
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16)
                if args.precision == "bf16" or config == "zero2-bf16-true" else contextlib.nullcontext())
    if device.type == "cuda":
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = live_tensor_bytes()
    out: dict = {}
    with tracer as t:
        model, make_batch, loss_fn = build_model(args.model, device)
        opt = make_optimizer(model, device)
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        run_model, handle = prepare(config, model, opt, device)
        g = torch.Generator().manual_seed(1000 + rank)
        steps = args.warmup + args.steps
        times = []
        for i in range(steps):
            x = make_batch(g, args.batch, args.seq)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = loss_fn(run_model, x)
            loss.backward()
            if i == steps - 1:          # every model state is present now: the formulas' moment
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    out["before_step_bytes"] = torch.cuda.memory_allocated() - base
                low_grads = [b.low_grad for b in getattr(handle, "buckets", []) if getattr(b, "low_grad", None) is not None]
                out["before_step_grads"] = breakdown(model, opt)["grads"] + _storage_bytes(low_grads)
                del low_grads
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        del loss, x
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            after = torch.cuda.memory_allocated() - base
            peak = torch.cuda.max_memory_allocated() - base
        elif traced:
            after, peak = t.recorder.live_bytes, t.recorder.peak_bytes
        else:
            after, peak = live_tensor_bytes() - base, None
        parts = breakdown(model, opt)
        out.update(psi=psi, after_step_bytes=after, peak_bytes=peak, step_s=sum(times) / max(len(times), 1),
                   step_times_s=times, **parts)
        if after is not None:
            out["other_bytes"] = after - sum(parts.values())
        if handle is not None:
            out["handle"] = handle.description
            out["local_param_bytes"] = handle.local_param_bytes
            if handle.impl == "flat":
                out["flat_grad_buckets_bound_bytes"] = (MAX_IN_FLIGHT + 1) * max(
                    b.numel * b.flat.element_size() for b in handle.buckets)
            handle.undo()
        del run_model, model, opt, handle
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def live_tensor_bytes() -> int:
    """CPU: the bytes of every storage a live tensor holds now, each once (what C++ alone
    holds, such as DDP's buckets, is not seen)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) is not torch.Tensor and type(obj) is not nn.Parameter:
            continue    # DTensor wrappers hold no storage of their own; their local tensors count
        try:
            storage = obj.untyped_storage()
        except Exception:
            continue
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class RssSampler:
    """CPU: this process's resident memory, read every half millisecond by a thread, above
    what it was at the start. With MALLOC_MMAP_THRESHOLD_ fixed (main() sets it before any
    allocation) every large tensor is its own mapping, returned on free, so the resident
    size follows live tensor bytes, and it sees what Python cannot: DDP's buckets, gloo's
    copies, FSDP2's storage resizes."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = 0
        self._stop = threading.Event()

    def rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self.page

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss() - self.base)
            time.sleep(self.interval_s)

    def __enter__(self) -> "RssSampler":
        gc.collect()
        self.base = self.rss()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure(config: str, args, device: torch.device) -> dict:
    if device.type == "cuda":
        return run_config(config, args, device, traced=False)
    with RssSampler() as rss:
        timed = run_config(config, args, device, traced=False)
    timed["rss_peak_bytes"] = rss.peak if os.path.exists("/proc/self/statm") else None
    traced = run_config(config, args, device, traced=True)
    timed["peak_bytes"] = traced["peak_bytes"]
    timed["traced_after_step_bytes"] = traced["after_step_bytes"]
    return timed


# ----------------------------------------------------------------------------- formulas
def formulas(config: str, psi: int, n: int) -> dict:
    """Bytes per rank: the paper's mixed-precision formula, and the same accounting for our
    setting (fp32 weights under autocast, fp32 gradients, AdamW's two fp32 states)."""
    if config == "plain":
        return {"paper": 16 * psi, "ours": 16 * psi}
    if config == "ddp":
        return {"paper": 16 * psi, "ours": 16 * psi + 4 * psi}
    if config == "zero2-bf16-true":         # bf16 weights 2Ψ, bf16 gradient shard, fp32 masters + Adam shards
        return {"paper": 2 * psi + 14 * psi / n, "ours": 2 * psi + 14 * psi / n}
    if config.startswith("zero2"):
        return {"paper": 2 * psi + 14 * psi / n, "ours": 4 * psi + 12 * psi / n}
    if config == "zero3":
        return {"paper": 16 * psi / n, "ours": 16 * psi / n}
    return {}


def markdown(report: dict) -> str:
    n = report["world_size"]
    cpu = report["backend"] == "gloo"
    rows = ["| config | N_d | Ψ (M) | after step | params | grads | optim state | buffers | other | "
            + ("after step (tracer) | " if cpu else "")
            + "flat grad buckets (transient bound) | paper 2Ψ+14Ψ/N_d (or 16Ψ, 16Ψ/N_d) | "
            "ours (fp32 weights under autocast) | end of backward | grads then | peak | "
            + ("peak (RSS) | " if cpu else "") + "step (ms) |",
            "|---" * (18 if cpu else 16) + "|"]

    def m(v):
        return "n/a" if v is None else f"{v / MiB:,.1f}"
    for config, r in report["results"].items():
        if "error" in r:
            rows.append(f"| {config} | | | error: {r['error'].splitlines()[-1][:120]} | | | | | | | | | | |")
            continue
        nd = 1 if config == "plain" else n
        rows.append(
            f"| {config} | {nd} | {r['psi'] / 1e6:.1f} | {m(r['after_step_bytes'])} | {m(r['params'])} | {m(r['grads'])} | "
            f"{m(r['optimizer_state'])} | {m(r['buffers'])} | {m(r.get('other_bytes'))} | "
            + (f"{m(r.get('traced_after_step_bytes'))} | " if cpu else "")
            + f"{m(r.get('flat_grad_buckets_bound_bytes'))} | {m(r['formula']['paper'])} | {m(r['formula']['ours'])} | "
            f"{m(r.get('before_step_bytes'))} | {m(r.get('before_step_grads'))} | {m(r['peak_bytes'])} | " + (f"{m(r.get('rss_peak_bytes'))} | " if cpu else "")
            + f"{r['step_s'] * 1e3:,.1f} |")
    head = (f"ZeRO memory per rank, MiB: model {report['model']}, {report['precision']}, batch {report['batch']}"
            + (f" x {report['seq']} tokens" if report["model"].startswith("gpt2") else "")
            + f", {report['device_name']}, torch {report['torch']}, backend {report['backend']}\n\n")
    return head + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="gpt2-355m (default on CUDA), mlp (default on CPU), gpt2-tiny")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="bf16 autocast (CUDA default) or fp32")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    ap.add_argument("--no-reexec", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or ("gpt2-355m" if args.device == "cuda" else "mlp")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    args.batch = args.batch or (4 if args.model.startswith("gpt2") else 8)
    if args.device == "cpu" and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and not args.no_reexec:
        # glibc reads it at start: run again with every allocation over 64 KiB its own mapping
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
        os.execv(sys.executable, [sys.executable, *sys.argv, "--no-reexec"])
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=600),
                            **({"device_id": device} if device.type == "cuda" else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for config in args.configs.split(","):
        mine: dict = {}
        if config != "plain" or rank == 0:
            try:
                mine = measure(config, args, device)
            except Exception:
                mine = {"error": traceback.format_exc()}
        dist.barrier()
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        per_rank = [e for e in everyone if e]
        r = dict(per_rank[0]) if per_rank else {"error": "no rank ran it"}
        if "error" not in r:
            r["per_rank"] = [{k: e.get(k) for k in ("after_step_bytes", "before_step_bytes", "peak_bytes", "params", "grads",
                                                    "optimizer_state", "step_s")} for e in per_rank]
            r["formula"] = formulas(config, r["psi"], 1 if config == "plain" else world)
        results[config] = r
        if rank == 0:
            print(f"[{config}] " + (r["error"] if "error" in r else
                  f"after step {r['after_step_bytes'] / MiB:,.1f} MiB, peak {r['peak_bytes'] / MiB:,.1f} MiB, "
                  f"step {r['step_s'] * 1e3:,.1f} ms"), flush=True)
    if rank == 0:
        report = {
            "model": args.model, "precision": args.precision, "batch": args.batch, "seq": args.seq,
            "steps": args.steps, "warmup": args.warmup, "world_size": world, "backend": backend,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "bucket_bytes": DEFAULT_BUCKET_BYTES, "max_in_flight": MAX_IN_FLIGHT,
            "results": results,
        }
        print(markdown(report))
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import resultfile
        hw = resultfile.hardware(device.type, world)
        print("wrote", resultfile.save("zero_memory", hw, report, args.out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
