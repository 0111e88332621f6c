"""Run memdoctor's command line on many inputs in one process under a memory cap, and
record for each its exit code, the bytes it wrote to stdout and stderr, and its seconds.

    python -m tests.support.cli_under_cap CASES.json RESULTS.json CAP_BYTES

CASES.json is a list of {"id", "argv", "env"}. The cap is set with RLIMIT_AS before
memdoctor is imported: a case that needs more memory fails its allocation (MemoryError,
"internal error", exit 4) instead of taking the machine. One process for all cases, so
torch is imported once; file descriptors 1 and 2 are redirected per case, so what is
recorded is what a terminal would receive.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import sys
import tempfile
import time


def run_case(cli, case: dict) -> dict:
    env = case.get("env") or {}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        start = time.perf_counter()
        try:
            code = cli(case["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException as exc:        # the driver reports it; the test fails on it
            code = f"raised {type(exc).__name__}: {exc}"
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        result = {"id": case["id"], "code": code, "seconds": seconds,
                  "stdout": out.read().decode("latin-1"), "stderr": err.read().decode("latin-1")}
    for k, v in old_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    gc.collect()
    result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def main(cases_path: str, results_path: str, cap: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    from memdoctor.cli.main import main as cli
    with open(cases_path) as fh:
        cases = json.load(fh)
    results = [run_case(cli, case) for case in cases]
    with open(results_path, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
