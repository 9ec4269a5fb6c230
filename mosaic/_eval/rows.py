"""The pre-registered rows of an evaluation: one text per non-empty line, or JSONL with a ``text`` field.

A row is the unit the panel compares candidates on ("32/32 rows improve"), so the file is read exactly:
its SHA-256 goes into a saved reference, and a reference is refused for another file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from mosaic._base.errors import FormatError
from mosaic._formats.safetensors_reader import strict_json_loads


@dataclass(frozen=True)
class Rows:
    texts: tuple[str, ...]
    sha256: str
    path: str


def load_rows(path: str | Path) -> Rows:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise FormatError(f"{p}: cannot read the rows: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{p}: not UTF-8 (byte {e.start})") from None
    lines = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    if not lines:
        raise FormatError(f"{p}: no rows (every line is empty)")
    jsonl = lines[0][1].lstrip().startswith("{")
    texts = []
    for i, ln in lines:
        if not jsonl:
            texts.append(ln)
            continue
        try:
            doc = strict_json_loads(ln)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{p}: line {i}: not JSON ({e}); a JSONL file holds one object per line") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("text"), str) or not doc["text"]:
            raise FormatError(f"{p}: line {i}: needs a non-empty string field \"text\"")
        texts.append(doc["text"])
    return Rows(tuple(texts), hashlib.sha256(raw).hexdigest(), str(p))
