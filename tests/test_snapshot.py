"""The snapshot loader reads what torch.cuda.memory._dump_snapshot() writes, refuses
pickles that would run code, and turns a snapshot into a Run whose live bytes match the
allocator's."""
from __future__ import annotations

import builtins
import copy
import gzip
import json
import os
import pickle
import random
import shlex
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memdoctor.capture.snapshot import (
    SnapshotError, frame_name, load_snapshot, snapshot_to_run,
)
from memdoctor.run import Action, Run

MiB = 2**20
SEG1 = 0x7F00_0000_0000     # a segment that exists before the trace starts
SEG2 = 0x7F00_4000_0000     # a segment the trace allocates


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


# Innermost first, as torch records them: C++ frames, then torch's Python, then the user's.
MODEL_STACK = [
    frame("??", 0, "c10::cuda::CUDACachingAllocator::malloc"),
    frame("/venv/lib/python3.11/site-packages/torch/nn/functional.py", 2380, "linear"),
    frame("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 1527, "_call_impl"),
    frame("/home/me/model.py", 12, "forward"),
    frame("/home/me/train.py", 30, "main"),
]
INIT_STACK = [frame("/home/me/train.py", 8, "<module>")]
FREE_STACK = [frame("/home/me/train.py", 31, "main")]

P_REQ = 2 * MiB - 24   # allocated before the trace, alive at the end (size rounds up to 2 MiB)
Q = 1 * MiB            # allocated before the trace, freed in it
X, Y, Z = 4 * MiB, 1 * MiB, 3 * MiB
OOM_SIZE = 8 * 1024 * MiB


def entry(action, addr, size, t, frames=(), **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
         "frames": list(frames), "compile_context": "", "user_metadata": ""}
    e.update(extra)
    return e


def make_snapshot() -> dict:
    """A snapshot in the shape torch 2.x writes (see torch.cuda.memory._snapshot)."""
    shared = list(MODEL_STACK)        # torch shares one frames list between equal stacks
    trace = [
        entry("segment_alloc", SEG2, 20 * MiB, 100, MODEL_STACK),
        entry("free_requested", SEG1 + 2 * MiB, Q, 101, FREE_STACK),
        entry("free_completed", SEG1 + 2 * MiB, Q, 102, FREE_STACK),
        entry("alloc", SEG2, X, 103, shared, user_metadata="step 0"),
        entry("alloc", SEG2 + 4 * MiB, Y, 104, compile_context="N/A"),
        entry("free_requested", SEG2, X, 105, FREE_STACK),
        entry("free_completed", SEG2, X, 106, FREE_STACK),
        entry("alloc", SEG2, Z, 107, shared),
        {"action": "oom", "device_free": 5 * MiB, "size": OOM_SIZE, "stream": 0,
         "time_us": 108, "frames": shared},
        entry("snapshot", 0, 0, 109),
    ]

    def block(addr, size, state, requested=None, frames=()):
        return {"address": addr, "size": size, "requested_size": requested if requested is not None else size,
                "state": state, "frames": list(frames)}

    segments = [
        {"device": 0, "address": SEG1, "total_size": 20 * MiB, "allocated_size": 2 * MiB,
         "active_size": 2 * MiB, "requested_size": P_REQ, "stream": 0, "segment_type": "large",
         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
         "blocks": [block(SEG1, 2 * MiB, "active_allocated", P_REQ, INIT_STACK),
                    block(SEG1 + 2 * MiB, 18 * MiB, "inactive", 0)]},
        {"device": 0, "address": SEG2, "total_size": 20 * MiB, "allocated_size": Z + Y,
         "active_size": Z + Y, "requested_size": Z + Y, "stream": 0, "segment_type": "large",
         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
         "blocks": [block(SEG2, Z, "active_allocated", frames=MODEL_STACK),
                    block(SEG2 + Z, 1 * MiB, "inactive", 0),
                    block(SEG2 + 4 * MiB, Y, "active_allocated"),
                    block(SEG2 + 5 * MiB, 15 * MiB, "inactive", 0)]},
    ]
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
                               "max_split_size": -1, "garbage_collection_threshold": 0.0,
                               "expandable_segments": False, "roundup_power2_divisions": {"1": 0}},
        "external_annotations": [{"device": 0, "time_us": 103, "stage": "START", "name": "fwd"}],
    }


