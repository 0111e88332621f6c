"""Escaping for the report: text in HTML markup, in plotly labels and in the page's JSON block."""
from __future__ import annotations

import html
import json
import re
from typing import Any

from memdoctor.sanitize import printable

MAX_LABEL = 120


def esc(value: Any) -> str:
    """Text for HTML markup (element content and quoted attributes), control characters
    out (memdoctor.sanitize)."""
    return html.escape(printable("" if value is None else value, newlines=True), quote=True)


def plot_text(value: Any, limit: int = MAX_LABEL) -> str:
    """Text for a plotly label or hover: plotly reads a subset of HTML in them and decodes
    entities, so `<`, `>` and `&` go in as entities and show as themselves."""
    text = printable("" if value is None else value, newlines=True)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return html.escape(text, quote=False)


def script_json(obj: Any) -> str:
    """JSON safe inside <script>: no `<`, `>`, `&`, U+2028 or U+2029 left unescaped."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def inline_code(text: str) -> str:
    """Escape, then show `backticked` parts as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(text))
