"""Sizes: parse "224MiB" / "1.5 GB" into bytes and format bytes for people."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1, "bytes": 1, "byte": 1,
    "k": 1024, "kb": 1024, "kib": 1024,
    "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1024**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


class SizeError(ValueError):
    """A size string memdoctor cannot read."""


def parse_size(text: str | int | float) -> int:
    """Bytes from "224MiB", "1.5GB", "4096" or a number. GB and GiB both mean 1024**3,
    as PyTorch's own messages do."""
    if isinstance(text, bool):
        raise SizeError(f"not a size: {text!r}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise SizeError(f"a size cannot be negative: {text!r}")
        return int(text)
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise SizeError(f"not a size: {text!r} (try 224MiB, 16GiB or a byte count)")
    return round(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
