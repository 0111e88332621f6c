"""How close memdoctor's default estimate comes, on architectures it was never shaped for,
to what a GPU measures (benchmarks/zoo/zoo_models.py: 51 transformers, torch and
torchvision models with random weights).

For each configuration (architecture x fp32 / bf16 autocast / full checkpointing x two batch
sizes), one fresh process:
  (a) measures: builds the configuration on the GPU, trains 6 AdamW steps (--steps: more
      for a model whose steps draw at random, LayerDrop's, whose peak grows with the draws)
      (memdoctor.predict.fake_step.train_step: forward, backward, step,
      zero_grad(set_to_none=True); the plan applied with memdoctor.remedies.prepare),
      torch.cuda.max_memory_allocated() / max_memory_reserved() of the whole process;
  (b) then predicts: `memdoctor estimate benchmarks/zoo/zoo_script.py -- ARCH BATCH` as the CLI
      runs it by default (settled steady state, cuDNN workspaces measured on this GPU), and,
      for the smaller batch, torch's MemTracker under FakeTensorMode on the same step;
      with the time each took.
Configurations run side by side in a pool of workers (each a fresh subprocess per
configuration; a new one starts only while the GPU has room), so the zoo finishes in a few
minutes on one H200. A configuration that fails records its error as text and the run goes on.
Beside them, a check process compares memdoctor's SDPA backend rules
(memdoctor.cuda.sdpa_backend) with the dispatcher's own choice on this GPU, on real and on
fake tensors, and cuDNN's measured RNN sizes with the bound used without a GPU.

    python benchmarks/zoo_accuracy.py --out DIR             # the whole zoo on a GPU (time budget 450 s)
    python benchmarks/zoo_accuracy.py --resume DIR/zoo_accuracy_h200_<date>.json --out DIR2
                                                            # run what a time-limited run left
    python benchmarks/zoo_accuracy.py --only llama lstm     # some architectures
    python benchmarks/zoo_accuracy.py --set holdout --out DIR   # the held-out architectures (holdout_models.py)
    python benchmarks/zoo_accuracy.py --only wav2vec2 hubert --steps 30    # LayerDrop: many steps
    python benchmarks/zoo_accuracy.py --dry-run             # estimates only, no GPU (CPU stands in for CUDA)
    python benchmarks/zoo_accuracy.py --measured RESULT     # estimate anew on a GPU's machine, against the peaks
                                                            # an earlier result measured (the models train alike)

Writes zoo_accuracy_<hardware>_<date>.json (holdout_accuracy_... for --set holdout;
benchmarks/results, or --out) with the command,
commit and versions, a row per configuration and the summary (median and worst |error|,
under-estimates below -2% of reserved, crashes), rewritten as configurations finish, and
prints the summary last.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO_DIR = ROOT / "benchmarks" / "zoo"
ZOO_SCRIPT = ZOO_DIR / "zoo_script.py"
for path in (ROOT, ROOT / "benchmarks", ZOO_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import resultfile  # noqa: E402

GiB = 1024 ** 3
STEPS = 6
MODES = ("fp32", "bf16", "ckpt")
RESULT_TAG = "ZOO_RESULT "
SETS = {"zoo": "zoo_accuracy", "holdout": "holdout_accuracy", "all": "zoo_and_holdout_accuracy"}  # -> result name
UNDER_LIMIT_PCT = -2.0          # an under-estimate of reserved memory below this sends a user into an OOM
CHILD_TIMEOUT_S = 300
DEVICE = "cuda"                 # where configurations are measured
ROOM_BYTES = 24 * GiB           # a new configuration starts only while the GPU has this much free


# ----------------------------------------------------------------------- configurations
def configs(only: list[str] | None, modes: list[str], which: str = "zoo") -> list[dict]:
    """One row per architecture x mode x batch, as the children take them: of `only`, else
    of the zoo (`which` "zoo"), the held-out set ("holdout") or both ("all")."""
    from zoo_models import ZOO
    unknown = [n for n in (only or []) if n not in ZOO]
    if unknown:
        raise SystemExit(f"unknown architecture(s): {', '.join(unknown)}; known: {', '.join(ZOO)}")
    rows = []
    for name, arch in ZOO.items():
        if only and name not in only:
            continue
        if not only and which != "all" and arch.held_out != (which == "holdout"):
            continue
        for mode in modes:
            if mode == "ckpt" and arch.checkpointing == "none":
                continue
            for i, batch in enumerate(arch.batches):
                own = mode == "ckpt" and arch.checkpointing == "model"
                plan = {"fp32": None, "bf16": "bf16", "ckpt": None if own else "ckpt=full"}[mode]
                rows.append({"id": f"{name}/{mode}/b{batch}", "arch": name, "family": arch.family,
                             "source": arch.source, "held_out": arch.held_out, "mode": mode, "batch": batch,
                             "plan": plan, "own_checkpointing": own, "small": i == 0})
    return rows


def _order(rows: list[dict]) -> list[dict]:
    """Longest first (checkpointing recomputes, the larger batch, the heavier families), so
    that the pool ends together."""
    weight = {"moe": 3, "vision": 2, "diffusion": 2, "segmentation": 2, "detection": 3, "encoder-decoder": 2}
    return sorted(rows, key=lambda r: -(weight.get(r["family"], 1) + (r["mode"] == "ckpt") + (not r["small"])))


# ----------------------------------------------------------------------- the child process
def _script_args(row: dict) -> list[str]:
    return [row["arch"], str(row["batch"])] + (["--own-checkpointing"] if row["own_checkpointing"] else [])


def child(row: dict, measure: bool, memtracker: bool) -> dict:
    """Measure (on a GPU) and then estimate one configuration, in this fresh process."""
    import torch
    torch.manual_seed(0)
    out: dict = {}
    if measure:
        out.update(_measure(row))
    out.update(_estimate(row))
    if memtracker and row["small"] and out.get("estimate_error") is None:
        out.update(_memtracker(row))
    return out


def _measure(row: dict) -> dict:
    import torch

    from memdoctor.predict.fake_step import train_step
    from memdoctor.remedies import prepare
    from zoo_models import build
    t0 = time.perf_counter()
    model = optimizer = batch = prepared = None
    try:
        with torch.device(DEVICE):
            model, optimizer, batch, loss_fn = build(row["arch"], row["batch"], own_checkpointing=row["own_checkpointing"])
        if row["plan"]:
            prepared = prepare(model, optimizer, row["plan"], device_type=DEVICE)
            optimizer = prepared.optimizer
        for _ in range(row.get("measure_steps", STEPS)):
            train_step(model, optimizer, batch, loss_fn, prepared)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        return {"measured_allocated_bytes": torch.cuda.max_memory_allocated(),
                "measured_reserved_bytes": torch.cuda.max_memory_reserved(),
                "alloc_retries": stats.get("num_alloc_retries", 0),
                "measure_seconds": round(time.perf_counter() - t0, 2)}
    except Exception as exc:
        return {"measure_error": _error_text(exc), "measure_seconds": round(time.perf_counter() - t0, 2)}
    finally:
        del model, optimizer, batch, prepared
        try:
            import gc
            gc.collect()
            torch.cuda.empty_cache()
        except Exception:
            pass


def _estimate(row: dict) -> dict:
    from memdoctor.predict.config import estimate_config
    t0 = time.perf_counter()
    try:
        est = estimate_config(script=str(ZOO_SCRIPT), script_args=_script_args(row), plan=row["plan"])
        return {"predicted_allocated_bytes": est.peak_allocated_bytes,
                "predicted_reserved_bytes": est.peak_reserved_bytes,
                "estimate_seconds": round(est.elapsed_s, 2), "peak_phase": est.peak_phase,
                "params": est.params, "simulated_on": est.simulated_on,
                "notes": [n[:400] for n in est.notes]}
    except Exception as exc:
        return {"estimate_error": _error_text(exc), "estimate_seconds": round(time.perf_counter() - t0, 2),
                "estimate_trace": traceback.format_exc()[-1500:]}


def _memtracker(row: dict) -> dict:
    from memdoctor.predict.anchors import memtracker_peak
    from memdoctor.remedies.plan import Plan
    from zoo_models import build
    t0 = time.perf_counter()
    try:
        peak = memtracker_peak(lambda: build(row["arch"], row["batch"], own_checkpointing=row["own_checkpointing"]),
                               Plan.parse(row["plan"]) if row["plan"] else None, "cuda")
        return {"memtracker_peak_bytes": peak, "memtracker_seconds": round(time.perf_counter() - t0, 2)}
    except Exception as exc:
        return {"memtracker_error": _error_text(exc), "memtracker_seconds": round(time.perf_counter() - t0, 2)}


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


# ----------------------------------------------------------------------- checks on the GPU
def checks() -> dict:
    """memdoctor's SDPA rules against the dispatcher on this GPU (real and fake tensors), and
    cuDNN's measured RNN sizes against the bound used without a GPU."""
    return {"sdpa": _sdpa_checks(), "rnn": _rnn_checks()}


