"""The JSON files a mosaic rewrites: the index, config.json and quantization_config.json.

Pure functions from the base's documents (and the planned output headers) to the exact bytes to
write, so that the plan knows them before any data is copied. Formatting follows exllamav3's
writer (``json.dumps(..., indent=4)``) so that untouched fields read exactly as before.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction

from mosaic.checkpoint.census import ST_TO_TORCH
from mosaic.checkpoint.folder import entry_spans, parse_span
from mosaic.errors import SourceError
from mosaic.formats.safetensors_reader import strict_json_loadb


def dumps(doc: object) -> bytes:
    return json.dumps(doc, indent=4).encode("utf-8")


def exl3_bits(rate: Fraction) -> float:
    """The rate as exllamav3 writes it into ``quantization_config.bits`` (2 decimals)."""
    return round(float(rate), 2)


_TOTAL_RE = re.compile(rb'"total_size"\s*:\s*(\d+)')


def new_index(base_text: bytes, base_meta: Mapping[str, object], total_size: int) -> bytes:
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
            return base_text[: m.start(1)] + str(total_size).encode() + base_text[m.end(1) :]
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


@dataclass(frozen=True)
class SplicedText:
    """A file's bytes as a source text with some byte ranges replaced, held as the text and the
    replacements rather than joined: the mosaic's quantization_config.json is 48 MB at GLM-5.3's
    size and differs from the base's in a fraction of them, so the joined copy is made only by
    whoever needs it whole (the writer streams the pieces)."""

    text: bytes
    cuts: tuple[tuple[int, int, bytes], ...]  # (start, end, replacement), sorted and disjoint

    def __len__(self) -> int:
        return len(self.text) + sum(len(r) - (e - a) for a, e, r in self.cuts)

    def chunks(self) -> Iterator[bytes | memoryview]:
        view = memoryview(self.text)
        pos = 0
        for a, e, repl in self.cuts:
            yield view[pos:a]
            yield repl
            pos = e
        yield view[pos:]

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks())


def new_qconfig(
    base_text: bytes,
    base_q: dict,
    donor_texts: Mapping[str, bytes],
    expected: dict,
    replaced: Mapping[str, str],
    whole: Callable[[], dict] | None = None,
) -> bytes | SplicedText:
    """The bytes of the mosaic's quantization_config.json.

    Replaced entries are spliced in as the donor's own text and ``bits`` is patched in the base's
    text, so that everything else stays byte-identical (and 48 MB are not re-serialized). Each cut
    is checked to parse to exactly the entry it replaces and each insert to the entry expected; if
    the text does not allow that, the document is written anew from ``expected``, or from
    ``whole()`` when ``expected`` holds only the replaced entries (the layout keeps no more)."""
    base_spans = entry_spans(base_text)
    donor_spans = {did: entry_spans(t) for did, t in donor_texts.items() if did in set(replaced.values())}
    storage = expected.get("tensor_storage") or {}
    base_storage = base_q.get("tensor_storage") or {}
    pieces: list[tuple[int, int, bytes]] = []
    ok = True
    for key, did in replaced.items():
        b = base_spans.get(key)
        d = donor_spans.get(did, {}).get(key)
        # each cut must be exactly the entry it names, on both sides
        if b is None or d is None or parse_span(base_text, b) != (key, base_storage.get(key)) or parse_span(donor_texts[did], d) != (key, storage.get(key)):
            ok = False
            break
        pieces.append((b[0], b[1], donor_texts[did][d[0] : d[1]]))
    m = _BITS_RE.search(base_text) if "bits" in expected else None
    if m is not None and parse_span(base_text, (m.start(), m.end())) != ("bits", base_q.get("bits")):
        m = None  # not the top-level member it looked like
    if ok and ("bits" not in expected or m is not None):
        if m is not None:
            pieces.append((m.start(), m.end(), b'    "bits": ' + json.dumps(expected["bits"]).encode()))
        pieces.sort()
        if all(pieces[i][1] <= pieces[i + 1][0] for i in range(len(pieces) - 1)):
            return SplicedText(base_text, tuple(pieces))
    return dumps(whole() if whole is not None else expected)


def keep_storage(q: dict | None, modules: set[str]) -> None:
    """Drop, in place, every tensor_storage entry that holds no tensor of ``modules``.

    The base's quantization_config.json is the largest document a build parses (48 MB, ~80 MB as
    objects at GLM-5.3-Flash's size). Its census has checked every entry against the base's headers;
    the layout only replaces the entries that hold a tensor of a module a donor supplies, and keeps
    every other entry as the base's own bytes, whose tensors keep the base's header entries. Those
    entries need not stay in memory until then."""
    storage = q.get("tensor_storage") if isinstance(q, dict) else None
    if not isinstance(storage, dict):
        return
    keep = {}
    for key, entry in storage.items():
        stored = entry.get("stored_tensors") if isinstance(entry, dict) else None
        if key in modules or not isinstance(stored, dict) or any(n.rpartition(".")[0] in modules for n in stored):
            keep[key] = entry
    q["tensor_storage"] = keep  # type: ignore[index]


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
