"""PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot()`): a loader that never
runs code from the file, and the conversion of a snapshot into a Run.

A snapshot is plain data (dicts, lists, tuples, strings, numbers), yet `pickle.load` builds
whatever objects a file names, and naming `os.system` is all a hostile pickle needs. Users
hand memdoctor snapshots from colleagues, clusters and bug reports, so the loader refuses
every class or function a pickle asks for. The same data saved as JSON is read too.
"""
from __future__ import annotations

import gc
import io
import json
import math
import os
import pickle
import pickletools
import re
import stat
import zlib
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from memdoctor.run import CATEGORIES, OOM, Action, Block, Category, Mark, Phase, Run, Sample
from memdoctor.runcheck import check_run
from memdoctor.capture.frames import SourceTable, snapshot_source
from memdoctor.limits import Allowance, ReadLimitError, gunzip, read_all
from memdoctor.units import MAX_SIZE, format_bytes

MAX_BYTES = 2 * 1024**3
# Blocks kept per segment in Run.segments; a 2 MiB small-pool segment can hold 4096 blocks
# and a long run thousands of segments. Totals and the largest free block cover them all.
SEGMENT_BLOCKS_CAP = 64
ANNOTATIONS_CAP = 10_000
PLAIN_CAP = 10_000          # values copied from the snapshot's settings and annotations, at most
# What converting builds, charged before it starts: per trace entry (a block, its events,
# its name), per block listed in segments (walked; a block when alive), per segment.
ENTRY_COST = 512
SEGMENT_BLOCK_COST = 256
SEGMENT_COST = 1024
_ACTIVE = "active_allocated"
# Freed by the program but still in use by another stream; the name changed across versions.
_PENDING = ("active_pending_free", "active_awaiting_free")


