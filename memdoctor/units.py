"""Sizes: parse "224MiB" / "1.5 GB" into bytes and format bytes for people."""
from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1, "b": 1, "bytes": 1, "byte": 1,
    "k": 1024, "kb": 1024, "kib": 1024,
    "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1024**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$", re.ASCII)
MAX_SIZE = 2**63 - 1          # what a byte count in PyTorch (int64) can hold
_MAX_TEXT = 64                # longer input is not a size anyone means; never parsed


class SizeError(ValueError):
    """A size string memdoctor cannot read."""


def parse_size(text: str | int | float) -> int:
    """Bytes from "224MiB", "1.5GB", "4096" or a number. GB and GiB both mean 1024**3,
    as PyTorch's own messages do."""
    if isinstance(text, bool):
        raise SizeError(f"not a size: {text!r}")
    if isinstance(text, (int, float)):
        if text != text or text in (float("inf"), float("-inf")):
            raise SizeError(f"not a size: {text!r}")
        if text < 0:
            raise SizeError(f"a size cannot be negative: {text!r}")
        return _in_range(int(text), text)
    text = str(text)
    if len(text) > _MAX_TEXT:
        raise SizeError(f"not a size: {_short(text)} (too long; sizes go up to 8 EiB)")
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise SizeError(f"not a size: {_short(text)} (try 224MiB, 16GiB or a byte count)")
    # exact arithmetic: a float would overflow or round a long number
    return _in_range(round(Fraction(match.group(1)) * _UNITS[match.group(2).lower()]), text)


def _in_range(n: int, text) -> int:
    if n > MAX_SIZE:
        raise SizeError(f"size {_short(str(text))} is too large (sizes go up to 8 EiB)")
    return n


def _short(text: str) -> str:
    """The input as quoted in a one-line message: cut, control characters shown escaped."""
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def format_bytes(n: int | float | None) -> str:
    """'1.50 GiB' style, the way PyTorch prints sizes."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} bytes"
