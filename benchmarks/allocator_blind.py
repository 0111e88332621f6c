"""Our scenarios diagnosed from what the allocator source records, on a machine with no GPU.

usage: python benchmarks/allocator_blind.py [OUT.json]

Each scenario with a known cause (as benchmarks/scenarios_on_cuda.py lists them), more of
the loops tests/test_loops_elsewhere.py runs, and each real-code case of tests/realworld
with a CPU budget (named by its case), is traced
on the CPU under its budget; the run is then stripped to what CUDA's allocator history and
memdoctor's owner claims give: a block made by an op keeps its size, its events, its mark
(phase, step, module) and its user's line, but loses its shape, dtype, op name and what
saved-tensor hooks said of it; the allocator source's own labelling then runs on it (what
outlives a forward is saved, a loss made before backward and freed by it too). Printed:
the first finding under both, for each case. What this cannot show: the allocator's rounding,
cuBLAS's and cuDNN's workspaces, an OOM placed elsewhere by them (scenarios_on_cuda.py on a
GPU measures those).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from scenarios_on_cuda import SCENARIOS, all_cases  # noqa: E402

OWNED = ("weights", "gradients", "optimizer_state", "inputs")
# more of tests/test_loops_elsewhere.py's loops, whose first finding there is what the tests
# check around (cause None: compared with what the CPU's dispatch source names first)
MORE = [("checkpointed_blocks.py", ["reentrant"], "100MiB", None), ("two_generators.py", [], "300MiB", None),
        ("triplet_conv_embedding.py", [], "64MiB", None), ("contrastive_two_towers.py", [], "230MiB", None),
        ("gradient_penalty.py", [], "60MiB", None), ("gradient_penalty.py", [], "84MiB", None),
        ("accumulate_grads_zeroed_in_place.py", [], "106MiB", None),
        ("frozen_network_requires_grad.py", ["teacher"], "20MiB", None),
        ("model_too_big_to_build.py", ["convert"], "200MiB", None)]


def blind(run) -> None:
    """Strip a dispatch run to what the allocator source knows, then label it as that does."""
    from memdoctor.capture.allocator import _freed_by_backward_are_activations, _outliving_forward_are_activations
    from memdoctor.run import Phase
    run.source = "allocator"
    nob, fwd = Phase.FORWARD_NO_BACKWARD.value, Phase.FORWARD.value
    relabelled = [x for x in list(run.blocks.values()) + run.marks if x.phase == nob]
    for x in relabelled:        # the allocator labels before passes without backward are told apart
        x.phase = fwd
    for b in run.blocks.values():
        if b.category in OWNED:
            continue
        b.category, b.shape, b.dtype, b.name = "temporaries", [], "", ""
    _freed_by_backward_are_activations(run)
    _outliving_forward_are_activations(run)
    for x in relabelled:
        x.phase = nob


def first_rules(run) -> list[str]:
    from memdoctor.diagnosis import diagnose, facts_from_run
    return [f.rule for f in diagnose(facts_from_run(run))][:3]


def run_case(script: str, args: list[str], budget: str, cause: str, cwd: Path | None = None) -> dict:
    from memdoctor.run import Run
    saved = Path(tempfile.mkdtemp()) / "run.memrun.json.gz"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    path = cwd / script if cwd is not None else SCENARIOS / script
    subprocess.run([sys.executable, "-m", "memdoctor", "trace", str(path), "--budget", budget,
                    "-o", str(saved), "--", *args], capture_output=True, timeout=900, cwd=cwd or saved.parent, env=env)
    row = {"script": script, "args": args, "budget": budget, "cause": cause}
    if not saved.exists():
        row["error"] = "no run saved"
        return row
    run = Run.load(saved)
    row["dispatch"] = first_rules(run)
    blind(run)
    row["allocator"] = first_rules(run)
    return row


def real_code_cases() -> list[tuple]:
    """tests/realworld's cases with a CPU budget, each prepared in a folder of its own as
    that test prepares it (its modules installed)."""
    from importlib.util import find_spec
    from tests.realworld.test_realworld import CASES, prepare
    found = []
    for case in CASES:
        if "cpu" not in case["budget"] or any(find_spec(m) is None for m in case.get("requires", [])):
            continue
        work = Path(tempfile.mkdtemp()) / case["name"]
        prepare(case, work)
        found.append((case["script"], case.get("args_cpu", case.get("args", [])), case["budget"]["cpu"],
                      case["cause"], work))
    return found


def main() -> int:
    cases = [(*c, None) for c in all_cases() + MORE]
    rows = []
    for case in cases + real_code_cases():
        row = run_case(*case[:4], cwd=case[4])
        if case[4] is not None:
            row["script"] = case[4].name
        rows.append(row)
        name = row["script"] + ("[" + " ".join(row["args"]) + "]" if row["args"] else "")
        if "error" in row:
            print(f"ERROR {name}: {row['error']}", flush=True)
            continue
        same = row["allocator"][:1] == row["dispatch"][:1]
        print(f"{'same' if same else 'DIFF'} {name:48s} expected {str(row['cause']):28s} dispatch {row['dispatch']} "
              f"allocator {row['allocator']}", flush=True)
    known = [r for r in rows if r["cause"] is not None]
    right = sum(1 for r in known if r.get("allocator", [None])[:1] == [r["cause"]])
    same = sum(1 for r in rows if r.get("allocator", [None])[:1] == r.get("dispatch", [0])[:1])
    print(f"allocator-blind: {right}/{len(known)} first as expected; dispatch: "
          f"{sum(1 for r in known if r.get('dispatch', [None])[:1] == [r['cause']])}/{len(known)}; "
          f"the same first finding under both: {same}/{len(rows)}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps({"cases": rows, "right": right, "total": len(known),
                                                 "same_under_both": same, "cases_run": len(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
