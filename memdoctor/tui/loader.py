"""Read a *.memrun.json.gz fast enough to show a 1,000,000-event run in under two seconds,
in small pieces so that a worker thread never holds the GIL for long.

The file is the JSON that `Run.to_dict` writes. Its top-level object is walked key by
key with `json.JSONDecoder.raw_decode`; the `events` and `blocks` objects are walked
column by column, and a column of plain integers is parsed by numpy rather than turned
into a million Python ints. The `shape` column (lists of lists, the slowest to parse) is
left as text and parsed later, in chunks. Anything unexpected falls back to `Run.load`,
which has the one-line error messages for broken files.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from memdoctor.run import CATEGORIES, FORMAT, OOM, VERSION, Block, Mark, Run, RunFileError, read_run_text
from memdoctor.runcheck import check_blocks, check_header
from memdoctor.sanitize import printable, printable_column, printable_data
from memdoctor.tui.index import Header, RunIndex

_WS = " \t\n\r"
_DEC = json.JSONDecoder()


class _Unexpected(Exception):
    """The fast path met something it does not read: use Run.load instead."""


@dataclass
class _Slice:
    """A column left unparsed: text[start:end] is its JSON array."""
    start: int
    end: int
    kind: str           # "ints", "strings" or "shapes"


# what the overview needs; every other column is parsed later, off the critical path
OVERVIEW_COLUMNS = {"nbytes", "category", "alloc_seq", "free_seq"}
DETAIL_COLUMNS = ("name", "module", "dtype", "phase", "step", "shape")


@dataclass
class Loaded:
    """A run read for the TUI: the index now, the rest (names, shapes, events, a full Run)
    on demand."""
    index: RunIndex
    data: dict[str, Any]                 # the top-level JSON values (events/blocks as columns)
    text: str | None = None              # the file's text while columns are still unparsed
    run: Run | None = None

    def _resolve(self, where: str, names, tick: Callable[[], None] | None) -> None:
        columns = self.data.get(where, {})
        for name in names:
            value = columns.get(name)
            if isinstance(value, _Slice):
                columns[name] = _parse_slice(self.text, value, tick)
                if value.kind == "strings":
                    columns[name] = printable_column(columns[name])
                if tick:
                    tick()
        if not any(isinstance(v, _Slice) for part in ("events", "blocks")
                   for v in self.data.get(part, {}).values()):
            self.text = None

    def parse_details(self, tick: Callable[[], None] | None = None) -> None:
        """Names, modules, dtypes, phases, steps and shapes: what the timeline's tensors and
        the modules tree show."""
        if self.run is not None or not self.data:
            return
        self._resolve("blocks", DETAIL_COLUMNS, tick)
        self.index.attach({k: self.data["blocks"][k] for k in DETAIL_COLUMNS})

    def build_run(self, tick: Callable[[], None] | None = None) -> Run:
        """The full Run (for the rules): every column parsed, back to lists, Run.from_dict."""
        if self.run is not None:
            return self.run
        self.parse_details(tick)
        self._resolve("events", list(self.data["events"]), tick)
        self._resolve("blocks", list(self.data["blocks"]), tick)
        data = dict(self.data)
        data["events"] = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in data["events"].items()}
        cols = {}
        for k, v in data["blocks"].items():
            cols[k] = v.tolist() if isinstance(v, np.ndarray) else v
            if k in ("free_seq", "address") and isinstance(v, np.ndarray):
                cols[k] = [None if x < 0 else x for x in cols[k]]
        data["blocks"] = cols
        self.run = Run.from_dict(data)
        return self.run


def load(path: str | os.PathLike, tick: Callable[[], None] | None = None) -> Loaded:
    """Read a run file into a Loaded. Raises RunFileError (one line) for a bad file."""
    text = read_run_text(path)
    try:
        data = _walk(text, tick)
        index = _index(data, text)
    except RunFileError:                # not a run file, or another version: said as it is
        raise
    except Exception:                   # not the layout we know: the careful reader decides
        run = printable_run(Run.load(path))
        return Loaded(index=RunIndex.from_run(run), data={}, run=run)
    return Loaded(index=index, data=data, text=text)


def from_run(run: Run) -> Loaded:
    printable_run(run)
    return Loaded(index=RunIndex.from_run(run), data={}, run=run)


def printable_run(run: Run) -> Run:
    """The run's names, in place, passed through memdoctor.sanitize: what the screens and
    the findings made from it show comes from a file and must not reach the terminal raw."""
    for b in run.blocks.values():
        b.name, b.dtype, b.device, b.phase = (printable(b.name), printable(b.dtype), printable(b.device),
                                              printable(b.phase))
        b.module = None if b.module is None else printable(b.module)
    for item in (*run.marks, *run.ooms):
        item.phase = printable(item.phase)
        item.module = None if item.module is None else printable(item.module)
    for o in run.ooms:
        o.message = printable(o.message, newlines=True)
    run.source, run.script = printable(run.source), None if run.script is None else printable(run.script)
    run.argv, run.device, run.meta = printable_data(run.argv), printable_data(run.device), printable_data(run.meta)
    run.torch_version, run.sources = printable(run.torch_version), printable_data(run.sources)
    return run


def _index(data: dict[str, Any], text: str) -> RunIndex:
    """The index from the overview's columns. Anything damaged raises _Unexpected, so that
    Run.load reads the file again and words the error."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RunFileError("not a memdoctor run file")
    if data.get("version") != VERSION:
        raise RunFileError(f"run file version {data.get('version')!r} is not supported (expected {VERSION})")
    for key in ("source", "device", "script", "argv", "torch_version", "marks", "ooms", "sources", "meta"):
        if key in data:                 # shown as they are, and read by the findings
            data[key] = printable_data(data[key])
    events, blocks = data["events"], data["blocks"]
    n = _count(events["action"], text)
    if not (n == _count(events["block"], text) == _count(events["bytes"], text)):
        raise _Unexpected
    if set(blocks) != set(Block.__dataclass_fields__):
        raise _Unexpected
    count = len(blocks["nbytes"])
    if any(len(blocks[k]) != count for k in OVERVIEW_COLUMNS):
        raise _Unexpected
    check_header(data, n)               # a bad value: Run.load reads it again and says which
    check_blocks({k: blocks[k] for k in OVERVIEW_COLUMNS}, n, CATEGORIES)
    header = Header(source=data["source"], device=data["device"] or {}, budget_bytes=data["budget_bytes"],
                    script=data["script"], argv=data["argv"], torch_version=data["torch_version"],
                    marks=[Mark(**m) for m in data["marks"]], ooms=[OOM(**o) for o in data["ooms"]],
                    meta=data["meta"] or {})
    return RunIndex(header, n, {k: blocks[k] for k in OVERVIEW_COLUMNS})