def live_bytes(run: Run, upto: int | None = None) -> int:
    """Replay the event columns: what a consumer of the Run sees."""
    total = 0
    for seq, action, _block, nbytes in run.events():
        if upto is not None and seq >= upto:
            break
        if action == Action.ALLOC:
            total += nbytes
        elif action == Action.FREE:
            total -= nbytes
    return total


def active_requested(snapshot: dict) -> int:
    return sum(b["requested_size"] for s in snapshot["segments"] for b in s["blocks"]
               if b["state"] == "active_allocated")


def write(tmp_path, data: bytes, name="snap.pickle"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def assert_one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert text and "\n" not in text and "Traceback" not in text
    return text


# ---- loading ----------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_loads_back_equal(tmp_path, protocol):
    snap = make_snapshot()
    path = write(tmp_path, pickle.dumps(snap, protocol=protocol))
    assert load_snapshot(path) == snap


def test_json_is_detected_by_content(tmp_path):
    snap = make_snapshot()
    path = write(tmp_path, b"  \n" + json.dumps(snap).encode(), name="snap.pickle")
    loaded = load_snapshot(path)
    assert loaded == json.loads(json.dumps(snap))      # tuples come back as lists
    a, b = snapshot_to_run(loaded), snapshot_to_run(snap)
    assert (a.actions, a.event_blocks, a.event_bytes) == (b.actions, b.event_blocks, b.event_bytes)


def test_gzip_compressed_pickle(tmp_path):
    snap = make_snapshot()
    path = write(tmp_path, gzip.compress(pickle.dumps(snap)), name="snap.pickle.gz")
    assert load_snapshot(path) == snap


# ---- conversion -------------------------------------------------------------------------
def test_run_from_snapshot():
    snap = make_snapshot()
    run = snapshot_to_run(snap)
    assert run.source == "allocator"
    by_addr = {}
    for b in run.blocks.values():
        by_addr.setdefault(b.address, []).append(b)

    # Alive before the trace: Q (freed during it) and P (still allocated at the end) come
    # first, as allocations at seq 0 and 1.
    q, = by_addr[SEG1 + 2 * MiB]
    p, = by_addr[SEG1]
    assert (q.alloc_seq, p.alloc_seq) == (0, 1)
    assert q.nbytes == Q and p.nbytes == P_REQ
    assert p.free_seq is None and p.name == "train.py:8 <module>"
    assert run.actions[:2] == [Action.ALLOC, Action.ALLOC]

    x, z = sorted(by_addr[SEG2], key=lambda b: b.alloc_seq)
    y, = by_addr[SEG2 + 4 * MiB]
    assert (x.nbytes, y.nbytes, z.nbytes) == (X, Y, Z)
    assert x.name == "model.py:12 forward" and z.name == x.name and y.name == ""
    assert x.free_seq is not None and y.free_seq is None and z.free_seq is None
    assert q.free_seq < x.alloc_seq < y.alloc_seq < x.free_seq < z.alloc_seq
    assert all(b.device == "cuda:0" and b.category == "other" for b in run.blocks.values())

    # Each event points at its block, with that block's bytes.
    for seq, action, bid, nbytes in run.events():
        if action == Action.ALLOC:
            assert run.blocks[bid].alloc_seq == seq and run.blocks[bid].nbytes == nbytes
        elif action == Action.FREE:
            assert run.blocks[bid].free_seq == seq and run.blocks[bid].nbytes == nbytes

    oom, = run.ooms
    assert oom.requested_bytes == OOM_SIZE
    assert "5.00 MiB" in oom.message and "8.00 GiB" in oom.message
    assert run.actions[oom.seq] == Action.OOM and run.event_blocks[oom.seq] == -1
    assert oom.live_bytes == live_bytes(run, oom.seq) == P_REQ + Y + Z

    assert live_bytes(run) == active_requested(snap) == P_REQ + Y + Z
    assert run.device["allocator_settings"] == snap["allocator_settings"]
    assert run.device["reserved_bytes"] == 40 * MiB
    assert run.meta["snapshot"]["blocks_before_trace"] == 2
    assert run.meta["snapshot"]["block_context"] == [[x.id, "", "step 0"]]
    assert run.meta["snapshot"]["external_annotations"][0]["name"] == "fwd"
    assert [m.seq for m in run.marks] == [0]


def test_reserved_samples_follow_segment_events():
    run = snapshot_to_run(make_snapshot())
    first, grow, last = run.samples
    assert (first.seq, first.reserved) == (2, 20 * MiB)        # before the trace: SEG1 only
    assert grow.reserved == 40 * MiB and last.reserved == 40 * MiB
    assert last.seq == run.num_events and last.allocated == P_REQ + Y + Z


def test_segments_are_compact():
    run = snapshot_to_run(make_snapshot())
    s1, s2 = run.segments
    assert s1["address"] == SEG1 and s1["total_size"] == 20 * MiB
    assert s1["segment_type"] == "large" and s1["stream"] == 0
    assert s1["blocks"] == [{"size": 2 * MiB, "state": "active_allocated"},
                            {"size": 18 * MiB, "state": "inactive"}]
    assert s2["largest_inactive"] == 15 * MiB and s2["inactive_size"] == 16 * MiB
    assert "frames" not in json.dumps(run.segments)


def test_segment_blocks_are_capped():
    snap = make_snapshot()
    seg = snap["segments"][0]
    seg["blocks"] = [{"address": SEG1 + i * 512, "size": 512, "requested_size": 0,
                      "state": "inactive", "frames": []} for i in range(5000)]
    run = snapshot_to_run(snap)
    compact = run.segments[0]
    assert len(compact["blocks"]) < 5000 and compact["blocks_omitted"] == 5000 - len(compact["blocks"])
    assert compact["inactive_size"] == 5000 * 512


def test_run_survives_save_and_load(tmp_path):
    run = snapshot_to_run(make_snapshot())
    run.save(tmp_path / "r.memrun.json.gz")
    back = Run.load(tmp_path / "r.memrun.json.gz")
    assert back.actions == run.actions and back.blocks == run.blocks and back.ooms == run.ooms


def test_free_requested_used_when_no_completed_events():
    snap = make_snapshot()
    snap["device_traces"][0] = [e for e in snap["device_traces"][0] if e["action"] != "free_completed"]
    run = snapshot_to_run(snap)
    assert run.meta["snapshot"]["free_action"] == "free_requested"
    assert live_bytes(run) == active_requested(snap)
    assert sum(1 for a in run.actions if a == Action.FREE) == 2


def test_block_awaiting_another_stream_stays_live():
    """Freed by the program, still used by another stream: busy until free_completed."""
    snap = make_snapshot()
    snap["device_traces"][0].insert(-2, entry("free_requested", SEG2 + 4 * MiB, Y, 107))
    snap["segments"][1]["blocks"][2]["state"] = "active_pending_free"
    run = snapshot_to_run(snap)
    y, = [b for b in run.blocks.values() if b.address == SEG2 + 4 * MiB]
    assert y.free_seq is None
    assert live_bytes(run) == P_REQ + Y + Z


def test_torch_2_0_block_history_format():
    """torch 2.0 blocks had no address or frames: 'history' held them."""
    snap = make_snapshot()
    seg = snap["segments"][0]
    seg["blocks"] = [
        {"size": 2 * MiB, "requested_size": P_REQ, "state": "active_allocated",
         "history": [{"addr": SEG1, "real_size": P_REQ, "frames": INIT_STACK}]},
        {"size": 18 * MiB, "requested_size": 0, "state": "inactive"},
    ]
    for e in snap["device_traces"][0]:
        e.pop("time_us", None)
    run = snapshot_to_run(snap)
    p, = [b for b in run.blocks.values() if b.address == SEG1]
    assert p.nbytes == P_REQ and p.name == "train.py:8 <module>"
    assert live_bytes(run) == P_REQ + Y + Z


def test_address_reused_without_recorded_free():
    snap = make_snapshot()
    snap["device_traces"][0] = [entry("alloc", SEG2, X, 1), entry("alloc", SEG2, Z, 2)]
    snap["segments"] = snap["segments"][1:]
    snap["segments"][0]["blocks"][2]["state"] = "inactive"
    run = snapshot_to_run(snap)
    assert run.meta["snapshot"]["implied_frees"] == 1
    assert live_bytes(run) == Z


def test_picks_device_and_rejects_missing_one():
    snap = make_snapshot()
    other = copy.deepcopy(snap["device_traces"][0])
    snap["device_traces"] = [[], other]
    for s in snap["segments"]:
        s["device"] = 1
    run = snapshot_to_run(snap)
    assert run.device["index"] == 1 and live_bytes(run) == P_REQ + Y + Z
    assert snapshot_to_run(snap, device=1).actions == run.actions
    with pytest.raises(SnapshotError) as exc:
        snapshot_to_run(snap, device=5)
    assert "device 5" in assert_one_line(exc)


def test_snapshot_without_trace():
    snap = make_snapshot()
    snap["device_traces"] = [[]]
    run = snapshot_to_run(snap)
    assert live_bytes(run) == active_requested(snap)
    assert sorted(b.alloc_seq for b in run.blocks.values()) == [0, 1, 2] and run.ooms == []


def test_damaged_snapshot_raises_snapshot_error():
    snap = make_snapshot()
    snap["device_traces"][0][3]["size"] = "four"
    with pytest.raises(SnapshotError) as exc:
        snapshot_to_run(snap)
    assert "damaged" in assert_one_line(exc)


def test_frame_name_prefers_user_code():
    assert frame_name(MODEL_STACK) == "model.py:12 forward"
    lib = [frame("/usr/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py", 7, "forward")]
    assert frame_name(MODEL_STACK[:3] + lib) == "modeling_llama.py:7 forward"
    assert frame_name(MODEL_STACK[:3]) == "functional.py:2380 linear"     # no user frame
    assert frame_name(MODEL_STACK[:1]) == "??:0 c10::cuda::CUDACachingAllocator::malloc"


# ---- refusing code ----------------------------------------------------------------------
class SystemPayload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


class EvalPayload(SystemPayload):
    def __reduce__(self):
        return (builtins.eval, (f"open({self.marker!r}, 'w').close()",))


class SubprocessPayload(SystemPayload):
    def __reduce__(self):
        return (subprocess.call, (["touch", self.marker],))


PAYLOADS = [SystemPayload, EvalPayload, SubprocessPayload]


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_code_in_pickle_is_refused(tmp_path, payload, protocol):
    marker = tmp_path / "pwned"
    snap = make_snapshot()
    snap["segments"][0]["blocks"][0]["frames"] = [payload(str(marker))]   # hidden deep inside
    path = write(tmp_path, pickle.dumps(snap, protocol=protocol))
    with pytest.raises(SnapshotError) as exc:
        load_snapshot(path)
    text = assert_one_line(exc)
    assert "refused" in text and "code" in text
    assert not marker.exists()


def test_payload_is_live(tmp_path):
    """The payloads above do run under plain pickle.load: the refusal is what stops them."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(EvalPayload(str(marker))))
    assert marker.exists()


@pytest.mark.parametrize("data", [
    b"cos\nsystem\n(S'true'\ntR.",                   # protocol 0 by hand
    b"\x80\x02c__builtin__\neval\nq\x00.",           # a global, not even called
    b"\x80\x02\x82\x01.",                            # the extension registry
    b"\x80\x02K\x01Q.",                              # a persistent id
], ids=["global-reduce", "global", "ext1", "persid"])
def test_other_ways_to_name_objects_are_refused(tmp_path, data):
    with pytest.raises(SnapshotError) as exc:
        load_snapshot(write(tmp_path, data))
    assert_one_line(exc)


# Files built to exhaust memory or crash the interpreter rather than to run code: each must
# end in SnapshotError, quickly, in a process capped at 2 GiB of address space.
CRAFTED = {
    "memo index 2**31": b"\x80\x02]r\xff\xff\xff\x7f.",
    "text memo index": b"(lp99999999999\n.",
    "bytes8 of a TiB": b"\x80\x05\x8e" + (1 << 40).to_bytes(8, "little") + b"x.",
    "unicode of 4 GiB": b"\x80\x02X\xff\xff\xff\xff" + b"x.",
    "key nested 200k tuples deep": b"\x80\x04}N" + b"\x85" * 200_000 + b"Ns.",
    "tuple of tuples via memo": b"\x80\x04K\x01\x85\x94h\x00\x85.",
    "a set": b"\x80\x04\x8f\x94.",
    "reduce without a global": b"\x80\x02}]R.",
    "json nested 100k deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


def test_crafted_files_end_in_snapshot_error(tmp_path):
    for i, data in enumerate(CRAFTED.values()):
        write(tmp_path, data, f"c{i}.pickle")
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from memdoctor.capture.snapshot import load_snapshot, SnapshotError\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        load_snapshot(path)\n"
        "        print('loaded')\n"
        "    except SnapshotError as e:\n"
        "        print('SnapshotError', 'MemoryError' in str(e))\n"
    )
    paths = [str(tmp_path / f"c{i}.pickle") for i in range(len(CRAFTED))]
    out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["SnapshotError False"] * len(CRAFTED), dict(zip(CRAFTED, out.stdout.splitlines()))


def test_tuples_of_strings_are_refused(tmp_path):
    """Snapshots hold tuples only as segment_pool_id pairs of numbers; anything else in a
    tuple could nest keys deep enough to crash hashing, so it is refused."""
    data = pickle.dumps({"segments": [], "device_traces": [], "x": ("a", "b")})
    with pytest.raises(SnapshotError) as exc:
        load_snapshot(write(tmp_path, data))
    assert "tuple" in assert_one_line(exc)


# ---- bad files --------------------------------------------------------------------------
def test_bad_files_give_one_line(tmp_path):
    good = pickle.dumps(make_snapshot(), protocol=4)
    rng = random.Random(1)
    cases = {
        "truncated": write(tmp_path, good[: len(good) // 2], "t.pickle"),
        "random": write(tmp_path, bytes(rng.randrange(256) for _ in range(4096)), "r.pickle"),
        "empty": write(tmp_path, b"", "e.pickle"),
        "not a snapshot": write(tmp_path, pickle.dumps([1, 2, 3]), "l.pickle"),
        "broken json": write(tmp_path, b'{"segments": [', "j.json"),
        "bad gzip": write(tmp_path, b"\x1f\x8b" + b"\x00" * 30, "g.gz"),
        "directory": tmp_path,
        "missing": tmp_path / "nope.pickle",
    }
    for what, path in cases.items():
        with pytest.raises(SnapshotError) as exc:
            load_snapshot(path)
        assert_one_line(exc)
        assert str(path) in str(exc.value), what


def test_size_cap(tmp_path):
    path = write(tmp_path, pickle.dumps(make_snapshot()))
    with pytest.raises(SnapshotError) as exc:
        load_snapshot(path, max_bytes=1000)
    assert "limit" in assert_one_line(exc)
    gz = write(tmp_path, gzip.compress(b"\x00" * 100_000), "bomb.gz")
    with pytest.raises(SnapshotError) as exc:
        load_snapshot(gz, max_bytes=10_000)
    assert "limit" in assert_one_line(exc)


def test_no_traceback_from_the_command_line(tmp_path):
    """What a user sees: one line on stderr, from a fresh interpreter."""
    path = write(tmp_path, b"\x80\x04garbage")
    code = ("import sys\nfrom memdoctor.capture.snapshot import load_snapshot, SnapshotError\n"
            "try:\n    load_snapshot(sys.argv[1])\nexcept SnapshotError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.count("\n") == 1 and not out.stderr


_TMP = {}


def _load_bytes(tmp_path_factory, data: bytes) -> None:
    folder = _TMP.get("dir") or _TMP.setdefault("dir", tmp_path_factory.mktemp("fuzz"))
    path = folder / "f.bin"
    path.write_bytes(data)
    try:
        snap = load_snapshot(path)
    except SnapshotError as exc:
        assert "\n" not in str(exc)
        return
    try:
        snapshot_to_run(snap)
    except SnapshotError as exc:
        assert "\n" not in str(exc)


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.binary(max_size=512) | st.binary(max_size=256).map(lambda b: b"\x80\x04" + b)
       | st.binary(max_size=256).map(lambda b: b"{" + b))
def test_random_bytes_raise_only_snapshot_error(tmp_path_factory, data):
    _load_bytes(tmp_path_factory, data)


_VALID = pickle.dumps(make_snapshot(), protocol=4)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.integers(1, len(_VALID)))
def test_damaged_pickles_raise_only_snapshot_error(tmp_path_factory, flips, cut):
    data = bytearray(_VALID)
    for at, value in flips:
        data[at] = value
    _load_bytes(tmp_path_factory, bytes(data[:cut]))


# ---- a real allocator (run on a GPU) ---------------------------------------------------
def _record(tmp_path, max_entries, work):
    import torch
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        kept = work(torch)
        path = tmp_path / "real.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path, kept


def _work(torch):
    kept = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 1 << 20, 3 << 20 | 7)]
    for _ in range(3):
        scratch = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        del scratch
    try:
        torch.empty(1 << 46, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    return kept


@pytest.mark.gpu
def test_real_snapshot(tmp_path):
    path, kept = _record(tmp_path, 100_000, _work)
    snap = load_snapshot(path)
    run = snapshot_to_run(snap)
    assert live_bytes(run) == active_requested(snap)
    assert run.ooms and run.ooms[-1].requested_bytes == 1 << 46
    assert "block_context" not in run.meta["snapshot"]      # torch writes "N/A" when unset
    # the three kept tensors are named by this file's frame (blocks of earlier GPU tests in
    # the same process may also be alive, named by theirs)
    named = {b.nbytes for b in run.blocks.values() if "test_snapshot.py" in b.name}
    assert {1000, 1 << 20, 3 << 20 | 7} <= named, sorted((b.nbytes, b.name) for b in run.blocks.values())
    assert run.device["allocator_settings"] is not None or "allocator_settings" not in snap
    del kept


@pytest.mark.gpu
def test_real_snapshot_with_a_short_ring_buffer(tmp_path):
    """Only the last few entries survive: the rest must come from the segments."""
    path, kept = _record(tmp_path, 3, _work)
    snap = load_snapshot(path)
    run = snapshot_to_run(snap)
    assert len(snap["device_traces"][run.device["index"]]) <= 3
    assert live_bytes(run) == active_requested(snap)
    assert run.meta["snapshot"]["blocks_before_trace"] >= 3
    del kept


def test_opcode_check_without_possessive_regex(tmp_path, monkeypatch):
    """Python 3.10 has no possessive quantifier; the bounded pattern must give the same."""
    import re
    from memdoctor.capture import snapshot as module
    monkeypatch.setattr(module, "_DATA_RUN", re.compile(rb"(?:" + module._DATA_OPS + rb"){0,1024}", re.S))
    snap = make_snapshot()
    snap["device_traces"][0] *= 500
    for protocol in (0, 2, 4):
        assert load_snapshot(write(tmp_path, pickle.dumps(snap, protocol=protocol))) == snap
    with pytest.raises(SnapshotError):
        load_snapshot(write(tmp_path, CRAFTED["memo index 2**31"]))
