"""Where a benchmark saves its result: results/<bench>_<hardware>_<date>.json, holding the
command, commit and versions that made it, so a figure can be traced to what produced it."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def hardware(device: str = "cpu", count: int = 1) -> str:
    """A short name for what the figure was measured on: "h200" (or "h200x2" for two GPUs)
    on CUDA, "cpu2" for a CPU of two cores."""
    if device.startswith("cuda"):
        import torch
        name = torch.cuda.get_device_name(0).split()[-1].lower()
        return name + (f"x{count}" if count > 1 else "")
    return f"cpu{os.cpu_count()}"


def path(bench: str, hw: str, out: str | Path | None = None) -> Path:
    """results/<bench>_<hw>_<today>.json, or the same name under `out`."""
    folder = Path(out) if out else RESULTS
    return folder / f"{bench}_{hw}_{datetime.date.today().isoformat()}.json"


def provenance() -> dict:
    """The command, commit and versions behind a result."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    if os.environ.get("BENCH_COMMIT"):      # a copy of the tree whose .git is not the checkout's (a GPU machine)
        commit, dirty = os.environ["BENCH_COMMIT"], None
    versions = {"python": platform.python_version()}
    for name in ("torch", "transformers", "triton", "plotly", "textual"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", None)
    argv = [os.path.relpath(sys.argv[0], ROOT) if sys.argv and sys.argv[0].endswith(".py") else "", *sys.argv[1:]]
    return {"command": " ".join(["python", *argv]).strip(), "commit": commit, "uncommitted_changes": dirty,
            "versions": versions}


def save(bench: str, hw: str, data: dict, out: str | Path | None = None) -> Path:
    """Write `data` with its provenance to results/<bench>_<hw>_<today>.json."""
    target = path(bench, hw, out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({**provenance(), **data}, indent=1, default=str) + "\n")
    return target


def add_run(bench: str, hw: str, run: dict, out: str | Path | None = None) -> Path:
    """Append one run, with its provenance, to today's results/<bench>_<hw>_<today>.json
    ({"runs": [...]}): for a benchmark run once per configuration."""
    target = path(bench, hw, out)
    target.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(target.read_text())["runs"] if target.exists() else []
    runs.append({**provenance(), **run})
    target.write_text(json.dumps({"runs": runs}, indent=1, default=str) + "\n")
    return target


def results(bench: str, hw: str | None = None) -> list[Path]:
    """The committed results of a benchmark (on that hardware, if named), oldest first."""
    found = [p for p in RESULTS.glob(f"{bench}_*_????-??-??.json")
             if p.stem.rsplit("_", 2)[0] == bench and hw in (None, p.stem.rsplit("_", 2)[1])]
    return sorted(found, key=lambda p: p.stem.rsplit("_", 1)[1])


def latest(bench: str, hw: str | None = None) -> Path:
    """The newest committed result of a benchmark (on that hardware, if named)."""
    found = results(bench, hw)
    if not found:
        raise FileNotFoundError(f"no {bench} result under {RESULTS}")
    return found[-1]
