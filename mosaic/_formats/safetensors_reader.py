"""The strict safetensors reader shared by census, build and audit.

It parses a header without touching tensor data and enforces every rule of the format (see the
safetensors spec and its Rust reader), plus the one both common JSON parsers forget: duplicate keys.
One function per rule; each violation raises :class:`~mosaic._base.errors.SafetensorsError` naming the
file, the rule and, where there is one, the tensor. It accepts the official writer's space-padded
headers and exllamav3's minified, unpadded ones, with or without ``__metadata__``.

JSON is parsed at C speed (orjson) and proven equal to the strict parse before it is trusted: orjson,
like Python's json, silently keeps the last of duplicate keys, and a count that cannot be fooled
shows that none was dropped. Every ``:`` of a JSON text is either the separator of one object member
or inside a string; when the text holds no backslash escape, its colons equal those of orjson's own
re-serialization of what it parsed exactly when no member was lost. Whenever that proof is not clean
(an escape, an integer too long for 64 bits, anything orjson refuses, any rule broken), the exact
slow path (:func:`strict_json_loads` and the checks below) runs and has the last word; it alone names
a duplicate.

This module never reads tensor bytes, never trusts a length before checking it against the file,
and never executes anything from a file.
"""

from __future__ import annotations

import json
import math
import operator
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain, repeat
from pathlib import Path
from typing import NamedTuple

import orjson

from mosaic._base.errors import SafetensorsError

#: The reference reader's cap on the JSON header (bytes).
MAX_HEADER_SIZE = 100_000_000

#: Bits per element of every dtype the format knows (safetensors 0.8, sub-byte types included).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

_TENSOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
#: One string object per dtype name, and one tuple per distinct shape, shared by every entry that
#: has it: a parser makes a new object per value, ~17 MB over GLM-5.3's 151,000 entries.
_DTYPE_OBJECTS = {d: d for d in DTYPE_BITS}
_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}
_MAX_SHAPES = 1 << 16


def _shared_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    got = _SHAPES.get(shape)
    if got is None:
        if len(_SHAPES) >= _MAX_SHAPES:
            _SHAPES.clear()
        got = _SHAPES[shape] = shape
    return got
_METADATA_KEY = "__metadata__"


class TensorInfo(NamedTuple):
    """One header entry. ``begin``/``end`` are relative to the start of the byte buffer.

    A named tuple rather than a frozen dataclass: 151,000 of them are made per GLM-5.3 header set,
    and a tuple is built several times faster."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    """A validated safetensors header: tensors in byte order, and where the data starts."""

    path: str
    header_len: int
    file_size: int
    metadata: dict[str, str] | None
    tensors: tuple[TensorInfo, ...]
    _by_name: dict[str, TensorInfo] = field(repr=False, compare=False, default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> TensorInfo:
        return self._by_name[name]

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def file_range(self, name: str) -> tuple[int, int]:
        """Absolute (start, end) byte positions of a tensor in the file."""
        t = self._by_name[name]
        return self.data_start + t.begin, self.data_start + t.end


def element_count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this dtype and shape occupies; sub-byte types must fill whole bytes."""
    bits = element_count(shape) * DTYPE_BITS[dtype]
    if bits % 8:
        raise ValueError(f"{dtype} tensor of shape {list(shape)} does not fill a whole number of bytes")
    return bits // 8


# --- rules, one function each -------------------------------------------------------------------


def _check_length_prefix(path: str, prefix: bytes, file_size: int) -> int:
    if len(prefix) < 8:
        raise SafetensorsError(path, "HeaderTooSmall", f"file is {file_size} bytes, shorter than the 8-byte length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_SIZE:
        raise SafetensorsError(path, "HeaderTooLarge", f"header length {n} exceeds {MAX_HEADER_SIZE}")
    if 8 + n > file_size:
        raise SafetensorsError(
            path, "InvalidHeaderLength", f"header length {n} runs past the end of the {file_size}-byte file"
        )
    return n


class DuplicateKey(ValueError):
    """A JSON object repeats a key (Python's json and Rust's serde would silently keep the last)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``object_pairs_hook`` that refuses repeated keys (``dict(pairs)`` keeps this fast at 150k keys)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKey(k)
            seen.add(k)
    return obj


def _finite_float(text: str) -> float:
    """A number literal too large for a float (``1e400``) is refused like ``Infinity``: Python's json
    would silently read it as inf, which no checkpoint or record means (orjson refuses it too)."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} overflows a 64-bit float")
    return value


def _reject_constant(name: str) -> object:
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json_loads(text: str) -> object:
    """``json.loads`` without duplicate keys or NaN/Infinity. Raises :class:`DuplicateKey`, other
    ``ValueError`` s, or ``RecursionError`` for absurd nesting; shared by every JSON reader of mosaic."""
    return json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant, parse_float=_finite_float)