def _sdpa_cases():
    import torch
    f32, bf16 = torch.float32, torch.bfloat16
    cases = []
    for dtype in (f32, bf16):
        for heads, kv in ((16, 16), (14, 2), (8, 1)):
            for gqa in ((False, True) if heads != kv else (False,)):
                for mask in (None, "bool", "float", "bool-padded"):
                    for causal in ((False, True) if mask is None else (False,)):
                        for d in (64, 128, 256):
                            cases.append({"dtype": dtype, "heads": heads, "kv": kv, "gqa": gqa, "mask": mask,
                                          "causal": causal, "d": d, "seq": 1024, "dropout": 0.0})
        cases.append({"dtype": dtype, "heads": 12, "kv": 12, "gqa": False, "mask": None, "causal": True, "d": 64,
                      "seq": 1024, "dropout": 0.1})
        cases.append({"dtype": dtype, "heads": 12, "kv": 12, "gqa": False, "mask": None, "causal": False, "d": 72,
                      "seq": 197, "dropout": 0.0})
    return cases


def _sdpa_tensors(case, device, fake_mode=None):
    import contextlib

    import torch
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx:
        b, s, d = 2, case["seq"], case["d"]
        q = torch.empty(b, case["heads"], s, d, dtype=case["dtype"], device=device, requires_grad=True)
        k = torch.empty(b, case["kv"], s, d, dtype=case["dtype"], device=device, requires_grad=True)
        v = torch.empty(b, case["kv"], s, d, dtype=case["dtype"], device=device, requires_grad=True)
        mask = None
        if case["mask"] == "bool":
            mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=device)
        elif case["mask"] == "float":
            mask = torch.zeros(b, 1, s, s, dtype=case["dtype"], device=device)
        elif case["mask"] == "bool-padded":
            mask = torch.ones(b, 1, s, s + 3, dtype=torch.bool, device=device)[..., :s]
    return q, k, v, mask