class SnapshotError(Exception):
    """A snapshot memdoctor cannot or will not read; the message is one line for the user."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@contextmanager
def _gc_paused():
    """Building millions of containers sets off full garbage collections over all of them,
    again and again, though none can be garbage yet: that doubles load and convert time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Refused(Exception):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class _DataOnlyUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers, and refuses every global. Calling
    anything (REDUCE, INST, OBJ, NEWOBJ) needs a callable, and every way for a pickle to
    name one (GLOBAL, STACK_GLOBAL, INST, the extension registry) goes through find_class."""

    def find_class(self, module: str, name: str):
        raise _Refused(f"{module}.{name}"[:80])


# ---- the opcode check before unpickling --------------------------------------------------
# Refusing globals stops code, not crashes. CPython's C unpickler sizes its memo table from
# the index a PUT names, so ten bytes can make it allocate tens of GiB (gh-115952, fixed
# only in recent releases), and it hashes dict keys, so a key nested a million tuples deep
# overflows the C stack. A
# snapshot never needs either, so every opcode is checked first, at regex speed: memo
# indices and lengths must fit the file, tuples may hold only numbers (so nothing hashable
# nests), and sets and object-building opcodes are refused outright.
_NUMBER = (rb"(?:K.|M..|J....|N|\x88|\x89|G.{8}|[IFL][^\n]*\n|\x8a(?:\x00|\x01.|\x02..|"
           rb"\x03...|\x04.{4}|\x05.{5}|\x06.{6}|\x07.{7}|\x08.{8}))")
_DATA_OPS = (
    rb"h.|\x94|j...."                                     # memo get, memoize
    rb"|" + _NUMBER + rb"(?:\x85|" + _NUMBER + rb"(?:[\x85\x86]|(?:" + _NUMBER + rb")+[\x85-\x87]?)?)?"
    rb"|\((?:" + _NUMBER + rb")*t"                        # a tuple of numbers after MARK
    rb"|[()}\]ldaesu012]"                                 # containers and stack ops
    rb"|[q\x80].|\x95.{8}|r..\x00\x00|[SVg][^\n]*\n"      # small memo puts, proto, frame, text
)
try:   # possessive: no backtracking state kept across millions of opcodes (Python 3.11+)
    _DATA_RUN = re.compile(rb"(?:" + _DATA_OPS + rb")*+", re.S)
except re.error:
    _DATA_RUN = re.compile(rb"(?:" + _DATA_OPS + rb"){0,1024}", re.S)
_COUNTED = {b"\x8c": 1, b"C": 1, b"U": 1, b"\x8a": 1, b"X": 4, b"B": 4, b"T": 4, b"\x8b": 4,
            b"\x8d": 8, b"\x8e": 8, b"\x96": 8}


def _opname(op: bytes) -> str:
    info = pickletools.code2op.get(op.decode("latin-1"))
    return info.name if info else f"0x{op.hex()}"


def _check_opcodes(data: bytes) -> None:
    """Walk the pickle's opcodes up to STOP; raise ValueError or _Refused on anything a
    snapshot cannot contain. Returns early at a global, which find_class then refuses."""
    pos, size, match = 0, len(data), _DATA_RUN.match
    while True:
        end = match(data, pos).end()
        if end != pos:          # the pattern without *+ stops every 1024 opcodes
            pos = end
            continue
        if pos >= size:
            raise ValueError("the pickle is truncated")
        op = data[pos:pos + 1]
        width = _COUNTED.get(op)
        if op == b"." or op in (b"c", b"i", b"\x93"):
            return
        if width is not None:
            length = int.from_bytes(data[pos + 1:pos + 1 + width], "little", signed=op in (b"T", b"\x8b"))
            pos += 1 + width + length
            if length < 0 or pos > size:
                raise ValueError(f"{_opname(op)} at byte {pos} runs past the end of the file")
        elif op == b"r" or op == b"p":
            if op == b"r":
                index, end = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
            else:
                end = data.find(b"\n", pos)
                digits = data[pos + 1:end] if end > 0 else b""
                index, end = (int(digits), end + 1) if digits.isdigit() and len(digits) < 12 else (-1, end)
            if not 0 <= index <= pos or end > size:
                raise ValueError(f"memo index at byte {pos} is out of range")
            pos = end
        elif op in (b"R", b"b", b"o", b"\x81", b"\x92", b"\x82", b"\x83", b"\x84",
                    b"P", b"Q", b"\x97", b"\x98"):
            raise _Refused(_opname(op))
        elif op in (b"\x85", b"\x86", b"\x87", b"t", b"\x8f", b"\x90", b"\x91"):
            raise ValueError(f"{_opname(op)} at byte {pos} builds a tuple or set of "
                             f"non-numbers, which a snapshot never holds")
        elif pickletools.code2op.get(op.decode("latin-1")):
            raise ValueError("the pickle is truncated")    # a known opcode cut short
        else:
            raise ValueError(f"unknown pickle opcode 0x{op.hex()} at byte {pos}")


def read_snapshot(path: str | os.PathLike, device: int | None = None) -> Run:
    """load_snapshot and snapshot_to_run within one memory limit for reading files."""
    allowance = Allowance(f"snapshot {os.fspath(path)!r}")
    return snapshot_to_run(load_snapshot(path, allowance=allowance), device, allowance=allowance)


def load_snapshot(path: str | os.PathLike, max_bytes: int = MAX_BYTES,
                  allowance: Allowance | None = None) -> dict:
    """The snapshot dict stored at `path`: a pickle (any protocol), JSON, or either
    gzip-compressed, told apart by content. Anything else raises SnapshotError. The file
    and what is built from it are charged to `allowance` (by default the limit for reading
    files, memdoctor.limits) before they are made: past it, ReadLimitError."""
    name = os.fspath(path)
    allowance = allowance or Allowance(f"snapshot {name!r}")
    try:
        info = os.stat(name)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotError(f"{name!r} is not a file")
        if info.st_size > max_bytes:
            raise SnapshotError(f"{name!r} is {format_bytes(info.st_size)}, over the "
                                f"{format_bytes(max_bytes)} limit for snapshots")
        with open(name, "rb") as fh:
            raw = read_all(fh, allowance)
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {name!r}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise SnapshotError(f"{name!r} is over the {format_bytes(max_bytes)} limit for snapshots")
    if not raw:
        raise SnapshotError(f"{name!r} is empty, not a PyTorch memory snapshot")
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(raw, max_bytes, name, allowance)
    data = _decode(raw, name, allowance)
    _check_shape(data, name)
    return data


def _gunzip(raw: bytes, max_bytes: int, name: str, allowance: Allowance) -> bytes:
    """Decompress within the allowance and at most max_bytes, so a small file cannot
    expand to fill memory."""
    cap = 2 * (max_bytes + 1)                   # gunzip charges each byte twice
    part = Allowance(allowance.what, min(allowance.limit - allowance.used, cap))
    try:
        out = gunzip(raw, part)
    except ReadLimitError:
        if part.limit < cap:
            allowance.charge(part.used)         # past the limit for reading files: say so
        raise SnapshotError(f"{name!r} expands past the {format_bytes(max_bytes)} limit for snapshots") from None
    except (zlib.error, EOFError) as exc:
        raise SnapshotError(f"{name!r} is a damaged gzip file ({exc})") from None
    allowance.charge(part.used)
    if not out:
        raise SnapshotError(f"{name!r} is an empty gzip file, not a PyTorch memory snapshot")
    return out


def _decode(raw: bytes, name: str, allowance: Allowance) -> Any:
    if raw[:64].lstrip()[:1] == b"{":
        allowance.charge_json(raw)
        try:
            with _gc_paused():
                return json.loads(raw)
        except (ValueError, RecursionError, MemoryError) as exc:   # bad JSON or UTF-8, deep nesting
            raise SnapshotError(f"{name!r} is not a readable snapshot: broken JSON ({exc})") from None
    allowance.charge_pickle(raw)
    try:
        _check_opcodes(raw)
        with _gc_paused():
            return _DataOnlyUnpickler(io.BytesIO(raw)).load()
    except _Refused as exc:
        raise SnapshotError(
            f"{name!r} was refused: it contains Python code or objects ({exc.what}), "
            f"not the plain data of a PyTorch memory snapshot; memdoctor never runs code "
            f"from a file") from None
    except Exception as exc:   # garbage reaches the unpickler's many error paths
        why = " ".join(str(exc).split())[:120] or "no detail"
        raise SnapshotError(
            f"{name!r} is not a readable PyTorch memory snapshot ({type(exc).__name__}: {why})") from None


def _check_shape(data: Any, name: str) -> None:
    if not isinstance(data, dict) or not ("segments" in data or "device_traces" in data):
        raise SnapshotError(f"{name!r} is not a PyTorch memory snapshot "
                            f"(no 'segments' or 'device_traces')")
    if not isinstance(data.get("segments", []), list):
        raise SnapshotError(f"{name!r} is a damaged snapshot: 'segments' is not a list")
    traces = data.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(f"{name!r} is a damaged snapshot: 'device_traces' is not a list of lists")


# ---- frames -----------------------------------------------------------------------------
@lru_cache(maxsize=8192)
def _is_user_file(filename: str) -> bool:
    """Python source outside PyTorch and the standard library: the code a user can change,
    their own or a model library's (the line in modeling_llama.py explains an activation
    better than the call into torch.nn.functional below it)."""
    if not filename.endswith(".py"):
        return False
    f = filename.replace("\\", "/")
    if "/torch/" in f or f.startswith("torch/") or "/functorch/" in f:
        return False
    if "/lib/python" in f and "-packages/" not in f:
        return False
    return True


def frame_name(frames: list) -> str:
    """"file.py:line function" of the innermost user frame (frames come innermost first),
    else of the innermost Python frame, else of the innermost frame at all."""
    first_py = None
    for f in frames:
        filename = f.get("filename") or ""
        if filename.endswith(".py"):
            if _is_user_file(filename):
                return _frame_text(f)
            if first_py is None:
                first_py = f
    return _frame_text(first_py or frames[0])


def _frame_text(f: dict) -> str:
    filename = (f.get("filename") or "?").replace("\\", "/").rsplit("/", 1)[-1]
    return f"{filename}:{f.get('line', '?')} {f.get('name') or '?'}"


def _block_frames(b: dict) -> list:
    """A segment block's allocation stack: 'frames' since torch 2.1, 'history' in 2.0."""
    frames = b.get("frames")
    if frames is None and b.get("history"):
        frames = b["history"][0].get("frames")
    return frames or []


