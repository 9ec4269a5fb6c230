"""``mosaic census`` of a GGUF model: files, tensor types, bits per layer and module group, problems.

Bits per weight come from each tensor's ggml type (8 x type size / block size, e.g. Q4_K 4.5, Q8_0
8.5), weighted by the tensor's weights — the same numbers a GGUF mosaic's card prints. It only reports:
a model it can open is described, and what would make it a poor base or donor is listed as a problem
(a tensor type mosaic does not know cannot be opened at all: that is an error, exit 2).
"""

from __future__ import annotations

from collections import defaultdict

from mosaic._checkpoint.gguf_model import GGUFModel, bits_per_weight, parse_name
from mosaic._formats.gguf_container import type_bits

#: Module groups of a layer as the census and the card show them (the same names a recipe's
#: ``modules`` accepts; see :mod:`mosaic._recipe.gguf_rules`).
_GROUP_OF = (("ffn_exps", "_exps"), ("ffn_shexp", "_shexp"), ("attn", "attn_"), ("ssm", "ssm_"), ("ffn", "ffn_"))


def module_group(rest: str) -> str:
    """The census column of a tensor inside a layer (``ffn_down_exps.weight`` -> ``ffn_exps``)."""
    first = rest.split(".")[0]
    for group, marker in _GROUP_OF:
        if (marker.startswith("_") and first.endswith(marker)) or (not marker.startswith("_") and first.startswith(marker)):
            return group
    return "other"


def _r(x: object) -> float | None:
    return None if x is None else round(float(x), 4)  # type: ignore[arg-type]


def gguf_census(m: GGUFModel) -> dict:
    """The census report (also ``--json``) of one GGUF model."""
    types: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "weights": 0})
    per_layer: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for t in m.tensors:
        h = types[t.type_name]
        h["tensors"] += 1
        h["bytes"] += t.nbytes
        h["weights"] += t.elements
        layer, rest = parse_name(t.name)
        if layer is not None:
            per_layer[layer][module_group(rest)].append(t)
    layers = []
    for layer in sorted(per_layer):
        groups = {}
        for g, ts in sorted(per_layer[layer].items()):
            groups[g] = {"bits": _r(bits_per_weight(ts)), "types": sorted({t.type_name for t in ts})}
        every = [t for ts in per_layer[layer].values() for t in ts]
        layers.append({"layer": layer, "groups": groups, "rate": _r(bits_per_weight(every))})
    problems = []
    present = sorted(per_layer)
    if present and present != list(range(present[-1] + 1)):
        missing = sorted(set(range(present[-1] + 1)) - set(present))
        problems.append(f"layers {missing[:10]} have no tensors (blk.N numbering has holes)")
    block_count = m.first.value(f"{m.architecture}.block_count")
    if isinstance(block_count, int) and present and block_count != present[-1] + 1:
        problems.append(f"{m.architecture}.block_count is {block_count}, the tensors name {present[-1] + 1} layers")
    return {
        "path": m.describe(),
        "format": "gguf",
        "architecture": m.architecture,
        "name": m.first.value("general.name"),
        "file_type": m.first.value("general.file_type"),
        "alignment": m.alignment,
        "files": [{"name": f, "size": m.headers[f].file_size, "tensors": len(m.headers[f].tensors)} for f in m.files],
        "tensors": len(m.tensors),
        "metadata_keys": len(m.metadata),
        "bytes": {"files": m.size, "tensors": sum(t.nbytes for t in m.tensors)},
        "rate": {"all": _r(bits_per_weight(m.tensors)),
                 "layers": _r(bits_per_weight([t for t in m.tensors if t.layer is not None]))},
        "types": {k: {**v, "bits": round(type_bits(next(t.type_id for t in m.tensors if t.type_name == k)), 4)}
                  for k, v in sorted(types.items())},
        "layers": layers,
        "problems": problems,
        "notes": [],
    }
