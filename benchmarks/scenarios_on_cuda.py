"""Our own OOM scenarios on a GPU, at the pressure their CPU budgets set.

usage (on a GPU machine, from the repository root):
    python benchmarks/scenarios_on_cuda.py [OUT.json] [--jobs N] [--only SCRIPT,...] [--runs DIR]

--only runs the named scripts' cases alone; --runs saves each case's diagnosed run in DIR
(SCRIPT[-ARGS].memrun.json.gz), to be read again anywhere with `memdoctor diagnose --run`.

Each scenario of tests/scenarios with a known cause (expected.json, and the loops that
tests/test_loops_elsewhere.py checks) runs with torch's default device set to cuda. Its
CUDA budget is its CPU budget plus what the GPU's traced peak adds to the CPU's (the same
script traced on both, no budget: cuBLAS's and cuDNN's workspaces, the allocator's
rounding, which do not grow with the cause), so it runs out about where it does on the
CPU; then `memdoctor diagnose` runs it there under that budget. What the GPU adds differs by
phase (autograd's thread takes its own cuBLAS workspace at its first backward), so
a case can run out a step earlier than on the CPU, before its cause has grown (the row
gives the step). Printed per case: the two peaks, the budget, where it ran out, the first
finding (expected first) and its first remedy's predicted peak; each case is also appended
to OUT.jsonl as it ends.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "tests" / "scenarios"

# (script, arguments, CPU budget, cause) as tests/test_loops_elsewhere.py checks them
LOOPS = [
    ("gan_two_optimizers.py", [], "56MiB", "model-states"),
    ("frozen_backbone.py", ["all"], "40MiB", "model-states"),
    ("head_outside_blocks.py", [], "180MiB", "large-logits"),
    ("checkpointed_blocks.py", ["non-reentrant"], "100MiB", "activations"),
    ("triplet_one_loss.py", [], "120MiB", "activations"),
    ("leak_through_retained_graph.py", [], "40MiB", "leak"),
    ("accumulate_then_step.py", [], "44MiB", "model-states"),
    ("validation_sums_loss_tensors.py", [], "150MiB", "eval-without-no-grad"),
    ("dataset_converted_on_device.py", [], "56MiB", "data-on-device"),
    ("leak_in_three_steps.py", [], "140MiB", "leak"),
    ("leak_in_two_steps.py", [], "240MiB", "leak"),
    ("leak_in_two_steps.py", ["reference"], "372MiB", "leak"),
    ("model_too_big_to_build.py", [], "200MiB", "model-states"),
    ("retain_graph_stray.py", [], "56MiB", "retained-graph"),
    ("frozen_network_requires_grad.py", ["loss-net"], "40MiB", "grads-never-stepped"),
    ("frozen_network_requires_grad.py", ["teacher"], "24MiB", "grads-never-stepped"),
    ("swa_predict_without_no_grad.py", [], "140MiB", "eval-without-no-grad"),
    ("prediction_pass_in_training_mode.py", [], "200MiB", "eval-without-no-grad"),
]

ON_CUDA = """import runpy, sys, torch
torch.set_default_device("cuda")
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def all_cases() -> list[tuple]:
    """(script, arguments, CPU budget, cause): expected.json's scenarios, then LOOPS."""
    expected = json.loads((SCENARIOS / "expected.json").read_text())
    return [(s, [], e["budget"], e["cause"]) for s, e in expected.items()] + LOOPS


def parse_bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def memdoctor(args: list[str], cpu: bool = False) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""        # scripts that pick cuda when they see one
    proc = subprocess.run([sys.executable, "-m", "memdoctor", *args], capture_output=True, text=True,
                          timeout=900, cwd=tempfile.mkdtemp(), env=env)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": (proc.stderr or proc.stdout)[-400:], "rc": proc.returncode}


