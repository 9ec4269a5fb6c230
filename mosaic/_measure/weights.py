"""Weight errors: how far each version of a unit is from the reference weights, read from the files alone.

For a unit (one tensor kind of a layer, a layer's routed experts, a whole layer) and a version of it (the
base's or a donor's), ``eps = Σ‖W_v − W_ref‖² / Σ‖W_ref‖²`` over the unit's tensors, the squares summed in
float64 over the dequantized values (for GGUF ggml's own C where a compiled llama-cpp-python is installed, checked
bit for bit against gguf-py's ``gguf.quants.dequantize`` first, else gguf-py: :mod:`mosaic._formats.ggml_dequant`;
exllamav3's reconstruction for EXL3). ``W_ref`` is the teacher's tensor when the teacher is a model holding it with the
same shape, else the version with the most bits per weight among the base and the donors.

Why it is worth having: the error a quantization leaves in a tensor is known exactly without running the
model, so a measurement needs forward passes only to learn how much the model *feels* each unit's error
(:mod:`.calibrate`), not to rank every version of every unit.

A tensor is read in chunks of elements, every version and the reference at the same element positions (a
multiple of every block size involved), on threads, so the working memory stays below
:data:`WORK_BUDGET` whatever the tensor: a 262,144 × 640 embedding or a 100 GB stack of experts never needs
its floats at once. Each sum is cached in mosaic's cache under the SHA-256 of the files involved, so a run
again (another method, another shard on the same host) reads nothing twice.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mosaic._base.errors import FormatError, MosaicError
from mosaic._base.faults import check_cancel
from mosaic._base.hashing import parallel_map
from mosaic._base.progress import SILENT, Reporter
from mosaic._build.digest_cache import cache_root
from mosaic._eval.backends import exllamav3_rows
from mosaic._formats import ggml_dequant
from mosaic._formats.gguf_container import type_name
from mosaic._measure.importance import Importance

#: Working memory of all threads together, whatever the tensors (raw bytes, dequantized floats, float64
#: copies and the difference of the chunks in flight).
WORK_BUDGET = 192 << 20
#: Bytes held per element of a chunk in flight: the version's and the reference's raw bytes and float32
#: values, their float64 copies, the difference, and gguf-py's own temporaries while it dequantizes.
BYTES_PER_ELEMENT = 64
#: The cache's record format (a line per computed pair).
_CACHE_FORMAT = 1

#: The reference every version of a tensor is compared with (``settings.weights_reference``).
TEACHER, MOST_BITS, MIXED = "teacher", "most-bits", "teacher, else most-bits"


@dataclass(frozen=True)
class Stored:
    """One stored tensor: where its bytes are, how they decode, and what names it in the cache."""

    path: Path
    start: int
    nbytes: int
    type_id: int
    elements: int
    key: str  # "<SHA-256 of its file>:<tensor name>": the same key is the same bytes
    row: int = 0  # elements per row (ggml's ne[0], the input width); 0: unknown (no weighting possible)
    experts: int = 1  # the stacked experts of a 3-D expert tensor (ne[2]); 1 otherwise

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / max(1, self.elements)


def _block(type_id: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type, from gguf-py's own table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (KeyError, ValueError):
        raise FormatError(f"ggml type {type_id}: gguf-py does not know its block size") from None


def chunk_elements(types: Iterable[int], threads: int, budget: int = WORK_BUDGET) -> int:
    """Elements per chunk: a multiple of every block size among ``types``, and small enough that
    ``threads`` chunks in flight stay within ``budget`` bytes."""
    step = 1
    for t in set(types):
        step = math.lcm(step, _block(t)[0])
    per = budget // (max(1, threads) * BYTES_PER_ELEMENT)
    return max(step, per // step * step)


def _dequantize(raw: np.ndarray, type_id: int, what: str) -> np.ndarray:
    try:
        return ggml_dequant.dequantize(raw, type_id)
    except (NotImplementedError, ValueError) as e:
        raise MosaicError(f"{what}: gguf-py cannot dequantize its type ({e}); the weight error of this unit is unknown") from None


def _read(fd: int, t: Stored, first: int, count: int) -> np.ndarray:
    """Elements ``first .. first+count`` of ``t`` as raw bytes (whole blocks: both are block multiples)."""
    per, size = _block(t.type_id)
    a, n = first // per * size, count // per * size
    data = os.pread(fd, n, t.start + a)
    if len(data) != n:
        raise FormatError(f"{t.path}: ends inside tensor {t.key.split(':', 1)[1]!r}")
    return np.frombuffer(data, dtype=np.uint8)


def _weighted(m: np.ndarray, row0: int, rows_per_expert: int, s: np.ndarray) -> float:
    """``Σ_{r,j} s[e(r), j] · m[r, j]`` for the rows ``row0 ..`` of a tensor whose expert ``e(r)`` is
    ``r // rows_per_expert``: each expert's rows summed into one row first, then one dot product with its
    weights (a chunk may straddle experts)."""
    total = 0.0
    end = row0 + m.shape[0]
    r = row0
    while r < end:
        e = r // rows_per_expert
        stop = min(end, (e + 1) * rows_per_expert)
        total += float(np.dot(m[r - row0 : stop - row0].sum(axis=0), s[e]))
        r = stop
    return total


def squared_errors(ref: Stored, versions: Sequence[Stored], chunk: int,
                   on_elements: Callable[[int], None] | None = None,
                   weights: np.ndarray | None = None) -> tuple[float, list[float]]:
    """``(Σ W_ref², [Σ (W_v − W_ref)² for each version])``, float64 sums over chunks of ``chunk`` elements
    (a multiple of every block size involved); one read of the reference for all versions. With ``weights``
    (``s``, shape ``(experts, row)``: an importance matrix's values over their mean) every square is weighted
    by its input channel's ``s`` (its expert's row of it), and ``chunk`` must be a multiple of the row."""
    for v in versions:
        if v.elements != ref.elements:
            raise MosaicError(f"{v.key}: {v.elements} elements, its reference {ref.key} {ref.elements}")
    rows_per_expert = 0
    if weights is not None:
        if ref.row <= 0 or chunk % ref.row or weights.shape != (ref.experts, ref.row):
            raise ValueError(f"{ref.key}: weights of shape {weights.shape} for rows of {ref.row} in {ref.experts} expert(s)")
        rows_per_expert = ref.elements // (ref.row * ref.experts)
    fds: dict[Path, int] = {}

    def fd(p: Path) -> int:
        if p not in fds:
            fds[p] = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fds[p]

    def total(x: np.ndarray, first: int) -> float:  # Σ x² (x is the chunk's values or their differences)
        if weights is None:
            return float(np.dot(x, x))
        np.multiply(x, x, out=x)
        return _weighted(x.reshape(-1, ref.row), first // ref.row, rows_per_expert, weights)

    sq = 0.0
    errs = [0.0] * len(versions)
    name = ref.key.split(":", 1)[1]
    try:
        for first in range(0, ref.elements, chunk):
            check_cancel()
            count = min(chunk, ref.elements - first)
            r = _dequantize(_read(fd(ref.path), ref, first, count), ref.type_id, f"{ref.path}: tensor {name!r}").astype(np.float64)
            for i, v in enumerate(versions):
                if v.key == ref.key:
                    continue  # the reference itself (its own pair holds its Σ W_ref²): no error
                w = _dequantize(_read(fd(v.path), v, first, count), v.type_id, f"{v.path}: tensor {name!r}").astype(np.float64)
                np.subtract(w, r, out=w)
                errs[i] += total(w, first)
                del w
            sq += total(r, first)
            del r
            if on_elements is not None:
                on_elements(count * (1 + len(versions)))
    finally:
        for f in fds.values():
            os.close(f)
    return sq, errs


# --------------------------------------------------------------------------------------------- cache


class Cache:
    """Sums already computed, one JSON line per (reference tensor, version tensor, weighting) triple, in one
    file per reference file (``<cache>/weights/<sha256>.jsonl``). Keys hold the files' SHA-256 (and, for a
    weighted sum, the importance matrix's), so an entry can only be the sum of those very bytes; a file that
    cannot be read or written only costs time."""

    def __init__(self, root: Path | None) -> None:
        self._root = None if root is None else root / "weights"
        self._known: dict[tuple[str, str, str], tuple[float, float]] = {}
        self._loaded: set[str] = set()
        self._lock = threading.Lock()

    def _file(self, ref_key: str) -> Path | None:
        return None if self._root is None else self._root / f"{ref_key.split(':', 1)[0]}.jsonl"

    def _load(self, ref_key: str) -> None:
        sha = ref_key.split(":", 1)[0]
        if sha in self._loaded:
            return
        self._loaded.add(sha)
        path = self._file(ref_key)
        try:
            lines = path.read_bytes().splitlines() if path is not None else []
        except OSError:
            return
        for line in lines:
            try:
                rec = json.loads(line)
                if rec.get("format") != _CACHE_FORMAT:
                    continue
                key = (str(rec["ref"]), str(rec["version"]), str(rec.get("weights", "")))
                self._known[key] = (float(rec["err"]), float(rec["sq"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a line cut short by an interrupted run

    def get(self, ref_key: str, version_key: str, weights: str = "") -> tuple[float, float] | None:
        with self._lock:
            self._load(ref_key)
            return self._known.get((ref_key, version_key, weights))

    def put(self, ref_key: str, version_key: str, err: float, sq: float, weights: str = "") -> None:
        with self._lock:
            self._known[(ref_key, version_key, weights)] = (err, sq)
            path = self._file(ref_key)
            if path is None:
                return
            rec: dict[str, object] = {"format": _CACHE_FORMAT, "ref": ref_key, "version": version_key, "err": err, "sq": sq}
            if weights:
                rec["weights"] = weights
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
            except OSError:
                return


# ---------------------------------------------------------------------------------------- the tables


@dataclass(frozen=True)
class Weighting:
    """The importance of a tensor's input channels: ``key`` names it in the cache (the importance matrix's
    SHA-256, and its ceiling where it has one), ``load`` reads ``s`` (shape ``(experts, row)``, mean 1) when the
    tensor's sums are computed."""

    key: str
    load: Callable[[], np.ndarray]


