"""What the driver says about a GPU: name, capacity, memory in use, and which processes hold
it (so memdoctor can tell "your model does not fit" from "someone else is on your GPU").

The facts come from NVML through nvidia-ml-py (its module is `pynvml`). memdoctor must work
where there is no GPU, no driver, no NVML library or no permission to ask, so every NVML
call goes through `nvml_call`, which hands back a `NotAvailable` carrying the reason
instead of raising; `device_facts` then reports `available: False` with that reason.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Any

_lock = threading.Lock()
_started: tuple[Any, str | None] | None = None   # (pynvml module or None, reason), once


class NotAvailable:
    """What an NVML call returns instead of raising; false in a boolean test."""
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"NotAvailable({self.reason!r})"


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _start() -> tuple[Any, str | None]:
    """Import nvidia-ml-py and initialise NVML the first time; the outcome is kept, so a
    machine without a driver pays for the failed attempt once, not on every call."""
    global _started
    with _lock:
        if _started is not None:
            return _started
        try:
            with warnings.catch_warnings():
                # The deprecated `pynvml` distribution warns on import when it shadows
                # nvidia-ml-py's module of the same name; the calls are the same.
                warnings.simplefilter("ignore", FutureWarning)
                import pynvml
        except Exception as exc:      # ImportError, or a broken install failing on import
            _started = (None, f"nvidia-ml-py is not installed ({_describe(exc)})")
            return _started
        if not callable(getattr(pynvml, "nvmlInit", None)):
            _started = (None, "the installed pynvml module is not nvidia-ml-py (no nvmlInit)")
            return _started
        try:
            pynvml.nvmlInit()
        except Exception as exc:      # NVMLError (no library, no driver, ...), OSError
            _started = (None, f"NVML could not start: {_describe(exc)}")
            return _started
        _started = (pynvml, None)
        return _started


def _reset() -> None:
    """Forget the NVML start-up outcome (tests, or after a driver appears)."""
    global _started
    with _lock:
        _started = None


def nvml_call(name: str, *args: Any) -> Any:
    """`pynvml.<name>(*args)`, or a NotAvailable with the reason it could not be had."""
    lib, reason = _start()
    if lib is None:
        return NotAvailable(reason or "NVML is not available")
    fn = getattr(lib, name, None)
    if fn is None:
        return NotAvailable(f"{name} is not in this nvidia-ml-py")
    try:
        return fn(*args)
    except Exception as exc:
        return NotAvailable(f"{name}: {_describe(exc)}")


def _text(value: Any) -> str:
    """NVML strings are bytes in older nvidia-ml-py releases and str in newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _handle(index: int) -> Any:
    """The NVML handle of CUDA device `index`. CUDA numbers only the devices that
    CUDA_VISIBLE_DEVICES lets through, NVML numbers all of them, so a visible-devices
    list (indices or GPU-UUID prefixes) is translated the way torch.cuda does it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nvml_call("nvmlDeviceGetHandleByIndex", index)
    entries = []
    for item in visible.split(","):      # CUDA stops reading at the first invalid entry
        item = item.strip()
        if not item or item.startswith("-"):
            break
        entries.append(item)
    if not 0 <= index < len(entries):
        return NotAvailable(f"CUDA device {index} is not visible (CUDA_VISIBLE_DEVICES={visible!r})")
    entry = entries[index]
    if entry.isdigit():
        return nvml_call("nvmlDeviceGetHandleByIndex", int(entry))
    if entry.startswith("GPU-"):
        count = nvml_call("nvmlDeviceGetCount")
        if isinstance(count, NotAvailable):
            return count
        for i in range(count):
            handle = nvml_call("nvmlDeviceGetHandleByIndex", i)
            if isinstance(handle, NotAvailable):
                continue
            uuid = nvml_call("nvmlDeviceGetUUID", handle)
            if not isinstance(uuid, NotAvailable) and _text(uuid).startswith(entry):
                return handle
        return NotAvailable(f"no GPU matches {entry!r} from CUDA_VISIBLE_DEVICES")
    return NotAvailable(f"cannot map CUDA_VISIBLE_DEVICES entry {entry!r} (MIG?) to an NVML device")


def _processes(handle: Any) -> list[dict[str, Any]]:
    """Compute and graphics processes on the device, one entry per pid. A process that
    uses both kinds appears in both NVML lists with the same memory; it is counted once.
    In a container NVML reports host pids, so our own process may not be recognised."""
    me = os.getpid()
    by_pid: dict[int, dict[str, Any]] = {}
    for kind, call in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                       ("graphics", "nvmlDeviceGetGraphicsRunningProcesses")):
        procs = nvml_call(call, handle)
        if isinstance(procs, NotAvailable):
            continue
        for p in procs:
            pid = int(getattr(p, "pid", -1))
            used = getattr(p, "usedGpuMemory", None)   # None where NVML cannot tell (WDDM, MIG)
            entry = by_pid.get(pid)
            if entry is None:
                name = nvml_call("nvmlSystemGetProcessName", pid)
                by_pid[pid] = {"pid": pid, "bytes": None if used is None else int(used),
                               "name": None if isinstance(name, NotAvailable) else _text(name),
                               "is_self": pid == me, "type": kind}
            else:
                entry["type"] = "compute+graphics"
                if used is not None and (entry["bytes"] is None or used > entry["bytes"]):
                    entry["bytes"] = int(used)
    return list(by_pid.values())


def device_facts(index: int = 0) -> dict[str, Any]:
    """Facts about CUDA device `index` as the driver sees them. Never raises: without a
    GPU, a driver or NVML the result is {"available": False, "reason": ...} with the
    other keys present and empty."""
    facts: dict[str, Any] = {
        "available": False, "index": index, "name": None, "total_bytes": None,
        "used_bytes": None, "free_bytes": None, "driver_version": None, "processes": [],
    }
    try:
        handle = _handle(index)
        if isinstance(handle, NotAvailable):
            facts["reason"] = handle.reason
            return facts
        memory = nvml_call("nvmlDeviceGetMemoryInfo", handle)
        if isinstance(memory, NotAvailable):
            facts["reason"] = memory.reason
            return facts
        name = nvml_call("nvmlDeviceGetName", handle)
        driver = nvml_call("nvmlSystemGetDriverVersion")
        facts.update(
            available=True,
            name=None if isinstance(name, NotAvailable) else _text(name),
            total_bytes=int(memory.total), used_bytes=int(memory.used), free_bytes=int(memory.free),
            driver_version=None if isinstance(driver, NotAvailable) else _text(driver),
            processes=_processes(handle),
        )
    except Exception as exc:   # an odd nvidia-ml-py build must not break a diagnosis
        facts.update(available=False, processes=[], reason=f"NVML: {_describe(exc)}")
    return facts


def other_process_bytes(facts: dict[str, Any]) -> int:
    """Device memory held by processes other than this one (0 where unknown)."""
    return sum(p.get("bytes") or 0 for p in facts.get("processes") or () if not p.get("is_self"))
