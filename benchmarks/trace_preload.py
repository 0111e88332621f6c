"""What `memdoctor trace` costs on a script of many tiny forwards and no backward: a
parameterless nn.Module (torchvision's Normalize, as a dataset preloaded sample by sample
applies it) called 60,000 times on 1x28x28 tensors. Every sample is three ops, three new
storages and one outermost module call, so the per-op and per-call costs of the dispatch
source dominate.

The whole command is timed, as a user waits for it: `python script.py` against
`python -m memdoctor trace script.py` (startup, the script, the analysis and the saved run),
in rounds that run both (the order alternating) so that a machine shared with other work
slows them alike; medians of wall and CPU time (this process's children).

    python benchmarks/trace_preload.py            # -> results/trace_preload_<hardware>_<date>.json
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import resultfile  # noqa: E402

SCRIPT = '''import time, torch
from torch import nn
class Normalize(nn.Module):
    def forward(self, x):
        return (x - 0.1307) / 0.3081
norm = Normalize()
t0 = time.perf_counter()
data = [norm(torch.rand(1, 28, 28)) for _ in range({samples})]
print("preload", time.perf_counter() - t0)
'''


def timed(cmd: list[str], cwd: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `cmd`; raises if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="memdoctor-preload-") as folder:
        script = os.path.join(folder, "preload.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT.format(samples=args.samples))
        commands = {
            "plain": [sys.executable, script],
            "traced": [sys.executable, "-m", "memdoctor", "trace", script,
                       "-o", os.path.join(folder, "preload.memrun.json.gz")],
        }
        wall = {m: [] for m in commands}
        cpu = {m: [] for m in commands}
        load_before = os.getloadavg()
        for r in range(args.rounds):
            for name in (commands if r % 2 == 0 else list(commands)[::-1]):
                w, c = timed(commands[name], ROOT)
                wall[name].append(w)
                cpu[name].append(c)
        load_after = os.getloadavg()
    result = {
        "config": {"script": f"{args.samples} calls of a parameterless nn.Module ((x - 0.1307) / 0.3081) "
                             "on torch.rand(1, 28, 28), no backward",
                   "rounds": args.rounds, "timed": "the whole command, startup and saving included"},
        "wall_s": {m: {"median": round(statistics.median(v), 3), "all": [round(x, 3) for x in v]}
                   for m, v in wall.items()},
        "cpu_s": {m: {"median": round(statistics.median(v), 3), "all": [round(x, 3) for x in v]}
                  for m, v in cpu.items()},
        "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
    }
    for kind in ("wall_s", "cpu_s"):
        result[f"ratio_{kind[:-2]}"] = round(result[kind]["traced"]["median"] / result[kind]["plain"]["median"], 3)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=60000, help="module calls the script makes")
    p.add_argument("--rounds", type=int, default=3, help="runs of each command (medians reported)")
    p.add_argument("--out", help="output folder (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.samples < 1 or args.rounds < 1:
        p.error("--samples and --rounds must be at least 1")
    result = measure(args)
    import torch
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                         "python": platform.python_version(), "torch": torch.__version__}
    result["target"] = "traced under 2x plain (whole command, wall time)"
    print(f"{args.samples} forwards, median of {args.rounds}: plain {result['wall_s']['plain']['median']:.2f} s, "
          f"traced {result['wall_s']['traced']['median']:.2f} s wall ({result['ratio_wall']:.2f}x); "
          f"CPU {result['ratio_cpu']:.2f}x; load {result['load_average_before_after']}")
    print("wrote", resultfile.save("trace_preload", resultfile.hardware("cpu"), result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
