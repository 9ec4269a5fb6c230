"""Importance matrices as llama.cpp writes them: a strict reader for both of its formats.

An importance matrix holds, for each weight tensor a model multiplies its activations with, the sum over
calibration tokens of ``x_j²`` for every input channel ``j`` (one row per routed expert for a 3-D expert
tensor): how much each input column of the weight matters to the tensor's output. ``llama-quantize
--imatrix`` weighs its rounding error by it; ``mosaic measure --imatrix`` weighs the weight error of a
unit by it. Two formats, told apart by content:

- **GGUF** (``llama-imatrix``'s default): ``general.type`` = ``imatrix``, ``imatrix.datasets`` (strings),
  ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32); per weight ``<name>`` a tensor ``<name>.in_sum2``
  (F32, ne ``(n_in)`` or ``(n_in, n_expert)``: the raw Σx²) and ``<name>.counts`` (F32, ne ``(1)`` or
  ``(1, n_expert)``: the tokens each row summed). Read by mosaic's strict GGUF reader
  (:func:`mosaic._formats.gguf_container.read_gguf`); a GGUF model file is not an importance matrix.
- **legacy** ``.dat`` (``--output-format dat``): int32 entry count ≥ 1; per entry int32 name length, the name,
  int32 ``ncall``, int32 value count, that many float32 (each expert row's per-token mean × ``ncall``); then,
  optionally, int32 chunk count, int32 length and the dataset's name. Every length is checked against what
  is left of the file before it is trusted; nothing may follow.

Every value is read once when the file is opened and refused if it is NaN, infinite or negative; the
values themselves are kept on disk and read again, one tensor at a time, when a caller asks for them
(:meth:`Imatrix.values`), so memory stays one tensor's row whatever the model. Which tensors the model
has, and their widths, is the caller's to check (:meth:`Imatrix.for_model`): this module knows files,
not models.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mosaic._base.errors import FormatError
from mosaic._formats.gguf_container import GGUFError, read_gguf

GGUF_MAGIC = b"GGUF"
SUM2, COUNTS = ".in_sum2", ".counts"
F32 = 0
#: Values checked per read while the file is opened (bounded memory for a matrix of any size).
_CHECK_VALUES = 1 << 22


class ImatrixError(FormatError):
    """A file is not a usable importance matrix; the message names the file and, where there is one, the tensor."""


@dataclass(frozen=True)
class Entry:
    """One weight's statistics: ``rows`` rows (its experts; 1 for a dense weight) of ``n_in`` float32 values
    at ``offset`` in the file, and the tokens each row summed (GGUF; ``None`` in a ``.dat``, which keeps only
    per-token means)."""

    name: str
    n_in: int
    rows: int
    offset: int
    counts: tuple[float, ...] | None
    empty: bool = False  # every value is 0: nothing reached the weight while the matrix was made


@dataclass(frozen=True)
class Imatrix:
    """An importance matrix read strictly: its format (``gguf`` or ``dat``), what made it and its entries."""

    path: Path
    format: str
    datasets: tuple[str, ...]
    chunk_count: int | None
    chunk_size: int | None
    entries: Mapping[str, Entry]

    def values(self, name: str) -> np.ndarray:
        """The entry's values as float64, shape ``(rows, n_in)``, read from the file again."""
        e = self.entries[name]
        n = e.rows * e.n_in
        with open(self.path, "rb") as f:
            f.seek(e.offset)
            raw = f.read(4 * n)
        if len(raw) != 4 * n:
            raise ImatrixError(f"{self.path}: ends inside the values of {name!r} (the file changed while in use?)")
        a = np.frombuffer(raw, dtype="<f4").astype(np.float64).reshape(e.rows, e.n_in)
        if not np.isfinite(a).all() or (a < 0).any():
            raise ImatrixError(f"{self.path}: {name!r} holds a NaN, infinite or negative value (the file changed while in use?)")
        return a

    def weights(self, name: str) -> np.ndarray:
        """``s``: the entry's values divided by their mean over every row and channel (mean 1), shape
        ``(rows, n_in)``. An entry whose values are all 0 weighs nothing: the caller leaves it out."""
        v = self.values(name)
        mean = float(v.mean())
        if mean <= 0:
            raise ImatrixError(f"{self.path}: {name!r} holds only zeros: it weighs nothing")
        return v / mean

    def weighing(self) -> list[str]:
        """The entries that weigh something (not every value 0), in the file's order."""
        return [n for n, e in self.entries.items() if not e.empty]

    def for_model(self, tensors: Mapping[str, tuple[int, ...]]) -> Imatrix:
        """This matrix checked against a model (``tensors``: name → ggml ``ne``, innermost first): every entry
        names a tensor of it and holds its input width × its experts values (one line naming the first that
        does not). A ``.dat`` keeps one flat list per weight; here each becomes ``n_expert`` rows of the input
        width, as the GGUF format keeps them."""
        shaped: dict[str, Entry] = {}
        for name, e in self.entries.items():
            ne = tensors.get(name)
            if ne is None:
                raise ImatrixError(f"{self.path}: {name!r} is not a tensor of the model (an importance matrix of another model?)")
            experts = ne[2] if len(ne) >= 3 else 1
            if e.n_in * e.rows != ne[0] * experts or (e.counts is not None and (e.n_in, e.rows) != (ne[0], experts)):
                raise ImatrixError(f"{self.path}: {name!r} holds {e.n_in * e.rows} values ({e.rows} × {e.n_in}), but the "
                                   f"tensor's input width is {ne[0]} with {experts} expert(s): {ne[0] * experts} values")
            shaped[name] = Entry(name, ne[0], experts, e.offset, e.counts, e.empty)
        return Imatrix(self.path, self.format, self.datasets, self.chunk_count, self.chunk_size, shaped)


