"""How long diagnosing a 1,000,000-event run takes, and how fast `memdoctor --help` starts.

    python benchmarks/diagnose_speed.py    # -> results/diagnose_speed_<hardware>_<date>.json
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resultfile  # noqa: E402

from memdoctor.run import Action, Block, Mark, Run


def synthetic_run(events: int = 1_000_000, seed: int = 0) -> Run:
    """A leaky training run: 200 steps of forward/backward/optimizer, a few blocks kept
    from every step."""
    rnd = random.Random(seed)
    run = Run(source="dispatch", budget_bytes=6 << 30, device={"type": "cpu"})
    live: list[int] = []
    steps = 200
    per_step = events // steps
    bid = 0
    for step in range(steps):
        for phase in ("forward", "backward", "optimizer", "other"):
            run.marks.append(Mark(len(run.actions), phase, step, "model" if phase == "forward" else None))
            for _ in range(per_step // 8):
                size = rnd.choice((4096, 65536, 1 << 20))
                b = Block(bid, size, "activations" if phase == "forward" else "temporaries", "aten.mm",
                          [size // 4], "float32", "cpu", "model.layer", phase, step, len(run.actions))
                run.blocks[bid] = b
                run.actions.append(Action.ALLOC); run.event_blocks.append(bid); run.event_bytes.append(size)
                live.append(bid)
                bid += 1
            while len(live) > 50 and len(run.actions) < (step + 1) * per_step:
                victim = live.pop(rnd.randrange(len(live)))
                if rnd.random() < 0.02:      # kept across steps: the leak
                    continue
                b = run.blocks[victim]
                b.free_seq = len(run.actions)
                run.actions.append(Action.FREE); run.event_blocks.append(victim); run.event_bytes.append(b.nbytes)
    return run


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    t0 = time.perf_counter()
    run = synthetic_run()
    build = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.memrun.json.gz")
        t0 = time.perf_counter()
        run.save(path)
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "memdoctor", "diagnose", "--run", path, "--json"],
                              capture_output=True, text=True)
        diagnose = time.perf_counter() - t0
        if proc.returncode not in (0, 3):
            raise SystemExit(f"memdoctor diagnose failed: {proc.stderr.strip()[-500:]}")
        findings = [f["rule"] for f in json.loads(proc.stdout)["findings"]]
    helps = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memdoctor", "--help"], capture_output=True)
        helps.append(time.perf_counter() - t0)
    result = {"events": run.num_events, "blocks": len(run.blocks), "build_s": round(build, 2),
              "save_s": round(save, 2), "diagnose_cli_s": round(diagnose, 2), "findings": findings,
              "help_s_median": round(sorted(helps)[2], 3)}
    print(json.dumps(result, indent=1))
    print("wrote", resultfile.save("diagnose_speed", resultfile.hardware("cpu"), result))


if __name__ == "__main__":
    main()
