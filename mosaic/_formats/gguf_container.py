"""The GGUF v3 container, as far as mosaic writes and audits it: header bytes and a strict reader.

Owns the byte layout (magic, version, key/value pairs, tensor infos, alignment, offsets) and the
tensor type table, including ranma.cpp's EXL3 trellis types, which upstream ggml does not know
(ids ``256 + 16 * codebook + code``; block 128 values, ``16 * bits`` bytes, see ranma.cpp
``gguf-py/gguf/constants.py`` and ``ggml/src/ggml-exl3.c``). Writing is split in two so that every
offset and size is known before the first data byte: :func:`layout` computes the header and where
each tensor goes; the caller streams the data. :func:`read_gguf` never reads tensor data and refuses
anything the format forbids, each violation as a :class:`GGUFError` naming the file, the rule and,
where there is one, the key or tensor.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from mosaic._base.errors import FormatError

MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32
MAX_NAME = 63  # GGML_MAX_NAME - 1
MAX_DIMS = 4

# GGUF value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
               FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
VALUE_TYPE_NAMES = {UINT8: "u8", INT8: "i8", UINT16: "u16", INT16: "i16", UINT32: "u32", INT32: "i32",
                    FLOAT32: "f32", BOOL: "bool", STRING: "string", ARRAY: "array", UINT64: "u64",
                    INT64: "i64", FLOAT64: "f64"}

#: ggml types of plain tensors: id -> (name, block size, type size)
PLAIN_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
    27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}
#: safetensors dtype -> ggml type id (tensors that keep their dtype)
GGML_TYPE_OF_DTYPE = {"F32": 0, "F16": 1, "I8": 24, "I16": 25, "I32": 26, "I64": 27, "F64": 28, "BF16": 30}



@lru_cache(maxsize=1)
def quant_types() -> dict[int, tuple[str, int, int]]:
    """ggml's quantized types: id -> (name, block size, type size).

    llama.cpp's quantized types (Q4_0, Q8_0, Q4_K, IQ2_XS, ...) from gguf-py's own table, which
    follows ggml's: id -> (name, block size, type size). The plain types above stay this module's own;
    a GGUF mosaic copies every other type's blocks byte for byte and needs only their sizes. Read on
    first use: gguf-py brings numpy, which an EXL3 command never needs."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    out = {}
    for t in GGMLQuantizationType:
        if int(t) not in PLAIN_TYPES and t in GGML_QUANT_SIZES:
            bs, ts = GGML_QUANT_SIZES[t]
            out[int(t)] = (t.name, bs, ts)
    return out


EXL3_BASE = 256
EXL3_CODEBOOKS = ("mul1", "mcg", "3inst")
EXL3_BLOCK = 128


def exl3_type(codebook: str, bits: float) -> int:
    """ranma.cpp's type id of an EXL3 trellis: 256 + 16 * codebook + code (code 0..7 = 1..8 bits,
    8..10 = 1.5, 2.5, 3.5 bits, the half rates for mul1 only)."""
    cb = EXL3_CODEBOOKS.index(codebook)
    b = Fraction(bits)
    if b.denominator == 1 and 1 <= b <= 8:
        code = int(b) - 1
    elif codebook == "mul1" and b in (Fraction(3, 2), Fraction(5, 2), Fraction(7, 2)):
        code = 8 + int(b - Fraction(3, 2))
    else:
        raise ValueError(f"no EXL3 type for {bits} bits with the {codebook} codebook")
    return EXL3_BASE + 16 * cb + code


def exl3_bits2(type_id: int) -> int | None:
    """Twice the bits per weight of an EXL3 type id, None for any other id."""
    rel = type_id - EXL3_BASE
    if rel < 0:
        return None
    cb, code = divmod(rel, 16)
    if cb >= len(EXL3_CODEBOOKS) or code > 10 or (code > 7 and cb != 0):
        return None
    return 2 * (code + 1) if code < 8 else 2 * (code - 7) + 1


