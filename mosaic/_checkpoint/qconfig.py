"""quantization_config.json read one tensor_storage entry at a time.

exllamav3 writes the file with ``json.dumps(..., indent=4)``: 48 MB and 38,000 entries at GLM-5.3-Flash's
size, ~80 MB as Python objects plus the parser's own transient copy, although the census needs a few
fields of each entry and the layout only the entries a donor replaces. So the text is read as a
*skeleton* (every entry's value replaced by a placeholder) parsed strictly, plus each entry parsed
strictly on its own, summarized (:class:`EntrySummary`) and let go.

Why that is the strict parse of the whole document: an entry is found by its first line, 8 spaces
and ``"key": {`` after a newline, and ends at the first later line of 8 spaces and ``}``. A newline
cannot occur inside a JSON string, so each entry starts on a token boundary; the entry parsed alone
(``{`` + entry + ``}``, strictly) is exactly one member, so it ends on one too, and the document's tokens
are the skeleton's with each placeholder replaced by one value's tokens. The text must hold no
backslash, so the placeholder (the string ``"\\u0000"``) appears nowhere else: when the skeleton's
``tensor_storage`` holds exactly one placeholder per entry, under the entries' keys in their order,
every entry is a direct member of it. Duplicate keys: those of the skeleton are refused by its strict
parse, those inside an entry by the entry's. Whenever any step of that is not clean, the whole text is
parsed strictly and has the last word (and names what is wrong).
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from array import array
from collections.abc import Iterable, Iterator, Mapping
from itertools import chain, islice, repeat
from pathlib import Path
from typing import NamedTuple

from mosaic._base.errors import CheckpointError
from mosaic._checkpoint.jsonfile import parse_json, read_bytes
from mosaic._formats.safetensors_reader import (
    TensorInfo,
    plain_json_text,
    strict_json_loadb,
    strict_json_loads,
)

WHERE = "quantization_config.json"

#: torch dtype names (as quantization_config.json writes them) → safetensors dtypes
TORCH_DTYPES = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.int16": "I16",
    "torch.uint16": "U16",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int32": "I32",
    "torch.uint32": "U32",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.uint64": "U64",
    "torch.float64": "F64",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
}
ST_TO_TORCH = {v: k for k, v in TORCH_DTYPES.items()}

# exllamav3 writes quantization_config.json with indent=4: every tensor_storage entry opens on a line
# of its own at 8 spaces and closes at the first later line that is 8 spaces and "}".
_ENTRY_START = b'\n        "'
_ENTRY_END = b"\n        }"
_PLACEHOLDER = b'"\\u0000"'


class Span(NamedTuple):
    key: str
    start: int  # the entry's first byte (its line's indentation)
    value: int  # the "{" that opens its value
    end: int  # one past the "}" that closes it


_ENTRY_LINE = re.compile(rb'\n {8}(".*"): \{(?=\n)')
_ENTRY_CLOSE = re.compile(rb"\n {8}\}")


def entry_span_list(text: bytes) -> list[Span]:
    """Every 8-space-indented ``"key": {...}`` member of an indent=4 document, in text order.

    Found with two regex scans at C speed (first lines, closing lines) that must interleave one to
    one, as they do in exllamav3's layout; any other text takes :func:`_entry_span_scan`. Nothing here
    is trusted: callers prove the spans (see the module docstring) or check each with
    :func:`parse_span`."""
    firsts = list(_ENTRY_LINE.finditer(text))
    ends = [m.end() for m in _ENTRY_CLOSE.finditer(text)]
    if not firsts or len(ends) != len(firsts) or b"\\" in text:
        return _entry_span_scan(text)
    starts = [m.start() + 1 for m in firsts]
    values = [m.end() - 1 for m in firsts]
    if any(map(operator.ge, values, ends)) or any(map(operator.ge, ends[:-1], starts[1:])):
        return _entry_span_scan(text)
    try:
        keys = [m.group(1)[1:-1].decode("utf-8") for m in firsts]
    except UnicodeDecodeError:
        return _entry_span_scan(text)
    return list(map(tuple.__new__, repeat(Span), zip(keys, starts, values, ends)))


def _entry_span_scan(text: bytes) -> list[Span]:
    """:func:`entry_span_list` one line at a time, for any text (escaped keys, entries the closing
    lines of other objects fall between)."""
    spans: list[Span] = []
    pos = text.find(_ENTRY_START)
    while pos >= 0:
        start = pos + 1
        eol = text.find(b"\n", start)
        if eol < 0:
            break
        if text.endswith(b'": {', start, eol):
            raw = text[start + 8 : eol - 3]
            end = text.find(_ENTRY_END, eol)
            if end < 0:
                break
            end += len(_ENTRY_END)
            key: object
            if b"\\" in raw:
                try:
                    key = json.loads(raw)
                except ValueError:
                    key = None
            else:
                key = raw[1:-1].decode("utf-8", "replace")
            if isinstance(key, str):
                spans.append(Span(key, start, eol - 1, end))
            pos = text.find(_ENTRY_START, end)
        else:
            pos = text.find(_ENTRY_START, eol)
    return spans


def entry_spans(text: bytes) -> dict[str, tuple[int, int]]:
    """:func:`entry_span_list` by key, as ``(start, end)`` (a repeated key: its last span)."""
    return {s.key: (s.start, s.end) for s in entry_span_list(text)}


def parse_span(text: bytes, span: tuple[int, int]) -> tuple[str, object] | None:
    """The (key, value) a span holds, or None when it is not exactly one JSON member (or repeats a
    key inside: the strict rule holds for entries read alone as for whole files)."""
    try:
        obj = strict_json_loadb(b"{" + text[span[0] : span[1]] + b"}")
    except (ValueError, RecursionError):
        return None
    return next(iter(obj.items())) if isinstance(obj, dict) and len(obj) == 1 else None


def prove_spans(text: bytes) -> tuple[dict, list[Span]] | None:
    """The document's members but tensor_storage, and the spans of every tensor_storage entry,
    when the text proves that reading those spans one by one is reading the document (see the module
    docstring; each span must still parse on its own); else None."""
    if b"\\" in text:
        return None
    spans = entry_span_list(text)
    if not spans:
        return None
    pieces: list[bytes | memoryview] = []
    view = memoryview(text)
    pos = 0
    for s in spans:
        if s.start < pos:
            return None
        pieces += (view[pos : s.value], _PLACEHOLDER)
        pos = s.end
    pieces.append(view[pos:])
    try:
        doc = strict_json_loadb(b"".join(pieces))
    except (ValueError, RecursionError):
        return None
    storage = doc.get("tensor_storage") if isinstance(doc, dict) else None
    if (
        not isinstance(storage, dict)
        or len(storage) != len(spans)
        or any(v != "\x00" for v in storage.values())
        or list(storage) != [s.key for s in spans]
    ):
        return None
    return {k: v for k, v in doc.items() if k != "tensor_storage"}, spans


def is_top_member(text: bytes, entries: Iterable[tuple[int, int]], span: tuple[int, int], key: str) -> bool:
    """Whether ``text[span]`` (one ``"key": value`` member, outside every proved entry span in
    ``entries``) is a member of the document's top-level object, not a look-alike nested elsewhere.

    The skeleton with every entry replaced by a numbered placeholder member and this member's value
    by a marker string (which a text without backslashes cannot contain) must parse strictly with
    the marker at the top level under ``key``."""
    if b"\\" in text:
        return False
    pieces: list[bytes | memoryview] = []
    view = memoryview(text)
    pos = 0
    cuts = sorted([(a, e, b'"\\u0000%d": 0' % i) for i, (a, e) in enumerate(entries)])
    cuts.append((span[0], span[1], b'%s: "\\u0001"' % json.dumps(key).encode()))
    for a, e, repl in sorted(cuts):
        if a < pos:
            return False
        pieces += (view[pos:a], repl)
        pos = e
    pieces.append(view[pos:])
    try:
        doc = strict_json_loadb(b"".join(pieces))
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get(key) == "\x01"


class EntrySummary(NamedTuple):
    """What the census keeps of one tensor_storage entry: its stored tensors' names (the headers'
    own string objects), the disagreements of their dtype, shape and n_bytes with the headers, and
    the three fields the module checks compare. ``names`` is None for an entry without a
    stored_tensors object (its one problem says so)."""

    key: str
    names: tuple[str, ...] | None
    problems: tuple[str, ...]
    bits_per_weight: object
    mul1_multiplier: object
    mcg_multiplier: object


def summarize(key: str, entry: object, info: Mapping[str, TensorInfo], _want: dict | None = None) -> EntrySummary:
    """One entry checked against the headers (``info``: every tensor's header entry by name).

    ``_want`` caches, per header (dtype, shape, size), the stored-tensor record that agrees with it:
    at 151,000 stored tensors one dict comparison each decides the common case."""
    if not isinstance(entry, dict) or not isinstance(entry.get("stored_tensors"), dict):
        return EntrySummary(key, None, (f"{WHERE}: {key}: entry has no stored_tensors object",), None, None, None)
    want = _want if _want is not None else {}
    problems: list[str] = []
    names: list[str] = []
    for name, st in entry["stored_tensors"].items():
        t = info.get(name)
        if t is None:
            names.append(name)
            problems.append(f"{WHERE}: {key}: stored tensor {name!r} is in no shard")
            continue
        names.append(t.name)
        k = (t.dtype, t.shape, t.end - t.begin)
        good = want.get(k)
        if good is None:
            good = want[k] = {"shape": list(t.shape), "n_bytes": t.end - t.begin, "dtype": ST_TO_TORCH.get(t.dtype)}
        if st == good and type(st["dtype"]) is str:
            continue  # the common case, all three fields right (and nothing else): nothing to report
        if not isinstance(st, dict):
            problems.append(f"{WHERE}: {name}: entry is not an object")
            continue
        dtype = st.get("dtype")
        if st.get("shape") != list(t.shape):
            problems.append(f"{WHERE}: {name}: shape {st.get('shape')} but the header says {list(t.shape)}")
        if st.get("n_bytes") != t.nbytes:
            problems.append(f"{WHERE}: {name}: n_bytes {st.get('n_bytes')} but the header says {t.nbytes}")
        if (TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else None) != t.dtype:
            problems.append(f"{WHERE}: {name}: dtype {st.get('dtype')!r} but the header says {t.dtype}")
    return EntrySummary(
        key, tuple(names), tuple(problems), entry.get("bits_per_weight"), entry.get("mul1_multiplier"), entry.get("mcg_multiplier")
    )


_E_NAME, _E_DTYPE, _E_SHAPE, _E_BEGIN, _E_END = (operator.attrgetter(f) for f in ("name", "dtype", "shape", "begin", "end"))
_E_FIELDS = tuple(operator.methodcaller("get", f) for f in ("bits_per_weight", "mul1_multiplier", "mcg_multiplier"))


def summarize_all(items: list[tuple[str, object]], info: Mapping[str, TensorInfo], want: dict) -> list[EntrySummary]:
    """:func:`summarize` of many entries, the common case (every entry an object of stored tensors
    that are in the headers and agree with them) decided a column at a time over all their stored
    tensors; anything else takes :func:`summarize` entry by entry, which has the last word."""
    entries = [e for _, e in items]
    if set(map(type, entries)) != {dict}:
        return [summarize(k, e, info, want) for k, e in items]
    stored = list(map(operator.methodcaller("get", "stored_tensors"), entries))
    if set(map(type, stored)) != {dict}:
        return [summarize(k, e, info, want) for k, e in items]
    names = list(chain.from_iterable(stored))
    infos = list(map(info.get, names))
    if None in infos:
        return [summarize(k, e, info, want) for k, e in items]
    # (dtype, shape, size) of each stored tensor's header entry, and the record that agrees with it
    kinds = list(zip(map(_E_DTYPE, infos), map(_E_SHAPE, infos), map(operator.sub, map(_E_END, infos), map(_E_BEGIN, infos))))
    distinct = set(kinds)
    for k in distinct - want.keys():
        want[k] = {"shape": list(k[1]), "n_bytes": k[2], "dtype": ST_TO_TORCH.get(k[0])}
    records = list(chain.from_iterable(map(dict.values, stored)))
    if records != list(map(want.__getitem__, kinds)) or any(want[k]["dtype"] is None for k in distinct):
        return [summarize(k, e, info, want) for k, e in items]
    header_names = iter(list(map(_E_NAME, infos)))
    per_entry = [tuple(islice(header_names, n)) for n in map(len, stored)]
    n = len(items)
    columns = zip([k for k, _ in items], per_entry, repeat((), n), *(map(f, entries) for f in _E_FIELDS))
    return list(map(tuple.__new__, repeat(EntrySummary), columns))


#: The stand-in for an entry's key in its template: an escape, which a text without backslashes
#: cannot hold, spelling a control character, which no JSON string may hold raw.
_MARK = "\x01"
_MARK_ESCAPED = b"\\u0001"
_KEY_UNFIT = re.compile(r'["\\\x00-\x1f]')
#: More distinct templates than this share (per entry) gain nothing over parsing the entries.
_TEMPLATE_SHARE = 16
#: Nesting a template may have (exllamav3's entries have 4). Whether a parser refuses a deeply nested
#: text depends on its recursion limit, which a piece parsed alone meets at another depth than the whole
#: document: a deeper entry leaves the verdict to the whole document's strict parse.
_TEMPLATE_DEPTH = 32


class _TooDeep(Exception):
    """A template nests deeper than :data:`_TEMPLATE_DEPTH`: the whole document is parsed instead."""
_BRACKETS = re.compile(rb'"[^"]*"|[\[{]|[\]}]')


def _depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text without backslashes (strings skipped)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        c = m.group()[:1]
        if c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


def summarize_templated(text: bytes, spans: list[Span], info: Mapping[str, TensorInfo], want: dict) -> list[EntrySummary] | None:
    """:func:`summarize` of every proved entry, parsing each distinct *template* once instead of
    each entry: an entry's value with its key replaced by ``\\u0001``. exllamav3's entries differ
    only in their key and shapes, so GLM-5.3-Flash's 38,000 entries have a few dozen templates.
    None when the text does not fit (the caller parses the entries); an entry whose template or
    headers do not fit is parsed on its own, and one that is not exactly its member also returns None.

    Why a template's parse is the entry's: the text has no backslash, so every ``\\u0001`` of a
    template stands for the key. A backslash is only valid inside a string, so when the template
    parses, each stands inside a string; the key has no quote, backslash or control character, so
    putting it back changes no token but those strings, whose values get the key where the
    template's have ``\x01``. When the marks are exactly one per stored tensor name, at its start,
    no other string holds the key and the names are the key + the template name's rest: distinct
    exactly when the template's are, so the strict rule on repeated keys carries over too."""
    keys = [s.key for s in spans]
    if not keys or not all(keys) or _KEY_UNFIT.search("".join(keys)):
        return None
    groups: dict[bytes, list[int]] = {}
    values = map(text.__getitem__, map(slice, map(operator.attrgetter("value"), spans), map(operator.attrgetter("end"), spans)))
    for i, t in enumerate(map(bytes.replace, values, map(str.encode, keys), repeat(_MARK_ESCAPED))):
        g = groups.get(t)
        if g is None:
            groups[t] = [i]
        else:
            g.append(i)
    if len(groups) * _TEMPLATE_SHARE > len(spans) and len(groups) > 64:
        return None
    out: list[EntrySummary | None] = [None] * len(spans)
    for t, idx in groups.items():
        done = _summarize_group(t, [keys[i] for i in idx], info, want)
        if done is None:  # the template or the headers do not fit: each entry of it on its own
            done = []
            for i in idx:
                kv = parse_span(text, (spans[i].start, spans[i].end))
                if kv is None or kv[0] != keys[i]:
                    return None
                done.append(summarize(kv[0], kv[1], info, want))
        for i, e in zip(idx, done):
            out[i] = e
    return out  # type: ignore[return-value]


def _summarize_group(template: bytes, keys: list[str], info: Mapping[str, TensorInfo], want: dict) -> list[EntrySummary] | None:
    """The summaries of the entries ``keys`` that share ``template``, when it parses, its marks are
    exactly its stored tensors' name prefixes, and every stored tensor agrees with its header; else None."""
    if _depth(template) > _TEMPLATE_DEPTH:
        raise _TooDeep
    try:
        v = strict_json_loads(template.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    stored = v.get("stored_tensors") if type(v) is dict else None
    if type(stored) is not dict or template.count(_MARK_ESCAPED) != len(stored):
        return None
    if not all(n.startswith(_MARK) and n.count(_MARK) == 1 for n in stored):
        return None
    rests = [n[1:] for n in stored]
    infos = list(map(info.get, [k + r for k in keys for r in rests]))
    if None in infos:
        return None
    kinds = list(zip(map(_E_DTYPE, infos), map(_E_SHAPE, infos), map(operator.sub, map(_E_END, infos), map(_E_BEGIN, infos))))
    distinct = set(kinds)
    for k in distinct - want.keys():
        want[k] = {"shape": list(k[1]), "n_bytes": k[2], "dtype": ST_TO_TORCH.get(k[0])}
    records = list(stored.values())
    if any(want[k]["dtype"] is None for k in distinct) or list(map(want.__getitem__, kinds)) != records * len(keys):
        return None
    m = len(rests)
    names = list(zip(*[iter(list(map(_E_NAME, infos)))] * m)) if m else [()] * len(keys)
    fields = tuple(f(v) for f in _E_FIELDS)
    return [EntrySummary(k, n, (), *fields) for k, n in zip(keys, names)]


#: Entries parsed together (about 1 MB of text at GLM-5.3's entry size)
_BATCH = 1024
_JSON_SPACE = b" \t\n\r"


def member_batches(text: bytes, spans: Iterable[tuple[str, int, int]]) -> Iterator[list[tuple[str, object]] | None]:
    """The (key, entry) of each ``(key, start, end)`` span, in text order, parsed strictly a batch
    of neighbours at a time; a None batch (then nothing more) when a span is not exactly its member.

    Spans next to each other in the text (only JSON whitespace and one comma between them) are
    members of one object with its own separators, so ``{`` + the text from the first one's start
    to the last one's end + ``}`` must be an object of exactly those members, in that order: one
    strict parse for up to a thousand entries instead of one each, and only a batch held at once."""
    ordered = sorted(spans, key=lambda s: s[1])
    plain = plain_json_text(text)  # once for the text, not again for every batch
    i = 0
    while i < len(ordered):
        j = i + 1
        while j < len(ordered) and j - i < _BATCH and text[ordered[j - 1][2] : ordered[j][1]].strip(_JSON_SPACE) == b",":
            j += 1
        run = ordered[i:j]
        piece = bytearray(b"{")
        piece += memoryview(text)[run[0][1] : run[-1][2]]
        piece += b"}"
        try:
            obj = strict_json_loadb(piece, plain=plain)
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict) or list(obj) != [k for k, _, _ in run]:
            yield None
            return
        yield list(obj.items())
        i = j


def parse_members(text: bytes, spans: Iterable[tuple[str, int, int]]) -> list[tuple[str, object]] | None:
    """Every batch of :func:`member_batches`, or None."""
    out: list[tuple[str, object]] = []
    for batch in member_batches(text, spans):
        if batch is None:
            return None
        out += batch
    return out


class QConfigRead(NamedTuple):
    """A whole quantization_config.json as the census keeps it."""

    top: dict  # every member but tensor_storage
    entries: list[EntrySummary] | None  # None: no tensor_storage object
    digest: str  # SHA-256 of the text read
    #: each entry's (start, end) in the text, flattened, aligned with ``entries``, when proved
    offsets: array | None


def _read_proved(text: bytes, top: dict, spans: list[Span], info: Mapping[str, TensorInfo], want: dict, digest: str) -> QConfigRead | None:
    """:func:`read_qconfig` of a text whose spans are proved: by templates, else a batch at a time;
    None when a batch is not exactly its members (raises :class:`_TooDeep` for a deep template)."""
    offsets = array("q", (x for s in spans for x in (s.start, s.end)))
    templated = summarize_templated(text, spans, info, want)
    if templated is not None:
        return QConfigRead(top, templated, digest, offsets)
    entries: list[EntrySummary] = []
    for batch in member_batches(text, ((s.key, s.start, s.end) for s in spans)):
        if batch is None:
            return None
        entries += summarize_all(batch, info, want)
    return QConfigRead(top, entries, digest, offsets)


def read_qconfig(path: Path, info: Mapping[str, TensorInfo]) -> QConfigRead:
    """Read and summarize every entry, holding a batch at a time when the text allows (else
    parsing the whole document strictly, which also names any error)."""
    text = read_bytes(path, "quantization config")
    digest = hashlib.sha256(text).hexdigest()
    proved = prove_spans(text)
    want: dict = {}
    if proved is not None:
        try:
            read = _read_proved(text, *proved, info, want, digest)
        except _TooDeep:
            read = None  # the whole parse below decides
        if read is not None:
            return read
    q = parse_json(text, path, "quantization config")
    if not isinstance(q, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    storage = q.get("tensor_storage")
    top = {k: v for k, v in q.items() if k != "tensor_storage"}
    if not isinstance(storage, dict):
        return QConfigRead(top, None, digest, None)
    return QConfigRead(top, summarize_all(list(storage.items()), info, want), digest, None)


def entries_of(text: bytes, keys: Iterable[str], spans: Mapping[str, tuple[int, int]] | None, path: Path) -> dict[str, object]:
    """The tensor_storage entries of ``keys`` (those present), from a text already read and
    checked: cut out by ``spans`` when given (proved spans of this text), else parsed whole."""
    wanted = list(keys)
    if spans is not None:
        found = parse_members(text, ((k, *spans[k]) for k in wanted if k in spans))
        if found is not None:
            return dict(found)
    q = parse_json(text, path, "quantization config")
    if not isinstance(q, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    storage = q.get("tensor_storage")
    return {k: storage[k] for k in wanted if k in storage} if isinstance(storage, dict) else {}


def read_partial(path: Path, keys: set[str]) -> tuple[dict, str, dict[str, tuple[int, int]] | None]:
    """The tensor_storage entries of ``keys`` only (a donor's: the modules it supplies), without
    parsing the other entries when the text's spans are proved; otherwise the whole file, strictly.
    With the SHA-256 of the text read and, when proved, the spans of those entries."""
    text = read_bytes(path, "quantization config")
    digest = hashlib.sha256(text).hexdigest()
    proved = prove_spans(text)
    spans = {s.key: (s.start, s.end) for s in proved[1] if s.key in keys} if proved is not None else None
    found = parse_members(text, ((k, *span) for k, span in spans.items())) if spans is not None else None
    if found is None:  # not proved, or a span that is not exactly its member: the whole text decides
        return {"tensor_storage": entries_of(text, keys, None, path)}, digest, None
    return {"tensor_storage": dict(found)}, digest, spans
