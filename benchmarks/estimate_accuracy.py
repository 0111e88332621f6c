"""How close memdoctor's estimate comes to what a GPU measures, next to the rules people use.

For each configuration (model x precision mode x batch size) it
  (a) predicts with memdoctor.predict.estimate (FakeTensorMode + the caching-allocator model), in
      worker processes while the GPU measures;
  (b) measures on the GPU, each configuration in a fresh process as a training script runs
      (--same-process: all in this one): caches emptied (cuBLAS workspaces too), peak stats
      reset, the model built on cuda, two training steps (forward, backward, AdamW step,
      zero_grad(set_to_none=True)) through the same memdoctor.predict.fake_step.train_step the
      estimate runs; torch.cuda.max_memory_allocated() / max_memory_reserved();
  (c) computes the anchors: torch's MemTracker under FakeTensorMode (where it finishes in
      time), DeepSpeed's ZeRO-2 model-states formula, accelerate's "model size x 4 for Adam"
      and memdoctor's own tensor-level peak without the allocator model;
and prints a table and writes results/estimate_accuracy_<hardware>_<date>.json and a .md
table beside it: per configuration predicted / measured / error %, and per predictor the
median absolute error, the worst case and the number of under-estimates.

    python benchmarks/estimate_accuracy.py --gpus 2   # all 54 (~5-7 minutes on two H200s)
    python benchmarks/estimate_accuracy.py --quick    # a smoke test (~1 minute)
    python benchmarks/estimate_accuracy.py --dry-run --measured benchmarks/results/estimate_accuracy_h200_2026-11-30.json
        # no GPU: this machine's predictions against a GPU's committed measurements

Needs torch (2.11 or later) with CUDA, numpy optional, nothing else: memdoctor is imported
from this checkout. A configuration that fails records its error and the run goes on.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
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
MiB = 1024 ** 2

# (model, sequence length or None for images, two batch sizes). The larger sizes keep the
# fp32 peak under ~100 GiB of an H200's 139 GiB (the prediction workers' CUDA contexts take
# ~0.5 GiB each); all fit, none is skipped for size.
MODELS = [
    ("gpt2-124m", 1024, (8, 32)),
    ("gpt2-355m", 1024, (8, 24)),
    ("gpt2-774m", 1024, (4, 16)),
    ("gpt2-1.5b", 1024, (4, 10)),
    ("bert-base", 512, (32, 96)),
    ("bert-large", 512, (16, 48)),
    ("llama-1b", 2048, (2, 6)),
    ("resnet50", None, (64, 256)),
    ("vit-b16", None, (64, 256)),
]
QUICK = [("gpt2-124m", 512, (4,)), ("resnet50", None, (32,)), ("vit-b16", None, (32,))]
MODES = {"fp32": None, "bf16": "bf16", "ckpt": "ckpt=full"}


def configs(quick: bool, only: list[str] | None) -> list[dict]:
    rows = []
    for name, seq, batches in (QUICK if quick else MODELS):
        if only and name not in only:
            continue
        for mode, plan in MODES.items():
            for i, batch in enumerate(batches):
                rows.append({"id": f"{name}/{mode}/b{batch}", "model": name, "seq": seq, "batch": batch,
                             "mode": mode, "plan": plan, "small": i == 0})
    return rows


# ----------------------------------------------------------------------- workers
def _worker_init() -> None:
    import torch
    torch.set_num_threads(1)


def predict(job: dict) -> dict:
    """memdoctor's estimate (and the formula anchors) for one configuration."""
    from memdoctor.predict.anchors import accelerate_adam_bytes, deepspeed_zero2_model_states_bytes
    from memdoctor.predict.estimate import estimate
    from memdoctor.predict.models import get, make_optimizer
    t0 = time.perf_counter()
    try:
        spec = get(job["model"])
        est = estimate(lambda: spec.build_model(job["seq"]), lambda m: make_optimizer("adamw", m),
                       lambda: spec.make_batch(job["batch"], job["seq"]), spec.loss_fn,
                       plan=job["plan"], device="cuda", settle=False)   # the GPU measures two steps
        return {
            "ok": True,
            "peak_allocated_bytes": est.peak_allocated_bytes,
            "peak_reserved_bytes": est.peak_reserved_bytes,
            "live_peak_bytes": est.live_peak_bytes,
            "requested_peak_bytes": est.allocator.get("peak_requested_bytes"),
            "segments": est.allocator.get("segments"),
            "peak_phase": est.peak_phase, "peak_step": est.peak_step,
            "breakdown": est.breakdown, "workspace_bytes": est.workspace_bytes,
            "params": est.params, "param_bytes": est.param_bytes,
            "deepspeed_zero2_model_states_bytes": deepspeed_zero2_model_states_bytes(est.params),
            "accelerate_adam_x4_bytes": accelerate_adam_bytes(est.param_bytes),
            "simulated_on": est.simulated_on, "notes": est.notes,
            "seconds": round(time.perf_counter() - t0, 2),
        }
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500],
                "trace": traceback.format_exc()[-2000:], "seconds": round(time.perf_counter() - t0, 2)}


