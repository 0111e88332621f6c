"""Device facts come from NVML when there is a GPU and degrade to {"available": False,
"reason": ...} when there is none, no driver, or no nvidia-ml-py; they never raise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from collections import namedtuple

import pytest

from memdoctor.cuda import nvml

GiB = 1024**3
KEYS = {"available", "name", "total_bytes", "used_bytes", "free_bytes", "driver_version", "processes"}


@pytest.fixture(autouse=True)
def fresh_nvml(monkeypatch):
    """Each test starts NVML afresh and leaves no fake module behind."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml._reset()
    yield
    nvml._reset()


def test_this_machine_never_raises():
    start = time.perf_counter()
    facts = nvml.device_facts()
    assert KEYS <= set(facts)
    if facts["available"]:         # a GPU machine: the numbers must add up
        assert facts["total_bytes"] >= facts["used_bytes"] >= 0 and facts["name"]
    else:
        assert facts["reason"] and facts["processes"] == []
        assert time.perf_counter() - start < 5
    assert nvml.other_process_bytes(facts) >= 0


def test_missing_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)     # makes `import pynvml` fail
    facts = nvml.device_facts(0)
    assert facts["available"] is False and "nvidia-ml-py" in facts["reason"]
    assert nvml.other_process_bytes(facts) == 0