def _sdpa_checks() -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memdoctor.cuda.sdpa_backend import SdpaRules, choose
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    cap = torch.cuda.get_device_capability()
    rules = SdpaRules(sm=tuple(cap))
    rows, disagree, fake_disagree = [], 0, 0
    for case in _sdpa_cases():
        q, k, v, mask = _sdpa_tensors(case, "cuda")
        args = (q, k, v, mask, case["dropout"], case["causal"])
        try:
            real = names.get(int(torch._fused_sdp_choice(*args, enable_gqa=case["gqa"])), "error")
        except Exception as exc:
            real = f"error: {_error_text(exc)}"
        try:
            mode = FakeTensorMode()
            fq, fk, fv, fmask = _sdpa_tensors(case, "cuda", mode)
            with mode:
                fake = names.get(int(torch._fused_sdp_choice(fq, fk, fv, fmask, case["dropout"], case["causal"],
                                                             enable_gqa=case["gqa"])), "error")
        except Exception as exc:
            fake = f"error: {_error_text(exc)}"
        ours = choose(q, k, v, mask, case["dropout"], case["causal"], case["gqa"], rules=rules)
        disagree += ours != real
        fake_disagree += fake != real
        rows.append({**{k2: str(v2).replace("torch.", "") for k2, v2 in case.items()},
                     "dispatcher": real, "dispatcher_on_fake": fake, "memdoctor": ours})
        del q, k, v, mask
    return {"cases": len(rows), "memdoctor_disagrees": disagree, "fake_disagrees": fake_disagree,
            "cudnn_version": torch.backends.cudnn.version(), "rows": rows}


