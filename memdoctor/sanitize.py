"""Printable text from strings that came from a file: the one function every renderer
(terminal, TUI, JSON, HTML) passes such strings through.

A name in a run file or a snapshot (script path, module, tensor, stack frame) is whatever
the file says. Sent raw to a terminal, an escape sequence in it can retitle the window,
rewrite lines already printed or fill the paste buffer (OSC 52); bidirectional overrides
make text read differently from what it is. Every such character becomes "?".
"""
from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls, zero-width and bidirectional
# formatting, line and paragraph separators, the byte-order mark.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_BREAKS = re.compile("[\t\n]")


def printable(text: object, newlines: bool = False) -> str:
    """`text` as a string with every control character replaced by "?"; tabs and
    newlines become spaces unless `newlines` (a block of text rather than a name)."""
    text = text if isinstance(text, str) else str(text)
    text = _UNSAFE.sub("?", text)
    return text if newlines else _BREAKS.sub(" ", text)


def printable_data(value: object) -> object:
    """A JSON-shaped value with `printable` applied to every string in it (keys too)."""
    if isinstance(value, str):
        return printable(value, newlines=True)
    if isinstance(value, dict):
        return {printable_data(k) if isinstance(k, str) else k: printable_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_data(v) for v in value]
    return value


def printable_column(values: list) -> list:
    """`printable` over a column of names (None kept), the same list when none needs it:
    one search over the joined column instead of one call per name."""
    if "".join([v for v in values if type(v) is str]).isprintable():     # no control, format or break
        return values
    return [printable(v) if isinstance(v, str) else v for v in values]
