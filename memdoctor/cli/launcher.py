"""Under a launcher (torchrun, accelerate launch) every rank runs memdoctor on its own
process: each saves its run with its rank in the file name, rank 0 waits for the other
ranks' files and speaks for all of them, and the other ranks print nothing but errors.

The run files meet beside each other, so the ranks need a folder they share (one machine,
or a shared file system). A rank whose file does not come within WAIT_S seconds is named
as missing and the others are diagnosed without it. The other ranks wait (as long) for
rank 0 to say it is done (an empty `.RUN.done` file beside the runs) before they exit: a launcher stops every rank as soon as one
exits with an error, an OOM's exit 3 included, which would cut rank 0 off mid-report.
"""
from __future__ import annotations

import os
import sys
import time

WAIT_S = float(os.environ.get("MEMDOCTOR_RANK_WAIT_S", "120"))
_POLL_S = 0.2
_STARTED = time.time()          # a rank's file older than this is left over from an earlier launch
_CLOCK_SLACK_S = 2.0


def launched(run) -> bool:
    """The run is one rank of several."""
    rank = run.meta.get("rank")
    return isinstance(rank, int) and not isinstance(rank, bool) and (run.meta.get("world_size") or 1) > 1


def speaks(run) -> bool:
    """Whether this process prints its results: alone, or rank 0 of several."""
    return not launched(run) or run.meta.get("rank") == 0


def save_for_rank(run, base: str) -> str:
    """Save `run` as its rank's file beside `base` (run.memrun.json.gz -> run.rank1.memrun.json.gz)."""
    from memdoctor.capture.ranks import path_for
    path = path_for(run, base)
    run.save(path)
    return path


def gather(run, base: str, wait_s: float | None = None) -> list[str]:
    """Rank 0: the run files of every rank of this launch, waiting up to `wait_s` seconds
    for those not written yet; missing ranks are named on stderr."""
    from memdoctor.capture.ranks import per_rank_path
    world = int(run.meta.get("world_size") or 1)
    wanted = {r: per_rank_path(base, r) for r in range(world)}
    deadline = time.monotonic() + (WAIT_S if wait_s is None else wait_s)
    found: dict[int, str] = {}
    while True:
        for rank, path in wanted.items():
            if rank not in found and _fresh(path):
                found[rank] = path
        if len(found) == world or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    missing = sorted(set(wanted) - set(found))
    if missing:
        print(f"memdoctor: no run file from rank{'s' if len(missing) > 1 else ''} "
              f"{', '.join(map(str, missing))} (looked for {wanted[missing[0]]}); diagnosing the others",
              file=sys.stderr)
    return [found[r] for r in sorted(found)]


def done(base: str) -> None:
    """Rank 0 has printed: the other ranks may exit."""
    from memdoctor.run import write_atomic
    write_atomic(_done_path(base), b"")


def release_peers(timeout_s: float = 10.0) -> None:
    """A rank whose script stopped (out of memory) leaves the others blocked in the collective it
    never joins (DDP's all-reduce), and they would wait for it as long as it waits for rank 0:
    ending its process group here makes their collective fail now, and rank 0 report. Ended
    in a thread, given up after `timeout_s` seconds (a backend that blocks on it)."""
    import threading
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return
    except Exception:
        return

    def end() -> None:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    thread = threading.Thread(target=end, daemon=True)
    thread.start()
    thread.join(timeout_s)


def wait_for_rank0(base: str, wait_s: float | None = None) -> None:
    """A rank other than 0: wait until rank 0 is done, or `wait_s` seconds."""
    deadline = time.monotonic() + (WAIT_S if wait_s is None else wait_s)
    while not _fresh(_done_path(base)) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def _done_path(base: str) -> str:
    folder, name = os.path.split(base)
    return os.path.join(folder, f".{name}.done")


def _fresh(path: str) -> bool:
    """Written during this launch: files are written whole (renamed into place), so one that
    exists and is newer than this process's start is complete and this launch's."""
    try:
        return os.path.getmtime(path) >= _STARTED - _CLOCK_SLACK_S
    except OSError:
        return False
