"""Log text as the OOM-message scanner reads it: decoded a block at a time, with terminal
escape sequences (colours, titles) taken out, never splitting one between blocks.

A coloured log ("Tried to allocate \\x1b[1m2.00 GiB\\x1b[0m") reads as the plain message.
Blocks do not end at newlines: a log that is one 100 MB line is read in blocks like any
other, so memory stays bounded by the block size whatever the lines.
"""
from __future__ import annotations

import codecs
import re
from typing import IO, Iterator

# CSI (colours, cursor moves), OSC (titles, links, clipboard) ended by BEL or ST, and the
# two-character escapes; the 8-bit CSI too. None spans a newline, so line numbers stay.
_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x9b[0-?]*[ -/]*[@-~]"
                     r"|\x1b\][^\x07\x1b\n]{0,2048}(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# The start of a sequence cut off at the end of a block: held back until the next block.
_CUT = re.compile(r"(?:\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b\n]*\x1b?)?|\x9b[0-?]*[ -/]*)\Z")
_TAIL = 4096            # longer than any sequence _ESCAPE takes out


def strip_escapes(text: str) -> str:
    """`text` without terminal escape sequences."""
    return _ESCAPE.sub("", text) if ("\x1b" in text or "\x9b" in text) else text


def _held_back(data: str) -> int:
    """Where a sequence that the next block may complete starts in `data` (len if none)."""
    i = max(0, len(data) - _TAIL)
    while True:
        esc = min((j for j in (data.find("\x1b", i), data.find("\x9b", i)) if j >= 0), default=-1)
        if esc < 0:
            return len(data)
        whole = _ESCAPE.match(data, esc)
        if whole is not None:
            i = whole.end()
        elif _CUT.match(data, esc):
            return esc
        else:
            i = esc + 1


def _encoding(head: bytes) -> str:
    """UTF-16 only when a byte-order mark is followed by what UTF-16 text looks like (the
    high byte of most characters zero); garbage that happens to start with FF FE stays
    UTF-8 with replacement characters."""
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        high = head[3:4096:2] if head[:2] == b"\xff\xfe" else head[2:4096:2]
        if high and high.count(0) * 2 > len(high):
            return "utf-16"
    return "utf-8-sig"


def text_blocks(stream: IO, size: int) -> Iterator[str]:
    """The stream's text in blocks of about `size`, escape sequences taken out.

    Bytes that are not text become U+FFFD instead of an error; a UTF-16 log (what a
    Windows PowerShell redirect writes) is recognised by its byte-order mark."""
    decoder = None
    pending = ""
    first = True
    while True:
        chunk = stream.read(max(size, 4096) if first else size)   # enough to tell UTF-16
        first = False
        if not chunk:
            break
        if isinstance(chunk, bytes):
            if decoder is None:
                decoder = codecs.getincrementaldecoder(_encoding(chunk))("replace")
            chunk = decoder.decode(chunk)
        data = pending + chunk
        cut = _held_back(data)
        body, pending = data[:cut], data[cut:]
        if body:
            yield strip_escapes(body)
    if decoder is not None:
        pending += decoder.decode(b"", final=True)
    if pending:
        yield strip_escapes(pending)