#: An integer literal of 19 digits or more may not fit 64 bits: orjson reads those as floats, where
#: Python's json keeps an exact int, so a document that has one takes the slow path.
_LONG = 19
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_NUMBER_START = frozenset(b"[:, \t\n\r")


def _has_long_integer(raw: bytes) -> bool:
    """Whether a run of 19+ digits starts a JSON number (digits inside strings, e.g. in hex
    digests, follow a quote or a letter, not a separator). A scan at C speed: a regex with a
    look-behind alternative reads 48 MB at a few tens of MB/s. Windows of 4 MB (overlapping by a
    run's length) keep the translated copy small."""
    run = b"0" * _LONG
    step = _WINDOW
    for base in range(0, max(len(raw), 1), step):
        stop = min(len(raw), base + step + _LONG)
        zeros = raw[base:stop].translate(_DIGITS_AS_ZERO)
        i = zeros.find(run)
        while i >= 0:
            at = base + i
            if at == 0 or raw[at - 1] not in _DIGITS:  # the start of a run, not inside a longer one
                j = at - 1 if at and raw[at - 1] != 0x2D else at - 2  # skip a minus sign
                if j < 0 or raw[j] in _NUMBER_START:
                    return True
            k = i + _LONG
            while k < len(zeros) and zeros[k] == 0x30:
                k += 1
            i = zeros.find(run, k)
    return False


_WINDOW = 4 << 20
_DIGITS = frozenset(b"0123456789")
#: Containers longer than this are re-serialized a slice at a time for the colon count.
_SLICE = 4096
#: A top-level object of at most this many members is counted member by member.
_FEW = 64


def _colons(obj: object, top: bool = True) -> int:
    """The colons of ``orjson.dumps(obj)``, counted without ever holding the whole re-serialized
    text: long lists and objects a slice at a time, the top-level object member by member (a
    40 MB PROVENANCE.json is one long list of records under one member)."""
    if type(obj) is list and len(obj) > _SLICE:
        return sum(orjson.dumps(obj[i : i + _SLICE]).count(b":") for i in range(0, len(obj), _SLICE))
    if type(obj) is dict and top and len(obj) <= _FEW:
        return len(obj) + "".join(obj).count(":") + sum(_colons(v, False) for v in obj.values())
    if type(obj) is dict and len(obj) > _SLICE:
        items = list(obj.items())
        return sum(orjson.dumps(dict(items[i : i + _SLICE])).count(b":") for i in range(0, len(items), _SLICE))
    return orjson.dumps(obj).count(b":")


class _Unproven(Exception):
    """The fast parse could not prove the document equal to the strict parse: take the slow path."""


def _fast_json(raw: bytes | bytearray, plain: bool = False) -> object:
    """The strict parse of ``raw`` at C speed; raises :class:`_Unproven` when it cannot be proven
    equal to :func:`strict_json_loads` of the same text.

    The proof needs no walk of the parsed objects: orjson writes every member back with one colon
    and every string with its colons as they are (it never escapes one), so the colons of its
    output are exactly the members plus the colons inside the strings parsed."""
    if not plain and (b"\\" in raw or _has_long_integer(raw)):
        raise _Unproven  # an escape can hide a colon, or spell one key two ways
    try:
        obj = orjson.loads(raw)
        colons = _colons(obj)
    except (orjson.JSONDecodeError, orjson.JSONEncodeError, RecursionError):
        raise _Unproven from None
    if colons != raw.count(b":"):
        raise _Unproven  # a repeated key dropped a member
    return obj


def strict_json_loadb(raw: bytes | bytearray, *, plain: bool = False) -> object:
    """:func:`strict_json_loads` of UTF-8 bytes: orjson with the duplicate-key proof, the exact slow
    path whenever the proof is not clean. Raises what :func:`strict_json_loads` raises, or
    ``UnicodeDecodeError``. ``plain``: the caller has found no backslash and no integer of 19+
    digits in a text this is a piece of (see :func:`plain_json_text`), so the piece is not scanned
    again."""
    try:
        return _fast_json(raw, plain)
    except _Unproven:
        return strict_json_loads(bytes(raw).decode("utf-8"))


def plain_json_text(raw: bytes) -> bool:
    """Whether a JSON text has neither a backslash escape nor an integer literal of 19+ digits: then
    the colon-count proof alone decides the strict parse of it and of any piece of it."""
    return b"\\" not in raw and not _has_long_integer(raw)


