"""Cuts of a source model that llama-quantize quantizes in place of the whole: a sample of every tensor's rows,
or some of its tensors whole.

llama.cpp quantizes a weight row by row: each row's bytes depend on that row, the type and the importance
matrix's weights for its columns, nothing else. So a row that ``llama-quantize`` writes for a file holding only
a sample of a tensor's rows is, byte for byte, the row it writes for the whole model, and a tensor it writes for
a file holding only some tensors is the tensor it writes for the whole model (``tests/test_cuts.py`` holds the
tool to both, against whole rungs). A ladder needs every type's error of every tensor, which a sample of rows
gives (as llama.cpp's own ``--target-size`` mixer estimates it), and whole tensors only at the types a plan or a
measurement takes: each made by the tool from a cut of its tensors, at a fraction of a rung's cost.

A cut is a GGUF file holding the source's metadata as it is and the chosen rows or tensors copied from the
source byte for byte (rows of a quantized tensor are whole blocks, so a row is a contiguous range). Which rows
a sample holds is fixed by the tensor's name and the seed, not by the machine: the same source gives the same
cut anywhere.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mosaic._base.errors import MosaicError
from mosaic._checkpoint.gguf_model import GGUFModel, GGUFTensor
from mosaic._checkpoint.gguf_pieces import write_gguf_pieces

#: Elements a sample takes of each tensor (of each expert's slice): about half a million, as llama.cpp's
#: --target-size samples (``tensor_budget``), and never fewer rows than MIN_ROWS.
SAMPLE_ELEMENTS = 1 << 19
MIN_ROWS = 256
SEED = 0


@dataclass(frozen=True)
class Cut:
    """A cut written: its file, its SHA-256 and size, and for a sample the rows each tensor kept (per slice)."""

    path: Path
    sha256: str
    bytes: int
    rows: dict[str, list[list[int]]]


def sample_rows(name: str, rows: int, width: int, slices: int = 1, seed: int = SEED, *,
                elements: int = SAMPLE_ELEMENTS, min_rows: int = MIN_ROWS) -> list[list[int]]:
    """The rows a sample keeps of each ``slices`` slice (an expert's rows) of a tensor of ``rows`` rows of
    ``width`` elements: all of them where the tensor is small, else ``max(min_rows, elements / (width ×
    slices))`` drawn without replacement, sorted; the draw is seeded by the tensor's name, so it is the same on
    every machine."""
    want = max(min_rows, math.ceil(elements / (width * slices)))
    if rows <= want:
        return [list(range(rows)) for _ in range(slices)]
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return [sorted(int(r) for r in rng.choice(rows, want, replace=False)) for _ in range(slices)]


def sampled(t: GGUFTensor) -> bool:
    """A weight llama-quantize quantizes: 2-D or wider, named ``*.weight`` (norms and biases stay as they are)."""
    return len(t.ne) >= 2 and t.name.endswith(".weight")


def _write(path: Path, source: GGUFModel, pieces: list[tuple[GGUFTensor, tuple[int, ...], list[tuple[int, int]]]]) -> Cut:
    """A GGUF of ``source``'s metadata and ``pieces`` (tensor, its shape in the cut, the (start, length) byte
    ranges of the source that make its data, in order)."""
    sha256, size = write_gguf_pieces(path, source, [(source, t, ne, ranges) for t, ne, ranges in pieces])
    return Cut(path, sha256, size, {})


def write_sample(source: GGUFModel, path: Path, seed: int = SEED, *, elements: int = SAMPLE_ELEMENTS,
                 min_rows: int = MIN_ROWS) -> Cut:
    """``source`` with every weight cut to :func:`sample_rows` of its rows (every expert's slice alike in count,
    each drawn apart), every other tensor whole."""
    pieces = []
    rows_kept: dict[str, list[list[int]]] = {}
    for t in source.tensors:
        if not sampled(t):
            pieces.append((t, t.ne, [(t.start, t.nbytes)]))
            continue
        rows, slices = t.ne[1], math.prod(t.ne[2:])
        row_bytes = t.nbytes // (rows * slices)
        keep = sample_rows(t.name, rows, t.ne[0], slices, seed, elements=elements, min_rows=min_rows)
        rows_kept[t.name] = keep
        ranges = [(t.start + (s * rows + r) * row_bytes, row_bytes) for s, rs in enumerate(keep) for r in rs]
        pieces.append((t, (t.ne[0], len(keep[0]), *t.ne[2:]), _merge(ranges)))
    cut = _write(path, source, pieces)
    return Cut(cut.path, cut.sha256, cut.bytes, rows_kept)


def write_subset(source: GGUFModel, path: Path, names: Iterable[str]) -> Cut:
    """``source`` holding only the tensors ``names``, each whole."""
    want = set(names)
    pieces = [(t, t.ne, [(t.start, t.nbytes)]) for t in source.tensors if t.name in want]
    missing = want - {t.name for t, _, _ in pieces}
    if missing:
        raise MosaicError(f"{source.describe()} has no tensor {sorted(missing)[0]!r}")
    return _write(path, source, pieces)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent byte ranges joined, so that consecutive rows copy in one step."""
    out: list[tuple[int, int]] = []
    for start, n in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return out
