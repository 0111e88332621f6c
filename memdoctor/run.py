"""The Run: everything a trace recorded, in one typed structure that saves to a versioned,
gzip-compressed JSON file (never a pickle) and loads back losslessly.

Events are kept columnar (three parallel int lists) because a long run has millions of
them; blocks (one per storage) carry who owns the memory and the user's line that made it
(an index into the run's table of source lines); marks say when the phase, the step or
the module changed.
"""
from __future__ import annotations

import bisect
import itertools
import json
import linecache
import os
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from enum import Enum
from operator import attrgetter
from typing import Any, Iterator

from memdoctor.collector import paused_gc
from memdoctor.limits import Allowance, gunzip, read_all
from memdoctor.runcheck import check_run

FORMAT = "memdoctor.run"
VERSION = 1


class Category(str, Enum):
    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    INPUTS = "inputs"
    OTHER = "other"


CATEGORIES = [c.value for c in Category]
# When one storage plays several roles, the more durable role names it: a parameter saved
# for backward stays a weight, a batch saved for backward stays an input.
_PRIORITY = {c: i for i, c in enumerate(
    ["weights", "gradients", "optimizer_state", "inputs", "activations", "temporaries", "other"])}


def stronger(a: str, b: str) -> str:
    """The category that wins when a storage is seen in both roles."""
    return a if _PRIORITY[a] <= _PRIORITY[b] else b


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    FORWARD_NO_BACKWARD = "forward-without-backward"
    OTHER = "other"


class Action:
    ALLOC = 0
    FREE = 1
    OOM = 2


@dataclass(slots=True)
class Block:
    """One storage: the unit memory is allocated and freed in."""
    id: int
    nbytes: int
    category: str = Category.OTHER.value
    name: str = ""
    shape: list[int] = field(default_factory=list)
    dtype: str = ""
    device: str = ""
    module: str | None = None
    phase: str = Phase.OTHER.value
    step: int = 0
    alloc_seq: int = 0
    free_seq: int | None = None
    address: int | None = None
    source: int = -1            # index into Run.sources: the user's line that made it; -1 unknown


@dataclass(slots=True)
class Mark:
    """From event index `seq` on, the run is in `phase` of `step` (module: the outermost
    module running, if any)."""
    seq: int
    phase: str
    step: int
    module: str | None = None
    time: float = 0.0


@dataclass
class OOM:
    """An out-of-memory event: real (CUDA) or simulated (a budget under the dispatch source)."""
    seq: int
    requested_bytes: int | None
    message: str
    phase: str = Phase.OTHER.value
    step: int = 0
    module: str | None = None
    simulated: bool = False
    live_bytes: int | None = None
    source: int = -1            # index into Run.sources: the user's line that asked for the memory


@dataclass(frozen=True)
class Source:
    """A line of the user's code: the first frame outside torch, memdoctor, the standard
    library and installed packages."""
    file: str
    line: int
    function: str = ""

    @property
    def label(self) -> str:
        """"train.py:25": the file's name and the line number."""
        return f"{os.path.basename(self.file)}:{self.line}"

    def text(self) -> str:
        """The line's source text, read when asked (empty when the file is not here)."""
        return linecache.getline(self.file, self.line).strip()

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function,
                "label": self.label, "text": self.text()}


@dataclass
class Sample:
    """Allocator counters read at an instant (CUDA runs only)."""
    seq: int
    allocated: int
    reserved: int