def _block_bytes(b: dict) -> int:
    """What was asked for (as trace entries count it), not the 512-byte-rounded size."""
    requested = b.get("requested_size")
    if not requested and b.get("history"):
        requested = b["history"][0].get("real_size")
    return _int(requested or b["size"], "block size")


def _int(value: Any, what: str) -> int:
    """A size or an address: an int from 0 to int64's largest."""
    if type(value) is not int:
        raise TypeError(f"{what} is {type(value).__name__}, not int")
    if not 0 <= value <= MAX_SIZE:
        raise ValueError(f"{what} is {str(value)[:40]}, outside 0..{MAX_SIZE}")
    return value


def _plain(value: Any, depth: int = 4, left: list[int] | None = None) -> Any:
    """A JSON-safe copy of snapshot data kept in the Run, cut at `depth` and after
    PLAIN_CAP values in all: a hostile snapshot could nest, loop or share one list a
    million times where a real one holds a few flat settings."""
    left = [PLAIN_CAP] if left is None else left
    if left[0] <= 0:
        return None
    left[0] -= 1
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else None
    if depth > 0 and type(value) is dict:
        return {str(k): _plain(v, depth - 1, left) for k, v in value.items()
                if type(k) in (str, int) and left[0] > 0}
    if depth > 0 and type(value) in (list, tuple):
        return [_plain(v, depth - 1, left) for v in value if left[0] > 0]
    return None


