"""Apply memdoctor plans to real training on the GPU, under a memory cap, and measure them.

For each plan a fresh process builds the model on cuda (random init), caps the caching
allocator at --budget (`torch.cuda.set_per_process_memory_fraction`), applies the plan with
`memdoctor.remedies.prepare`, trains --steps steps through `Prepared.step`, and reports
`max_memory_allocated()`, `max_memory_reserved()` and the median step time of the second
half of the steps: the steady state, since the first steps compile and autotune Triton
kernels and grow the allocator's pool. With --repeats N the step time is the median of N
such runs, made round-robin so that every plan meets the same conditions (runs of one plan
differ by up to 12% from one machine or GPU to the next). Given the planner's output
(`memdoctor plan --json`), the measured peaks are set next to its predictions (peaks and step
time) and the planner's first choice is checked against every other plan measured: does it
fit, and is it at least as fast as every other plan that fits (--plans adds plans beyond
the planner's first --top)? Given ckpt=full and ckpt=selective with none, it reports the
share of full checkpointing's memory saving that selective keeps, and the share of its
extra step time that selective costs.

Models: the names of memdoctor.predict.models (the planner's own definitions), and
transformers' GPT-2 (random init, default config: dropout 0.1, sdpa attention):
hf-gpt2-124m, hf-gpt2-355m, hf-gpt2-1.5b (GPT2LMHeadModel) and hf-gpt2-1.5b-doubleheads
(GPT2DoubleHeadsModel, two choices a sample, LM loss + multiple-choice loss).

    # the planner's candidates for GPT-2 1.5B, measured under the budget they were planned for
    # (benchmarks/plans/*.json: `memdoctor plan --model gpt2-1.5b --batch 8 --budget 32GiB --json`)
    python benchmarks/plan_apply.py --model gpt2-1.5b --batch 8 --budget 32GiB \\
        --plans-from benchmarks/plans/gpt2-1.5b_b8_32GiB.json --top 4 --repeats 4
    # the cost of checkpointing
    python benchmarks/plan_apply.py --model hf-gpt2-124m --batch 8 --plans none ckpt=full ckpt=selective

Each run is appended to results/plan_apply_<hardware>_<date>.json ({"runs": [...]}), with
its tag (default: model, batch and budget).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402

GiB = 1024 ** 3
HF_GPT2 = {"124m": (12, 768, 12), "355m": (24, 1024, 16), "1.5b": (48, 1600, 25)}


# ----------------------------------------------------------------------- models
def build(model: str, batch: int, seq: int):
    """(model, optimizer, batch, loss_fn) on the default device."""
    import torch
    if not model.startswith("hf-"):
        from memdoctor.predict.models import get
        return get(model).builder(batch=batch, seq=seq)()
    from transformers import GPT2Config, GPT2DoubleHeadsModel, GPT2LMHeadModel
    size = model.removeprefix("hf-gpt2-").removesuffix("-doubleheads")
    layers, dim, heads = HF_GPT2[size]
    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, n_positions=max(1024, seq))
    vocab = config.vocab_size
    if model.endswith("-doubleheads"):
        net = GPT2DoubleHeadsModel(config)
        choices = 2
        data = {"input_ids": torch.randint(0, vocab, (batch, choices, seq)),
                "mc_token_ids": torch.full((batch, choices), seq - 1, dtype=torch.long),
                "mc_labels": torch.randint(0, choices, (batch,))}

        def loss_fn(m, b):
            out = m(input_ids=b["input_ids"], mc_token_ids=b["mc_token_ids"], labels=b["input_ids"],
                    mc_labels=b["mc_labels"])
            return out.loss + out.mc_loss
    else:
        net = GPT2LMHeadModel(config)
        data = torch.randint(0, vocab, (batch, seq))

        def loss_fn(m, b):
            return m(input_ids=b, labels=b).loss
    net.train()
    return net, torch.optim.AdamW(net.parameters(), lr=1e-5), data, loss_fn


# ----------------------------------------------------------------------- one plan (child process)
def steady_steps(times: list[float]) -> list[float]:
    """The step times that speak for a long run: the second half (all but the first of 2-3)."""
    if len(times) >= 4:
        return times[len(times) // 2:]
    return times[1:] or times


def measure_plan(model: str, batch: int, seq: int, plan: str, budget: int | None, steps: int) -> dict:
    import torch
    from memdoctor.remedies import prepare
    from memdoctor.capture.budget import cap_cuda
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()     # without CUDA (a smoke test): no caps, no memory figures
    if budget and cuda:
        cap_cuda(budget)
    t0 = time.perf_counter()
    result: dict = {"plan": plan}
    times: list[float] = []
    try:
        with torch.device("cuda" if cuda else "cpu"):
            net, optimizer, data, loss_fn = build(model, batch, seq)
        result["params"] = sum(p.numel() for p in {id(p): p for p in net.parameters()}.values())
        prepared = prepare(net, optimizer, plan, device_type="cuda" if cuda else "cpu")
        losses = []
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            losses.append(prepared.step(data, loss_fn))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        stats = torch.cuda.memory_stats() if cuda else {}
        result.update(
            ok=True, oom=False,
            peak_allocated_bytes=torch.cuda.max_memory_allocated() if cuda else 0,
            peak_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else 0,
            num_alloc_retries=stats.get("num_alloc_retries", 0),
            step_seconds=times,
            median_step_seconds=statistics.median(steady_steps(times)),
            losses=losses,
        )
    except torch.OutOfMemoryError as exc:
        result.update(ok=False, oom=True, error=str(exc).splitlines()[0][:300], oom_step=len(times),
                      peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved())
    except Exception as exc:
        result.update(ok=False, oom=False, error=f"{type(exc).__name__}: {exc}"[:500],
                      trace=traceback.format_exc()[-2000:])
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def run_child(args, plan: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps), "--plans", plan]
    if args.budget:
        cmd += ["--budget", args.budget]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"plan": plan, "ok": False, "oom": False, "error": f"timed out after {args.timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"plan": plan, "ok": False, "oom": False, "error": f"exit {proc.returncode}",
                "stderr": proc.stderr[-2000:]}
    return json.loads(lines[-1])


# ----------------------------------------------------------------------- comparisons
def error_pct(predicted, measured):
    if not predicted or not measured:
        return None
    return round(100.0 * (predicted - measured) / measured, 2)


def selective_share(rows: list[dict]) -> dict | None:
    """The share of full checkpointing's saving (peak allocated) that selective keeps, and
    the share of full's extra step time that selective costs."""
    by = {r["plan"]: r for r in rows if r.get("ok")}
    if not all(k in by for k in ("none", "ckpt=full", "ckpt=selective")):
        return None
    none, full, sel = by["none"], by["ckpt=full"], by["ckpt=selective"]
    saving_full = none["peak_allocated_bytes"] - full["peak_allocated_bytes"]
    extra_full = full["median_step_seconds"] - none["median_step_seconds"]
    if saving_full <= 0 or extra_full <= 0:
        return {"note": "full checkpointing saved no memory or cost no time here"}
    saving = (none["peak_allocated_bytes"] - sel["peak_allocated_bytes"]) / saving_full
    extra = (sel["median_step_seconds"] - none["median_step_seconds"]) / extra_full
    return {"saving_share": round(saving, 4), "extra_time_share": round(extra, 4),
            "meets_target": saving >= 0.60 and extra <= 0.40,
            "target": "selective keeps >= 60% of full's saving for <= 40% of its extra step time"}