def _rnn_checks() -> list[dict]:
    import torch

    from memdoctor.predict.fused_rnn import RnnShape, bound, measure
    out = []
    for mode in ("lstm", "gru"):
        for dtype in (torch.float32, torch.bfloat16):
            for batch in (16, 32):
                shape = RnnShape(mode, 1024, 1024, 0, 3, 1, batch, 256, dtype, True)
                row = {"mode": mode, "dtype": str(dtype).replace("torch.", ""), "batch": batch}
                try:
                    got, cap = measure(shape), bound(shape)
                    row.update(measured=got.__dict__, bound=cap.__dict__,
                               bound_holds=all(getattr(cap, f) >= getattr(got, f) for f in
                                               ("reserve", "forward_workspace", "backward_data_workspace",
                                                "backward_weight_workspace")))
                except Exception as exc:
                    row["error"] = _error_text(exc)
                out.append(row)
    return out


# ----------------------------------------------------------------------- the pool
def _run_child(row: dict, args, deadline: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(row)]
    if args.dry_run or args.measured:
        cmd.append("--dry-run")
    if args.no_memtracker:
        cmd.append("--no-memtracker")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    timeout = max(5.0, min(CHILD_TIMEOUT_S, deadline - time.perf_counter()))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        cut_short = timeout < CHILD_TIMEOUT_S          # by the run's deadline: --resume runs it again
        return {**row, "child_error": f"no result within {timeout:.0f} s" + (" (time budget)" if cut_short else ""),
                "child_seconds": round(timeout, 1)}
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
    if result is None:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        return {**row, "child_error": f"exit {proc.returncode}: {' | '.join(tail)}"[:600],
                "child_seconds": round(time.perf_counter() - t0, 1)}
    return {**row, **result, "child_seconds": round(time.perf_counter() - t0, 1)}


def _gpu_free_bytes() -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
    except Exception:
        return None


def _wait_for_room(lock: threading.Lock, deadline: float) -> None:
    """Start a configuration only while the GPU has room for it (a measurement that ran out
    of memory, or whose allocator had to free its cache to retry, would measure nothing)."""
    with lock:
        while time.perf_counter() < deadline:
            free = _gpu_free_bytes()
            if free is None or free >= ROOM_BYTES:
                return
            time.sleep(0.5)


def run_pool(rows: list[dict], args, deadline: float, save) -> list[dict]:
    done: list[dict] = []
    lock = threading.Lock()
    last_save = [time.perf_counter()]

    def job(row):
        if time.perf_counter() > deadline - 20:
            return {**row, "child_error": "not run: time budget"}
        if not (args.dry_run or args.measured):
            _wait_for_room(lock, deadline)
            time.sleep(1.0)              # let the last one started claim its memory before the next looks
        return _run_child(row, args, deadline)

    with cf.ThreadPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(job, r) for r in _order(rows)]
        for fut in cf.as_completed(futures):
            res = fut.result()
            done.append(res)
            print(_row_line(_with_errors(res)), flush=True)
            if time.perf_counter() - last_save[0] > 20:
                save(done, partial=True)
                last_save[0] = time.perf_counter()
    order = {r["id"]: i for i, r in enumerate(rows)}
    return sorted(done, key=lambda r: order[r["id"]])


# ----------------------------------------------------------------------- summary
def _pct(pred, meas):
    if pred is None or not meas:
        return None
    return round(100.0 * (pred - meas) / meas, 2)


def _with_errors(r: dict) -> dict:
    r = dict(r)
    r["error_allocated_pct"] = _pct(r.get("predicted_allocated_bytes"), r.get("measured_allocated_bytes"))
    r["error_reserved_pct"] = _pct(r.get("predicted_reserved_bytes"), r.get("measured_reserved_bytes"))
    r["memtracker_error_pct"] = _pct(r.get("memtracker_peak_bytes"), r.get("measured_allocated_bytes"))
    return r


def _stats(errs: list[tuple[str, float]]) -> dict:
    if not errs:
        return {"count": 0}
    worst = max(errs, key=lambda e: abs(e[1]))
    return {"count": len(errs), "median_abs_error_pct": round(statistics.median(abs(e) for _, e in errs), 2),
            "worst_error_pct": worst[1], "worst_config": worst[0],
            "within_1_5pct": sum(abs(e) <= 1.5 for _, e in errs), "within_5pct": sum(abs(e) <= 5 for _, e in errs)}


