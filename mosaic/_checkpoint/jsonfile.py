"""JSON files of a checkpoint read strictly: UTF-8, no duplicate keys, no NaN, errors naming the file.

The parse is :func:`mosaic._formats.safetensors_reader.strict_json_loadb` (C speed, proven equal to
the exact parser); this module only turns its refusals into one-line :class:`FormatError` messages and
keeps the SHA-256 of the bytes parsed, so that a later reader of the same text (a writer that splices
it) can prove it reads what was checked.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mosaic._base.errors import FormatError
from mosaic._formats.safetensors_reader import DuplicateKey, strict_json_loadb


def read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise FormatError(f"{path}: cannot read {what}: {e.strerror or e}") from None


def load_json(path: Path, what: str) -> object:
    """Read a JSON file strictly: UTF-8, no duplicate keys, no NaN; errors name the file."""
    return parse_json(read_bytes(path, what), path, what)


def load_json_digest(path: Path, what: str) -> tuple[object, str]:
    """:func:`load_json`, and the SHA-256 of the exact bytes parsed."""
    raw = read_bytes(path, what)
    return parse_json(raw, path, what), hashlib.sha256(raw).hexdigest()


def parse_json(raw: bytes, path: Path, what: str) -> object:
    """``raw`` parsed strictly; a refusal is a :class:`FormatError` naming ``path`` and ``what``."""
    try:
        return strict_json_loadb(raw)
    except DuplicateKey as e:
        raise FormatError(f"{path}: {what}: duplicate key {e.key!r}") from None
    except UnicodeDecodeError:
        raise FormatError(f"{path}: {what} is not UTF-8") from None
    except RecursionError:
        raise FormatError(f"{path}: {what} is nested too deeply") from None
    except ValueError as e:
        raise FormatError(f"{path}: {what} is not valid JSON: {e}") from None