def _check_values(path: Path, f: object, offset: int, n: int, what: str) -> bool:
    """Refuse a NaN, an infinity or a negative value among the ``n`` float32 at ``offset``; whether any is
    positive."""
    done = 0
    positive = False
    while done < n:
        k = min(_CHECK_VALUES, n - done)
        f.seek(offset + 4 * done)  # type: ignore[attr-defined]
        raw = f.read(4 * k)  # type: ignore[attr-defined]
        if len(raw) != 4 * k:
            raise ImatrixError(f"{path}: truncated: the file ends inside {what}")
        a = np.frombuffer(raw, dtype="<f4")
        if not np.isfinite(a).all():
            raise ImatrixError(f"{path}: {what} holds a NaN or infinite value")
        if (a < 0).any():
            raise ImatrixError(f"{path}: {what} holds a negative value ({float(a[a < 0][0])}); sums of squares are never negative")
        positive = positive or bool((a > 0).any())
        done += k
    return positive


def _u32(h: object, key: str, path: Path) -> int | None:
    kv = h.kvs.get(key)  # type: ignore[attr-defined]
    if kv is None:
        return None
    if not isinstance(kv.value, int) or isinstance(kv.value, bool) or kv.value < 0:
        raise ImatrixError(f"{path}: key {key!r} is not a non-negative integer ({kv.value!r})")
    return int(kv.value)


def _read_gguf(path: Path) -> Imatrix:
    try:
        h = read_gguf(path)
    except GGUFError as e:
        raise ImatrixError(f"not a readable importance matrix: {e}") from None
    kind = h.value("general.type")
    if kind != "imatrix":
        arch = h.value("general.architecture")
        what = f"a GGUF model (general.architecture {arch})" if arch is not None else f"a GGUF file of general.type {kind!r}"
        raise ImatrixError(f"{path}: {what}, not an importance matrix (general.type 'imatrix', as llama-imatrix writes)")
    ds = h.kvs.get("imatrix.datasets")
    datasets: tuple[str, ...] = ()
    if ds is not None:
        if not isinstance(ds.value, list) or not all(isinstance(x, str) for x in ds.value):
            raise ImatrixError(f"{path}: key 'imatrix.datasets' is not an array of strings")
        datasets = tuple(ds.value)
    by_name = {t.name: t for t in h.tensors}
    entries: dict[str, Entry] = {}
    with open(path, "rb") as f:
        for t in h.tensors:
            if t.name.endswith(COUNTS):
                if t.name[: -len(COUNTS)] + SUM2 not in by_name:
                    raise ImatrixError(f"{path}: tensor {t.name!r} has no {t.name[: -len(COUNTS)] + SUM2!r} beside it")
                continue
            if not t.name.endswith(SUM2):
                raise ImatrixError(f"{path}: tensor {t.name!r} is neither '<weight>{SUM2}' nor '<weight>{COUNTS}'")
            name = t.name[: -len(SUM2)]
            c = by_name.get(name + COUNTS)
            if c is None:
                raise ImatrixError(f"{path}: tensor {t.name!r} has no {name + COUNTS!r} beside it")
            for x in (t, c):
                if x.type_id != F32:
                    raise ImatrixError(f"{path}: tensor {x.name!r} is not F32")
            rows = t.ne[1] if len(t.ne) > 1 else 1
            if len(t.ne) > 2 or c.ne not in ((1,), (1, rows)) or (len(t.ne) == 1 and c.ne != (1,)):
                raise ImatrixError(f"{path}: tensor {t.name!r} has ne {list(t.ne)} and its counts {list(c.ne)}: "
                                   "expected (n_in) and (1), or (n_in, n_expert) and (1, n_expert)")
            start = h.data_start + t.offset
            positive = _check_values(path, f, start, rows * t.ne[0], f"tensor {t.name!r}")
            cstart = h.data_start + c.offset
            _check_values(path, f, cstart, rows, f"tensor {c.name!r}")
            f.seek(cstart)
            counts = tuple(float(x) for x in np.frombuffer(f.read(4 * rows), dtype="<f4"))
            entries[name] = Entry(name, t.ne[0], rows, start, counts, not positive)
    if not entries:
        raise ImatrixError(f"{path}: an importance matrix with no '<weight>{SUM2}' tensor")
    return Imatrix(path, "gguf", datasets, _u32(h, "imatrix.chunk_count", path), _u32(h, "imatrix.chunk_size", path), entries)


