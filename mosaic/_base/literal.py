"""Text that comes from data, made safe to print: one line, no markup, no terminal control.

Names, paths and details come from files a user did not write (a tensor name in a header, a file
name in a manifest). Printed as they are, ``[model.layers.1.mlp]`` vanishes into rich's markup,
a newline splits one finding over two lines, an escape sequence drives the terminal, and a lone
surrogate from a JSON ``\\ud800`` escape cannot be encoded at all. Every renderer, progress
description and error line passes data through :func:`printable` (plain output) or
:func:`markup_literal` (text handed to rich).
"""

from __future__ import annotations

import re

from rich.markup import escape

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _control(m: re.Match[str]) -> str:
    c = m.group(0)
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, f"\\x{ord(c):02x}")


def printable(value: object) -> str:
    """``value`` as one line of encodable text: control characters and lone surrogates as escapes."""
    s = str(value)
    if s.isascii() and s.isprintable():
        return s
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL.sub(_control, s)


def markup_literal(value: object) -> str:
    """``value`` for a rich string that may hold markup of our own: shown literally, on one line."""
    return escape(printable(value))
