"""The JSON files a mosaic rewrites: the index, config.json and quantization_config.json.

Pure functions from the base's documents (and the planned output headers) to the exact bytes to
write, so that the plan knows them before any data is copied. Formatting follows exllamav3's
writer (``json.dumps(..., indent=4)``) so that untouched fields read exactly as before.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from mosaic._checkpoint.qconfig import ST_TO_TORCH, parse_members, parse_span
from mosaic._base.errors import CheckpointError, SourceError
from mosaic._formats.safetensors_reader import strict_json_loadb


def dumps(doc: object) -> bytes:
    return json.dumps(doc, indent=4).encode("utf-8")


def exl3_bits(rate: Fraction) -> float:
    """The rate as exllamav3 writes it into ``quantization_config.bits`` (2 decimals)."""
    return round(float(rate), 2)


#: Bytes read at a time when a spliced text is streamed from its source file
_READ_CHUNK = 4 << 20


@dataclass(frozen=True)
class SplicedText:
    """A file's bytes as a source text with some byte ranges replaced, held as the replacements and
    the text, or (:meth:`from_file`) the file the text is read from again when written.

    The mosaic's quantization_config.json (48 MB at GLM-5.3's size) and index (16 MB) differ from the
    base's in a fraction of their bytes: neither the joined copy nor, once planned, the source text
    needs to stay in memory through the splice. Read again, the source must be byte for byte the text
    that was planned (its SHA-256), or writing it fails."""

    cuts: tuple[tuple[int, int, bytes], ...]  # (start, end, replacement), sorted and disjoint
    text: bytes | None = None
    source: Path | None = None
    digest: str = ""
    source_size: int = 0

    def __post_init__(self) -> None:
        if self.text is not None:
            object.__setattr__(self, "source_size", len(self.text))

    def from_file(self, path: Path, digest: str | None = None) -> SplicedText:
        """The same bytes, the source text to be read again from ``path`` when written; ``digest``
        is the text's SHA-256 when the caller already has it (computed here otherwise)."""
        assert self.text is not None
        return SplicedText(self.cuts, None, path, digest or hashlib.sha256(self.text).hexdigest(), self.source_size)

    def __len__(self) -> int:
        return self.source_size + sum(len(r) - (e - a) for a, e, r in self.cuts)

    def chunks(self) -> Iterator[bytes | memoryview]:
        if self.text is None:
            yield from self._chunks_from_file()
            return
        view = memoryview(self.text)
        pos = 0
        for a, e, repl in self.cuts:
            yield view[pos:a]
            yield repl
            pos = e
        yield view[pos:]

    def _chunks_from_file(self) -> Iterator[bytes | memoryview]:
        assert self.source is not None
        h = hashlib.sha256()
        with open(self.source, "rb") as f:

            def take(n: int) -> Iterator[bytes]:
                while n > 0:
                    data = f.read(min(n, _READ_CHUNK))
                    if not data:
                        raise CheckpointError(f"{self.source}: changed since it was read (shorter); nothing was written from it")
                    h.update(data)
                    n -= len(data)
                    yield data

            pos = 0
            for a, e, repl in self.cuts:
                yield from take(a - pos)
                for _ in take(e - a):
                    pass
                yield repl
                pos = e
            yield from take(self.source_size - pos)
            if f.read(1) or h.hexdigest() != self.digest:
                raise CheckpointError(f"{self.source}: changed since it was read; nothing was written from it")

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks())


_TOTAL_RE = re.compile(rb'"total_size"\s*:\s*(-?\d+)')


def new_index(base_text: bytes, base_meta: Mapping[str, object], total_size: int) -> bytes | SplicedText:
    """The base's index with ``metadata.total_size`` set to the output's tensor bytes.

    ``base_text`` is the text ``base_meta`` (the index's members but the weight map) was parsed
    from. The number is replaced in that text, so the file is otherwise byte-identical, when the
    text proves the match is the member: no backslash escape (so every ``"total_size"`` key is
    spelled so), one match only, and its digits are the parsed value. The member must match, so a
    unique match is it, and the patched text parses to the base's index with only that number
    changed; the 16 MB document is not parsed again. Otherwise the text is parsed and written anew
    (same content)."""
    meta = base_meta.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if b"\\" not in base_text and type(total) is int:
        found = _TOTAL_RE.findall(base_text)
        if len(found) == 1 and int(found[0]) == total:
            m = _TOTAL_RE.search(base_text)
            assert m is not None
            return SplicedText(((m.start(1), m.end(1), str(total_size).encode()),), base_text)
    base_index = strict_json_loadb(base_text)
    assert isinstance(base_index, dict)
    expected = dict(base_index)
    new_meta = dict(expected["metadata"]) if isinstance(expected.get("metadata"), dict) else {}
    new_meta["total_size"] = total_size
    expected["metadata"] = new_meta
    if "metadata" not in base_index:
        expected = {"metadata": new_meta, **{k: v for k, v in base_index.items() if k != "metadata"}}
    return dumps(expected)