def summarize(rows: list[dict], dry_run: bool) -> dict:
    trained = [r for r in rows if dry_run or r.get("measured_allocated_bytes")]
    crashes = [r for r in trained if r.get("estimate_error")]
    lost = [r for r in rows if r.get("child_error") and "time budget" not in r["child_error"]]
    seconds = [r["estimate_seconds"] for r in rows if r.get("estimate_seconds") is not None
               and not r.get("estimate_error")]
    out = {
        "configurations": len(rows),
        "measured": sum(1 for r in rows if r.get("measured_allocated_bytes")),
        "did_not_train": [{"id": r["id"], "error": r.get("measure_error")} for r in rows if r.get("measure_error")],
        "not_run": [r["id"] for r in rows if "time budget" in (r.get("child_error") or "")],
        "estimate_crashes": [{"id": r["id"], "error": r["estimate_error"]} for r in crashes],
        "no_result": [{"id": r["id"], "error": r["child_error"]} for r in lost],
        "estimate_seconds": {"median": round(statistics.median(seconds), 2) if seconds else None,
                             "max": max(seconds, default=None),
                             "slowest": max(rows, key=lambda r: r.get("estimate_seconds") or 0)["id"] if rows else None},
    }
    if not dry_run:
        out["allocated"] = _stats([(r["id"], r["error_allocated_pct"]) for r in rows
                                   if r.get("error_allocated_pct") is not None])
        out["reserved"] = _stats([(r["id"], r["error_reserved_pct"]) for r in rows
                                  if r.get("error_reserved_pct") is not None])
        out["memtracker_vs_allocated"] = _stats([(r["id"], r["memtracker_error_pct"]) for r in rows
                                                 if r.get("memtracker_error_pct") is not None])
        out["memdoctor_allocated_on_memtracker_configs"] = _stats(
            [(r["id"], r["error_allocated_pct"]) for r in rows
             if r.get("memtracker_error_pct") is not None and r.get("error_allocated_pct") is not None])
        out["under_estimates_reserved"] = [{"id": r["id"], "error_reserved_pct": r["error_reserved_pct"]}
                                           for r in rows if (r.get("error_reserved_pct") or 0) < UNDER_LIMIT_PCT]
        out["allocator_retried"] = [r["id"] for r in rows if r.get("alloc_retries")]
        out["done_when"] = {
            "no_crash": not crashes and not lost,
            "median_abs_le_1_5": all((out[k].get("median_abs_error_pct") or 0) <= 1.5 for k in ("allocated", "reserved")),
            "worst_abs_le_5": all(abs(out[k].get("worst_error_pct") or 0) <= 5 for k in ("allocated", "reserved")),
            "no_under_estimate_below_2pct": not out["under_estimates_reserved"],
            "estimate_under_60s": (out["estimate_seconds"]["max"] or 0) < 60,
        }
    return out


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _fmt_pct(e) -> str:
    return "-" if e is None else f"{e:+.1f}%"


def _row_line(r: dict) -> str:
    status = r.get("child_error") or r.get("measure_error") or r.get("estimate_error") or ""
    if status:
        status = "  " + status[:90]
    return (f"{r['id']:<30}{_gib(r.get('measured_allocated_bytes')):>8}{_gib(r.get('predicted_allocated_bytes')):>8}"
            f"{_fmt_pct(r.get('error_allocated_pct')):>8}{_gib(r.get('measured_reserved_bytes')):>8}"
            f"{_gib(r.get('predicted_reserved_bytes')):>8}{_fmt_pct(r.get('error_reserved_pct')):>8}"
            f"{_fmt_pct(r.get('memtracker_error_pct')):>9}{(r.get('estimate_seconds') or 0):>7.1f}s{status}")


def table_lines(rows: list[dict]) -> list[str]:
    head = (f"{'configuration':<30}{'m.alloc':>8}{'p.alloc':>8}{'err':>8}{'m.res':>8}{'p.res':>8}{'err':>8}"
            f"{'MemTrk':>9}{'est.':>8}   (GiB; err = (predicted - measured) / measured)")
    return [head, "-" * len(head)] + [_row_line(r) for r in rows]


