"""What moves together in a plan: all routed experts of a layer (``layer-experts``, the default,
because exllamav3 fuses them at load), a whole layer (``layer``), or each module group of a layer
(``module-group``: routed experts, shared experts, attention, dense MLP, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mosaic._base.errors import MosaicError
from mosaic._checkpoint.census_exl3 import Analysis
from mosaic._checkpoint.exl3 import Module, parse_key
from mosaic._recipe.document import (
    component_match,
)

UNIT_KINDS = ("layer-experts", "layer", "module-group")


class PlanError(MosaicError):
    """The planning request cannot be met (budget too small, nothing to choose)."""


class TooSmall(PlanError):
    """A budget below the smallest plan the versions at hand allow (a ladder's floor may be why)."""


# --- units --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """Modules that are upgraded together; ``pattern`` is the recipe's ``modules`` entry (None: whole layer)."""

    index: int
    layer: int
    pattern: str | None
    modules: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"layer {self.layer}" + (f" {self.pattern}" if self.pattern else "")


def _common_prefix(paths: Sequence[str]) -> str:
    parts = [p.split(".") for p in paths]
    out = []
    for comps in zip(*parts):
        if len(set(comps)) != 1:
            break
        out.append(comps[0])
    return ".".join(out)


def find_units(base: Analysis, kind: str) -> list[Unit]:
    """The units of ``kind`` in the base, in (layer, model order)."""
    if kind not in UNIT_KINDS:
        raise MosaicError(f"--unit: {kind!r} is not one of {', '.join(UNIT_KINDS)}")
    by_layer: dict[int, list[Module]] = {}
    for m in base.modules.values():
        if m.info.layer is not None:
            by_layer.setdefault(m.info.layer, []).append(m)
    units: list[Unit] = []
    for layer in sorted(by_layer):
        mods = by_layer[layer]
        if kind == "layer":
            if any(m.is_exl3 for m in mods):
                units.append(Unit(len(units), layer, None, tuple(m.key for m in mods)))
            continue
        groups: dict[str, list[Module]] = {}
        for m in mods:
            if m.is_exl3:
                groups.setdefault(m.info.group, []).append(m)
        wanted = ["routed_experts"] if kind == "layer-experts" else list(groups)
        taken: set[str] = set()
        for g in wanted:
            if g not in groups:
                continue
            if g == "routed_experts":
                proj = groups[g][0].info.proj or ""
                pattern = proj.split(".*.", 1)[0]
            else:
                pattern = _common_prefix([m.info.path for m in groups[g]])
            members = tuple(m.key for m in mods if pattern and component_match(m.info.path, pattern))
            if not pattern or set(members) & taken or any(parse_key(k).group not in (g,) and base.modules[k].is_exl3 for k in members):
                raise MosaicError(
                    f"layer {layer}: the {g} modules have no module path of their own "
                    f"(common prefix {pattern!r}); use --unit layer"
                )
            taken.update(members)
            units.append(Unit(len(units), layer, pattern, members))
    if not units:
        raise MosaicError(f"the base has no units of kind {kind!r} (no quantized modules in its layers)")
    return units