# ---- conversion -------------------------------------------------------------------------
def snapshot_to_run(snapshot: dict, device: int | None = None, allowance: Allowance | None = None) -> Run:
    """A Run (source "allocator") from a snapshot: every traced allocation becomes a Block
    with an ALLOC event and, once freed, a FREE event; OOM entries become Run.ooms.

    Blocks alive before the trace began (the trace is a ring buffer, or recording started
    late) appear in two ways: freed during the trace without having been allocated in it,
    or still allocated in `segments` at the end. Both become blocks allocated at the very
    start, so live bytes at every point and at the end match the allocator.

    `device` picks which GPU's trace to read; by default the one with the longest trace.
    A snapshot that is not shaped like PyTorch's, or whose values are out of range (a
    negative size), raises SnapshotError. What the Run will take is charged to `allowance`
    (by default the limit for reading files) before it is built: past it, ReadLimitError.
    """
    if not isinstance(snapshot, dict):
        raise SnapshotError("not a PyTorch memory snapshot (expected a dict)")
    allowance = allowance or Allowance("the snapshot")
    try:
        traces = snapshot.get("device_traces") or []
        all_segments = snapshot.get("segments") or []
        device = _pick_device(traces, all_segments, device)
        trace = traces[device] if device < len(traces) else []
        segments = [s for s in all_segments if s.get("device", device) == device]
        allowance.charge(len(trace) * ENTRY_COST + len(segments) * SEGMENT_COST
                         + sum(len(s.get("blocks") or ()) for s in segments) * SEGMENT_BLOCK_COST)
        with _gc_paused():
            run = _convert(snapshot, trace, segments, device)
        run.meta["snapshot"]["devices"] = sorted(
            {i for i, t in enumerate(traces) if t}
            | {d for s in all_segments if type(d := s.get("device", 0)) is int and d >= 0})
        check_run(run, CATEGORIES, {Action.ALLOC, Action.FREE, Action.OOM})
        return run
    except SnapshotError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError,
            RecursionError) as exc:
        why = " ".join(str(exc).split())[:160]
        raise SnapshotError(f"the snapshot is damaged ({type(exc).__name__}: {why})") from None


def _pick_device(traces: list, segments: list, device: int | None) -> int:
    seg_devices = {d for s in segments if type(d := s.get("device", 0)) is int and d >= 0}
    if device is None:
        if any(traces):
            return max(range(len(traces)), key=lambda i: len(traces[i]))
        return min(seg_devices, default=0)
    if type(device) is not int or device < 0 or (device >= len(traces) and device not in seg_devices):
        have = sorted({i for i, t in enumerate(traces) if t} | seg_devices)
        raise SnapshotError(f"the snapshot has no data for device {device!r} (it has {have or 'none'})")
    return device