# ---- the walker ----------------------------------------------------------------------
def _skip(text: str, pos: int) -> int:
    while text[pos] in _WS:
        pos += 1
    return pos


def _walk_object(text: str, pos: int, value: Callable[[str, str, int], tuple[Any, int]]) -> tuple[dict, int]:
    pos = _skip(text, pos)
    if text[pos] != "{":
        raise _Unexpected
    out: dict[str, Any] = {}
    pos = _skip(text, pos + 1)
    if text[pos] == "}":
        return out, pos + 1
    while True:
        key, pos = _DEC.raw_decode(text, _skip(text, pos))
        pos = _skip(text, pos)
        if text[pos] != ":":
            raise _Unexpected
        pos = _skip(text, pos + 1)
        out[key], pos = value(text, key, pos)
        pos = _skip(text, pos)
        if text[pos] == "}":
            return out, pos + 1
        if text[pos] != ",":
            raise _Unexpected
        pos += 1


def _walk(text: str, tick: Callable[[], None] | None) -> dict:
    def column(text: str, key: str, pos: int) -> tuple[Any, int]:
        if text[pos] != "[":
            return _DEC.raw_decode(text, pos)
        if key in OVERVIEW_COLUMNS:
            if tick:
                tick()
            ints = _int_column(text, pos)
            return ints if ints is not None else _DEC.raw_decode(text, pos)
        if key == "shape":
            end = _end_of_nested_int_lists(text, pos)
            return _Slice(pos, end, "shapes"), end
        end = text.find("]", pos)
        if end < 0:
            raise _Unexpected
        if '"' not in text[pos:end]:            # numbers and nulls: the first ] closes it
            return _Slice(pos, end + 1, "ints"), end + 1
        end = _end_of_string_array(text, pos)
        return _Slice(pos, end, "strings"), end

    def top(text: str, key: str, pos: int) -> tuple[Any, int]:
        if tick:
            tick()
        if key in ("events", "blocks") and text[pos] == "{":
            return _walk_object(text, pos, column)
        return _DEC.raw_decode(text, pos)

    data, pos = _walk_object(text, 0, top)
    if text[pos:].strip():
        raise _Unexpected
    return data


