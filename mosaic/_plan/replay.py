"""A GGUF plan as llama.cpp's own ``llama-quantize --tensor-type-file`` reads it, so that the stock tool makes the
planned file from the source without mosaic.

``llama-quantize`` reads the file as entries split on white space, each ``PATTERN=TYPE``; it lower-cases the pattern
and searches it as a regular expression anywhere in a tensor's name, the first entry that matches deciding the
tensor's type (``parse_tensor_type`` and ``llama_tensor_get_type`` in the llama.cpp ``make llama-tools`` builds).
So each name is escaped and anchored (``^blk\\.0\\.attn_q\\.weight$``): it matches that tensor and no other, and every
tensor the tool quantizes is named, so that no type is left to the tool's own mix. A tensor named at the type it
already has in the source is copied as it is, as a ladder's rungs copy it. The file has no comments: the tool
would read one as a malformed entry.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from mosaic._base.errors import MosaicError
from mosaic._formats.gguf_container import type_name
from mosaic._formats.quantizable import quantizable


def entry(name: str, type_: str) -> str:
    """One ``PATTERN=TYPE`` entry that matches the tensor ``name`` alone."""
    if re.search(r"\s", name) or name != name.lower():
        raise MosaicError(f"{name!r}: llama-quantize lower-cases a --tensor-type pattern and splits its file on white space, "
                          "so no entry can name this tensor; the plan cannot be written for it")
    return f"^{re.escape(name)}$={type_.lower()}"


def tensor_type_lines(tensors: Iterable[tuple[str, tuple[int, ...], int]]) -> list[str]:
    """Every tensor the tool quantizes (``(name, ne, ggml type id)``, in the file's order) as an entry of its type."""
    return [entry(name, type_name(type_id)) for name, ne, type_id in tensors if quantizable(name, ne)]


def types_of(lines: Iterable[str], names: Iterable[str]) -> dict[str, str]:
    """What ``llama-quantize`` makes of such a file for ``names``: each name's type by the first entry whose
    lower-cased pattern is found in it (the tool's own reading; names no entry matches are left out)."""
    entries = []
    for word in (w for line in lines for w in line.split()):
        pattern, sep, t = word.partition("=")
        if not sep or not pattern or not t:
            raise MosaicError(f"{word!r}: not a PATTERN=TYPE entry")
        entries.append((re.compile(pattern.lower()), t.upper()))
    out = {}
    for n in names:
        hit = next((t for p, t in entries if p.search(n)), None)
        if hit is not None:
            out[n] = hit
    return out


def write_tensor_types(path: Path, tensors: Iterable[tuple[str, tuple[int, ...], int]]) -> int:
    """The plan's tensors (the build's own layout: name, ``ne``, type) as ``llama-quantize --tensor-type-file``
    reads them, one entry a line, written whole or not at all; returns the number of entries. The file is read
    back by :func:`types_of` first: every tensor it names must come out at its planned type."""
    tensors = list(tensors)
    lines = tensor_type_lines(tensors)
    planned = {name: type_name(t) for name, ne, t in tensors if quantizable(name, ne)}
    if types_of(lines, planned) != planned:
        raise MosaicError(f"{path}: the tensor-type file does not read back as the plan (a tensor's name matches another's entry)")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise MosaicError(f"--tensor-type-file {path}: cannot write it: {e.strerror or e}") from None
    return len(lines)