def _convert(snapshot: dict, trace: list, segments: list, device: int) -> Run:
    dev = f"cuda:{device}"
    # With free_completed entries, memory counts as in use until it can really be reused
    # (a block used by another stream stays busy after the program frees it). Traces
    # recorded without them (skip_actions, old versions) free at the request.
    free_action = "free_completed"
    if not any(e.get("action") == "free_completed" for e in trace):
        free_action = "free_requested"
    other, other_phase = Category.OTHER.value, Phase.OTHER.value
    ALLOC, FREE, OOM_EVENT = Action.ALLOC, Action.FREE, Action.OOM

    blocks: dict[int, Block] = {}
    live: dict[int, Block] = {}         # address -> block alive there
    actions: list[int] = []
    ev_blocks: list[int] = []
    ev_bytes: list[int] = []
    ooms: list[OOM] = []
    steps: list[tuple[int, int, int]] = []   # (seq, reserved change, live change) so far
    early: list[Block] = []             # allocated before the trace began
    context: list[list] = []            # [block id, compile_context, user_metadata]
    oom_tags: list[list] = []           # [OOM index, user_metadata] in force when it was refused
    names: dict[int, tuple[str, int]] = {}   # id(frames list) -> (name, source); torch shares one list per stack
    sources: list[list] = []            # the user's lines (Run.sources)
    table = SourceTable(sources)
    running = reserved = implied = 0

    for e in trace:
        act = e["action"]
        if act == "alloc":
            addr, size = e["addr"], e["size"]
            if type(addr) is not int or type(size) is not int:
                raise TypeError(f"alloc entry with addr {addr!r:.40} and size {size!r:.40}")
            _int(addr, "alloc address"), _int(size, "alloc size")
            seq = len(actions)
            old = live.pop(addr, None)
            if old is not None:   # its free fell outside what was recorded
                old.free_seq = seq
                actions.append(FREE)
                ev_blocks.append(old.id)
                ev_bytes.append(old.nbytes)
                running -= old.nbytes
                implied += 1
                seq += 1
            frames = e.get("frames")
            if frames:
                named = names.get(id(frames))
                if named is None:
                    named = names[id(frames)] = (frame_name(frames), snapshot_source(table, frames))
                name, source = named
            else:
                name, source = "", -1
            bid = len(blocks)
            b = Block(bid, size, other, name, [], "", dev, None, other_phase, 0, seq, None, addr, source)
            blocks[bid] = live[addr] = b
            actions.append(ALLOC)
            ev_blocks.append(bid)
            ev_bytes.append(size)
            running += size
            compiled, tag = e.get("compile_context"), e.get("user_metadata")
            if (compiled and compiled != "N/A") or tag:     # torch writes "N/A" when unset
                context.append([bid, compiled if type(compiled) is str else "",
                                tag if type(tag) is str else ""])
        elif act == free_action:
            addr = e["addr"]
            b = live.pop(addr, None)
            if b is None:             # allocated before the trace began
                bid = len(blocks)
                b = Block(bid, _int(e["size"], "free size"), other, "", [], "", dev, None,
                          other_phase, 0, 0, None, _int(addr, "free address"))
                blocks[bid] = b
                early.append(b)
            b.free_seq = len(actions)
            actions.append(FREE)
            ev_blocks.append(b.id)
            ev_bytes.append(b.nbytes)
            running -= b.nbytes
        elif act == "oom":
            size = e.get("size")
            if size is not None:
                _int(size, "OOM size")
            frames = e.get("frames")
            tag = e.get("user_metadata")
            if type(tag) is str and tag:
                oom_tags.append([len(ooms), tag])
            ooms.append(OOM(len(actions), size, _oom_message(size, e.get("device_free"), device),
                            live_bytes=running,
                            source=snapshot_source(table, frames) if type(frames) is list else -1))
            actions.append(OOM_EVENT)
            ev_blocks.append(-1)
            ev_bytes.append(size or 0)
        elif act == "segment_alloc" or act == "segment_map":
            reserved += _int(e["size"], "segment size")
            steps.append((len(actions), reserved, running))
        elif act == "segment_free" or act == "segment_unmap":
            reserved -= _int(e["size"], "segment size")
            steps.append((len(actions), reserved, running))

    # Still allocated at the end, and never allocated in the trace: alive from the start.
    keep = (_ACTIVE,) + (_PENDING if free_action == "free_completed" else ())
    for seg in segments:
        addr = _int(seg.get("address", 0), "segment address")
        for b in seg.get("blocks") or ():
            baddr = _int(b.get("address", addr), "block address")
            addr = baddr + _int(b["size"], "block size")
            if b.get("state") in keep and baddr not in live:
                frames = _block_frames(b)
                bid = len(blocks)
                blk = Block(bid, _block_bytes(b), other, frame_name(frames) if frames else "",
                            [], "", dev, None, other_phase, 0, 0, None, baddr,
                            snapshot_source(table, frames) if type(frames) is list else -1)
                blocks[bid] = blk
                early.append(blk)

    # The early blocks' ALLOC events go first; everything traced moves up behind them.
    shift = len(early)
    start_bytes = sum(b.nbytes for b in early)
    if shift:
        for b in blocks.values():
            b.alloc_seq += shift
            if b.free_seq is not None:
                b.free_seq += shift
        for i, b in enumerate(early):
            b.alloc_seq = i
        for o in ooms:
            o.seq += shift
    for o in ooms:
        o.live_bytes += start_bytes

    run = Run(source="allocator")
    run.actions = [ALLOC] * shift + actions
    run.event_blocks = [b.id for b in early] + ev_blocks
    run.event_bytes = [b.nbytes for b in early] + ev_bytes
    run.blocks = blocks
    run.ooms = ooms
    run.marks = [Mark(0, other_phase, 0)]
    run.segments = [_compact_segment(seg) for seg in segments]
    run.sources = sources

    # Reserved bytes: the segments give the end, segment events in the trace the changes,
    # so the level at the start is what the end was before those changes.
    reserved_end = sum(_int(s.get("total_size", 0), "segment size") for s in segments)
    reserved_start = reserved_end - reserved
    if reserved_start >= 0:
        run.samples = [Sample(shift, start_bytes, reserved_start)]
        run.samples += [Sample(seq + shift, start_bytes + live_change, reserved_start + change)
                        for seq, change, live_change in steps]
        run.samples.append(Sample(len(run.actions), start_bytes + running, reserved_end))

    run.device = {
        "type": "cuda", "index": device, "name": dev,
        "reserved_bytes": reserved_end,
        "allocated_bytes": sum(_segment_allocated(s) for s in segments),
        "segment_count": len(segments),
    }
    if isinstance(snapshot.get("allocator_settings"), dict):
        run.device["allocator_settings"] = _plain(snapshot["allocator_settings"])

    meta: dict[str, Any] = {
        "trace_entries": len(trace),
        "free_action": free_action,
        "blocks_before_trace": shift,
        "bytes_before_trace": start_bytes,
    }
    if implied:
        meta["implied_frees"] = implied
    if reserved_start < 0:
        meta["reserved_inconsistent"] = True
    if trace and "time_us" in trace[0]:
        meta["time_us"] = [_plain(trace[0]["time_us"], 0), _plain(trace[-1].get("time_us"), 0)]
    if context:
        meta["block_context"] = context
    if oom_tags:
        meta["oom_context"] = oom_tags
    annotations = [a for a in snapshot.get("external_annotations") or ()
                   if not isinstance(a, dict) or a.get("device", device) == device]
    if annotations:
        left = [PLAIN_CAP]
        meta["external_annotations"] = [_plain(a, left=left) for a in annotations[:ANNOTATIONS_CAP]]
        meta["external_annotations_total"] = len(annotations)
    run.meta = {"snapshot": meta}
    return run


