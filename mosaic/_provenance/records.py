"""The records a mosaic folder carries and their formats: file names, the PROVENANCE.json schema,
its deterministic serialization, and the ``sha256sum`` manifest.

Shared by the builder (which writes them) and the audit (which reads them); this module knows
nothing of plans or splicing.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from itertools import chain, repeat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jsonschema


SCHEMA_ID = "mosaic.provenance/v1"
RECIPE_NAME = "mosaic-recipe.yaml"
PROVENANCE_NAME = "PROVENANCE.json"
MANIFEST_NAME = "sha256-manifest.txt"
CARD_NAME = "README.md"
#: The OpenSSF model signing convention's file name (the ``model_signing`` command line's default). It is
#: written after the manifest, so it is the one file of a mosaic that the manifest does not list.
SIGNATURE_NAME = "model.sig"

#: What the hub adds to a downloaded mosaic: its ``.gitattributes`` (LFS rules) and, with
#: ``--local-dir``, huggingface_hub's own download metadata. Neither is loaded by exllamav3 (it reads
#: top-level ``*.safetensors`` and the configs), so the audit skips them and counts them, rather than
#: failing every consumer's download, and a signature does not cover them.
HUB_ARTEFACTS = (".gitattributes", ".cache/huggingface")


@dataclass(frozen=True)
class FileRecord:
    """One file: its relative name, size and SHA-256 (the unit of PROVENANCE ``files`` and manifests)."""

    name: str
    size: int
    sha256: str

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


_TENSOR_ORDER = ("name", "file", "dtype", "shape", "nbytes", "sha256", "source")


@dataclass(frozen=True, eq=False)
class TensorColumns(Sequence[dict]):
    """PROVENANCE ``tensors`` as seven columns instead of one dict per record.

    A GLM-5.3 mosaic has 151,000 tensor records; as dicts they are ~60 MB and most of a build's
    serialization time, as columns they share the plan's own strings and integers. Reads as the list
    of dicts it stands for (indexing, iteration, equality); :func:`validation_errors` and
    :func:`dumps` work on the columns directly."""

    name: list[str]
    file: list[str]
    dtype: list[str]
    shape: list[tuple[int, ...]]
    nbytes: list[int]
    sha256: list[str]
    source: list[str]

    def __post_init__(self) -> None:
        if len({len(getattr(self, k)) for k in _TENSOR_ORDER}) != 1:
            raise ValueError("tensor columns of different lengths")

    def __len__(self) -> int:
        return len(self.name)

    def _record(self, i: int) -> dict:
        shape = self.shape[i]
        return {"name": self.name[i], "file": self.file[i], "dtype": self.dtype[i],
                "shape": list(shape) if type(shape) is tuple else shape,
                "nbytes": self.nbytes[i], "sha256": self.sha256[i], "source": self.source[i]}

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        if isinstance(i, slice):
            return [self._record(j) for j in range(*i.indices(len(self)))]
        return self._record(range(len(self))[i])

    def __iter__(self) -> Iterator[dict]:
        return (self._record(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorColumns):
            return all(getattr(self, k) == getattr(other, k) for k in _TENSOR_ORDER)
        return isinstance(other, list) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


def as_columns(tensors: object) -> TensorColumns | None:
    """Parsed tensor records as columns, when every one is a dict of exactly the seven fields with a
    list shape (what a build writes and an audit reads back): the checks then run a column at a
    time and the 151,000 dicts can go. None for anything else, which is then checked as it is;
    the columns read back as the very dicts they were made from."""
    if type(tensors) is not list or not tensors:
        return None
    if set(map(type, tensors)) != {dict} or not all(map(operator.eq, map(dict.keys, tensors), repeat(_TENSOR_KEYS))):
        return None
    cols = {k: list(map(operator.itemgetter(k), tensors)) for k in _TENSOR_ORDER}
    if set(map(type, cols["shape"])) != {list}:
        return None
    cols["shape"] = list(map(tuple, cols["shape"]))
    return TensorColumns(**cols)


def column(tensors: Sequence[dict], key: str) -> list:
    """One field of every tensor record, from columns or from a parsed list of dicts."""
    if isinstance(tensors, TensorColumns):
        return getattr(tensors, key)
    return [t[key] for t in tensors]


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(resources.files("mosaic").joinpath("schema/provenance.schema.json").read_text("utf-8"))


@lru_cache(maxsize=1)
def _validator() -> jsonschema.Draft202012Validator:
    import jsonschema  # on first use: a command that validates nothing does not pay its import

    return jsonschema.Draft202012Validator(schema())


_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_ID_RE = re.compile(r"^[a-z0-9_-]+$")
_BAD_NAME_RE = re.compile(r"^/|(^|/)\.\.?(/|$)|\\|^[A-Za-z]:")
_HEX_RE = re.compile(r"[0-9a-f]*")
_TENSOR_KEYS = frozenset({"name", "file", "dtype", "shape", "nbytes", "sha256", "source"})


def _surely_valid_tensor(t: object) -> bool:
    """A fast check that never accepts what the schema's tensor item rejects (it may refuse more;
    then the schema itself decides). At 150,000 tensors the generic validator takes tens of seconds."""
    if type(t) is not dict or t.keys() != _TENSOR_KEYS:
        return False
    name, file, dtype, shape, nbytes, sha, source = (
        t["name"], t["file"], t["dtype"], t["shape"], t["nbytes"], t["sha256"], t["source"]
    )
    return (
        type(name) is str and name != ""
        and type(file) is str and file != "" and _BAD_NAME_RE.search(file) is None
        and type(dtype) is str and dtype != ""
        and type(shape) is list and all(type(d) is int and d >= 0 for d in shape)
        and type(nbytes) is int and nbytes >= 0
        and type(sha) is str and _SHA_RE.match(sha) is not None
        and type(source) is str and _ID_RE.match(source) is not None
    )


def _surely_valid_tensors(tensors: list[object]) -> bool:
    """:func:`_surely_valid_tensor` for a whole list, column by column: ``map`` over the records
    (C speed) instead of a Python function per record (151,000 of them for GLM-5.3). False sends
    every record through the item test (and the schema) to find which ones fail."""
    if not tensors:
        return True
    if set(map(type, tensors)) != {dict} or not all(map(operator.eq, map(dict.keys, tensors), repeat(_TENSOR_KEYS))):  # type: ignore[arg-type]
        return False
    col = {k: list(map(operator.itemgetter(k), tensors)) for k in _TENSOR_KEYS}
    return _valid_columns(col["name"], col["file"], col["dtype"], col["shape"], col["nbytes"], col["sha256"], col["source"], list)


def _valid_columns(names: list, files: list, dtypes: list, shapes: list, nbytes: list, shas: list, sources: list, shape_type: type) -> bool:
    """The item rules of the schema's tensor record over whole columns (exact or stricter)."""
    flat = list(chain.from_iterable(shapes)) if set(map(type, shapes)) == {shape_type} else None
    return (
        set(map(type, chain(names, files, dtypes, shas, sources))) == {str}
        and "" not in names
        and all(x != "" and _BAD_NAME_RE.search(x) is None for x in set(files))
        and "" not in dtypes
        and flat is not None
        and set(map(type, flat)) <= {int}
        and (not flat or min(flat) >= 0)
        and set(map(type, nbytes)) == {int}
        and min(nbytes) >= 0
        and set(map(len, shas)) == {64}
        and _HEX_RE.fullmatch("".join(shas)) is not None
        and all(_ID_RE.match(x) is not None for x in set(sources))
    )