def new_config(base_config: dict, rate: Fraction | None) -> bytes:
    """The base's config.json with only ``quantization_config.bits`` changed."""
    cfg = copy.deepcopy(base_config)
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and rate is not None:
        qc["bits"] = exl3_bits(rate)
    return dumps(cfg)


_BITS_RE = re.compile(rb'^    "bits": [^,\n]*', re.M)


def expected_qconfig(base_q: dict, donor_q: Mapping[str, dict | None], replaced: Mapping[str, str], rate: Fraction | None) -> dict:
    """What the mosaic's quantization_config.json must say: the base's, with replaced modules'
    tensor_storage entries taken from their donors and ``bits`` set to the mosaic's rate."""
    q = dict(base_q)
    if rate is not None and "bits" in q:
        q["bits"] = exl3_bits(rate)
    storage = q.get("tensor_storage")
    if not isinstance(storage, dict):
        return q
    storage = dict(storage)
    for key, did in replaced.items():
        dq = donor_q.get(did)
        dstore = dq.get("tensor_storage") if isinstance(dq, dict) else None
        if not isinstance(dstore, dict) or key not in dstore:
            raise SourceError(
                f"donor {did!r}: quantization_config.json has no tensor_storage entry for {key}, "
                "so the mosaic's entry cannot be taken from it"
            )
        storage[key] = dstore[key]
    q["tensor_storage"] = storage
    return q


def cut_members(text: bytes, spans: Mapping[str, tuple[int, int]]) -> dict[str, tuple[bytes, object]] | None:
    """Each key's member text (``"key": {...}``) cut out of a quantization_config.json by its span,
    with the entry it parses to (strictly, neighbours a batch at a time); None when one is not
    exactly its member."""
    parsed = parse_members(text, ((k, a, e) for k, (a, e) in spans.items()))
    if parsed is None:
        return None
    return {k: (text[spans[k][0] : spans[k][1]], v) for k, v in parsed}


def new_qconfig(
    base_text: bytes,
    base_spans: Mapping[str, tuple[int, int]] | None,
    members: Mapping[str, bytes] | None,
    bits: tuple[object, object] | None,
    whole: Callable[[], dict],
    top_level: Callable[[tuple[int, int]], bool] | None = None,
) -> bytes | SplicedText:
    """The bytes of the mosaic's quantization_config.json.

    Replaced entries are spliced in as the donor's own text (``members``: key → the member text
    that takes the place of the base's entry of that key, already checked) and ``bits`` (the base's
    value, the mosaic's) is patched in the base's text, so that everything else stays byte-identical
    and 48 MB are neither parsed nor re-serialized. ``base_spans`` are the base text's entry spans,
    proved to be its tensor_storage members when its census read it (None: not proved). When the
    text does not allow the splice, the document ``whole()`` is written anew. ``top_level`` proves
    that the ``"bits"`` line found is the top-level member (without it, ``bits`` is not patched in
    place)."""
    if base_spans is None or members is None:
        return dumps(whole())
    pieces: list[tuple[int, int, bytes]] = []
    for key, member in members.items():
        b = base_spans.get(key)
        if b is None:
            return dumps(whole())
        pieces.append((b[0], b[1], member))
    if bits is not None:
        m = _BITS_RE.search(base_text)
        if (
            m is None
            or parse_span(base_text, (m.start(), m.end())) != ("bits", bits[0])
            or top_level is None
            or not top_level((m.start(), m.end()))
        ):
            return dumps(whole())  # not proved to be the top-level member
        pieces.append((m.start(), m.end(), b'    "bits": ' + json.dumps(bits[1]).encode()))
    pieces.sort()
    if all(pieces[i][1] <= pieces[i + 1][0] for i in range(len(pieces) - 1)):
        return SplicedText(tuple(pieces), base_text)
    return dumps(whole())


def storage_mismatches(q: dict, tensors: Mapping[str, object]) -> list[str]:
    """Entries of a quantization_config document that disagree with (dtype, shape, nbytes) of the
    planned tensors (anything with those three attributes, by name)."""
    out = []
    for key, entry in (q.get("tensor_storage") or {}).items():
        for name, st in (entry.get("stored_tensors") or {}).items():
            t = tensors.get(name)
            if t is None:
                out.append(f"{key}: {name} is in no output shard")
                continue
            dtype, shape, nbytes = t.dtype, t.shape, t.nbytes  # type: ignore[attr-defined]
            if st.get("shape") != list(shape) or st.get("n_bytes") != nbytes or st.get("dtype") != ST_TO_TORCH.get(dtype):
                out.append(f"{key}: {name}: {st} disagrees with the header ({dtype} {list(shape)} {nbytes} bytes)")
    return out
