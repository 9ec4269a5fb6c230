"""The JSON files a mosaic rewrites: the index, config.json and quantization_config.json.

Pure functions from the base's documents (and the planned output headers) to the exact bytes to
write, so that the plan knows them before any data is copied. Formatting follows exllamav3's
writer (``json.dumps(..., indent=4)``) so that untouched fields read exactly as before.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
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


def _same(data: bytes, expected: object) -> bool:
    """Whether ``data`` parses to ``expected`` (strictly: the base's text had no repeated key either)."""
    try:
        return strict_json_loadb(data) == expected
    except ValueError:
        return False


_TOTAL_RE = re.compile(rb'"total_size":\s*\d+')


def new_index(base_text: bytes, base_index: dict, total_size: int) -> bytes:
    """The base's index with ``metadata.total_size`` set to the output's tensor bytes.

    The number is replaced in the base's own text, so the file is otherwise byte-identical; if the
    text does not have the expected shape, the document is written anew (same content)."""
    expected = dict(base_index)
    meta = dict(expected["metadata"]) if isinstance(expected.get("metadata"), dict) else {}
    meta["total_size"] = total_size
    expected["metadata"] = meta
    if "metadata" not in base_index:
        expected = {"metadata": meta, **{k: v for k, v in base_index.items() if k != "metadata"}}
    m = _TOTAL_RE.search(base_text)
    if m is not None:
        patched = base_text[: m.start()] + b'"total_size": ' + str(total_size).encode() + base_text[m.end() :]
        if _same(patched, expected):
            return patched
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


def new_qconfig(
    base_text: bytes, base_q: dict, donor_texts: Mapping[str, bytes], expected: dict, replaced: Mapping[str, str]
) -> bytes:
    """The bytes of the mosaic's quantization_config.json.

    Replaced entries are spliced in as the donor's own text and ``bits`` is patched in the base's
    text, so that everything else stays byte-identical (and 48 MB are not re-serialized). Each cut
    is checked to parse to exactly the entry it replaces and each insert to the entry expected; if
    the text does not allow that, the document is written anew from ``expected``."""
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
        out = bytearray()
        pos = 0
        for a, e, repl in pieces:
            if a < pos:
                ok = False
                break
            out += base_text[pos:a]
            out += repl
            pos = e
        out += base_text[pos:]
        if ok:
            return bytes(out)
    return dumps(expected)


def storage_mismatches(q: dict, tensors: Mapping[str, tuple[str, tuple[int, ...], int]]) -> list[str]:
    """Entries of a quantization_config document that disagree with (dtype, shape, nbytes) of the headers."""
    out = []
    for key, entry in (q.get("tensor_storage") or {}).items():
        for name, st in (entry.get("stored_tensors") or {}).items():
            t = tensors.get(name)
            if t is None:
                out.append(f"{key}: {name} is in no output shard")
                continue
            dtype, shape, nbytes = t
            if st.get("shape") != list(shape) or st.get("n_bytes") != nbytes or st.get("dtype") != ST_TO_TORCH.get(dtype):
                out.append(f"{key}: {name}: {st} disagrees with the header ({dtype} {list(shape)} {nbytes} bytes)")
    return out
