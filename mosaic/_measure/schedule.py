"""Which forward passes a measurement runs, decided before any runs.

A pass is the model with some units at some versions (``{unit index: version}``; a unit left out is at the
base's version). ``top-down`` runs the base, the *top* (every unit at its lowest-error version) and, from the
top: one drop per measured unit to its worst version, or, where a kind's units are calibrated together
(``--calibrate pooled``), only the kind's pooled passes: its units moved together to each version they have
(``--curve versions``). ``swaps`` runs the base with one unit at one donor's version, for every pair.
"""

from __future__ import annotations

from mosaic._base.errors import MosaicError
from mosaic._measure.calibrate import (
    BASE,
    KIND_CALIBRATIONS,
    drop_version,
    kind_of,
    top_versions,
    worst_versions,
)
from mosaic._measure.shards import Shard, in_shard
from mosaic._measure.sides import Side
from mosaic._measure.weights import Errors


def measured_units(side: Side, calibrate: str | None, only_layers: str | None) -> list[int]:
    """The units whose candidates run: the selected ones; where a kind's units are calibrated together, also the
    units outside the layers (``token_embd``, ``output``: kinds of their own). Every kind of the model must be
    among them."""
    units = list(side.selected)
    if calibrate in KIND_CALIBRATIONS:
        units += [i for i, u in enumerate(side.units) if u.layer is None and i not in units]
        have = {kind_of(side.units[i].group) for i in units}
        for u in side.units:
            k = kind_of(u.group)
            if k not in have:
                where = sorted({x.layer for x in side.units if kind_of(x.group) == k and x.layer is not None})
                raise MosaicError(f"--calibrate {calibrate}: the kind {k} (layers {where[0]}-{where[-1]}) is in none of "
                                  f"--only-layers {only_layers}; add a layer that has it")
    return sorted(units)


class Schedule:
    """What runs: the versions of the top, the candidates of this run (its shard), the pooled passes."""

    def __init__(self, side: Side, errors: Errors, method: str, measured: list[int], shard: Shard | None,
                 refine: int = 0, curve: str = "line", calibrate: str = "units") -> None:
        self.side, self.errors, self.method, self.refine = side, errors, method, refine
        self.measured_units = measured
        mine = [u for i, u in enumerate(measured) if shard is None or in_shard(i, shard)]
        self.top = top_versions(side.versions, errors.eps, side.dbytes) if method == "top-down" else None
        self.top_map: dict[int, str] = {}
        self.to: list[str] = []
        self.drops: list[int] = []
        self.pooled: list[tuple[str, str, list[int]]] = []
        self.alpha_passes: set[tuple[str, str]] = set()
        self.swaps: list[tuple[int, str]] = []
        if self.top is not None:
            self.top_map = {ui: v for ui, v in enumerate(self.top) if v != BASE}
            #: each unit's drop goes to its worst version (the base's, or a smaller donor's where that is worse)
            self.to = worst_versions(side.versions, errors.eps, side.dbytes)
            drops = [ui for ui in mine if self.top[ui] != self.to[ui]]  # one version, or all alike: no drop
            #: --curve versions: (kind, version, the units moved there) for every version of each kind's units
            self.pooled = pooled_candidates(side, measured, self.top, self.to) if curve == "versions" else []
            #: --calibrate pooled: each kind's pass at its drop version gives its alpha; only a kind without one
            #: (a single unit, whose drop is that pass) keeps its drop
            self.alpha_passes = alpha_passes(self.pooled, self.to) if calibrate == "pooled" else set()
            calibrated = {k for k, _ in self.alpha_passes}
            self.drops = [ui for ui in drops if kind_of(side.units[ui].group) not in calibrated]
            self.pairs = (set(self.top_map.items()) | {(ui, self.to[ui]) for ui in self.drops if self.to[ui] != BASE}
                          | {(ui, v) for _, v, moved in self.pooled if v != BASE for ui in moved})
            if refine:  # a plan may take any version of any unit
                self.pairs |= {(ui, d) for ui, vs in enumerate(side.versions) for d in vs[1:]}
        else:
            self.swaps = [(ui, d) for ui in mine for d in side.versions[ui][1:]]
            self.pairs = set(self.swaps)
        self.mine = mine
        self.shard = shard


def pooled_candidates(side: Side, measured: list[int], top: list[str], to: list[str]) -> list[tuple[str, str, list[int]]]:
    """The candidates of ``--curve versions``: per kind and per version any of its measured units has, the top
    with every one of them that has that version (and is not at it already) moved there together. A kind's
    units summed at a version rise out of the noise where one unit's drop does not, and they measure the one
    thing a unit's line assumes and never checks: that a version costs what its weight error says, whatever
    its type. A kind of one unit at its worst version is that unit's drop, already measured: not run again.
    Nor is a version with no fewer bytes than the top's for every unit it would move: the top has the least
    weight error and the least loss, so no plan takes such a version and nothing it measured would reach a plan
    (over a ladder made from a quantization, the rungs above the source's own lossless types)."""
    kinds: dict[str, list[int]] = {}
    for ui in measured:
        kinds.setdefault(kind_of(side.units[ui].group), []).append(ui)
    out = []
    for k, uis in sorted(kinds.items()):
        for v in sorted({v for ui in uis for v in side.versions[ui]}, key=lambda v: (v != BASE, v)):
            moved = [ui for ui in uis if v in side.versions[ui] and top[ui] != v]
            if not any(side.dbytes[(ui, v)] < side.dbytes[(ui, top[ui])] for ui in moved):
                continue
            if not (len(uis) == 1 and to[uis[0]] == v):
                out.append((k, v, moved))
    return out


def alpha_passes(pooled: list[tuple[str, str, list[int]]], to: list[str]) -> set[tuple[str, str]]:
    """``(kind, version)`` of each kind's pooled pass at its drop version (the version most of its moved units'
    drops would go to), where one runs."""
    out = set()
    runs = {(k, v) for k, v, _ in pooled}
    for k in {k for k, _, _ in pooled}:
        v = drop_version([to[ui] for k2, _, moved in pooled if k2 == k for ui in moved])
        if (k, v) in runs:
            out.add((k, v))
    return out


def moved(versions: dict[int, str], ui: int, to: str) -> dict[int, str]:
    """``versions`` with unit ``ui`` at ``to``'s version (the base's: no entry)."""
    out = {x: v for x, v in versions.items() if x != ui}
    if to != BASE:
        out[ui] = to
    return out