def memtracker(job: dict) -> dict:
    """torch's MemTracker peak under FakeTensorMode for the same configuration."""
    from memdoctor.predict.anchors import memtracker_peak
    from memdoctor.predict.models import get
    from memdoctor.remedies.plan import Plan
    t0 = time.perf_counter()
    try:
        build = get(job["model"]).builder(batch=job["batch"], seq=job["seq"])
        plan = Plan.parse(job["plan"]) if job["plan"] else Plan()
        peak = memtracker_peak(build, plan, "cuda")
        return {"ok": True, "memtracker_peak_bytes": peak, "seconds": round(time.perf_counter() - t0, 2)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                "seconds": round(time.perf_counter() - t0, 2)}


# ----------------------------------------------------------------------- the GPU
def _reset_cuda() -> None:
    import torch
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:           # a fresh process would have none: the estimate adds them
        clear()
    torch.cuda.empty_cache()


def measure(job: dict) -> dict:
    import torch

    from memdoctor.predict.fake_step import train_step
    from memdoctor.predict.models import get
    from memdoctor.remedies import prepare
    t0 = time.perf_counter()
    if job.get("gpu") is not None:
        torch.cuda.set_device(job["gpu"])
    _reset_cuda()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    model = optimizer = batch = prepared = None
    try:
        build = get(job["model"]).builder(batch=job["batch"], seq=job["seq"])
        with torch.device("cuda"):
            model, optimizer, batch, loss_fn = build()
        if job["plan"]:
            prepared = prepare(model, optimizer, job["plan"], device_type="cuda")
            optimizer = prepared.optimizer
        for _ in range(2):
            train_step(model, optimizer, batch, loss_fn, prepared)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        return {
            "ok": True,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() - base_alloc,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() - base_res,
            "requested_peak_bytes": stats.get("requested_bytes.all.peak", 0) - base_alloc,
            "segments_peak": stats.get("segment.all.peak"),
            "num_alloc_retries": stats.get("num_alloc_retries"),
            "baseline_allocated_bytes": base_alloc, "baseline_reserved_bytes": base_res,
            "seconds": round(time.perf_counter() - t0, 2),
        }
    except torch.OutOfMemoryError as exc:
        return {"ok": False, "oom": True, "error": str(exc).splitlines()[0][:300],
                "seconds": round(time.perf_counter() - t0, 2)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500],
                "trace": traceback.format_exc()[-2000:], "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        del model, optimizer, batch, prepared
        try:
            _reset_cuda()
        except Exception:
            pass


def measure_in_fresh_process(job: dict, deadline: float) -> dict:
    """measure() in a process of its own, as a training script runs: where the CUDA driver
    places new segments depends on what the process freed before, and with it which free
    blocks tie in the allocator (measured: ResNet-50 fp32 batch 64 reserved 6,754 MiB in a
    fresh process, 7,072 MiB after the other configurations in one process)."""
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as ex:
        try:
            return ex.submit(measure, job).result(timeout=max(deadline - time.perf_counter(), 5))
        except cf.TimeoutError:
            _stop_pool(ex)
            return {"ok": False, "error": "time budget", "seconds": None}
        except Exception as exc:
            return {"ok": False, "error": f"measuring process: {type(exc).__name__}: {exc}"[:300], "seconds": None}


