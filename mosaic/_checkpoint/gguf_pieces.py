"""A GGUF file made of other GGUF files' bytes: one model's metadata and tensors (or byte ranges of them) copied
from any models, laid out before the first byte is written, read back strictly, hashed and renamed into place.

What a cut of a source holds (:mod:`mosaic._measure.cuts`: a sample of each weight's rows, some tensors whole)
and what the suite's stand-in for ``llama-quantize`` writes where the tool copies a tensor: nothing in such a
file is computed, every data byte is some model's own.
"""

from __future__ import annotations

import os
from pathlib import Path

from mosaic._base.hashing import digest_file, scratch
from mosaic._checkpoint.gguf_model import GGUFModel, GGUFTensor
from mosaic._formats.gguf_container import layout, read_gguf
from mosaic._formats.safetensors_writer import copy_in_steps

#: A piece: the model its bytes lie in, the tensor it is written as (name, type), its shape in the new file, and
#: the (start, length) byte ranges of that model's files that make its data, in order.
Piece = tuple[GGUFModel, GGUFTensor, tuple[int, ...], list[tuple[int, int]]]


def whole(model: GGUFModel, t: GGUFTensor) -> Piece:
    return (model, t, t.ne, [(t.start, t.nbytes)])


def write_gguf_pieces(path: Path, meta: GGUFModel, pieces: list[Piece]) -> tuple[str, int]:
    """``path``: ``meta``'s metadata and ``pieces`` in order, written under a temporary name, read back by the
    strict reader and renamed; returns its SHA-256 and size. Nothing is left behind on a failure."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    lay = layout(list(meta.metadata.values()),
                 [(t.name, ne, t.type_id, sum(n for _, n in ranges)) for _, t, ne, ranges in pieces], meta.alignment)
    buf = scratch("copy")[0]
    fds: dict[Path, int] = {}
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            os.pwrite(dst, lay.header, 0)
            for (model, t, _, ranges), info in zip(pieces, lay.tensors):
                src = model.path(t.file)
                if src not in fds:
                    fds[src] = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                at = lay.data_start + info.offset
                for start, n in ranges:
                    copy_in_steps(fds[src], dst, n, start, at, buf=buf)
                    at += n
            os.ftruncate(dst, lay.size)
            os.fsync(dst)
        finally:
            os.close(dst)
        read_gguf(tmp)  # what was written parses strictly
        digest = digest_file(tmp).sha256
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return digest, lay.size