def _oom_message(size: int | None, device_free: Any, device: int) -> str:
    text = f"CUDA out of memory. Tried to allocate {format_bytes(size)}."
    if type(device_free) is int and 0 <= device_free <= MAX_SIZE:
        text += f" GPU {device} had {format_bytes(device_free)} free."
    return text + " (from a PyTorch memory snapshot)"


def _segment_allocated(seg: dict) -> int:
    if "allocated_size" in seg:
        return _int(seg["allocated_size"], "segment allocated size")
    return sum(_int(b["size"], "block size") for b in seg.get("blocks") or ()
               if b.get("state") == _ACTIVE)


def _compact_segment(seg: dict) -> dict[str, Any]:
    """The layout of one segment without stacks: enough to see fragmentation (where the
    free space is and its largest piece) at a small, bounded size."""
    blocks = seg.get("blocks") or []
    free = [_int(b["size"], "block size") for b in blocks if b.get("state") == "inactive"]
    total = _int(seg.get("total_size", 0), "segment size")
    out = {
        "address": _int(seg.get("address", 0), "segment address"),
        "total_size": total,
        "allocated_size": _segment_allocated(seg),
        "stream": _plain(seg.get("stream", 0), 0),
        "segment_type": seg.get("segment_type") if seg.get("segment_type") in ("small", "large")
        else ("large" if total > 2**21 else "small"),
        "inactive_size": sum(free),
        "largest_inactive": max(free, default=0),
        "blocks": [{"size": b["size"], "state": _plain(b.get("state"), 0)}
                   for b in blocks[:SEGMENT_BLOCKS_CAP]],
    }
    if seg.get("is_expandable") is True:
        out["is_expandable"] = True
    if len(blocks) > SEGMENT_BLOCKS_CAP:
        out["blocks_omitted"] = len(blocks) - SEGMENT_BLOCKS_CAP
    return out