def first_choice_check(rows: list[dict], budget: int | None) -> dict | None:
    planned = [r for r in rows if r.get("rank") is not None]
    if not planned:
        return None
    first = min(planned, key=lambda r: r["rank"])
    fitting = [r for r in rows if r.get("ok") and (budget is None or r["peak_reserved_bytes"] <= budget)]
    out = {"first_choice": first["plan"], "first_fits": first in fitting}
    if first in fitting:
        faster = [r["plan"] for r in fitting if r is not first
                  and r["median_step_seconds"] < first["median_step_seconds"]]
        out["faster_fitting_plans"] = faster
        out["first_is_fastest"] = not faster
    return out


def gib(n) -> str:
    return f"{n / GiB:.2f}" if n else "-"


def _secs(x) -> str:
    return f"{x:.3f}" if x else "-"


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"# {a['model']}, batch {a['batch']}, seq {a['seq']}, budget {a['budget'] or 'none'}", "",
             f"{report['device']}, torch {report['torch']}", "",
             "| plan | rank | fits | step s | predicted s | x none | peak alloc GiB | predicted | err % | "
             "peak reserved GiB | predicted | err % |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in report["rows"] if r["plan"] == "none" and r.get("ok")), None)
    for r in report["rows"]:
        if not r.get("ok"):
            lines.append(f"| {r['plan']} | {r.get('rank', '-')} | {'OOM' if r.get('oom') else 'error'} | | | | "
                         f"{gib(r.get('peak_allocated_bytes'))} | {gib(r.get('predicted_peak_allocated'))} | | "
                         f"{gib(r.get('peak_reserved_bytes'))} | {gib(r.get('predicted_peak_reserved'))} | |")
            continue
        rel = f"{r['median_step_seconds'] / base['median_step_seconds']:.2f}" if base else "-"
        lines.append(
            f"| {r['plan']} | {r.get('rank', '-')} | {'yes' if r.get('fits', True) else 'no'} | "
            f"{r['median_step_seconds']:.3f} | {_secs(r.get('predicted_step_seconds'))} | {rel} | "
            f"{gib(r['peak_allocated_bytes'])} | "
            f"{gib(r.get('predicted_peak_allocated'))} | {r.get('error_allocated_pct', '-')} | "
            f"{gib(r['peak_reserved_bytes'])} | {gib(r.get('predicted_peak_reserved'))} | "
            f"{r.get('error_reserved_pct', '-')} |")
    for key in ("selective", "first_choice"):
        if report.get(key):
            lines += ["", f"{key}: `{json.dumps(report[key])}`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget", help="cap the allocator at this size, e.g. 32GiB")
    ap.add_argument("--plans", nargs="*", help="plan strings to measure")
    ap.add_argument("--plans-from", help="`memdoctor plan --json` output: measure its candidates")
    ap.add_argument("--top", type=int, default=4, help="with --plans-from: the first N fitting candidates")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure the plans this many times, round-robin (step time: the median)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for one plan")
    ap.add_argument("--tag", help="the run's name (default: model, batch and budget)")
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from memdoctor.units import parse_size
    budget = parse_size(args.budget) if args.budget else None

    if args.child:
        print(json.dumps(measure_plan(args.model, args.batch, args.seq, args.plans[0], budget, args.steps)))
        return 0

    import torch
    # the planner's first --top fitting plans, then any --plans not among them (with the
    # planner's figures where its list has them)
    given = json.loads(Path(args.plans_from).read_text()) if args.plans_from else []
    # `memdoctor plan --json` prints {"version", "plans"}; the files in results/plans/ hold the list alone
    fitting = [c for c in (given["plans"] if isinstance(given, dict) else given) if c["fits"]]
    chosen = [c["plan"] for c in fitting[:args.top]]
    chosen += [p for p in args.plans or [] if p not in chosen]
    ranked = {c["plan"]: (rank, c) for rank, c in enumerate(fitting)}
    rows: list[dict] = []
    for plan in chosen:
        row = {"plan": plan}
        if plan in ranked:
            rank, c = ranked[plan]
            row.update({"rank": rank, "fits": c["fits"], "predicted_peak_allocated": c["predicted_peak_allocated"],
                        "predicted_peak_reserved": c["predicted_peak_reserved"], "cost": c["cost"],
                        "predicted_step_seconds": c.get("step_seconds_h200")})
        rows.append(row)
    if not rows:
        ap.error("give --plans or --plans-from")
    for repeat in range(args.repeats):      # round-robin: every plan under the same conditions
        for row in rows:
            got = run_child(args, row["plan"])
            if repeat and row.get("ok") and got.get("ok"):
                row["repeat_step_seconds"].append(got["median_step_seconds"])
                continue
            row.update({k: v for k, v in got.items() if k != "plan"})
            row["repeat_step_seconds"] = [got["median_step_seconds"]] if got.get("ok") else []
    for row in rows:
        if row.get("ok"):
            row["median_step_seconds"] = statistics.median(row["repeat_step_seconds"])
            row["fits"] = budget is None or row["peak_reserved_bytes"] <= budget
            row["error_allocated_pct"] = error_pct(row.get("predicted_peak_allocated"), row["peak_allocated_bytes"])
            row["error_reserved_pct"] = error_pct(row.get("predicted_peak_reserved"), row["peak_reserved_bytes"])
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_seconds", "losses", "trace")}),
              flush=True)
    cuda = torch.cuda.is_available()
    report = {
        "tag": args.tag or f"{args.model}_b{args.batch}_{args.budget or 'nocap'}",
        "args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "rows": rows,
        "selective": selective_share(rows), "first_choice": first_choice_check(rows, budget),
    }
    print(markdown(report))
    hw = resultfile.hardware("cuda" if cuda else "cpu")
    print("appended to", resultfile.add_run("plan_apply", hw, report, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
