"""memdoctor's 8-bit AdamW (FusedAdamW(state_dtype="int8")) against bitsandbytes' AdamW8bit and
torch's fused fp32 AdamW, on a GPU: optimizer step time, optimizer-state bytes, and the loss
curve of a real training run.

- Step time and state bytes: the parameters of GPT-2 124M (transformers' GPT2Config()), one
  optimizer step on fixed random gradients, median of 50 after 10 warm-up steps (CUDA events).
- Loss curve: a byte-level GPT (6 layers, 512 wide, context 256) trained for --steps steps
  (default 1000) on the Python standard library's own source files (a real text corpus that
  every Python install carries), batch 32, bf16 autocast, lr 3e-4, same seed and batches for
  every optimizer; the mean loss of the last 100 steps and the largest gap to fp32 AdamW's curve
  (smoothed over 50 steps).

Run: python benchmarks/adamw_8bit_vs_bnb.py [--steps 1000] [--out DIR]
Writes adamw_8bit_vs_bnb_<hardware>_<date>.json under DIR (default benchmarks/results).
bitsandbytes is optional: without it its column says so.
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resultfile  # noqa: E402


def optimizers():
    from memdoctor.cuda.kernels import FusedAdamW
    out = {
        "torch AdamW fp32 (fused)": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, fused=True),
        "memdoctor FusedAdamW int8": lambda ps, lr: FusedAdamW(ps, lr=lr, state_dtype="int8"),
    }
    try:
        import bitsandbytes as bnb
        out["bitsandbytes AdamW8bit"] = lambda ps, lr: bnb.optim.AdamW8bit(ps, lr=lr)
    except Exception as exc:        # optional: recorded, not fatal
        out["bitsandbytes AdamW8bit"] = f"not available: {type(exc).__name__}: {exc}"
    return out


def state_bytes(opt) -> int:
    seen = {}
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    tables = getattr(opt, "device_tables", None)
    if callable(tables):
        for v in tables().values():
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def step_time(make) -> dict:
    import transformers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make(params, 1e-4)
    for _ in range(10):
        opt.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    n = sum(p.numel() for p in params)
    sb = state_bytes(opt)
    return {"step_ms": round(statistics.median(times), 4), "state_bytes": sb,
            "state_bytes_per_param": round(sb / n, 4), "params": n}


def corpus() -> torch.Tensor:
    root = sysconfig.get_paths()["stdlib"]
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        try:
            with open(path, "rb") as f:
                data += f.read()
        except OSError:
            continue
        if len(data) > 40_000_000:
            break
    return torch.frombuffer(bytes(data), dtype=torch.uint8).long()


class TinyGPT(nn.Module):
    def __init__(self, layers=6, d=512, heads=8, ctx=256):
        super().__init__()
        self.emb, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, x):
        h = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(self.body(h, mask=self.mask, is_causal=True))


def loss_curve(make, data: torch.Tensor, steps: int, batch: int = 32, ctx: int = 256) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(ctx=ctx).cuda()
    opt = make(model.parameters(), 3e-4)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(data) - ctx - 1, (batch,), generator=gen)
        chunk = torch.stack([data[i:i + ctx + 1] for i in idx.tolist()]).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), chunk[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def smooth(xs: list[float], w: int = 50) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", help="folder for the result file (default benchmarks/results)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    data = corpus()
    results = {}
    reference = None
    for name, make in optimizers().items():
        if isinstance(make, str):
            results[name] = {"error": make}
            continue
        row = step_time(make)
        curve = loss_curve(make, data, args.steps)
        row["final_loss_mean_last_100"] = round(statistics.fmean(curve[-100:]), 4)
        row["curve_every_50"] = [round(v, 4) for v in smooth(curve)[49::50]]
        if reference is None:
            reference = smooth(curve)
        row["max_gap_to_fp32_smoothed"] = round(max(abs(a - b) for a, b in zip(smooth(curve)[49:], reference[49:])), 4)
        results[name] = row
        print(name, {k: v for k, v in row.items() if k != "curve_every_50"}, flush=True)
    print(f"\n{'optimizer':28s} {'step ms':>8s} {'state B/param':>13s} {'loss last100':>12s} {'max gap':>8s}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:28s} {r['error']}")
        else:
            print(f"{name:28s} {r['step_ms']:8.3f} {r['state_bytes_per_param']:13.3f} "
                  f"{r['final_loss_mean_last_100']:12.4f} {r['max_gap_to_fp32_smoothed']:8.4f}")
    try:
        import bitsandbytes
        bnb_version = bitsandbytes.__version__
    except Exception:
        bnb_version = None
    data = {"bench": "adamw_8bit_vs_bnb", "bitsandbytes": bnb_version, "device": torch.cuda.get_device_name(0),
            "steps": args.steps, "results": results}
    path = resultfile.save("adamw_8bit_vs_bnb", resultfile.hardware("cuda"), data, args.out)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