def _decode_json(path: str, raw: bytes) -> dict[str, object]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(path, "InvalidHeaderUtf8", f"header is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.startswith("{"):
        raise SafetensorsError(path, "InvalidHeaderStart", "header does not start with '{'")
    try:
        obj = strict_json_loads(text)
    except DuplicateKey as e:
        raise SafetensorsError(path, "DuplicateKey", "key appears more than once in the header", key=e.key) from None
    except RecursionError:
        raise SafetensorsError(path, "InvalidHeaderDeserialization", "header JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, oversized integers, NaN/Infinity
        raise SafetensorsError(path, "InvalidHeaderDeserialization", f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise SafetensorsError(path, "InvalidHeaderDeserialization", "header is not a JSON object")
    return obj


def _check_metadata(path: str, value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SafetensorsError(path, "InvalidMetadata", "__metadata__ must map strings to strings")
    return value


def _is_uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_entry(path: str, name: str, entry: object) -> TensorInfo:
    # Fast path for the common, valid entry; anything unusual falls through to the detailed checks.
    if type(entry) is dict and len(entry) == 3:
        dtype = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
        if (
            bits is not None
            and type(shape) is list
            and type(offsets) is list
            and len(offsets) == 2
            and type(offsets[0]) is int
            and type(offsets[1]) is int
            and 0 <= offsets[0] <= offsets[1]
        ):
            n = bits
            ok = True
            for d in shape:
                if type(d) is not int or d < 0:
                    ok = False
                    break
                n *= d
            if ok and n % 8 == 0 and n // 8 == offsets[1] - offsets[0]:
                return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    return _check_entry_slow(path, name, entry)


def _check_entry_slow(path: str, name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict):
        raise SafetensorsError(path, "InvalidTensorInfo", "entry is not an object", key=name)
    if set(entry) != _TENSOR_FIELDS:
        missing = sorted(_TENSOR_FIELDS - set(entry))
        extra = sorted(set(entry) - _TENSOR_FIELDS)
        detail = ", ".join(
            part for part in (f"missing {missing}" if missing else "", f"unknown {extra}" if extra else "") if part
        )
        raise SafetensorsError(path, "InvalidTensorInfo", f"fields must be dtype, shape, data_offsets ({detail})", key=name)
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise SafetensorsError(path, "UnknownDtype", f"unknown dtype {dtype!r}", key=name)
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise SafetensorsError(path, "InvalidShape", f"shape must be a list of non-negative integers, got {shape!r}", key=name)
    offsets = entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise SafetensorsError(path, "InvalidOffset", f"data_offsets must be two non-negative integers, got {offsets!r}", key=name)
    begin, end = offsets
    if end < begin:
        raise SafetensorsError(path, "InvalidOffset", f"data_offsets end {end} is before begin {begin}", key=name)
    shape_t = tuple(shape)
    try:
        expected = tensor_nbytes(dtype, shape_t)
    except ValueError as e:
        raise SafetensorsError(path, "MisalignedSlice", str(e), key=name) from None
    if expected != end - begin:
        raise SafetensorsError(
            path,
            "TensorInvalidInfo",
            f"{dtype} shape {shape} needs {expected} bytes but data_offsets span {end - begin}",
            key=name,
        )
    return TensorInfo(name, dtype, shape_t, begin, end)


def _check_tiling(path: str, tensors: list[TensorInfo], data_size: int) -> None:
    pos = 0
    for t in tensors:
        if t.begin != pos:
            rule = "HoleInData" if t.begin > pos else "OverlappingTensors"
            raise SafetensorsError(
                path, rule, f"tensor starts at buffer offset {t.begin}, previous data ends at {pos}", key=t.name
            )
        pos = t.end
    if pos != data_size:
        rule = "TrailingBytes" if data_size > pos else "TruncatedFile"
        raise SafetensorsError(
            path, rule, f"tensor data ends at buffer offset {pos} but the file holds {data_size} data bytes"
        )


def _fast_header(path: str, raw: bytes, file_size: int) -> ShardHeader:
    """A header that breaks no rule, parsed at C speed; raises :class:`_Unproven` at the first doubt.

    The slow path (:func:`parse_header` below) re-reads anything this refuses, so every error keeps
    its exact rule and key. The duplicate-key proof needs no walk of the entries: a valid entry is an
    object of exactly three members whose only string, the dtype, holds no colon, so it adds exactly
    three colons to the text. Every rule is checked a column at a time (``map`` over the entries runs
    in C), not with a Python loop per tensor: 151,000 entries per GLM-5.3 checkpoint."""
    if raw[:1] != b"{" or b"\\" in raw:
        raise _Unproven
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _Unproven from None
    if type(obj) is not dict:
        raise _Unproven
    colons = len(obj) + "".join(obj).count(":")
    metadata = None
    if _METADATA_KEY in obj:
        metadata = obj.pop(_METADATA_KEY)
        values = metadata.values() if type(metadata) is dict else None
        if values is None or not all(type(v) is str for v in values):
            raise _Unproven
        colons += len(metadata) + "".join(metadata).count(":") + "".join(values).count(":")
    names = list(obj)
    entries = list(obj.values())
    del obj
    data_size = file_size - 8 - len(raw)
    tensors: list[TensorInfo] = []
    if entries:
        if set(map(type, entries)) != {dict} or set(map(len, entries)) != {3}:
            raise _Unproven
        try:
            dtypes = list(map(_DTYPE_OBJECTS.__getitem__, map(_DTYPE_OF, entries)))
            shapes = list(map(_SHAPE_OF, entries))
            offsets = list(map(_OFFSETS_OF, entries))
        except (KeyError, TypeError):
            raise _Unproven from None
        if set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}:
            raise _Unproven
        dims = list(chain.from_iterable(shapes))
        if dims and (set(map(type, dims)) != {int} or min(dims) < 0):
            raise _Unproven
        begins = list(map(_FIRST, offsets))
        ends = list(map(_SECOND, offsets))
        if set(map(type, begins)) != {int} or set(map(type, ends)) != {int} or min(begins) < 0 or any(map(operator.gt, begins, ends)):
            raise _Unproven
        bits = list(map(operator.mul, map(DTYPE_BITS.__getitem__, dtypes), map(math.prod, shapes)))
        if any(map(operator.mod, bits, repeat(8))) or list(map(operator.floordiv, bits, repeat(8))) != list(map(operator.sub, ends, begins)):
            raise _Unproven
        shape_ts = list(map(tuple, shapes))
        shared = {t: _shared_shape(t) for t in set(shape_ts)}
        tensors = list(map(tuple.__new__, repeat(TensorInfo), zip(names, dtypes, map(shared.__getitem__, shape_ts), begins, ends)))
        tiled = begins[0] == 0 and begins[1:] == ends[:-1] and ends[-1] == data_size
    else:
        tiled = data_size == 0
    if colons + 3 * len(tensors) != raw.count(b":"):
        raise _Unproven
    if not tiled:
        tensors.sort(key=lambda t: (t.begin, t.end))
        _check_tiling(path, tensors, data_size)
    return ShardHeader(path, len(raw), file_size, metadata, tuple(tensors), {t.name: t for t in tensors})


_DTYPE_OF = operator.itemgetter("dtype")
_SHAPE_OF = operator.itemgetter("shape")
_OFFSETS_OF = operator.itemgetter("data_offsets")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


def tensor_shards(headers: Mapping[str, ShardHeader]) -> dict[str, str] | None:
    """Every tensor's name → the shard that holds it, made a shard at a time at C speed; None when
    a name is in two shards (each header's own names are unique, so the merged map is then short),
    for the caller to name the tensor its own way."""
    out: dict[str, str] = {}
    for shard, h in headers.items():
        out.update(dict.fromkeys(map(_TENSOR_NAME, h.tensors), shard))
    return out if len(out) == sum(len(h.tensors) for h in headers.values()) else None


_TENSOR_NAME = operator.attrgetter("name")


# --- entry points --------------------------------------------------------------------------------


def parse_header(path: str | os.PathLike[str], head: bytes, file_size: int) -> ShardHeader:
    """Validate a header given the file's first bytes (at least 8 + header length) and its size."""
    p = str(path)
    n = _check_length_prefix(p, head[:8], file_size)
    raw = head[8 : 8 + n]
    if len(raw) < n:
        raise SafetensorsError(p, "InvalidHeaderLength", f"only {len(raw)} of {n} header bytes available")
    try:
        return _fast_header(p, raw, file_size)
    except _Unproven:
        pass
    obj = _decode_json(p, raw)
    metadata = None
    tensors: list[TensorInfo] = []
    for name, entry in obj.items():
        if name == _METADATA_KEY:
            metadata = _check_metadata(p, entry)
            continue
        tensors.append(_check_entry(p, name, entry))
    tensors.sort(key=lambda t: (t.begin, t.end))
    _check_tiling(p, tensors, file_size - 8 - n)
    return ShardHeader(p, n, file_size, metadata, tuple(tensors), {t.name: t for t in tensors})


def read_header(path: str | os.PathLike[str]) -> ShardHeader:
    """Read and validate the header of one safetensors file (reads only the header bytes)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = _check_length_prefix(str(p), prefix, size)
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(p, "Unreadable", e.strerror or str(e)) from None
    return parse_header(p, prefix + raw, size)
