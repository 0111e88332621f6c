"""The memory a reader of a user's file (run file, snapshot, log) may build: a stated limit,
1 GiB unless MEMDOCTOR_READ_LIMIT says otherwise, charged as the reader builds. The charge
is an upper bound (a trace of 60,000 forward calls and 300,000 events charges 636 MiB and
takes 320 MiB to read), and the limit leaves room for such traces.

A file's size says little about what reading it costs: a 50 KB gzip of JSON can hold
sixteen million empty objects, a 266 KB run file thirty million events. So readers charge
an Allowance with what they are about to build, in bytes estimated from what they count
(tokens of the text before it is parsed, entries as they are converted), and stop with
ReadLimitError, one line, when the total would pass the limit.
"""
from __future__ import annotations

import os
import zlib

from memdoctor.units import SizeError, format_bytes, parse_size

DEFAULT_LIMIT = 1024**3
ENV = "MEMDOCTOR_READ_LIMIT"

# What json.loads builds, per token of the text: a value's slot in its container and the
# object itself (an int up to 36 bytes, a str 49 bytes and its characters), a dict's
# table per entry and header. Measured with tracemalloc on CPython 3.11-3.13, rounded up.
JSON_PER_CHAR = 1
JSON_PER_VALUE = 48          # per ",": a slot and an int or float
JSON_PER_LIST = 72           # per "[": a list and its slot
JSON_PER_STRING = 32         # per '"': half a str header, twice per string
JSON_PER_OBJECT = 96         # per "{": an empty dict and its slot
JSON_PER_KEY = 48            # per ":": a dict entry
# What unpickling builds: per byte of the pickle (a slot, a number, a string, a memo
# entry; no opcode builds more than 12 bytes a byte of itself but the containers), plus a
# dict per "}" and a list per "]" (counted on every byte: an overestimate by the bytes of
# strings and numbers that happen to be those characters).
PICKLE_PER_BYTE = 12
PICKLE_PER_DICT = 80
PICKLE_PER_LIST = 72


class ReadLimitError(Exception):
    """Reading a file would take more memory than the limit allows; one line for the user."""


def read_limit() -> int:
    """The limit in bytes: MEMDOCTOR_READ_LIMIT ("4GiB", a byte count) or 1 GiB."""
    text = os.environ.get(ENV)
    if not text:
        return DEFAULT_LIMIT
    try:
        return parse_size(text)
    except SizeError as exc:
        raise ReadLimitError(f"{ENV}: {exc}") from None


class Allowance:
    """Bytes a reader has built so far, against the limit."""

    def __init__(self, what: str, limit: int | None = None):
        self.what = what
        self.limit = read_limit() if limit is None else limit
        self.used = 0

    def charge(self, nbytes: int) -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise ReadLimitError(
                f"{self.what} would take more than {format_bytes(self.limit)} of memory to read "
                f"(the limit for reading files; set {ENV}, e.g. {ENV}=4GiB, to allow more)")

    def charge_json(self, text: str | bytes) -> None:
        """What json.loads would build from `text`, charged before it runs."""
        marks = (",", "[", '"', "{", ":") if isinstance(text, str) else (b",", b"[", b'"', b"{", b":")
        comma, bracket, quote, brace, colon = (text.count(m) for m in marks)
        self.charge(len(text) * JSON_PER_CHAR + comma * JSON_PER_VALUE + bracket * JSON_PER_LIST
                    + quote * JSON_PER_STRING + brace * JSON_PER_OBJECT + colon * JSON_PER_KEY)

    def charge_pickle(self, data: bytes) -> None:
        """What unpickling `data` would build, charged before it runs."""
        self.charge(len(data) * PICKLE_PER_BYTE + data.count(b"}") * PICKLE_PER_DICT
                    + data.count(b"]") * PICKLE_PER_LIST)


def read_all(fh, allowance: Allowance, chunk: int = 1 << 20) -> bytes:
    """fh.read(), a chunk at a time, each charged first: a file that never ends (a pipe,
    /dev/zero) stops at the limit, and no buffer is sized by what a file claims."""
    parts = []
    while part := fh.read(chunk):
        allowance.charge(len(part))
        parts.append(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def gunzip(raw: bytes, allowance: Allowance, chunk: int = 1 << 20) -> bytes:
    """gzip.decompress a chunk at a time, each charged (twice: the parts and the joined
    copy) before the next is made, so a small file that expands without end stops at the
    limit; gzip members one after another read as one, trailing zeros are ignored.
    EOFError for a stream cut short, zlib.error for a damaged one."""
    parts = []
    while True:
        unzip, data = zlib.decompressobj(wbits=31), raw
        while not unzip.eof:
            part = unzip.decompress(data, chunk)
            data = unzip.unconsumed_tail
            if not part and not data and not unzip.eof:
                raise EOFError("the gzip stream is cut short")
            allowance.charge(2 * len(part))
            parts.append(part)
        raw = unzip.unused_data
        if raw[:2] != b"\x1f\x8b":
            return b"".join(parts)