def _count(column: Any, text: str) -> int:
    """Values in a column, parsed or not (an unparsed int array: its commas, plus one)."""
    if not isinstance(column, _Slice):
        return len(column)
    if column.kind != "ints":
        raise _Unexpected
    if not text[column.start + 1:column.end - 1].strip():
        return 0
    return text.count(",", column.start, column.end) + 1


def _parse_slice(text: str, part: _Slice, tick: Callable[[], None] | None) -> Any:
    if part.kind == "shapes":
        return _parse_nested_int_lists(text[part.start:part.end], tick)
    if part.kind == "ints":
        ints = _int_column(text, part.start)
        if ints is not None:
            return ints[0]
    value, end = _DEC.raw_decode(text, part.start)
    if end != part.end:
        raise RunFileError("run file is damaged: a column does not end where expected")
    return value


def _end_of_string_array(text: str, pos: int) -> int:
    """End of a JSON array of strings and nulls starting at pos: the first `]` with an even
    number of quotes before it. Text with backslashes (escapes) is left to the parser."""
    start = pos
    while True:
        end = text.find("]", pos)
        if end < 0:
            raise _Unexpected
        if text.count("\\", start, end):
            raise _Unexpected
        if text.count('"', start, end) % 2 == 0:
            return end + 1
        pos = end + 1


def _int_column(text: str, pos: int) -> tuple[np.ndarray, int] | None:
    """A JSON array of integers (and nulls, read as -1) as an int64 array, or None."""
    end = text.find("]", pos)
    if end < 0:
        raise _Unexpected
    body = text[pos + 1:end]
    if not body.strip():
        return np.zeros(0, dtype=np.int64), end + 1
    if "null" in body:
        body = body.replace("null", "-1")
    if not body.isascii() or body.encode("ascii").translate(None, b"0123456789,-"):
        return None
    values = np.fromstring(body, dtype=np.int64, sep=",")
    if len(values) != body.count(",") + 1:
        raise _Unexpected
    return values, end + 1


def _end_of_nested_int_lists(text: str, pos: int) -> int:
    """End of `[[1,2],[3],[]]` starting at pos (lists of ints only, else _Unexpected)."""
    if text.startswith("[]", pos):
        return pos + 2
    end = text.find("]]", pos)
    if end < 0:
        raise _Unexpected
    part = text[pos:end]
    if not part.isascii() or part.encode("ascii").translate(None, b"0123456789,-[]"):
        raise _Unexpected
    return end + 2


def _parse_nested_int_lists(text: str, tick: Callable[[], None] | None = None,
                            chunk: int = 1 << 19) -> list[list[int]]:
    """json.loads of a list of int lists, a chunk at a time (each chunk ends at `],`)."""
    if len(text) <= chunk:
        return json.loads(text)
    body, out, start = text[1:-1], [], 0
    while start < len(body):
        cut = body.find("],", start + chunk)
        stop = len(body) if cut < 0 else cut + 1
        out.extend(json.loads("[" + body[start:stop] + "]"))
        start = stop + 1
        if tick:
            tick()
    return out