@dataclass(frozen=True)
class Task:
    """One tensor: its reference, every version of it whose error is wanted, and its weighting (``None``:
    every input channel weighs the same)."""

    name: str
    ref: Stored
    versions: tuple[Stored, ...]
    weighting: Weighting | None = None


def tensor_sums(tasks: Sequence[Task], threads: int, progress: Reporter = SILENT,
                cache: Cache | None = None) -> dict[tuple[str, str], tuple[float, float]]:
    """``(reference key, version key) -> (Σ (W_v − W_ref)², Σ W_ref²)`` for every version of every task (each
    square weighted by the task's weighting, if it has one): cached sums taken as they are, the rest computed
    on ``threads`` threads."""
    cache = cache if cache is not None else Cache(cache_root())
    out: dict[tuple[str, str], tuple[float, float]] = {}
    todo: list[Task] = []
    for t in tasks:
        wkey = t.weighting.key if t.weighting is not None else ""
        missing = []
        for v in t.versions:
            hit = cache.get(t.ref.key, v.key, wkey)
            if hit is None:
                missing.append(v)
            else:
                out[(t.ref.key, v.key)] = hit
        if missing:
            todo.append(Task(t.name, t.ref, tuple(dict.fromkeys(missing)), t.weighting))
    if not todo:
        return out
    types = {x.type_id for t in todo for x in (t.ref, *t.versions)}
    _probe(todo)
    chunk = chunk_elements(types, threads)
    advance = progress.step("weight errors (dequantized and compared)", sum(t.ref.elements * (1 + len(t.versions)) for t in todo))

    def one(t: Task) -> tuple[Task, float, list[float]]:
        if t.weighting is None:
            sq, errs = squared_errors(t.ref, t.versions, chunk, advance)
        else:  # whole rows per chunk, so that each square meets its channel's weight
            rows = max(1, chunk // t.ref.row)
            sq, errs = squared_errors(t.ref, t.versions, rows * t.ref.row, advance, t.weighting.load())
        for v, e in zip(t.versions, errs):
            cache.put(t.ref.key, v.key, e, sq, t.weighting.key if t.weighting is not None else "")
        return t, sq, errs

    # the largest first, so that the threads finish together
    for t, sq, errs in parallel_map(one, sorted(todo, key=lambda t: -t.ref.elements), threads):
        for v, e in zip(t.versions, errs):
            out[(t.ref.key, v.key)] = (e, sq)
    return out


def _probe(tasks: Sequence[Task]) -> None:
    """Each quantized type's decoder decided before the sums start (:func:`ggml_dequant.verify`), from blocks
    spread over the largest tensor of that type among ``tasks``: the C function is held to gguf-py across a
    tensor's whole range, not only its first chunk."""
    largest: dict[int, Stored] = {}
    for t in tasks:
        for x in (t.ref, *t.versions):
            if x.type_id not in largest or x.nbytes > largest[x.type_id].nbytes:
                largest[x.type_id] = x
    for type_id, x in largest.items():
        try:
            per, size = _block(type_id)
        except FormatError:
            continue  # the sums themselves say it
        if per == 1:  # F32, F16, BF16, the integers: converted, not decoded
            continue
        offsets = ggml_dequant.spread_blocks(x.nbytes, type_id)
        fd = os.open(x.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            raw = b"".join(os.pread(fd, size, x.start + at) for at in offsets)
        finally:
            os.close(fd)
        if len(raw) == size * len(offsets):
            ggml_dequant.verify(np.frombuffer(raw, dtype=np.uint8), type_id)


def ratio(err: float, sq: float) -> float:
    """``eps`` of sums: relative where the reference has any weight, the plain squared error otherwise."""
    return err / sq if sq > 0 else err


@dataclass(frozen=True)
class Errors:
    """Every unit's weight error at every version it has (``(unit index, "base" or donor id) -> eps``), and
    what the versions were compared with (:data:`TEACHER`, :data:`MOST_BITS` or :data:`MIXED`)."""

    eps: dict[tuple[int, str], float]
    reference: str
    weighted: tuple[str, ...] = ()  # the tensors whose squares an importance matrix weighted
    types: tuple[str, ...] = ()  # the ggml types of the tensors compared (the versions' and the references')


def _stored(model: object, t: object, digests: dict[str, str]) -> Stored:
    ne = t.ne  # type: ignore[attr-defined]
    return Stored(model.path(t.file), t.start, t.nbytes, t.type_id, t.elements, f"{digests[t.file]}:{t.name}",  # type: ignore[attr-defined]
                  ne[0], ne[2] if len(ne) >= 3 else 1)


def gguf_errors(units: Sequence[object], versions: dict[str, object], digests: dict[str, dict[str, str]],
                teacher: tuple[object, dict[str, str]] | None, threads: int, progress: Reporter = SILENT,
                importance: Importance | None = None) -> Errors:
    """The weight errors of GGUF units. ``versions``: ``"base"`` and each donor id → its model (base first,
    then the donors in order: the order that breaks a tie of bits per weight); ``digests``: each version's
    file name → SHA-256; ``teacher``: the teacher model and its digests, when it is a model; ``importance``:
    an importance matrix checked against the base (:meth:`Imatrix.for_model`), whose values (under its ceiling,
    where it has one) weight every square of the tensors it holds (the others keep ``s = 1``). A unit's versions
    are the base's and those of the donors holding every tensor of it with the base's shape."""
    by_name = {vid: m.by_name() for vid, m in versions.items()}  # type: ignore[attr-defined]
    base_t = by_name["base"]
    tmodel, tdig = teacher if teacher is not None else (None, {})
    tnames = tmodel.by_name() if tmodel is not None else {}  # type: ignore[attr-defined]

    def holds(vid: str, n: str) -> bool:
        return n in by_name[vid] and by_name[vid][n].ne == base_t[n].ne

    def stored(vid: str, n: str) -> Stored:
        return _stored(versions[vid], by_name[vid][n], digests[vid])

    refs: dict[str, Stored] = {}
    tasks: list[Task] = []
    from_teacher = 0
    for n in dict.fromkeys(n for u in units for n in u.tensors):  # type: ignore[attr-defined]
        tt = tnames.get(n)
        if tt is not None and tt.ne == base_t[n].ne:
            refs[n] = _stored(tmodel, tt, tdig)
            from_teacher += 1
        else:  # the most bits per weight; ties: the base, then the donors in order
            best = max((vid for vid in versions if holds(vid, n)),
                       key=lambda vid: by_name[vid][n].nbytes / max(1, by_name[vid][n].elements))
            refs[n] = stored(best, n)
        weighting = None
        if importance is not None and n in importance.imatrix.entries and not importance.imatrix.entries[n].empty:
            weighting = Weighting(importance.key, lambda n=n: importance.weights(n))
        tasks.append(Task(n, refs[n], (refs[n], *(stored(vid, n) for vid in versions if holds(vid, n))), weighting))
    sums = tensor_sums(tasks, threads, progress)
    eps: dict[tuple[int, str], float] = {}
    for ui, u in enumerate(units):
        for vid in versions:
            if not all(holds(vid, n) for n in u.tensors):  # type: ignore[attr-defined]
                continue
            err = sum(sums[(refs[n].key, stored(vid, n).key)][0] for n in u.tensors)  # type: ignore[attr-defined]
            sq = sum(sums[(refs[n].key, refs[n].key)][1] for n in u.tensors)  # type: ignore[attr-defined]
            eps[(ui, vid)] = ratio(err, sq)
    kind = MIXED if 0 < from_teacher < len(refs) else TEACHER if from_teacher else MOST_BITS
    weighted = tuple(t.name for t in tasks if t.weighting is not None)
    types = tuple(sorted({type_name(x.type_id) for t in tasks for x in (t.ref, *t.versions)}))
    return Errors(eps, kind, weighted, types)


# ------------------------------------------------------------------------------------------------ EXL3


#: exllamav3's reconstruction of one EXL3 linear: (its shard, its module key, rows per block) -> its weight
#: [out_features, in_features] as float32 blocks of rows. Needs a CUDA GPU; tests put a stand-in here.
EXL3_RECONSTRUCT: Callable[[Path, str, int], Iterator[np.ndarray]] = exllamav3_rows

_FLOAT_DTYPES = {"F32": (4, np.float32), "F16": (2, np.float16), "BF16": (2, None)}


def _plain_rows(path: Path, start: int, dtype: str, shape: tuple[int, ...], rows: int) -> Iterator[np.ndarray]:
    """An unquantized [out, in] tensor of a safetensors file (F32, F16, BF16), ``rows`` rows at a time."""
    size, npt = _FLOAT_DTYPES[dtype]
    width = shape[1]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for a in range(0, shape[0], rows):
            n = min(rows, shape[0] - a) * width
            raw = os.pread(fd, n * size, start + a * width * size)
            if len(raw) != n * size:
                raise FormatError(f"{path}: ends inside a tensor")
            if npt is None:  # bfloat16: the high half of a float32
                x = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                x = np.frombuffer(raw, npt).astype(np.float32)
            yield x.reshape(-1, width)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Linear:
    """Where one version of an EXL3 linear (or the teacher's plain weight) is, and how to read its rows."""

    key: str  # cache identity: "<SHA-256 of its shard>:<module key>"
    rows: Callable[[int], Iterator[np.ndarray]]
    bits: float


def _teacher_linears(teacher: Path, keys: set[str], digest: Callable[[Path], str]) -> dict[str, _Linear]:
    """The teacher's version of each module it holds: an unquantized ``<key>.weight`` (F32, F16 or BF16,
    [out, in]) or an EXL3 linear of its own."""
    from mosaic._formats.safetensors_reader import read_header

    out: dict[str, _Linear] = {}
    for shard in sorted(teacher.glob("*.safetensors")):
        h = read_header(shard)
        for key in keys:
            w = f"{key}.weight"
            if key in out:
                continue
            if w in h and h[w].dtype in _FLOAT_DTYPES and len(h[w].shape) == 2:
                t = h[w]
                out[key] = _Linear(f"{digest(shard)}:{w}",
                                   lambda rows, s=shard, t=t, h=h: _plain_rows(s, h.data_start + t.begin, t.dtype, t.shape, rows),
                                   8 * _FLOAT_DTYPES[t.dtype][0])
            elif f"{key}.trellis" in h:
                out[key] = _Linear(f"{digest(shard)}:{key}", lambda rows, s=shard, k=key: EXL3_RECONSTRUCT(s, k, rows),
                                   h[f"{key}.trellis"].shape[-1] / 16)
    return out


def _linear_sums(ref: _Linear, versions: Sequence[_Linear], width: int, threads: int,
                 on_elements: Callable[[int], None]) -> tuple[float, list[float]]:
    rows = max(1, WORK_BUDGET // (max(1, threads) * BYTES_PER_ELEMENT * max(1, width)))
    its = [ref.rows(rows), *(v.rows(rows) for v in versions)]
    sq, errs = 0.0, [0.0] * len(versions)
    for blocks in zip(*its, strict=True):
        check_cancel()
        r = blocks[0].astype(np.float64)
        if any(b.shape != r.shape for b in blocks):
            raise MosaicError(f"{ref.key}: its versions reconstruct to different shapes ({[b.shape for b in blocks]})")
        sq += float(np.dot(r.ravel(), r.ravel()))
        for i, (v, b) in enumerate(zip(versions, blocks[1:])):
            if v.key != ref.key:
                d = b.astype(np.float64) - r
                errs[i] += float(np.dot(d.ravel(), d.ravel()))
        on_elements(r.size * len(blocks))
    return sq, errs


def exl3_errors(units: Sequence[object], analyses: dict[str, object], digests: dict[str, dict[str, str]],
                teacher: Path | None, threads: int, progress: Reporter = SILENT) -> Errors:
    """The weight errors of EXL3 units (every donor has every unit: the plan checked it). ``analyses``:
    ``"base"`` and each donor id → its analysis; the teacher: an unquantized checkpoint or an EXL3 one."""
    from mosaic._base.hashing import digest_file
    from mosaic._build.digest_cache import identity, lookup, store

    def digest(shard: Path) -> str:
        e = lookup(shard)
        if e is not None and e.size == shard.stat().st_size:
            return e.sha256
        before = identity(shard)
        d = digest_file(shard, on_bytes=progress.step(f"hashing {shard.name}", shard.stat().st_size))
        store(shard, d.sha256, {}, identity_before=before)
        return d.sha256

    keys = {k for u in units for k in u.tensors}  # type: ignore[attr-defined]  # an EXL3 unit's modules
    tlin = _teacher_linears(teacher, keys, digest) if teacher is not None else {}
    lin: dict[tuple[str, str], _Linear] = {}
    width: dict[str, int] = {}
    for vid, a in analyses.items():
        ck = a.ckpt  # type: ignore[attr-defined]
        for k in keys:
            m = a.modules[k]  # type: ignore[attr-defined]
            if not m.is_exl3:
                continue
            shard = ck.tensor_file[f"{k}.trellis"]
            path = ck.root / shard
            lin[(k, vid)] = _Linear(f"{digests[vid][shard]}:{k}", lambda rows, p=path, k=k: EXL3_RECONSTRUCT(p, k, rows), m.bits)
            width[k] = m.in_features
    cache = Cache(cache_root())
    refs: dict[str, _Linear] = {}
    todo: list[tuple[str, _Linear, list[_Linear]]] = []
    for k in sorted(width):
        vs = [lin[(k, vid)] for vid in analyses if (k, vid) in lin]
        refs[k] = tlin[k] if k in tlin else max(vs, key=lambda v: v.bits)
        missing = [v for v in dict.fromkeys([refs[k], *vs]) if cache.get(refs[k].key, v.key) is None]
        if missing:
            todo.append((k, refs[k], missing))
    advance = progress.step("weight errors (reconstructed and compared)", sum(
        width[k] * (analyses["base"].modules[k].out_features or 0) * (1 + len(vs)) for k, _, vs in todo))  # type: ignore[attr-defined]
    for k, ref, vs in todo:  # one module at a time: exllamav3 reconstructs on the one GPU
        sq, errs = _linear_sums(ref, vs, width[k], threads, advance)
        for v, e in zip(vs, errs):
            cache.put(ref.key, v.key, e, sq)
    eps: dict[tuple[int, str], float] = {}
    for ui, u in enumerate(units):
        for vid in analyses:
            err = sq = 0.0
            for k in u.tensors:  # type: ignore[attr-defined]
                if (k, vid) not in lin:
                    continue
                e, _ = cache.get(refs[k].key, lin[(k, vid)].key) or (0.0, 0.0)
                err += e
                sq += (cache.get(refs[k].key, refs[k].key) or (0.0, 0.0))[1]
            eps[(ui, vid)] = ratio(err, sq)
    from_teacher = sum(k in tlin for k in width)
    kind = MIXED if 0 < from_teacher < len(width) else TEACHER if from_teacher else MOST_BITS
    return Errors(eps, kind)
