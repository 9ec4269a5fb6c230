"""The units a measurement scores, and what each costs in bytes.

A unit is a set of tensors taken from one donor together. ``layer``: every tensor of ``blk.N``;
``layer-experts``: the layer's routed experts (``ffn_*_exps``); ``module-group``: each quantized
tensor of a layer on its own, named by its kind (the name without ``blk.N.`` and ``.weight``:
``attn_v``, ``ffn_down``, ``ffn_gate_exps``...), and ``output.weight`` / ``token_embd.weight`` as units of
their own with layer ``None`` (unless the layers are narrowed). Norms and other F32 tensors are never
units of their own. ``dbytes`` is the exact growth of a built one-file mosaic: the header does not depend
on the tensor types, so it is the sum of the unit's padded byte deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from mosaic._base.errors import MosaicError
from mosaic._checkpoint.gguf_model import GGUFModel, GGUFTensor, parse_name
from mosaic._formats.gguf_container import align
from mosaic._recipe.document import component_match
from mosaic._recipe.gguf_rules import module_patterns

UNITS = ("layer", "layer-experts", "module-group")
#: ggml types that are never quantized: F32, I8, I16, I32, I64, F64.
_PLAIN = {0, 24, 25, 26, 27, 28}
#: Tensors outside the layers that are units of their own at module-group granularity.
TOP_LEVEL = ("token_embd.weight", "output.weight")


@dataclass(frozen=True)
class Unit:
    layer: int | None
    group: str | None
    tensors: tuple[str, ...]

    @property
    def key(self) -> tuple[int, str]:
        """Sort key: layers in order, the top-level units (layer ``None``) last; then the group."""
        return (self.layer if self.layer is not None else 1 << 30, self.group or "")

    def describe(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "outside the layers"
        return f"{where}{f' {self.group}' if self.group else ''}"


def default_unit(base: GGUFModel) -> str:
    """``layer-experts`` where the base has routed experts, else ``layer``."""
    pats = module_patterns(["ffn_exps"])
    has = any(layer is not None and any(component_match(rest, p) for p in pats)
              for layer, rest in (parse_name(t.name) for t in base.tensors))
    return "layer-experts" if has else "layer"


def _kind(rest: str) -> str:
    return rest.removesuffix(".weight")


def gguf_units(base: GGUFModel, unit: str, only_layers: set[int] | None) -> list[Unit]:
    """The base's units of kind ``unit`` in the selected layers (all when ``only_layers`` is None)."""
    if unit not in UNITS:
        raise MosaicError(f"--unit {unit}: one of {', '.join(UNITS)}")
    layers_present = sorted({t.layer for t in base.tensors if t.layer is not None})
    if only_layers is not None:
        missing = sorted(only_layers - set(layers_present))
        if missing:
            raise MosaicError(f"--only-layers: the base has no layer {missing[0]} (its layers: "
                              f"{layers_present[0]}-{layers_present[-1]})" if layers_present else "--only-layers: the base has no layers")
    chosen = set(layers_present) if only_layers is None else only_layers
    pats = module_patterns(["ffn_exps"])
    by_layer: dict[int, list[GGUFTensor]] = {}
    for t in base.tensors:
        if t.layer is not None and t.layer in chosen:
            by_layer.setdefault(t.layer, []).append(t)
    out: list[Unit] = []
    for layer in sorted(by_layer):
        ts = by_layer[layer]
        if unit == "layer":
            out.append(Unit(layer, None, tuple(t.name for t in ts)))
        elif unit == "layer-experts":
            ex = [t.name for t in ts if any(component_match(parse_name(t.name)[1], p) for p in pats)]
            if ex:
                out.append(Unit(layer, "ffn_exps", tuple(ex)))
        else:
            for t in ts:
                if t.type_id not in _PLAIN:
                    out.append(Unit(layer, _kind(parse_name(t.name)[1]), (t.name,)))
    if unit == "module-group" and only_layers is None:
        names = base.by_name()
        for n in TOP_LEVEL:
            if n in names and names[n].type_id not in _PLAIN:
                out.append(Unit(None, _kind(n), (n,)))
    if not out:
        raise MosaicError(f"{base.describe()}: no unit of kind {unit} in the selected layers"
                          + ("; the base has no routed experts: use --unit layer" if unit == "layer-experts" else ""))
    return sorted(out, key=lambda u: u.key)


def dbytes(unit: Unit, base: GGUFModel, donor: GGUFModel) -> int:
    """The growth of a built one-file mosaic taking ``unit`` from ``donor``: padded bytes, exactly."""
    bt, dt, a = base.by_name(), donor.by_name(), base.alignment
    return sum(align(dt[n].nbytes, a) - align(bt[n].nbytes, a) for n in unit.tensors)


def donor_has(unit: Unit, base: GGUFModel, donor: GGUFModel) -> bool:
    names = donor.by_name()
    bt = base.by_name()
    return all(n in names and names[n].ne == bt[n].ne for n in unit.tensors)