@dataclass
class Run:
    source: str = "dispatch"
    device: dict[str, Any] = field(default_factory=dict)
    budget_bytes: int | None = None
    script: str | None = None
    argv: list[str] = field(default_factory=list)
    torch_version: str = ""
    actions: list[int] = field(default_factory=list)
    event_blocks: list[int] = field(default_factory=list)
    event_bytes: list[int] = field(default_factory=list)
    blocks: dict[int, Block] = field(default_factory=dict)
    marks: list[Mark] = field(default_factory=list)
    ooms: list[OOM] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    # the user's lines that blocks and OOMs point at: [file, line, function] each
    sources: list[list] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_events(self) -> int:
        return len(self.actions)

    @property
    def steps(self) -> int:
        return max((m.step for m in self.marks), default=0) + 1 if self.marks else 0

    def events(self) -> Iterator[tuple[int, int, int, int]]:
        """(seq, action, block id, bytes) in order."""
        for seq, (a, b, n) in enumerate(zip(self.actions, self.event_blocks, self.event_bytes)):
            yield seq, a, b, n

    def mark_at(self, seq: int) -> Mark | None:
        """The mark in force at event index seq."""
        lo, hi, found = 0, len(self.marks) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.marks[mid].seq <= seq:
                found, lo = self.marks[mid], mid + 1
            else:
                hi = mid - 1
        return found

    def source_at(self, index: int | None) -> Source | None:
        """The Source of a block's or an OOM's `source` index; None when unknown."""
        if index is None or not 0 <= index < len(self.sources):
            return None
        file, line, function = self.sources[index]
        return Source(file, line, function)

    # ---- persistence -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        blocks = list(self.blocks.values())
        columns = {name: list(map(attrgetter(name), blocks)) for name in Block.__dataclass_fields__}
        return {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "script": self.script,
            "argv": self.argv,
            "torch_version": self.torch_version,
            "events": {"action": self.actions, "block": self.event_blocks, "bytes": self.event_bytes},
            "blocks": columns,
            "marks": _rows(self.marks, Mark),
            "ooms": _rows(self.ooms, OOM),
            "samples": _rows(self.samples, Sample),
            "segments": self.segments,
            "sources": self.sources,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Run":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RunFileError("not a memdoctor run file")
        if data.get("version") != VERSION:
            raise RunFileError(f"run file version {data.get('version')!r} is not supported (expected {VERSION})")
        try:
            ev = data["events"]
            cols = data["blocks"]
            names = list(Block.__dataclass_fields__)
            count = len(cols["id"])
            cols = _with_defaults(cols, _NEWER_BLOCK_COLUMNS, count)
            sources = data.get("sources", [])       # files written before the column: none
            _check_sources(sources)
            if any(len(cols[n]) != count for n in names):
                raise RunFileError("run file is damaged: block columns differ in length")
            _check_columns("run", Run, {n: [data[n]] for n in _RUN_SCALARS})
            _check_columns("events", Run, {"actions": [ev["action"]], "event_blocks": [ev["block"]],
                                           "event_bytes": [ev["bytes"]]})
            _check_columns("blocks", Block, {n: cols[n] for n in names})
            for key, kind in (("marks", Mark), ("ooms", OOM), ("samples", Sample)):
                rows = data[key]
                if type(rows) is not list or not all(type(r) is dict for r in rows):
                    raise RunFileError(f"run file is damaged: {key} is not a list of objects")
                if kind is OOM:             # files written before OOM.source: unknown
                    rows = oom_rows = [{"source": -1, **r} for r in rows]
                _check_columns(key, kind, {n: [r[n] for r in rows] for n in kind.__dataclass_fields__})
            blocks = {}
            for values in zip(*(cols[n] for n in names)):
                b = Block(*values)
                blocks[b.id] = b
            if len(blocks) != count:
                raise RunFileError("run file is damaged: block ids repeat")
            if any(not -1 <= i < len(sources) for i in cols["source"]) or any(
                    not -1 <= r["source"] < len(sources) for r in oom_rows):
                raise RunFileError("run file is damaged: a source index is out of range")
            run = cls(
                source=data["source"], device=data["device"], budget_bytes=data["budget_bytes"],
                script=data["script"], argv=data["argv"], torch_version=data["torch_version"],
                actions=ev["action"], event_blocks=ev["block"], event_bytes=ev["bytes"], blocks=blocks,
                marks=[Mark(**m) for m in data["marks"]], ooms=[OOM(**o) for o in oom_rows],
                samples=[Sample(**s) for s in data["samples"]], segments=data["segments"],
                sources=sources, meta=data["meta"],
            )
        except RunFileError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise RunFileError(f"run file is damaged: {type(exc).__name__}: {exc}") from None
        if not (len(run.actions) == len(run.event_blocks) == len(run.event_bytes)):
            raise RunFileError("run file is damaged: event columns differ in length")
        try:
            check_run(run, CATEGORIES, {Action.ALLOC, Action.FREE, Action.OOM})
        except ValueError as exc:
            raise RunFileError(f"run file is damaged: {exc}") from None
        return run

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write never leaves a half file under `path`."""
        with paused_gc():
            payload = gzip_json(self.to_dict())
        write_atomic(path, payload)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Run":
        """Read a run file within the memory limit for reading files (memdoctor.limits);
        RunFileError or ReadLimitError, one line, when it cannot or may not be read."""
        text = read_run_text(path)
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise RunFileError(f"{os.fspath(path)!r} is not a readable run file ({type(exc).__name__})") from None
        return cls.from_dict(data)


def gzip_json(doc: dict[str, Any]) -> bytes:
    """`json.dumps(doc, separators=(",", ":"))`, gzip-compressed (level 5: as small as 6 on
    runs, in two thirds of the time). The text is made in pieces of a few megabytes, each
    compressed on a second thread while the next is made (zlib lets go of the GIL as it
    works; larger pieces hand the GIL back and forth less often): a run of millions of
    events saves in little more than its text takes to make."""
    packer = zlib.compressobj(5, zlib.DEFLATED, 31)        # wbits 31: gzip's header and trailer
    texts = _batched(_json_pieces(doc))
    try:
        with ThreadPoolExecutor(max_workers=1) as worker:   # one worker: the parts stay in order
            parts = [worker.submit(packer.compress, text.encode()) for text in texts]
            packed = [part.result() for part in parts]
    except RuntimeError:        # no thread to be had (the interpreter shutting down): all here
        packer = zlib.compressobj(5, zlib.DEFLATED, 31)
        packed = [packer.compress(text.encode()) for text in _batched(_json_pieces(doc))]
    packed.append(packer.flush())
    return b"".join(packed)


_COMPACT = (",", ":")
_LIST_CHUNK = 20_000        # list items made into text in one call


def _json_pieces(value: Any, depth: int = 3) -> Iterator[str]:
    """The compact JSON text of `value` (dict keys strings) in pieces: dicts `depth` levels
    down a key at a time, long lists there a chunk at a time. Joined, the pieces are exactly
    `json.dumps(value, separators=(",", ":"))`."""
    if depth and type(value) is dict and value:
        opening = "{"
        for key, item in value.items():
            yield opening + json.dumps(key) + ":"
            yield from _json_pieces(item, depth - 1)
            opening = ","
        yield "}"
    elif depth and type(value) is list and len(value) > _LIST_CHUNK:
        for i in range(0, len(value), _LIST_CHUNK):
            yield ("[" if i == 0 else ",") + json.dumps(value[i:i + _LIST_CHUNK], separators=_COMPACT)[1:-1]
        yield "]"
    else:
        yield json.dumps(value, separators=_COMPACT)


def _batched(pieces: Iterator[str], size: int = 1 << 22) -> Iterator[str]:
    """The pieces joined into texts of at least `size` characters (the last one shorter)."""
    batch, length = [], 0
    for piece in pieces:
        batch.append(piece)
        length += len(piece)
        if length >= size:
            yield "".join(batch)
            batch, length = [], 0
    if batch:
        yield "".join(batch)


def read_run_text(path: str | os.PathLike, allowance: Allowance | None = None) -> str:
    """The JSON text of a run file, gzip-compressed or not; RunFileError (one line) if not.
    What the text and the objects json.loads makes of it will take is charged to
    `allowance` (by default the limit for reading files) as it is decompressed, so a small
    file that expands past the limit stops with ReadLimitError."""
    name = os.fspath(path)
    allowance = allowance or Allowance(f"run file {name!r}")
    try:
        with open(path, "rb") as fh:
            raw = read_all(fh, allowance)
    except OSError as exc:
        raise RunFileError(f"cannot read run file {name!r}: {exc.strerror or exc}") from None
    try:
        data = gunzip(raw, allowance) if raw[:2] == b"\x1f\x8b" else raw
        allowance.charge_json(data)
        allowance.charge(len(data) * (1 if data.isascii() else 4))     # the str
        return data.decode()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise RunFileError(f"{name!r} is not a readable run file ({type(exc).__name__})") from None


# What each annotated field may hold once read back from JSON (bool is not an int here).
_ALLOWED = {"int": {int}, "int | None": {int, type(None)}, "str": {str}, "str | None": {str, type(None)},
            "float": {int, float}, "bool": {bool}, "dict[str, Any]": {dict}}
_LISTS_OF = {"list[int]": {int}, "list[str]": {str}, "list[dict[str, Any]]": {dict}}
_RUN_SCALARS = ("source", "device", "budget_bytes", "script", "argv", "torch_version", "segments", "meta")


def _check_columns(where: str, kind: type, columns: dict[str, Any]) -> None:
    """Every value of every column has the type its field is annotated with, or the file is
    damaged: a run that loads must be one the rest of memdoctor can read."""
    hints = {f.name: f.type for f in fields(kind)}
    for name, values in columns.items():
        hint = hints[name]
        if type(values) is not list:
            ok = False
        elif hint in _ALLOWED:
            ok = set(map(type, values)) <= _ALLOWED[hint]
        elif hint in _LISTS_OF:
            ok = (set(map(type, values)) <= {list}
                  and set(map(type, itertools.chain.from_iterable(values))) <= _LISTS_OF[hint])
        else:
            ok = True
        if not ok:
            raise RunFileError(f"run file is damaged: {where}.{name} does not hold {hint}")


# Block columns added after version 1 was released, with the value older files mean.
_NEWER_BLOCK_COLUMNS = {"source": -1}


def _with_defaults(cols: Any, defaults: dict[str, Any], count: int) -> Any:
    """Older files lack the newer columns: each reads as its default."""
    if type(cols) is not dict:
        return cols
    missing = {n: [v] * count for n, v in defaults.items() if n not in cols}
    return {**cols, **missing} if missing else cols


def _check_sources(sources: Any) -> None:
    """The source table holds [file, line, function] rows."""
    if type(sources) is not list or not all(
            type(r) is list and len(r) == 3 and type(r[0]) is str and type(r[1]) is int
            and type(r[2]) is str for r in sources):
        raise RunFileError("run file is damaged: sources is not a list of [file, line, function]")


class RunFileError(Exception):
    """A run file that cannot be read; the message is one line for the user."""


def write_atomic(path: str | os.PathLike, payload: bytes) -> None:
    """Write to a temporary file beside `path`, then rename it over. The file gets the
    mode any new file of the user's gets (0666 less the umask): a report is for sharing."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = _new_file(folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _new_file(folder: str) -> tuple[int, str]:
    """A new file under a random name in `folder`, created 0666 so that the kernel applies
    the umask (tempfile.mkstemp creates 0600 whatever the umask)."""
    for _ in range(100):
        tmp = os.path.join(folder, f".memdoctor-{secrets.token_hex(6)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {folder}")


def _rows(items: list, kind: type) -> list[dict[str, Any]]:
    """Flat dataclasses (of two fields or more) as dicts: the fields read in one call, where
    `asdict` deep-copies every value (a run of a million marks saves in a tenth of the time)."""
    names = [f.name for f in fields(kind)]
    values = attrgetter(*names)
    return [dict(zip(names, values(item))) for item in items]


def backward_cut_short(run: Run) -> tuple[int, int] | None:
    """(after, at): for an OOM inside backward, the event where that backward began and the
    end of the backward before it (0 if none). The passes between them are what the cut
    backward was to reach: its loss module's call is marked back-propagated, a model's
    that the OOM came before is not."""
    oom = run.ooms[0] if run.ooms else None
    if oom is None or oom.phase != Phase.BACKWARD.value or not run.marks:
        return None
    seqs = [m.seq for m in run.marks]
    i = bisect.bisect_right(seqs, oom.seq) - 1
    back = Phase.BACKWARD.value
    if i < 0 or run.marks[i].phase != back:
        return None
    while i > 0 and run.marks[i - 1].phase == back:
        i -= 1
    began = run.marks[i].seq
    j = i - 1
    while j >= 0 and run.marks[j].phase != back:
        j -= 1
    after = run.marks[j + 1].seq if j >= 0 else 0
    return after, began