def type_name(type_id: int) -> str:
    if type_id in PLAIN_TYPES:
        return PLAIN_TYPES[type_id][0]
    if type_id in quant_types():
        return quant_types()[type_id][0]
    b2 = exl3_bits2(type_id)
    if b2 is not None:
        cb = EXL3_CODEBOOKS[(type_id - EXL3_BASE) // 16]
        return f"EXL3_{cb}_{b2 / 2:g}bit"
    return f"type{type_id}"


def type_block(type_id: int) -> tuple[int, int] | None:
    """(block size in values, bytes per block), None for a type this module does not know."""
    if type_id in PLAIN_TYPES:
        return PLAIN_TYPES[type_id][1:]
    if type_id in quant_types():
        return quant_types()[type_id][1:]
    b2 = exl3_bits2(type_id)
    if b2 is not None:
        return EXL3_BLOCK, 8 * b2  # 128 values * bits / 8
    return None


def tensor_nbytes(type_id: int, ne: tuple[int, ...]) -> int:
    blk = type_block(type_id)
    if blk is None:
        raise ValueError(f"unknown ggml type {type_id}")
    bs, ts = blk
    if ne[0] % bs:
        raise ValueError(f"ne[0] = {ne[0]} is not a multiple of the block size {bs} of {type_name(type_id)}")
    n = 1
    for d in ne:
        n *= d
    return n // bs * ts


def type_bits(type_id: int) -> float:
    """Bits per weight of a type (8 * type size / block size): 8.5 for Q8_0, 4.5 for Q4_0."""
    bs, ts = type_block(type_id) or (0, 0)
    if not bs:
        raise ValueError(f"unknown ggml type {type_id}")
    return 8 * ts / bs


def align(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class KV:
    """One metadata pair; ``vtype`` is a GGUF value type, ``item`` the element type of an array."""

    key: str
    vtype: int
    value: object
    item: int | None = None


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's entry: ``ne`` ggml order (innermost first); ``offset`` relative to the data start."""

    name: str
    ne: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: object, item: int | None) -> bytes:
    if vtype == STRING:
        assert isinstance(value, str)
        return _str(value)
    if vtype == ARRAY:
        assert isinstance(value, (list, tuple)) and item is not None
        return struct.pack("<IQ", item, len(value)) + b"".join(_value(item, v, None) for v in value)
    return struct.pack(_SCALAR_FMT[vtype], value)


def encode_kv(kv: KV) -> bytes:
    return _str(kv.key) + struct.pack("<I", kv.vtype) + _value(kv.vtype, kv.value, kv.item)


@dataclass(frozen=True)
class Layout:
    """A file's header bytes (padded to the alignment), each tensor's info, and the file size."""

    header: bytes
    tensors: tuple[TensorInfo, ...]
    size: int

    @property
    def data_start(self) -> int:
        return len(self.header)


def layout(kvs: list[KV], tensors: list[tuple[str, tuple[int, ...], int, int]], alignment: int = ALIGNMENT) -> Layout:
    """Lay out one file: ``tensors`` as (name, ne, type id, nbytes), in file order. Each tensor's data
    is padded to the alignment, like gguf-py and llama-gguf-split write it (``alignment`` must equal
    the file's ``general.alignment`` when it has one)."""
    keys = [kv.key for kv in kvs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate metadata key")
    infos = []
    off = 0
    for name, ne, type_id, nbytes in tensors:
        if len(name.encode()) > MAX_NAME:
            raise ValueError(f"tensor name {name!r} is longer than {MAX_NAME} bytes")
        if not 1 <= len(ne) <= MAX_DIMS:
            raise ValueError(f"tensor {name!r}: {len(ne)} dimensions")
        if tensor_nbytes(type_id, ne) != nbytes:
            raise ValueError(f"tensor {name!r}: {nbytes} bytes do not match {type_name(type_id)} {list(ne)}")
        infos.append(TensorInfo(name, tuple(ne), type_id, off, nbytes))
        off = align(off + nbytes, alignment)
    head = bytearray(MAGIC + struct.pack("<IQQ", VERSION, len(infos), len(kvs)))
    for kv in kvs:
        head += encode_kv(kv)
    for t in infos:
        head += _str(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
        head += struct.pack("<iQ", t.type_id, t.offset)
    head += b"\0" * (align(len(head), alignment) - len(head))
    return Layout(bytes(head), tuple(infos), len(head) + off)


# ---- strict reader --------------------------------------------------------------------------------------------


class GGUFError(FormatError):
    """A GGUF file breaks one rule of the format; ``rule`` names which."""

    def __init__(self, path: object, rule: str, detail: str, key: str | None = None, tensor: str | None = None,
                 need: int | None = None) -> None:
        self.path = str(path)
        self.rule = rule
        #: for a header cut short (``truncated``): the bytes the parse needs at least, to read that many
        self.need = need
        self.key = key
        self.tensor = tensor
        where = self.path + (f": key {key!r}" if key else "") + (f": tensor {tensor!r}" if tensor else "")
        super().__init__(f"{where}: {rule}: {detail}")


@dataclass(frozen=True)
class GGUFFile:
    path: str
    version: int
    kvs: dict[str, KV]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    file_size: int
    alignment: int

    def value(self, key: str) -> object:
        kv = self.kvs.get(key)
        return None if kv is None else kv.value

    def file_range(self, t: TensorInfo) -> tuple[int, int]:
        return self.data_start + t.offset, self.data_start + t.offset + t.nbytes


class _Cursor:
    def __init__(self, path: str, data: bytes, base: int = 0) -> None:
        self.path, self.data, self.pos = path, data, base

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise GGUFError(self.path, "truncated", f"file ends inside {what}", need=self.pos + max(n, 0))
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def string(self, what: str) -> str:
        (n,) = self.unpack("<Q", what)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(self.path, "utf-8", f"{what} is not valid UTF-8") from None


def _read_value(c: _Cursor, vtype: int, key: str, depth: int = 0) -> tuple[object, int | None]:
    if vtype == STRING:
        return c.string(f"the value of {key!r}"), None
    if vtype == ARRAY:
        if depth:
            raise GGUFError(c.path, "kv-type", "nested arrays are not supported", key=key)
        item, n = c.unpack("<IQ", f"the array header of {key!r}")
        if item not in VALUE_TYPE_NAMES or item == ARRAY:
            raise GGUFError(c.path, "kv-type", f"unknown array element type {item}", key=key)
        if n > len(c.data):
            raise GGUFError(c.path, "truncated", f"array of {n} elements cannot fit", key=key, need=c.pos + n)
        return _read_array(c, item, n, key), item
    fmt = _SCALAR_FMT.get(vtype)
    if fmt is None:
        raise GGUFError(c.path, "kv-type", f"unknown value type {vtype}", key=key)
    (v,) = c.unpack(fmt, f"the value of {key!r}")
    if vtype == BOOL and c.data[c.pos - 1] not in (0, 1):
        raise GGUFError(c.path, "kv-type", "a bool that is neither 0 nor 1", key=key)
    return v, None


_U64 = struct.Struct("<Q")


def _read_array(c: _Cursor, item: int, n: int, key: str) -> list:
    """An array's ``n`` elements of type ``item``, checked as one value at a time would be (the same errors), in
    one pass over the bytes: a vocabulary is an array of some 150,000 strings, and every rung, shard and source a
    plan, build or audit opens holds one."""
    data, pos, end = c.data, c.pos, len(c.data)
    what = f"the value of {key!r}"
    if item == STRING:
        out: list = []
        append, unpack_u64 = out.append, _U64.unpack_from
        for _ in range(n):
            if pos + 8 > end:
                c.pos = pos
                c.take(8, what)  # raises: the file ends inside the string's length
            (k,) = unpack_u64(data, pos)
            pos += 8
            if pos + k > end:
                c.pos = pos
                c.take(k, what)  # raises: the file ends inside the string
            try:
                append(data[pos : pos + k].decode("utf-8"))
            except UnicodeDecodeError:
                c.pos = pos + k
                raise GGUFError(c.path, "utf-8", f"{what} is not valid UTF-8") from None
            pos += k
        c.pos = pos
        return out
    fmt = _SCALAR_FMT[item]  # the caller refused any other element type
    size = struct.calcsize(fmt)
    whole = min(n, (end - pos) // size)  # the elements the bytes hold: the first error is the one reading in order meets
    if item == BOOL:
        bad = next((i for i, b in enumerate(data[pos : pos + whole]) if b > 1), None)
        if bad is not None:
            c.pos = pos + bad + 1
            raise GGUFError(c.path, "kv-type", "a bool that is neither 0 nor 1", key=key)
    if whole < n:
        c.pos = pos + whole * size
        c.take(size, what)  # raises: the file ends inside the next element
    c.pos = pos + n * size
    return list(struct.unpack_from(f"<{n}{fmt[1:]}", data, pos))


#: The first read of a header; a larger header (a big vocabulary) is read again with twice as much.
FIRST_READ = 16 << 20


def read_gguf(path: str | os.PathLike[str], max_header: int = 1 << 30) -> GGUFFile:
    """Parse a GGUF file's header, reading only as much of the file as the header needs (starting
    with :data:`FIRST_READ` bytes, doubling up to ``max_header``): a multi-GB file costs a few MB."""
    p = str(path)
    size = os.path.getsize(p)
    want = min(size, FIRST_READ, max_header)
    while True:
        with open(p, "rb") as f:
            data = f.read(want)
        try:
            return _parse_gguf(p, data, size)
        except GGUFError as e:
            if e.rule != "truncated" or want >= min(size, max_header):
                raise
            want = min(size, max_header, want * 2)


def parse_gguf_header(path: str | os.PathLike[str], data: bytes, size: int) -> GGUFFile:
    """Parse a header from its first bytes ``data`` of a file of ``size`` bytes (read elsewhere, e.g. by
    HTTP ranges); a ``truncated`` error's ``need`` says how many bytes the parse needs at least."""
    return _parse_gguf(str(path), data, size)


def _parse_gguf(p: str, data: bytes, size: int) -> GGUFFile:
    """Parse and validate a GGUF v3 file's header and tensor infos; tensor data is never read.

    Checks: magic, version, key and tensor-name uniqueness, known value types, UTF-8, tensor infos
    (dims, known types, sizes), ``general.alignment``, offsets aligned and tiling the data section
    in order without holes or overlaps, and the file size (the last tensor padded, or not)."""
    c = _Cursor(p, data)
    if c.take(4, "the magic") != MAGIC:
        raise GGUFError(p, "magic", "not a GGUF file (magic is not 'GGUF')")
    (version,) = c.unpack("<I", "the version")
    if version != VERSION:
        raise GGUFError(p, "version", f"version {version}, expected {VERSION}")
    n_tensors, n_kv = c.unpack("<QQ", "the counts")
    if n_tensors > size or n_kv > size:
        raise GGUFError(p, "counts", f"{n_tensors} tensors / {n_kv} keys cannot fit in {size} bytes")
    kvs: dict[str, KV] = {}
    for _ in range(n_kv):
        key = c.string("a key")
        if not key:
            raise GGUFError(p, "kv-key", "empty key")
        if key in kvs:
            raise GGUFError(p, "duplicate-key", "key appears twice", key=key)
        (vtype,) = c.unpack("<I", f"the type of {key!r}")
        value, item = _read_value(c, vtype, key)
        kvs[key] = KV(key, vtype, value, item)
    alignment = ALIGNMENT
    if "general.alignment" in kvs:
        a = kvs["general.alignment"]
        if a.vtype != UINT32 or not isinstance(a.value, int) or a.value <= 0 or a.value & (a.value - 1):
            raise GGUFError(p, "alignment", f"general.alignment must be a u32 power of two, is {a.value!r}")
        alignment = a.value
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = c.string("a tensor name")
        if len(name.encode()) > MAX_NAME:
            raise GGUFError(p, "tensor-name", f"name longer than {MAX_NAME} bytes", tensor=name)
        if name in names:
            raise GGUFError(p, "duplicate-tensor", "tensor appears twice", tensor=name)
        names.add(name)
        (n_dims,) = c.unpack("<I", f"the dims of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(p, "tensor-dims", f"{n_dims} dimensions", tensor=name)
        ne = c.unpack(f"<{n_dims}Q", f"the dims of {name!r}")
        if any(d == 0 for d in ne):
            raise GGUFError(p, "tensor-dims", f"zero dimension in {list(ne)}", tensor=name)
        type_id, offset = c.unpack("<iQ", f"the type and offset of {name!r}")
        infos.append((name, tuple(ne), type_id, offset))
    data_start = align(c.pos, alignment)
    if data_start > size or data_start > len(data):
        raise GGUFError(p, "truncated", "file ends before the data section", need=data_start)
    if any(data[c.pos : data_start]):
        raise GGUFError(p, "padding", "non-zero bytes in the padding before the data section")
    tensors = []
    expect = 0
    for name, ne, type_id, offset in infos:
        try:
            nbytes = tensor_nbytes(type_id, ne)
        except ValueError as e:
            raise GGUFError(p, "tensor-type", str(e), tensor=name) from None
        if offset % alignment:
            raise GGUFError(p, "offset", f"offset {offset} is not a multiple of {alignment}", tensor=name)
        if offset != expect:
            what = "a hole before it" if offset > expect else "it overlaps the previous tensor"
            raise GGUFError(p, "offset", f"offset {offset}, expected {expect} ({what})", tensor=name)
        tensors.append(TensorInfo(name, ne, type_id, offset, nbytes))
        expect = offset + nbytes
        if data_start + expect > size:
            raise GGUFError(p, "truncated", f"data ends at {data_start + expect}, the file has {size} bytes", tensor=name)
        expect = align(expect, alignment)
    end = data_start + (tensors[-1].offset + tensors[-1].nbytes if tensors else 0)
    if size not in (end, data_start + expect):
        raise GGUFError(p, "trailing-bytes", f"{size - end} bytes after the last tensor")
    return GGUFFile(p, version, kvs, tuple(tensors), data_start, size, alignment)

