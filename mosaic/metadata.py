"""The JSON files a mosaic rewrites: the index, config.json and quantization_config.json.

Pure functions from the base's documents (and the planned output headers) to the exact bytes to
write, so that the plan knows them before any data is copied. Formatting follows exllamav3's
writer (``json.dumps(..., indent=4)``) so that untouched fields read exactly as before.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from fractions import Fraction

from .census import ST_TO_TORCH
from .errors import SourceError


def dumps(doc: object) -> bytes:
    return json.dumps(doc, indent=4).encode("utf-8")


def exl3_bits(rate: Fraction) -> float:
    """The rate as exllamav3 writes it into ``quantization_config.bits`` (2 decimals)."""
    return round(float(rate), 2)


def new_index(base_index: dict, total_size: int) -> bytes:
    """The base's index with ``metadata.total_size`` set to the output's tensor bytes."""
    idx = copy.deepcopy(base_index)
    meta = idx.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    meta["total_size"] = total_size
    out = {"metadata": meta}
    out.update({k: v for k, v in idx.items() if k != "metadata"})
    return dumps(out)


def new_config(base_config: dict, rate: Fraction | None) -> bytes:
    """The base's config.json with only ``quantization_config.bits`` changed."""
    cfg = copy.deepcopy(base_config)
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and rate is not None:
        qc["bits"] = exl3_bits(rate)
    return dumps(cfg)


def new_qconfig(
    base_q: dict,
    donor_q: Mapping[str, dict | None],
    replaced: Mapping[str, str],
    rate: Fraction | None,
) -> bytes:
    """The base's quantization_config.json with replaced modules' entries taken from their donors.

    ``replaced`` maps a tensor_storage key to the donor id that now supplies its tensors.
    """
    q = copy.deepcopy(base_q)
    if rate is not None and "bits" in q:
        q["bits"] = exl3_bits(rate)
    storage = q.get("tensor_storage")
    if not isinstance(storage, dict):
        return dumps(q)
    for key, did in replaced.items():
        dq = donor_q.get(did)
        dstore = dq.get("tensor_storage") if isinstance(dq, dict) else None
        if not isinstance(dstore, dict) or key not in dstore:
            raise SourceError(
                f"donor {did!r}: quantization_config.json has no tensor_storage entry for {key}, "
                "so the mosaic's entry cannot be taken from it"
            )
        storage[key] = copy.deepcopy(dstore[key])
    return dumps(q)


def storage_mismatches(q_bytes: bytes, tensors: Mapping[str, tuple[str, tuple[int, ...], int]]) -> list[str]:
    """Entries of a quantization_config.json that disagree with (dtype, shape, nbytes) of the headers."""
    q = json.loads(q_bytes)
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