def _surely_valid_columns(t: TensorColumns) -> bool:
    """:func:`_surely_valid_tensors` for records held as columns (the build's own)."""
    return not len(t) or _valid_columns(t.name, t.file, t.dtype, t.shape, t.nbytes, t.sha256, t.source, tuple)


def _format(e: jsonschema.ValidationError, prefix: tuple[object, ...] = ()) -> str:
    path = "/".join(map(str, (*prefix, *e.absolute_path))) or "(root)"
    return f"{path}: {e.message[:300]}"


def validation_errors(doc: object) -> list[str]:
    """Schema violations of a PROVENANCE document, as '<json path>: <message>' lines.

    The tensor list is checked column by column, then (when that is not clean) item by item, with
    fast exact-or-stricter tests; only the items they do not accept go through the generic
    validator, which has the last word."""
    v = _validator()
    tensors = doc.get("tensors") if isinstance(doc, dict) else None
    if not isinstance(tensors, (list, TensorColumns)):
        return [_format(e) for e in sorted(v.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
    rest = {**doc, "tensors": []}
    out = [_format(e) for e in sorted(v.iter_errors(rest), key=lambda e: list(map(str, e.absolute_path)))]
    if isinstance(tensors, TensorColumns):
        if _surely_valid_columns(tensors):
            return out
        tensors = list(tensors)
    item_schema = schema()["properties"]["tensors"]["items"]
    item_validator = v.evolve(schema={**item_schema, "$defs": schema()["$defs"]})
    if _surely_valid_tensors(tensors):
        return out
    for i, t in enumerate(tensors):
        if not _surely_valid_tensor(t):
            out += [_format(e, ("tensors", i)) for e in item_validator.iter_errors(t)]
    return out


_ENCODER = json.JSONEncoder(separators=(", ", ": "), ensure_ascii=False)

#: What the encoder would escape in a string (ensure_ascii=False): quote, backslash, control characters.
_ESCAPED = re.compile(r'["\\\x00-\x1f]')


def _tensor_lines(items: list[object], indent: str) -> list[str] | None:
    """Tensor records as ``_ENCODER`` writes them, from one f-string each (5× faster at 151,000
    records), or None when a record is not the plain shape this is exact for: the seven fields in
    the builder's order, strings with nothing to escape, integer shapes and sizes."""
    if not all(type(t) is dict and tuple(t) == _TENSOR_ORDER for t in items):
        return None
    cols = [[t[k] for t in items] for k in ("name", "file", "dtype", "sha256", "source")]  # type: ignore[index]
    shapes = [t["shape"] for t in items]  # type: ignore[index]
    nbytes = [t["nbytes"] for t in items]  # type: ignore[index]
    if not (
        all(type(x) is str for x in chain.from_iterable(cols))
        and not any(_ESCAPED.search("".join(c)) for c in cols)
        and all(type(s) is list for s in shapes)
        and all(type(d) is int for d in chain(nbytes, chain.from_iterable(shapes)))
    ):
        return None
    return [
        f'{indent}{{"name": "{n}", "file": "{f}", "dtype": "{d}", "shape": {s}, "nbytes": {b}, "sha256": "{h}", "source": "{o}"}}'
        for n, f, d, h, o, s, b in zip(*cols, shapes, nbytes)
    ]


def _column_lines(t: TensorColumns, indent: str, start: int, stop: int) -> list[str] | None:
    """:func:`_tensor_lines` for records held as columns, rows ``start:stop``; None when a value is
    not of the plain shape the f-string is exact for."""
    cols = [c[start:stop] for c in (t.name, t.file, t.dtype, t.sha256, t.source)]
    shapes, nbytes = t.shape[start:stop], t.nbytes[start:stop]
    try:
        distinct = set(shapes)
    except TypeError:  # a shape holding something unhashable: not the plain shape this is exact for
        return None
    if not (
        set(map(type, chain.from_iterable(cols))) <= {str}
        and not any(_ESCAPED.search("".join(c)) for c in cols)
        and set(map(type, shapes)) <= {tuple}
        and set(map(type, chain(nbytes, chain.from_iterable(distinct)))) <= {int}
    ):
        return None
    text = {s: "[" + ", ".join(map(str, s)) + "]" for s in distinct}
    return [
        f'{indent}{{"name": "{n}", "file": "{f}", "dtype": "{d}", "shape": {text[s]}, "nbytes": {b}, "sha256": "{h}", "source": "{o}"}}'
        for n, f, d, h, o, s, b in zip(*cols, shapes, nbytes)
    ]


#: Tensor records per chunk when PROVENANCE.json is streamed (about 2 MB of text)
_ROWS_PER_CHUNK = 8192


def _list_chunks(items: Sequence[object], indent: str, tensors: bool) -> Iterator[str]:
    """The lines of a list, in chunks of ``",\n"``-joined lines (the first without a separator)."""
    encode = _ENCODER.encode
    for start in range(0, len(items), _ROWS_PER_CHUNK):
        stop = min(start + _ROWS_PER_CHUNK, len(items))
        if isinstance(items, TensorColumns):
            lines = _column_lines(items, indent, start, stop) or [indent + encode(i) for i in items[start:stop]]
        else:
            part = list(items[start:stop])
            lines = (_tensor_lines(part, indent) if tensors else None) or [indent + encode(i) for i in part]
        yield ("" if start == 0 else ",\n") + ",\n".join(lines)


def _list_lines(items: Iterable[object], indent: str, tensors: bool = False) -> list[str]:
    encode = _ENCODER.encode
    fast = _tensor_lines(items, indent) if tensors and isinstance(items, list) else None  # type: ignore[arg-type]
    return fast if fast is not None else [indent + encode(i) for i in items]


def _dump_list(items: Iterable[object], indent: str, tensors: bool = False) -> str:
    lines = _list_lines(items, indent, tensors)
    return "[\n" + ",\n".join(lines) + "\n" + indent[:-2] + "]" if lines else "[]"


def dump_chunks(doc: dict) -> Iterator[bytes]:
    """Deterministic JSON, as byte chunks: top-level keys in order, each list item on its own line.

    Streamed: at 151,000 tensor records (40 MB of text) the file is written and hashed a few
    thousand records at a time, never held whole."""
    for i, (k, v) in enumerate(doc.items()):
        head = ("{\n" if i == 0 else ",\n") + f"  {json.dumps(k)}: "
        if isinstance(v, (list, TensorColumns)):
            if not len(v):
                yield (head + "[]").encode("utf-8")
                continue
            yield (head + "[\n").encode("utf-8")
            for chunk in _list_chunks(v, "    ", tensors=k == "tensors"):
                yield chunk.encode("utf-8")
            yield b"\n  ]"
            continue
        if k == "sources":
            inner = []
            for sid, s in v.items():
                fields = [f'      {json.dumps(fk)}: {json.dumps(fv, ensure_ascii=False)}' for fk, fv in s.items() if fk != "files"]
                fields.append(f'      "files": {_dump_list(s["files"], "        ")}')
                inner.append(f"    {json.dumps(sid)}: {{\n" + ",\n".join(fields) + "\n    }")
            text = "{\n" + ",\n".join(inner) + "\n  }"
        else:
            text = json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
        yield (head + text).encode("utf-8")
    yield b"\n}\n" if doc else b"{\n\n}\n"


def dumps(doc: dict) -> bytes:
    """:func:`dump_chunks`, joined."""
    return b"".join(dump_chunks(doc))


def manifest(records: Iterable[FileRecord]) -> bytes:
    """``sha256sum -c`` lines for every file but the manifest itself, sorted by name."""
    lines = [f"{r.sha256}  {r.name}\n" for r in sorted(records, key=lambda r: r.name) if r.name != MANIFEST_NAME]
    return "".join(lines).encode("utf-8")


def parse_manifest(data: bytes, where: str) -> dict[str, str]:
    """Read a manifest strictly: ``<64 hex>  <name>`` lines, no duplicates."""
    out: dict[str, str] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not UTF-8") from None
    for i, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not name:
            raise ValueError(f"{where}: line {i} is not '<sha256>  <name>'")
        if name in out:
            raise ValueError(f"{where}: {name} listed twice")
        out[name] = digest
    return out