def summary_lines(summary: dict, checks_result: dict | None, elapsed: float) -> list[str]:
    lines = ["", f"== zoo summary: {summary['configurations']} configurations, {summary['measured']} measured, "
                 f"{elapsed:.0f} s =="]
    for key, label in (("allocated", "memdoctor allocated"), ("reserved", "memdoctor reserved"),
                       ("memdoctor_allocated_on_memtracker_configs", "memdoctor alloc (MemTracker's configs)"),
                       ("memtracker_vs_allocated", "MemTracker (FakeTensorMode)")):
        s = summary.get(key)
        if s and s.get("count"):
            lines.append(f"{label:<40} n={s['count']:<4} median |err| {s['median_abs_error_pct']:>5.2f}%   worst "
                         f"{s['worst_error_pct']:+7.2f}% ({s['worst_config']})   within 5%: {s['within_5pct']}")
    es = summary["estimate_seconds"]
    lines.append(f"estimate time: median {es['median']} s, max {es['max']} s ({es['slowest']})")
    lines.append(f"estimate crashes: {len(summary['estimate_crashes'])}")
    lines += [f"  {c['id']}: {str(c['error'])[:110]}" for c in summary["estimate_crashes"][:8]]
    if summary["no_result"]:
        lines.append(f"configurations whose process gave no result: {len(summary['no_result'])}")
        lines += [f"  {c['id']}: {str(c['error'])[:110]}" for c in summary["no_result"][:4]]
    if "under_estimates_reserved" in summary:
        under = summary["under_estimates_reserved"]
        lines.append(f"under-estimates below {UNDER_LIMIT_PCT}% of reserved: {len(under)}")
        lines += [f"  {u['id']}: {u['error_reserved_pct']:+.2f}%" for u in under[:6]]
    if summary["did_not_train"]:
        lines.append(f"did not train on the GPU (not counted): {len(summary['did_not_train'])}")
        lines += [f"  {d['id']}: {str(d['error'])[:110]}" for d in summary["did_not_train"][:4]]
    if summary["not_run"]:
        lines.append(f"not run (time budget): {len(summary['not_run'])}")
    if summary.get("allocator_retried"):
        lines.append(f"allocator retried (GPU full; reserved unreliable): {', '.join(summary['allocator_retried'][:6])}")
    if checks_result and isinstance(checks_result.get("sdpa"), dict):
        s = checks_result["sdpa"]
        lines.append(f"SDPA rules: {s.get('cases')} cases, memdoctor disagrees with the dispatcher on "
                     f"{s.get('memdoctor_disagrees')}, fake tensors on {s.get('fake_disagrees')} "
                     f"(cuDNN {s.get('cudnn_version')})")
    if checks_result and isinstance(checks_result.get("rnn"), list):
        held = sum(1 for r in checks_result["rnn"] if r.get("bound_holds"))
        lines.append(f"cuDNN RNN bound holds on {held} of {len(checks_result['rnn'])} measured shapes")
    if "done_when" in summary:
        lines.append("done when: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in summary["done_when"].items()))
    return lines[-40:]


# ----------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memdoctor's default estimate against a GPU's measurement on the zoo "
                                             "(benchmarks/zoo): architectures it was never shaped for")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these architectures")
    ap.add_argument("--set", dest="which", choices=SETS, default="zoo",
                    help="the zoo (default), the held-out architectures (benchmarks/zoo/holdout_models.py) or all")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="precision / checkpointing modes")
    ap.add_argument("--dry-run", action="store_true", help="estimates only, no GPU needed")
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    ap.add_argument("--workers", type=int, help="configurations at a time (default: 10 on a GPU, the cores otherwise)")
    ap.add_argument("--time-budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    ap.add_argument("--no-memtracker", action="store_true", help="skip MemTracker")
    ap.add_argument("--no-checks", action="store_true", help="skip the SDPA / RNN checks on the GPU")
    ap.add_argument("--steps", type=int, default=STEPS,
                    help=f"training steps measured (default {STEPS}; more for a model whose steps draw at random)")
    ap.add_argument("--resume", metavar="RESULT", help="keep the configurations this earlier result has, run the rest")
    ap.add_argument("--measured", metavar="RESULT", help="estimate only, and take the measured peaks from this "
                    "earlier result (its rows' commits kept as measured_at)")
    ap.add_argument("--list", action="store_true", help="list the zoo and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-checks", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        result = child(json.loads(args.child), measure=not args.dry_run, memtracker=not args.no_memtracker)
        print(RESULT_TAG + json.dumps(result, default=str), flush=True)
        return 0
    if args.child_checks:
        print(RESULT_TAG + json.dumps(checks(), default=str), flush=True)
        return 0
    if args.list:
        from zoo_models import describe
        for a in describe():
            print(f"{a['name']:<20}{a['family']:<16}{a['source']:<14}batches {a['batches']}  ckpt: {a['checkpointing']}"
                  + ("  (held out)" if a["held_out"] else ""))
        return 0

    t0 = time.perf_counter()
    deadline = t0 + args.time_budget
    import torch
    gpu = not args.dry_run
    if gpu and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or with --dry-run for estimates only", file=sys.stderr)
        return 2
    if args.workers is None:
        args.workers = 10 if gpu else max(1, os.cpu_count() or 1)
    hw = resultfile.hardware("cuda" if gpu else "cpu")
    rows = [{**r, "measure_steps": args.steps} for r in configs(args.only, args.modes, args.which)]
    previous = json.loads(Path(args.resume).read_text()) if args.resume else {}
    measured = _measured_rows(args.measured) if args.measured else {}
    if measured:
        rows = [r for r in rows if r["id"] in measured]
    kept = _resumed(previous, rows)
    rows = [r for r in rows if r["id"] not in {k["id"] for k in kept}]
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(0) if gpu else None,
           "cudnn": torch.backends.cudnn.version() if gpu else None, "workers": args.workers, "steps": args.steps,
           "transformers": _version("transformers"),
           "torchvision": _version("torchvision"), "cpu_count": os.cpu_count()}
    print(f"{len(rows)} configurations ({len(kept)} kept from {args.resume}), " if kept else
          f"{len(rows)} configurations, ", end="")
    print(f"{args.workers} at a time, time budget {args.time_budget:.0f} s "
          f"({'estimates only' if args.dry_run else 'measured on ' + str(env['gpu'])})", flush=True)
    checks_result: dict | None = previous.get("checks")
    check_thread = None
    if gpu and not args.no_checks and not checks_result:
        holder: dict = {}

        def run_checks():
            holder["result"] = _checks_child(deadline)
        check_thread = threading.Thread(target=run_checks, daemon=True)
        check_thread.start()

    def rows_of(done: list[dict]) -> list[dict]:
        """Every configuration so far, with its measurement and its errors."""
        return [_with_errors({**r, **measured.get(r["id"], {})}) for r in kept + done]

    def save(done: list[dict], partial: bool = False) -> Path:
        full = rows_of(done)
        data = {"env": env, "dry_run": args.dry_run, "partial": partial, "elapsed_s": round(time.perf_counter() - t0, 1),
                "summary": summarize(full, args.dry_run), "checks": checks_result, "configs": full}
        return resultfile.save(SETS[args.which], hw, data, out=args.out)

    print("\n".join(table_lines([])), flush=True)          # rows follow as configurations finish
    done = run_pool(rows, args, deadline, save)
    if check_thread is not None:
        check_thread.join(timeout=max(1.0, deadline + 60 - time.perf_counter()))
        checks_result = holder.get("result")
    full = rows_of(done)
    path = save(done)
    summary = summarize(full, args.dry_run)
    print("\n".join(summary_lines(summary, checks_result, time.perf_counter() - t0)))
    print(f"written: {path}")
    return 0


MEASURED_FIELDS = ("measured_allocated_bytes", "measured_reserved_bytes", "alloc_retries", "measure_seconds",
                   "measure_error", "measure_steps")


def _measured_rows(path: str) -> dict[str, dict]:
    """Each configuration's measurement in an earlier result, with the commit it was measured at."""
    data = json.loads(Path(path).read_text())
    commit = str(data.get("commit", "")).split()[0]
    return {r["id"]: {**{k: r[k] for k in MEASURED_FIELDS if k in r}, "measured_at": r.get("measured_at", commit)}
            for r in data.get("configs", []) if r.get("measured_allocated_bytes") or r.get("measure_error")}


def _resumed(previous: dict, rows: list[dict]) -> list[dict]:
    """The configurations an earlier result finished (not those it ran out of time for)."""
    wanted = {r["id"] for r in rows}
    return [r for r in previous.get("configs", []) if r["id"] in wanted
            and "time budget" not in (r.get("child_error") or "")]


def _checks_child(deadline: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-checks"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT),
                              timeout=max(10.0, deadline - time.perf_counter()),
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
    except subprocess.TimeoutExpired:
        return {"error": "no result in time"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return {"error": " | ".join((proc.stderr or "").strip().splitlines()[-3:])[:600]}


def _version(name: str) -> str | None:
    try:
        module = __import__(name)
        return getattr(module, "__version__", None)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
