"""Runs a worker function on 2 spawned CPU ranks over gloo and brings back each rank's result."""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

WORLD = 2
SPAWN_TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, worker: Callable, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    path = Path(out_dir)
    name = worker.__name__
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        except BaseException:
            (path / f"{name}-rank{rank}.init").write_text("")    # the rendezvous failed, not the work
            raise
        result = worker(torch.device("cpu"))
        torch.save(result, path / f"{name}-rank{rank}.pt")
        dist.barrier()    # neither rank tears gloo down while the other still talks to it
    except BaseException:
        (path / f"{name}-rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(worker: Callable) -> list[dict]:
    """Run `worker(device)` (a module-level function, so that it pickles) on 2 spawned gloo
    ranks; their results, or a failure with the traceback. A run that failed outside the
    test's code is tried once more: a failed rendezvous (the free port taken by another
    process meanwhile), or a rank killed by a signal without a Python traceback (gloo's
    threads now and then abort a process on a loaded 2-core machine)."""
    try:
        return _spawn_once(worker, retry=True)
    except _NotTheTestsFault:
        return _spawn_once(worker, retry=False)


class _NotTheTestsFault(Exception):
    pass


def _spawn_once(worker: Callable, retry: bool) -> list[dict]:
    import torch.multiprocessing as mp
    name = worker.__name__
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(WORLD, _free_port(), worker, out), nprocs=WORLD,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        try:
            while not ctx.join(timeout=max(min(deadline - time.monotonic(), 5.0), 0.1)):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    pytest.fail(f"{name}: the ranks did not finish in {SPAWN_TIMEOUT_S} s")
        except Exception as exc:   # a rank raised: show its traceback
            tracebacks = sorted(Path(out).glob("*.err"))
            rendezvous_failed = bool(list(Path(out).glob("*.init")))
            if retry and (rendezvous_failed or not tracebacks):
                raise _NotTheTestsFault() from exc
            errors = "\n".join(p.read_text() for p in tracebacks)
            pytest.fail(f"{name} failed on a rank:\n{errors or exc}")
        return [torch.load(Path(out) / f"{name}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