def cuda_context_bytes() -> dict:
    """The CUDA context of this process, measured with NVML: device memory used after the
    context, a matmul (cuBLAS) and a convolution (cuDNN) exist, minus what the caching
    allocator reserved, minus what was used before."""
    import torch
    out: dict = {"available": False}
    try:
        import pynvml
        pynvml.nvmlInit()
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        before = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        a = torch.randn(256, 256, device="cuda")
        (a @ a).sum().item()
        torch.nn.functional.conv2d(torch.randn(1, 3, 32, 32, device="cuda"),
                                   torch.randn(8, 3, 3, 3, device="cuda")).sum().item()
        torch.cuda.synchronize()
        after = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        reserved = torch.cuda.memory_reserved()
        out = {"available": True, "context_bytes": after - before - reserved,
               "device_used_before": before, "device_used_after": after, "reserved": reserved}
        del a
    except Exception as exc:
        out["reason"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


# ----------------------------------------------------------------------- summary
# predictor -> (its figure, the measured figure it is compared with)
PREDICTORS = {
    "memdoctor": ("peak_allocated_bytes", "measured_allocated_bytes"),
    "memdoctor_reserved": ("peak_reserved_bytes", "measured_reserved_bytes"),
    "memdoctor_requested": ("requested_peak_bytes", "measured_requested_bytes"),
    "memdoctor_tensors_only": ("live_peak_bytes", "measured_allocated_bytes"),
    "memtracker": ("memtracker_peak_bytes", "measured_allocated_bytes"),
    "deepspeed_zero2": ("deepspeed_zero2_model_states_bytes", "measured_allocated_bytes"),
    "accelerate_x4": ("accelerate_adam_x4_bytes", "measured_allocated_bytes"),
}


def error_pct(pred, meas):
    if pred is None or not meas:
        return None
    return round(100.0 * (pred - meas) / meas, 2)


def summarize(rows: list[dict]) -> dict:
    out = {}
    for name, (key, target) in PREDICTORS.items():
        errs = [(r["id"], error_pct(r.get(key), r.get(target))) for r in rows]
        errs = [(i, e) for i, e in errs if e is not None]
        if not errs:
            out[name] = {"count": 0}
            continue
        worst = max(errs, key=lambda x: abs(x[1]))
        out[name] = {
            "count": len(errs),
            "median_abs_error_pct": round(statistics.median(abs(e) for _, e in errs), 2),
            "mean_abs_error_pct": round(statistics.fmean(abs(e) for _, e in errs), 2),
            "worst_error_pct": worst[1], "worst_config": worst[0],
            "under_estimates": sum(1 for _, e in errs if e < 0),
            "within_5pct": sum(1 for _, e in errs if abs(e) <= 5),
        }
    return out


def gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def pct(e) -> str:
    return "-" if e is None else f"{e:+.1f}%"


def table_lines(rows: list[dict]) -> list[str]:
    head = (f"{'config':<28}{'meas alloc':>11}{'pred alloc':>11}{'err':>8}{'meas res':>10}{'pred res':>10}"
            f"{'err':>8}{'tensors':>9}{'MemTrk':>9}{'DS z2':>9}{'acc x4':>9}  phase / status")
    lines = [head, "-" * len(head)]
    for r in rows:
        status = r.get("status", "")
        lines.append(
            f"{r['id']:<28}{gib(r.get('measured_allocated_bytes')):>11}{gib(r.get('peak_allocated_bytes')):>11}"
            f"{pct(r.get('error_allocated_pct')):>8}{gib(r.get('measured_reserved_bytes')):>10}"
            f"{gib(r.get('peak_reserved_bytes')):>10}{pct(r.get('error_reserved_pct')):>8}"
            f"{pct(error_pct(r.get('live_peak_bytes'), r.get('measured_allocated_bytes'))):>9}"
            f"{pct(error_pct(r.get('memtracker_peak_bytes'), r.get('measured_allocated_bytes'))):>9}"
            f"{pct(error_pct(r.get('deepspeed_zero2_model_states_bytes'), r.get('measured_allocated_bytes'))):>9}"
            f"{pct(error_pct(r.get('accelerate_adam_x4_bytes'), r.get('measured_allocated_bytes'))):>9}"
            f"  {r.get('peak_phase', '')} {status}".rstrip())
    return lines


def markdown(result: dict) -> str:
    env, rows, summ = result["env"], result["configs"], result["summary"]
    out = ["# memdoctor estimate accuracy", "",
           f"{env.get('gpu')} · torch {env.get('torch')} · CUDA {env.get('cuda')} · "
           f"{len(rows)} configurations · {result['elapsed_s']:.0f} s", "",
           f"CUDA context measured: {gib(env.get('cuda_context', {}).get('context_bytes'))} GiB "
           "(reported apart, not in the peaks)", "",
           "## Summary (error = (predicted - measured) / measured)", "",
           "memdoctor: max_memory_allocated; memdoctor_reserved: max_memory_reserved; memdoctor_requested: "
           "the peak of requested bytes (memory_stats requested_bytes.all.peak, before rounding); the rest "
           "against max_memory_allocated.", "",
           "| predictor | n | median abs error | mean abs error | worst | under-estimates | within 5% |",
           "|---|---|---|---|---|---|---|"]
    for name, s in summ.items():
        if not s.get("count"):
            out.append(f"| {name} | 0 | - | - | - | - | - |")
            continue
        out.append(f"| {name} | {s['count']} | {s['median_abs_error_pct']}% | {s['mean_abs_error_pct']}% | "
                   f"{s['worst_error_pct']:+}% ({s['worst_config']}) | {s['under_estimates']} | {s['within_5pct']} |")
    out += ["", "## Per configuration (GiB)", "",
            "| config | measured alloc | predicted alloc | err | measured reserved | predicted reserved | err | "
            "tensors only | MemTracker | DeepSpeed ZeRO-2 | accelerate x4 | peak phase | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.get("measured_allocated_bytes")
        out.append(
            f"| {r['id']} | {gib(m)} | {gib(r.get('peak_allocated_bytes'))} | {pct(r.get('error_allocated_pct'))} | "
            f"{gib(r.get('measured_reserved_bytes'))} | {gib(r.get('peak_reserved_bytes'))} | "
            f"{pct(r.get('error_reserved_pct'))} | {pct(error_pct(r.get('live_peak_bytes'), m))} | "
            f"{pct(error_pct(r.get('memtracker_peak_bytes'), m))} | "
            f"{pct(error_pct(r.get('deepspeed_zero2_model_states_bytes'), m))} | "
            f"{pct(error_pct(r.get('accelerate_adam_x4_bytes'), m))} | {r.get('peak_phase', '')} | "
            f"{r.get('status', '')} |")
    skipped = [r for r in rows if r.get("status")]
    if skipped:
        out += ["", "## Not compared", ""]
        out += [f"- {r['id']}: {r['status']}" for r in skipped]
    out += ["", "## Notes of the estimate", ""]
    out += [f"- {n}" for n in result.get("notes", [])]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset: a smoke test")
    ap.add_argument("--dry-run", action="store_true", help="predict only (no GPU needed)")
    ap.add_argument("--models", nargs="*", help="only these models")
    ap.add_argument("--jobs", type=int, default=None, help="prediction worker processes (0: in this process)")
    ap.add_argument("--no-memtracker", action="store_true", help="skip the MemTracker anchor (slow on big models)")
    ap.add_argument("--time-budget", type=float, default=440.0, help="seconds for the whole run (default 440)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="measure on this many GPUs side by side, one configuration per fresh process each")
    ap.add_argument("--same-process", action="store_true",
                    help="measure every configuration in this one process (faster; a convolutional "
                         "network's reserved peak then depends on what ran before it)")
    ap.add_argument("--measured", help="with --dry-run: take the measurements from this estimate_accuracy result")
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    deadline = t0 + args.time_budget
    if args.measured and not args.dry_run:
        ap.error("--measured goes with --dry-run")

    import torch
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "gpu": None, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
           "clear_cublas_workspaces": hasattr(torch._C, "_cuda_clearCublasWorkspaces")}
    measure_gpu = not args.dry_run
    if measure_gpu and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or with --dry-run for predictions only", file=sys.stderr)
        return 2
    if measure_gpu:
        try:
            env["allocator_backend"] = torch.cuda.get_allocator_backend()
        except Exception:
            pass
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", total_bytes=props.total_memory)
        env["cuda_context"] = cuda_context_bytes()
        _reset_cuda()

    rows = configs(args.quick, args.models)
    jobs = args.jobs if args.jobs is not None else max(1, min(8, (os.cpu_count() or 2) - 2))
    print(f"{len(rows)} configurations; {jobs or 'no'} prediction workers; time budget {args.time_budget:.0f} s",
          flush=True)

    # predictions (and MemTracker for the smaller batch of each model and mode) in workers
    pool = None
    futures: dict = {}
    mt_futures: dict = {}
    if jobs > 0:
        pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"),
                                      initializer=_worker_init)
        for r in rows:
            futures[r["id"]] = pool.submit(predict, r)
        if not args.no_memtracker:
            order = sorted((r for r in rows if r["small"]), key=_memtracker_cost)
            for r in order:
                mt_futures[r["id"]] = pool.submit(memtracker, r)

    # measurements on the GPU: one at a time, or one per GPU side by side (fresh processes)
    def measure_row(r: dict, gpu: int | None) -> None:
        if time.perf_counter() > deadline - 20:
            r["status"] = "not measured: time budget"
            return
        job = dict(r, gpu=gpu)
        got = measure(job) if args.same_process else measure_in_fresh_process(job, deadline)
        r["measure_seconds"] = got.pop("seconds", None)
        if got.get("ok"):
            r["measured_allocated_bytes"] = got["peak_allocated_bytes"]
            r["measured_reserved_bytes"] = got["peak_reserved_bytes"]
            r["measured_requested_bytes"] = got["requested_peak_bytes"]
            r["measured_segments_peak"] = got["segments_peak"]
            r["measured_alloc_retries"] = got["num_alloc_retries"]
            r["baseline_allocated_bytes"] = got["baseline_allocated_bytes"]
        else:
            r["status"] = ("measured OOM: " if got.get("oom") else "measure failed: ") + got["error"]
            r["measure_trace"] = got.get("trace")
        print(f"  measured {r['id']:<28} {gib(r.get('measured_allocated_bytes')):>7} GiB alloc  "
              f"{gib(r.get('measured_reserved_bytes')):>7} GiB reserved  ({r['measure_seconds']} s)"
              + (f"  {r['status']}" if r.get("status") else ""), flush=True)

    side_by_side = measure_gpu and args.gpus > 1 and not args.same_process
    if side_by_side:
        lanes = [rows[i::args.gpus] for i in range(args.gpus)]
        with cf.ThreadPoolExecutor(max_workers=args.gpus) as lanes_pool:
            list(lanes_pool.map(lambda g: [measure_row(r, g) for r in lanes[g]], range(args.gpus)))
    for r in rows:
        if measure_gpu and not side_by_side:
            measure_row(r, None)
        if pool is None:        # in-process predictions
            if time.perf_counter() > deadline - 10:
                r.setdefault("status", "not predicted: time budget")
                continue
            _merge_prediction(r, predict(r))

    if args.measured:
        env["measured_from"] = args.measured
        take_measurements(rows, json.loads(Path(args.measured).read_text())["configs"])

    notes: list[str] = []
    if pool is not None:
        for r in rows:
            fut = futures[r["id"]]
            try:
                got = fut.result(timeout=max(deadline - time.perf_counter(), 1))
            except cf.TimeoutError:
                r["status"] = (r.get("status", "") + " not predicted: time budget").strip()
                continue
            except Exception as exc:        # a worker died
                got = {"ok": False, "error": f"worker: {type(exc).__name__}: {exc}"}
            _merge_prediction(r, got)
        for r in rows:
            fut = mt_futures.get(r["id"])
            if fut is None:
                continue
            try:
                got = fut.result(timeout=max(deadline - time.perf_counter(), 0.5))
            except cf.TimeoutError:
                r["memtracker_status"] = "not run: time budget"
                continue
            except Exception as exc:
                got = {"ok": False, "error": f"worker: {type(exc).__name__}: {exc}"}
            if got.get("ok"):
                r["memtracker_peak_bytes"] = got["memtracker_peak_bytes"]
                r["memtracker_seconds"] = got["seconds"]
            else:
                r["memtracker_status"] = got.get("error")
        _stop_pool(pool)
        # a prediction that failed in a worker (say, a GPU in exclusive-process mode refusing
        # the workers a CUDA context) is retried here while time is left
        for r in rows:
            if "predict failed" in r.get("status", "") and time.perf_counter() < deadline - 15:
                r["status"] = r["status"].split("predict failed")[0].strip()
                r["predicted_in_process"] = True
                _merge_prediction(r, predict(r))
    for r in rows:
        notes.extend(n for n in r.pop("notes", []) if n not in notes)
    add_errors(rows)

    result = {"env": env, "configs": rows, "summary": summarize(rows), "notes": notes,
              "elapsed_s": round(time.perf_counter() - t0, 1), "quick": args.quick, "dry_run": args.dry_run}
    print()
    print("\n".join(table_lines(rows)))
    print()
    for name, s in result["summary"].items():
        if s.get("count"):
            print(f"{name:<24} n={s['count']:<3} median |err| {s['median_abs_error_pct']:>6}%   worst "
                  f"{s['worst_error_pct']:+.1f}% ({s['worst_config']})   under-estimates {s['under_estimates']}")
    hw = resultfile.hardware("cuda") if measure_gpu else resultfile.hardware("cpu")
    path = resultfile.save("estimate_accuracy", hw, result, args.out)
    path.with_suffix(".md").write_text(markdown(result))
    print(f"\nwrote {path} and its .md in {result['elapsed_s']} s")
    return 0


def take_measurements(rows: list[dict], measured: list[dict]) -> None:
    """Copy a GPU run's measurements onto this run's rows, configuration by configuration."""
    by_id = {m["id"]: m for m in measured}
    for r in rows:
        m = by_id.get(r["id"], {})
        r.update({k: v for k, v in m.items() if k.startswith("measured_") or k == "baseline_allocated_bytes"})


def add_errors(rows: list[dict]) -> None:
    for r in rows:
        r["error_allocated_pct"] = error_pct(r.get("peak_allocated_bytes"), r.get("measured_allocated_bytes"))
        r["error_reserved_pct"] = error_pct(r.get("peak_reserved_bytes"), r.get("measured_reserved_bytes"))
        # requested = bytes asked for, before the allocator's rounding: separates a wrong set
        # of tensors from a wrong allocator model
        r["error_requested_pct"] = error_pct(r.get("requested_peak_bytes"), r.get("measured_requested_bytes"))


def _merge_prediction(r: dict, got: dict) -> None:
    if got.get("ok"):
        got.pop("ok")
        r["predict_seconds"] = got.pop("seconds", None)
        r.update(got)
    else:
        r["status"] = (r.get("status", "") + " predict failed: " + got.get("error", "?")).strip()
        r["predict_trace"] = got.get("trace")


def _memtracker_cost(r: dict) -> tuple:
    size = {"vit-b16": 0, "resnet50": 1, "gpt2-124m": 2, "bert-base": 3, "gpt2-355m": 4, "bert-large": 5,
            "llama-1b": 6, "gpt2-774m": 7, "gpt2-1.5b": 8}
    return (size.get(r["model"], 9), r["mode"])


def _stop_pool(pool) -> None:
    """Cancel what has not started and end the workers this script started."""
    procs = list(getattr(pool, "_processes", {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()


if __name__ == "__main__":
    sys.exit(main())