class _Reader:
    """A ``.dat`` read front to back, every length checked against what is left before it is used."""

    def __init__(self, path: Path, size: int, f: object) -> None:
        self.path, self.size, self.f, self.pos = path, size, f, 0

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left():
            raise ImatrixError(f"{self.path}: truncated: the file ends inside {what} (at byte {self.pos}, "
                               f"{n} bytes wanted, {self.left()} left)")
        raw = self.f.read(n)  # type: ignore[attr-defined]
        self.pos += n
        return raw

    def i32(self, what: str) -> int:
        return int(struct.unpack("<i", self.take(4, what))[0])


def _read_dat(path: Path) -> Imatrix:
    size = path.stat().st_size
    not_one = f"{path}: not an importance matrix (neither GGUF nor llama-imatrix's .dat)"
    entries: dict[str, Entry] = {}
    with open(path, "rb") as f:
        r = _Reader(path, size, f)
        if size < 4:
            raise ImatrixError(f"{not_one}: {size} bytes")
        n = r.i32("the entry count")
        if n < 1 or n > size // 13:  # every entry takes at least 13 bytes: three int32, a name, a value
            raise ImatrixError(f"{not_one}: its first int32 ({n}) is not a possible entry count for {size} bytes")
        for i in range(n):
            k = r.i32(f"the name length of entry {i + 1}")
            if not 1 <= k <= min(r.left(), 4096):
                raise ImatrixError(f"{not_one}: entry {i + 1} has a name of {k} bytes ({r.left()} bytes left)")
            raw = r.take(k, f"the name of entry {i + 1}")
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ImatrixError(f"{not_one}: the name of entry {i + 1} is not UTF-8") from None
            if "\x00" in name or not name.isprintable():
                raise ImatrixError(f"{not_one}: the name of entry {i + 1} ({name!r}) holds a control character")
            if name in entries:
                raise ImatrixError(f"{path}: entry {name!r} appears twice")
            ncall = r.i32(f"the call count of {name!r}")
            nval = r.i32(f"the value count of {name!r}")
            if ncall < 0:
                raise ImatrixError(f"{path}: entry {name!r} has a negative call count ({ncall})")
            if not 1 <= nval <= r.left() // 4:
                raise ImatrixError(f"{path}: truncated or not an importance matrix: entry {name!r} claims {nval} values, "
                                   f"{r.left() // 4} fit in what is left")
            start = r.pos
            positive = _check_values(path, f, start, nval, f"the values of {name!r}")
            f.seek(start + 4 * nval)
            r.pos = start + 4 * nval
            entries[name] = Entry(name, nval, 1, start, None, not positive)
        chunk_count: int | None = None
        datasets: tuple[str, ...] = ()
        if r.left():
            chunk_count = r.i32("the chunk count")
            if chunk_count < 0:
                raise ImatrixError(f"{path}: a negative chunk count ({chunk_count})")
            if r.left():
                k = r.i32("the dataset name's length")
                if not 0 <= k <= r.left():
                    raise ImatrixError(f"{path}: truncated: a dataset name of {k} bytes, {r.left()} left")
                if k:
                    try:
                        datasets = (r.take(k, "the dataset name").decode("utf-8"),)
                    except UnicodeDecodeError:
                        raise ImatrixError(f"{path}: the dataset name is not UTF-8") from None
        if r.left():
            raise ImatrixError(f"{path}: {r.left()} bytes after the dataset name (not llama-imatrix's .dat layout)")
    return Imatrix(path, "dat", datasets, chunk_count, None, entries)


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """Read an importance matrix strictly (either format, by content): one :class:`ImatrixError` line
    naming the file and the rule it breaks for anything else."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ImatrixError(f"{p}: cannot read the importance matrix: {e.strerror or e}") from None
    if head == GGUF_MAGIC:
        return _read_gguf(p)
    try:
        return _read_dat(p)
    except OSError as e:
        raise ImatrixError(f"{p}: cannot read the importance matrix: {e.strerror or e}") from None