def test_missing_nvidia_ml_py_in_a_fresh_interpreter():
    code = ("import sys, json; sys.modules['pynvml'] = None\n"
            "from memdoctor.cuda.nvml import device_facts\n"
            "print(json.dumps(device_facts()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["available"] is False and "nvidia-ml-py" in facts["reason"]


# ---- a fake nvidia-ml-py: one GPU, shared with other processes --------------------------
Proc = namedtuple("Proc", "pid usedGpuMemory")
Memory = namedtuple("Memory", "total free used")


class FakeNVMLError(Exception):
    pass


def fake_pynvml(*, init_error=None, memory_error=None, compute_error=None, count=1, uuids=None):
    """A stand-in for nvidia-ml-py's module with the calls memdoctor makes."""
    me = os.getpid()
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.init_calls = 0
    m.asked_for = []

    def nvmlInit():
        m.init_calls += 1
        if init_error:
            raise init_error

    def handle_by_index(i):
        if not 0 <= i < count:
            raise FakeNVMLError("Invalid Argument")
        m.asked_for.append(i)
        return f"handle{i}"

    def memory_info(handle):
        if memory_error:
            raise memory_error
        return Memory(total=80 * GiB, free=20 * GiB, used=60 * GiB)

    def compute(handle):
        if compute_error:
            raise compute_error
        return [Proc(me, 10 * GiB), Proc(4242, 30 * GiB)]

    def graphics(handle):
        return [Proc(4242, 30 * GiB), Proc(777, None)]

    def process_name(pid):
        if pid == 777:
            raise FakeNVMLError("Insufficient Permissions")
        return b"python" if pid == me else "other-job"

    m.nvmlInit = nvmlInit
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = handle_by_index
    m.nvmlDeviceGetUUID = lambda h: (uuids or {}).get(h, "GPU-00000000")
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = memory_info
    m.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    m.nvmlDeviceGetComputeRunningProcesses = compute
    m.nvmlDeviceGetGraphicsRunningProcesses = graphics
    m.nvmlSystemGetProcessName = process_name
    return m


def use(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_facts_from_a_gpu_shared_with_others(monkeypatch):
    use(monkeypatch, fake_pynvml())
    facts = nvml.device_facts(0)
    assert facts["available"] is True and "reason" not in facts
    assert facts["name"] == "NVIDIA H100 80GB HBM3" and facts["driver_version"] == "550.54.15"
    assert (facts["total_bytes"], facts["used_bytes"], facts["free_bytes"]) == (80 * GiB, 60 * GiB, 20 * GiB)
    procs = {p["pid"]: p for p in facts["processes"]}
    assert set(procs) == {os.getpid(), 4242, 777}          # 4242 is in both lists, once here
    assert procs[os.getpid()] == {"pid": os.getpid(), "bytes": 10 * GiB, "name": "python",
                                  "is_self": True, "type": "compute"}
    assert procs[4242]["type"] == "compute+graphics" and procs[4242]["name"] == "other-job"
    assert procs[777]["name"] is None and procs[777]["bytes"] is None    # not ours to read
    assert nvml.other_process_bytes(facts) == 30 * GiB
    json.dumps(facts)      # facts go into run files as they are


def test_init_runs_once(monkeypatch):
    fake = use(monkeypatch, fake_pynvml())
    nvml.device_facts(0)
    nvml.device_facts(0)
    assert fake.init_calls == 1


def test_driver_missing(monkeypatch):
    fake = use(monkeypatch, fake_pynvml(init_error=FakeNVMLError("NVML Shared Library Not Found")))
    facts = nvml.device_facts(0)
    assert facts["available"] is False and "NVML Shared Library Not Found" in facts["reason"]
    nvml.device_facts(0)
    assert fake.init_calls == 1          # a failed start is not retried on every call


def test_failures_inside_calls_become_reasons(monkeypatch):
    use(monkeypatch, fake_pynvml(memory_error=FakeNVMLError("GPU is lost")))
    facts = nvml.device_facts(0)
    assert facts["available"] is False and "GPU is lost" in facts["reason"]


def test_process_list_failure_keeps_the_rest(monkeypatch):
    use(monkeypatch, fake_pynvml(compute_error=FakeNVMLError("Not Supported")))
    facts = nvml.device_facts(0)
    assert facts["available"] is True
    assert {p["pid"] for p in facts["processes"]} == {4242, 777}


def test_bad_index_is_not_available(monkeypatch):
    use(monkeypatch, fake_pynvml())
    facts = nvml.device_facts(3)
    assert facts["available"] is False and "Invalid Argument" in facts["reason"]


def test_unexpected_exception_types_are_contained(monkeypatch):
    fake = use(monkeypatch, fake_pynvml())
    fake.nvmlDeviceGetMemoryInfo = lambda h: object()        # no .total: AttributeError
    facts = nvml.device_facts(0)
    assert facts["available"] is False and facts["reason"]


def test_cuda_visible_devices_maps_to_nvml_index(monkeypatch):
    fake = use(monkeypatch, fake_pynvml(count=4, uuids={"handle2": "GPU-abcdef12-3456"}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert nvml.device_facts(1)["available"] and fake.asked_for[-1] == 1
    nvml.device_facts(0)
    assert fake.asked_for[-1] == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abcdef12")
    assert nvml.device_facts(0)["available"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    facts = nvml.device_facts(1)
    assert facts["available"] is False and "not visible" in facts["reason"]


def test_nvml_call_returns_not_available(monkeypatch):
    use(monkeypatch, fake_pynvml())
    got = nvml.nvml_call("nvmlDeviceGetNoSuchThing", "h")
    assert isinstance(got, nvml.NotAvailable) and not got
    got = nvml.nvml_call("nvmlDeviceGetHandleByIndex", 9)
    assert isinstance(got, nvml.NotAvailable) and "Invalid Argument" in got.reason


@pytest.mark.gpu
def test_real_gpu():
    import torch
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    facts = nvml.device_facts(torch.cuda.current_device())
    assert facts["available"], facts.get("reason")
    assert facts["total_bytes"] >= torch.cuda.get_device_properties(0).total_memory
    assert facts["used_bytes"] >= held.numel() and facts["driver_version"]
    mine = [p for p in facts["processes"] if p["is_self"]]
    # Containers may hide processes or show host pids; when we are listed, we hold the GiB.
    assert all(p["bytes"] is None or p["bytes"] >= held.numel() for p in mine)
    print(json.dumps(facts))