def run_case(case: tuple, wrapper: str, runs: Path | None = None) -> dict:
    script, args, cpu_budget, cause = case
    path = str(SCENARIOS / script)
    cpu = memdoctor(["trace", path, "--json", "--", *args], cpu=True)
    cuda = memdoctor(["trace", wrapper, "--json", "--", path, *args])
    row = {"script": script, "args": args, "cause": cause, "cpu_budget": parse_bytes(cpu_budget)}
    if not cpu or not cuda or "error" in cpu or "error" in cuda or not cpu.get("peak_bytes"):
        row["error"] = (cpu or {}).get("error") or (cuda or {}).get("error") or "no CPU peak"
        return row
    row["cpu_peak"], row["cuda_peak"] = cpu["peak_bytes"], cuda["peak_bytes"]
    budget = row["cpu_budget"] + cuda["peak_bytes"] - cpu["peak_bytes"]
    row["cuda_budget"] = budget
    if budget <= 0:         # a script that names its device ("cpu") keeps its tensors off the GPU
        row["error"] = f"the script puts {cuda['peak_bytes']} bytes on the GPU: it names its own device"
        return row
    save = ["-o", str(runs / f"{'-'.join([Path(script).stem, *args])}.memrun.json.gz")] if runs else []
    out = memdoctor(["diagnose", wrapper, "--budget", str(budget), *save, "--json", "--", path, *args])
    if not out or "error" in out:
        row["error"] = (out or {}).get("error")
        return row
    ooms = out.get("ooms") or [{}]
    row["oom"], row["oom_phase"], row["oom_step"] = out.get("oom"), ooms[0].get("phase"), ooms[0].get("step")
    row["findings"] = [{"rule": f["rule"], "bytes": f["accounts_for_bytes"],
                        "remedy": (f["remedies"][0]["title"], f["remedies"][0]["predicted_peak_bytes"])
                        if f["remedies"] else None} for f in out["findings"][:3]]
    row["first"] = row["findings"][0]["rule"] if row["findings"] else None
    row["right"] = row["first"] == cause
    if not row["right"]:
        row["diagnosis"] = out
    return row


def main() -> int:
    argv = sys.argv[1:]
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    jobs = 6
    if "--jobs" in argv:
        at = argv.index("--jobs")
        jobs = int(argv[at + 1])
        del argv[at:at + 2]
    only, runs = None, None
    if "--only" in argv:
        at = argv.index("--only")
        only = set(argv[at + 1].split(","))
        del argv[at:at + 2]
    if "--runs" in argv:
        at = argv.index("--runs")
        runs = Path(argv[at + 1]).resolve()
        runs.mkdir(parents=True, exist_ok=True)
        del argv[at:at + 2]
    out_path = Path(argv[0]) if argv else None
    cases = [c for c in all_cases() if only is None or c[0] in only]
    wrapper = os.path.join(tempfile.mkdtemp(), "on_cuda.py")
    Path(wrapper).write_text(ON_CUDA)
    def safe(case):
        try:
            row = run_case(case, wrapper, runs)
        except Exception as exc:        # one case's failure must not lose the others
            row = {"script": case[0], "args": case[1], "cause": case[3], "error": repr(exc)}
        if out_path:
            with open(out_path.with_suffix(".jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        return row
    with ThreadPoolExecutor(jobs) as pool:
        rows = list(pool.map(safe, cases))
    for r in rows:
        name = r["script"] + ("[" + " ".join(r["args"]) + "]" if r["args"] else "")
        if "error" in r:
            print(f"ERROR {name}: {r['error']}")
            continue
        mark = "ok " if r["right"] else "BAD"
        print(f"{mark} {name:48s} cpu {r['cpu_peak'] / 2**20:7.1f} MiB  cuda {r['cuda_peak'] / 2**20:7.1f} MiB  "
              f"budget {r['cuda_budget'] / 2**20:7.1f} MiB  oom {r['oom']} {r['oom_phase']} {r['oom_step']}  "
              f"first {r['first']} (expected {r['cause']})")
        for f in r["findings"]:
            print(f"      {f['rule']} {f['bytes'] / 2**20:.1f} MiB {f['remedy']}")
    right = sum(1 for r in rows if r.get("right"))
    print(f"{right}/{len(rows)} named first as expected")
    if out_path:
        out_path.write_text(json.dumps({"cases": rows, "right": right, "total": len(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
