"""A ladder: one GGUF per ggml type, every quantizable tensor of one source model at that type (with ``--lean``,
where that type has no fewer bytes, at its own), made by llama.cpp's own ``llama-quantize`` (``mosaic ladder``), and its
manifest ``ladder.json``.

This module holds what both sides of a ladder need: the types a rung may hold and the llama.cpp file type
(ftype) whose ``--pure`` output holds each (they differ for some: ftype IQ2_S writes IQ2_XS tensors, IQ2_M
writes IQ2_S), which types need an importance matrix, the manifest's schema, and ``--ladder DIR`` for
``measure`` and ``plan``: the rung of fewest bytes is the base, every other rung a donor named by its type in
lower case, each file checked against the manifest's SHA-256 before it is used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from mosaic._base.errors import FormatError, MosaicError
from mosaic._base.hashing import digest_file

LADDER_FILE = "ladder.json"
SCHEMA_ID = "mosaic.ladder/v1"

#: Every type a rung may hold, in the contract's order (also the order ties between equal sizes break by),
#: with the ftype name ``llama-quantize --pure`` is given for it.
FTYPE_OF: dict[str, str] = {
    "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_M",
    "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S", "IQ4_XS": "IQ4_XS", "IQ4_NL": "IQ4_NL", "Q2_K": "Q2_K",
    "Q3_K": "Q3_K_M", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q4_K": "Q4_K_M", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q5_K": "Q5_K_M", "Q6_K": "Q6_K", "Q8_0": "Q8_0",
}
#: llama.cpp's ``llama_ftype`` numbers of those ftype names (what its C API takes).
FTYPE_ID: dict[str, int] = {
    "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17,
    "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ2_M": 29,
    "IQ4_XS": 30, "IQ1_M": 31,
}
#: The types llama-quantize refuses to write without an importance matrix (in this llama.cpp), and the
#: nearest type that needs none, which a tensor the matrix does not cover gets instead (a rung never aborts).
NEEDS_IMATRIX: dict[str, str] = {
    "IQ1_S": "Q2_K", "IQ1_M": "Q2_K", "IQ2_XXS": "Q2_K", "IQ2_XS": "Q2_K", "IQ2_S": "Q2_K", "IQ3_XXS": "IQ3_S",
}
TYPES = tuple(FTYPE_OF)
#: The floor of the default types (``mosaic ladder --min-bpw``): IQ1_S, IQ1_M, IQ2_XXS and IQ2_XS are not made. No
#: plan of 2.5 bits a weight or more took one on either bench model, and without them the plans were the same files
#: (bench/RESULTS.md, "A ladder without the four types under 2.5 bits").
DEFAULT_MIN_BPW = 2.5


def bits_per_weight(type_name: str) -> float:
    """A ggml type's bits per weight: its block's bytes over the weights the block holds (IQ2_S 2.5625)."""
    from mosaic._formats.gguf_container import quant_types

    return next(8 * ts / bs for name, bs, ts in quant_types().values() if name == type_name)


def default_types(with_imatrix: bool, min_bpw: float | None = None) -> list[str]:
    """Every type llama.cpp's own mixer considers, less those that need a matrix when there is none and, with
    ``min_bpw``, those of fewer bits per weight."""
    return [t for t in TYPES if (with_imatrix or t not in NEEDS_IMATRIX) and (min_bpw is None or bits_per_weight(t) >= min_bpw)]


def parse_types(text: str | None, with_imatrix: bool, min_bpw: float | None = None) -> list[str]:
    """``--types Q4_K,IQ4_XS,...`` in the contract's order, each once; an unknown type, one that needs an
    importance matrix without one, or one under ``--min-bpw``, is refused naming it: a type named and a floor
    that excludes it contradict each other, and neither is the one to drop silently."""
    if min_bpw is not None and not (isinstance(min_bpw, (int, float)) and math.isfinite(min_bpw) and min_bpw > 0):
        raise MosaicError(f"--min-bpw {min_bpw}: expected a number of bits per weight above 0 (e.g. 2.5)")
    if text is None:
        types = default_types(with_imatrix, min_bpw)
        if not types:
            most = max(TYPES, key=bits_per_weight)
            raise MosaicError(f"--min-bpw {min_bpw:g}: no type a rung can hold has that many bits per weight "
                              f"(the most: {bits_per_weight(most):g}, {most})")
        return types
    asked = [t.strip().upper() for t in text.split(",") if t.strip()]
    if not asked:
        raise MosaicError("--types: name at least one ggml type (e.g. Q4_K,IQ4_XS,Q8_0)")
    for t in asked:
        if t not in FTYPE_OF:
            raise MosaicError(f"--types: {t} is not a type a rung can hold (one of {', '.join(TYPES)})")
        if t in NEEDS_IMATRIX and not with_imatrix:
            raise MosaicError(f"--types: {t} needs an importance matrix (llama-quantize refuses it without one); "
                              "give --imatrix FILE, or leave it out")
        if min_bpw is not None and bits_per_weight(t) < min_bpw:
            raise MosaicError(f"--types: {t} has {bits_per_weight(t):g} bits per weight, under --min-bpw {min_bpw:g}; "
                              "leave one of them out")
    return [t for t in TYPES if t in asked]


@cache
def _validator():  # type: ignore[no-untyped-def]
    import jsonschema

    schema = json.loads(resources.files("mosaic").joinpath("schema/ladder.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def manifest_errors(doc: object) -> list[str]:
    errs = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errs]


def read_manifest(folder: Path) -> dict:
    """``DIR/ladder.json``, validated against its schema (every rung's file a plain name in ``DIR``)."""
    from mosaic._formats.safetensors_reader import strict_json_loads

    path = folder / LADDER_FILE
    try:
        doc = strict_json_loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MosaicError(f"--ladder {folder}: no {LADDER_FILE} there (make one with: mosaic ladder SOURCE --out {folder})") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: cannot read the ladder's manifest: {e}") from None
    errs = manifest_errors(doc)
    if errs:
        raise FormatError(f"{path}: not a valid {SCHEMA_ID} manifest: {errs[0]}")
    return doc  # type: ignore[return-value]


@dataclass(frozen=True)
class Rung:
    type: str
    id: str
    path: Path
    bytes: int


@dataclass(frozen=True)
class RungSet:
    """``--ladder DIR`` as sources: the base (the rung of fewest bytes) and every other rung as a donor."""

    folder: Path
    base: Rung
    donors: tuple[Rung, ...]
    source_sha256: str  # the model the rungs were made of, as ladder.json records it
    source_bytes: int
    min_bpw: float | None = None  # the floor it was made with (ladder.json's options; None: none, or not recorded)


def rung_intact(folder: Path, rec: dict) -> bool:
    """Does the rung ``rec`` of a manifest still lie in ``folder`` with its recorded size and SHA-256?"""
    path = folder / rec["file"]
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return size == rec["bytes"] and digest_file(path).sha256 == rec["sha256"]


def open_ladder(folder: str | Path) -> RungSet:
    """The ladder in ``folder``, every rung's file checked against the manifest (size, then SHA-256) first: a
    rung that changed since it was made is refused naming it."""
    folder = Path(folder)
    doc = read_manifest(folder)
    rungs = []
    for r in doc["rungs"]:
        path = folder / r["file"]
        if not path.is_file():
            raise MosaicError(f"--ladder {folder}: the {r['type']} rung {r['file']} is missing; "
                              f"make it again with: mosaic ladder SOURCE --out {folder}")
        if not rung_intact(folder, r):
            raise MosaicError(f"--ladder {folder}: {r['file']} is not the {r['type']} rung {LADDER_FILE} records "
                              "(its bytes changed since it was made); make it again with mosaic ladder")
        rungs.append(Rung(r["type"], r["id"], path, r["bytes"]))
    if len(rungs) < 2:
        raise MosaicError(f"--ladder {folder}: {len(rungs)} rung(s); a ladder to plan over needs a base and a donor")
    order = {t: i for i, t in enumerate(TYPES)}
    base = min(rungs, key=lambda r: (r.bytes, order.get(r.type, len(order))))
    donors = tuple(sorted((r for r in rungs if r is not base), key=lambda r: order.get(r.type, len(order))))
    return RungSet(folder, base, donors, doc["source"]["sha256"], doc["source"]["bytes"],
                   doc.get("options", {}).get("min_bpw"))
