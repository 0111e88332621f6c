"""How fast `memdoctor diagnose --log` can find OOM messages in a large job log.

Writes a synthetic 100 MB training log to a temporary directory (timestamped per-rank
step lines, warnings, tracebacks, and an OOM of a different format every few MB), then
times `scan_file` on it. A second, smaller log in which every line mentions "out of
memory" without being an OOM measures the worst case: every line passes the cheap
needle filter and must be read closely. Prints the numbers and writes
results/oomlog_scan_<hardware>_<date>.json.

    python benchmarks/oomlog_scan.py [--mb 100] [--dense-mb 10]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from memdoctor.capture.oomlog import scan_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import resultfile  # noqa: E402

OOMS = [
    "[rank{r}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU {r} "
    "has a total capacity of 79.19 GiB of which 1.07 GiB is free. Process 4242 has 1.50 GiB "
    "memory in use. Including non-PyTorch memory, this process has 76.60 GiB memory in use. "
    "Of the allocated memory 74.23 GiB is allocated by PyTorch, and 943.54 MiB is reserved by "
    "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html"
    "#environment-variables)",
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU {r}; 7.79 GiB total "
    "capacity; 6.12 GiB already allocated; 2.44 MiB free; 6.31 GiB reserved in total by PyTorch)",
    "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
    "reported at some other API call, so the stacktrace below might be incorrect.",
    "gpu7:100:200 [{r}] include/alloc.h:103 NCCL WARN Cuda failure 'out of memory'",
]

TRACEBACK = ("Traceback (most recent call last):\n"
             '  File "/home/me/train.py", line 88, in <module>\n'
             "    loss = model(batch).loss\n")


def synthetic_log(path: Path, size: int, oom_every: int, seed: int = 0) -> tuple[int, int]:
    """Write about `size` bytes; return (bytes written, OOM messages written)."""
    rng = random.Random(seed)
    written = ooms = step = 0
    next_oom = oom_every
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            lines = []
            for _ in range(1000):
                step += 1
                rank = step % 8
                lines.append(
                    f"[2024-05-01 12:{step // 60 % 60:02d}:{step % 60:02d},{rng.randrange(1000):03d}]"
                    f"[INFO][rank{rank}] step {step} loss {rng.random() * 3:.4f} lr 3.0e-04 "
                    f"grad_norm {rng.random():.3f} mem_allocated {rng.uniform(10, 70):.1f}GiB "
                    f"mem_reserved {rng.uniform(70, 78):.1f}GiB tok/s {rng.randrange(30000, 45000)}")
                if step % 997 == 0:
                    lines.append(f"[rank{rank}]: UserWarning: torch.utils.checkpoint: the "
                                 "use_reentrant parameter should be passed explicitly")
            chunk = "\n".join(lines) + "\n"
            if written + len(chunk) >= next_oom:
                chunk += TRACEBACK + OOMS[ooms % len(OOMS)].format(r=ooms % 8) + "\n"
                ooms += 1
                next_oom += oom_every
            f.write(chunk)
            written += len(chunk.encode("utf-8"))
    return written, ooms


def dense_log(path: Path, size: int) -> int:
    """Every line mentions OOM in prose: nothing to find, everything to look at."""
    line = ("[2024-05-01 12:00:00,123][WARN][rank0] batch 17: retry after out of memory guard, "
            "reducing tokens to 4096\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(line * (size // len(line)))
    return os.path.getsize(path)


def timed_scan(path: Path) -> tuple[list, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    found = scan_file(path)
    return found, time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100, help="size of the main log (MB)")
    parser.add_argument("--dense-mb", type=float, default=10, help="size of the worst case (MB)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "train.log"
        start = time.perf_counter()
        size, ooms = synthetic_log(log, int(args.mb * 1e6), oom_every=5_000_000)
        build_s = time.perf_counter() - start
        found, scan_s, cpu_s = timed_scan(log)

        dense = Path(tmp) / "dense.log"
        dense_size = dense_log(dense, int(args.dense_mb * 1e6))
        dense_found, dense_s, dense_cpu_s = timed_scan(dense)

    result = {
        "benchmark": "oomlog_scan",
        "file_bytes": size,
        "ooms_written": ooms,
        "ooms_found": len(found),
        "build_s": round(build_s, 3),
        "scan_s": round(scan_s, 3),
        "scan_cpu_s": round(cpu_s, 3),
        "mb_per_s": round(size / 1e6 / scan_s, 1),
        "mb_per_cpu_s": round(size / 1e6 / cpu_s, 1),
        "dense_file_bytes": dense_size,
        "dense_ooms_found": len(dense_found),
        "dense_scan_s": round(dense_s, 3),
        "dense_mb_per_cpu_s": round(dense_size / 1e6 / dense_cpu_s, 1),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(f"{size / 1e6:.0f} MB log: {len(found)}/{ooms} OOMs in {scan_s:.2f} s "
          f"({result['mb_per_s']} MB/s wall, {result['mb_per_cpu_s']} MB/s CPU)")
    print(f"worst case, a needle on every line: {dense_size / 1e6:.0f} MB in {dense_s:.2f} s "
          f"({result['dense_mb_per_cpu_s']} MB/s CPU)")
    if len(found) != ooms or dense_found:
        print("error: wrong number of OOMs found", file=sys.stderr)
        raise SystemExit(1)
    print("wrote", resultfile.save("oomlog_scan", resultfile.hardware("cpu"), result))
    return result


if __name__ == "__main__":
    main()
