"""``mosaic plan``: which units to take from which donor under a size, rate or count budget.

This module owns the planning problem end to end, without writing anything but the recipe text:

* **units** — what moves together: all routed experts of a layer (``layer-experts``, the default,
  because exllamav3 fuses them at load), a whole layer (``layer``), or each module group of a layer
  (``module-group``: routed experts, shared experts, attention, dense MLP, ...);
* **scores** — per-layer numbers (JSON or CSV) or exllamav3's measurement JSON (``groups``/``alts``,
  ``dkld`` lower is better), mapped onto units, kept as exact fractions so that equal totals are equal;
* **costs** — exact, from the headers: tensor bytes for ``--max-size`` and bits × weights for
  ``--target-rate``; the output size of any chosen set is computed the way :mod:`mosaic.plan` lays
  shards out (header growth and padding included), so the prediction is the built size to the byte;
* **the choice** — an exact multiple-choice knapsack (Pareto dynamic programming over units; branch and bound with the LP bound
  of the remaining units' concave hulls); the non-additive header growth is handled by searching
  under a provably safe additive budget and accepting a leaf only if its exact size fits. Among
  equal totals the set whose sorted layer list is lexicographically smallest wins (CONTRACT.md);
* **the recipe** — one ``replace`` rule per donor (and module pattern), checked by the real
  preflight and planner (:func:`mosaic.selection.select`, :func:`mosaic.plan.make_plan`) before it
  is returned, so ``mosaic build`` accepts it unchanged and writes exactly the predicted size.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from itertools import pairwise
from pathlib import Path

import yaml

from .census import Analysis
from .errors import FormatError, MosaicError, SourceError, VerificationError
from .exl3 import Module, is_decoder_linear, parse_key
from .plan import BuildPlan, make_plan
from .recipe import _ID_RE, _REPO_RE, _REV_RE, Recipe, SourceSpec, component_match, layer_runs, parse_recipe
from .safetensors_writer import encode_header
from .selection import select

UNIT_KINDS = ("layer-experts", "layer", "module-group")


class ScoresError(FormatError):
    """A scores file is malformed or does not fit the sources (unknown layers, wrong alternatives)."""


class PlanError(MosaicError):
    """The planning request cannot be met (budget too small, nothing to choose)."""


# --- command-line values ------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_POWERS = {"K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``96.1G`` (powers of 1000) or ``80GiB`` (powers of 1024); rounded down."""
    m = _SIZE_RE.match(text)
    if not m:
        raise MosaicError(f"--max-size: {text!r} is not a size (bytes, or a number with K/M/G/T or KiB/MiB/GiB/TiB)")
    num = Fraction(Decimal(m.group(1)))
    unit = (m.group(2) or "").upper()
    if unit and unit != "B":
        num *= (1024 if "I" in unit else 1000) ** _POWERS[unit[0]]
    return int(num)


def parse_source(text: str, what: str, source_id: str) -> tuple[SourceSpec, Path]:
    """``org/name@<40-hex>`` (resolved offline from the hub cache) or a folder."""
    from .sources import hub_snapshot

    repo, sep, rev = text.partition("@")
    if sep and _REPO_RE.match(repo) and not Path(text).exists():
        if not _REV_RE.match(rev):
            raise MosaicError(f"{what}: {text!r}: the revision must be a full 40-hex commit hash")
        return SourceSpec(source_id, repo=repo, revision=rev), hub_snapshot(repo, rev)
    folder = Path(text)
    if not folder.is_dir():
        raise SourceError(f"{what}: {text} is not a folder (nor org/name@<40-hex commit>)")
    return SourceSpec(source_id, path=str(folder)), folder


def parse_donor_arg(text: str) -> tuple[str, str]:
    did, sep, src = text.partition("=")
    if not sep or not src:
        raise MosaicError(f"--donor: {text!r} is not ID=SRC")
    if not _ID_RE.match(did) or did == "base":
        raise MosaicError(f"--donor: id {did!r}: donor ids are lowercase letters, digits, '_' and '-' (and not 'base')")
    return did, src


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


# --- scores -------------------------------------------------------------------------------------


def _number(value: object, where: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, Decimal)):
        raise ScoresError(f"{where}: {value!r} is not a number")
    f = Fraction(value)
    return f


def _layer_key(key: object, where: str) -> int:
    if not isinstance(key, str) or not key.strip().isdigit():
        raise ScoresError(f"{where}: layer {key!r} is not a layer index")
    return int(key)


def _per_layer(raw: dict[int, Fraction], units: list[Unit], kind: str, donors: list[str], path: Path,
               layers: set[int]) -> tuple[dict[tuple[int, str], Fraction], list[str]]:
    if kind == "module-group":
        raise ScoresError(f"{path}: one score per layer cannot rank module groups; use --unit layer-experts or layer, "
                          "or exllamav3's measurement JSON")
    if len(donors) != 1:
        raise ScoresError(f"{path}: per-layer scores go with exactly one --donor (given {len(donors)}); "
                          "exllamav3's measurement JSON ranks several")
    unit_of = {u.layer: u for u in units}
    out: dict[tuple[int, str], Fraction] = {}
    notes = []
    for layer, score in sorted(raw.items()):
        if layer not in layers:
            span = f"{min(layers)}-{max(layers)}" if layers else "none"
            raise ScoresError(f"{path}: layer {layer} is not in the base (its layers: {span})")
        if layer not in unit_of:
            notes.append(f"layer {layer} has a score but no unit of kind {kind}; ignored")
            continue
        out[(unit_of[layer].index, donors[0])] = score
    return out, notes


def _measurement(doc: dict, units: list[Unit], base: Analysis, donors: list[str], path: Path) -> tuple[dict[tuple[int, str], Fraction], list[str]]:
    alts, groups = doc.get("alts"), doc.get("groups")
    if not isinstance(alts, list) or not isinstance(groups, list):
        raise ScoresError(f"{path}: measurement JSON needs lists 'alts' and 'groups'")
    if len(alts) != len(donors):
        raise ScoresError(f"{path}: alts: {len(alts)} alternative(s) measured but {len(donors)} --donor(s) given; "
                          "alternatives map to the donors in order")
    unit_of_module = {k: u.index for u in units for k in u.modules}
    by_layer_path = {(m.info.layer, m.info.path): k for k, m in base.modules.items()}
    sums: dict[tuple[int, str], Fraction] = {}
    notes: list[str] = []
    for gi, g in enumerate(groups):
        where = f"{path}: groups[{gi}]"
        if not isinstance(g, dict):
            raise ScoresError(f"{where}: not an object")
        keys, cands = g.get("layers"), g.get("candidates")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise ScoresError(f"{where}.layers: must be a non-empty list of module keys")
        if not isinstance(cands, list) or len(cands) != len(donors):
            raise ScoresError(f"{where}.candidates: must hold one entry per alternative ({len(donors)})")
        hits: list[int] = []
        for k in keys:
            mods = [k] if k in base.modules else [m for m in base.modules if m.startswith(k + ".")]
            if not mods:
                info = parse_key(k)
                alt = by_layer_path.get((info.layer, info.path))
                if alt is None:
                    raise ScoresError(f"{where}.layers: module {k!r} is not in the base")
                mods = [alt]
            hits.extend(unit_of_module[m] for m in mods if m in unit_of_module)
            hits.extend(-1 for m in mods if m not in unit_of_module)
        inside = [h for h in hits if h >= 0]
        if not inside:
            continue
        for di, (c, did) in enumerate(zip(cands, donors)):
            if not isinstance(c, dict) or "dkld" not in c:
                raise ScoresError(f"{where}.candidates[{di}]: needs a 'dkld' number")
            dkld = _number(c["dkld"], f"{where}.candidates[{di}].dkld")
            for u in set(inside):
                share = Fraction(inside.count(u), len(hits))
                sums[(u, did)] = sums.get((u, did), Fraction(0)) - dkld * share
        if len(inside) < len(hits):
            notes.append(f"groups[{gi}] spans modules outside the units; only their share of its dkld counts")
    return sums, notes


def load_scores(path: Path, units: list[Unit], kind: str, base: Analysis, donors: list[str]) -> tuple[dict[tuple[int, str], Fraction], list[str]]:
    """(unit index, donor id) -> score, higher is better; plus notes about ignored entries."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ScoresError(f"{path}: cannot read scores: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ScoresError(f"{path}: scores file is not UTF-8") from None
    layers = set(base.layers())
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            doc = json.loads(text, parse_float=Decimal, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except (ValueError, RecursionError) as e:
            raise ScoresError(f"{path}: not valid JSON: {e}") from None
        if "groups" in doc and "alts" in doc:
            scores, notes = _measurement(doc, units, base, donors, path)
        else:
            if set(doc) - {"higher_is_better", "scores"}:
                raise ScoresError(f"{path}: unknown field(s) {sorted(set(doc) - {'higher_is_better', 'scores'})} "
                                  "(a scores file holds higher_is_better and scores; a measurement JSON groups and alts)")
            hib = doc.get("higher_is_better")
            if not isinstance(hib, bool):
                raise ScoresError(f"{path}: higher_is_better must be true or false")
            raw_scores = doc.get("scores")
            if not isinstance(raw_scores, dict) or not raw_scores:
                raise ScoresError(f"{path}: scores must be a non-empty object of layer -> number")
            sign = 1 if hib else -1
            raw = {_layer_key(k, f"{path}: scores"): sign * _number(v, f"{path}: scores[{k!r}]") for k, v in raw_scores.items()}
            scores, notes = _per_layer(raw, units, kind, donors, path, layers)
    else:
        rows = list(csv.reader(io.StringIO(text)))
        rows = [r for r in rows if r and any(c.strip() for c in r)]
        if not rows or [c.strip().lower() for c in rows[0]] != ["layer", "score"]:
            raise ScoresError(f"{path}: neither JSON nor CSV with the header line 'layer,score'")
        raw = {}
        for i, r in enumerate(rows[1:], start=2):
            if len(r) != 2:
                raise ScoresError(f"{path}: line {i}: expected 2 columns, got {len(r)}")
            layer = _layer_key(r[0].strip(), f"{path}: line {i}")
            if layer in raw:
                raise ScoresError(f"{path}: line {i}: layer {layer} scored twice")
            try:
                raw[layer] = Fraction(Decimal(r[1].strip()))
            except (InvalidOperation, ValueError):
                raise ScoresError(f"{path}: line {i}: score {r[1]!r} is not a number") from None
        if not raw:
            raise ScoresError(f"{path}: no scores after the header line")
        scores, notes = _per_layer(raw, units, kind, donors, path, layers)
    if not scores:
        raise ScoresError(f"{path}: no score applies to any unit of kind {kind} (missing scores)")
    return scores, notes


# --- exact costs --------------------------------------------------------------------------------


class SizeModel:
    """The exact size (Σ .safetensors file sizes) of the mosaic for any choice, as make_plan lays it out."""

    def __init__(self, base: Analysis, donors: dict[str, Analysis], units: list[Unit]) -> None:
        ck = base.ckpt
        self.base, self.donors, self.units = base, donors, units
        self.unit_tensors = {u.index: [f"{k}.{s}" for k in u.modules for s in base.modules[k].tensors] for u in units}
        self.shard_of = dict(ck.tensor_file)
        self.base_size = ck.shard_bytes
        self._cache: dict[tuple[str, tuple[tuple[int, str], ...]], int] = {}
        self._fixed: dict[str, tuple[int, list[int]]] = {}
        self.delta: dict[tuple[int, str], int] = {}
        for u in units:
            for did, d in donors.items():
                self.delta[(u.index, did)] = sum(
                    d.ckpt.tensor(n).nbytes - ck.tensor(n).nbytes for n in self.unit_tensors[u.index]
                )
        self.header_low = self._header_lower_bound()

    def _donor_tensor(self, did: str, name: str) -> tuple[str, tuple[int, ...], int]:
        t = self.donors[did].ckpt.tensor(name)
        return t.dtype, t.shape, t.nbytes

    def _header_lower_bound(self) -> int:
        """A lower bound on header growth over every possible choice (≤ 0): each shard's header with
        every tensor at its shortest shape and smallest size among the sources."""
        ck = self.base.ckpt
        in_unit = {n for ts in self.unit_tensors.values() for n in ts}
        low = 0
        for shard in ck.shards:
            h = ck.headers[shard]
            entries = []
            for t in h.tensors:
                shape, nbytes = t.shape, t.nbytes
                if t.name in in_unit:
                    for d in self.donors.values():
                        dt = d.ckpt.tensor(t.name)
                        if len(json.dumps(list(dt.shape))) < len(json.dumps(list(shape))):
                            shape = dt.shape
                        nbytes = min(nbytes, dt.nbytes)
                entries.append((t.name, t.dtype, shape, nbytes))
            low += min(0, len(encode_header(entries, h.metadata)) - h.data_start)
        return low

    def _shard_size(self, shard: str, donor_of: dict[str, str]) -> int:
        """File size of a rewritten shard: the length of the header :func:`encode_header` writes
        (compact JSON, padded to 8), counted without building it — each entry's length is fixed
        text plus the digits of its shape and offsets — plus the tensor bytes."""
        h = self.base.ckpt.headers[shard]
        fixed = self._fixed.get(shard)
        if fixed is None:
            meta = len(json.dumps({"__metadata__": h.metadata}, separators=(",", ":"), ensure_ascii=False).encode()) - 1 if h.metadata is not None else 1
            fixed = self._fixed[shard] = (meta, [
                len(json.dumps(t.name, ensure_ascii=False).encode()) + len(json.dumps(t.dtype)) + len('{"dtype":,"shape":,"data_offsets":[,]}:')
                for t in h.tensors
            ])
        commas = max(len(h.tensors) - 1, 0) + (1 if h.metadata is not None and h.tensors else 0)
        n = fixed[0] + commas + 1
        pos = 0
        for t, f in zip(h.tensors, fixed[1]):
            if t.name in donor_of:
                dt = self.donors[donor_of[t.name]].ckpt.tensor(t.name)
                shape, nbytes = dt.shape, dt.nbytes
            else:
                shape, nbytes = t.shape, t.nbytes
            n += f + len(json.dumps(list(shape), separators=(",", ":"))) + len(str(pos)) + len(str(pos + nbytes))
            pos += nbytes
        return 8 + n + (-n % 8) + pos

    def size(self, choice: dict[int, str]) -> int:
        """Exact output size when unit ``i`` comes from donor ``choice[i]``."""
        ck = self.base.ckpt
        per_shard: dict[str, list[tuple[int, str]]] = {}
        for ui, did in choice.items():
            for n in self.unit_tensors[ui]:
                per_shard.setdefault(self.shard_of[n], []).append((ui, did))
        total = 0
        for shard in ck.shards:
            h = ck.headers[shard]
            picks = per_shard.get(shard)
            if not picks:
                total += h.file_size
                continue
            key = (shard, tuple(sorted(set(picks))))
            if key not in self._cache:
                donor_of = {n: did for ui, did in key[1] for n in self.unit_tensors[ui]}
                self._cache[key] = self._shard_size(shard, donor_of)
            total += self._cache[key]
        return total


def bit_weight_deltas(base: Analysis, donors: dict[str, Analysis], units: list[Unit]) -> dict[tuple[int, str], int]:
    """Δ Σ bits × weights over decoder linears per (unit, donor): the rate's additive numerator."""
    n_layers = base.num_hidden_layers
    out = {}
    for u in units:
        for did, d in donors.items():
            delta = Fraction(0)
            for k in u.modules:
                bm = base.modules[k]
                if is_decoder_linear(bm, n_layers) and bm.bits is not None:
                    dm = d.modules[k]
                    delta += (Fraction(dm.bits or 0) - Fraction(bm.bits)) * bm.weights
            assert delta.denominator == 1
            out[(u.index, did)] = int(delta)
    return out


# --- the exact solver ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    unit: int  # position in the solver's unit order
    rank: int  # donor order (ties between donors go to the earlier one)
    donor: str
    cost: int
    score: Fraction


@dataclass
class Solution:
    picks: list[Option]
    score: Fraction
    key: tuple[tuple[int, ...], tuple[int, ...]]


def _key(picks: Sequence[Option]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(p.unit for p in picks), tuple(p.rank for p in picks)


def _hull(opts: Sequence[Option]) -> tuple[Fraction, list[tuple[int, Fraction]]]:
    """Zero-cost gain and increments (Δcost > 0, Δscore > 0) of one unit's upper concave hull,
    slopes decreasing: the unit's part of the LP relaxation."""
    best: dict[int, Fraction] = {0: Fraction(0)}
    for o in opts:
        if o.cost >= 0 and o.score >= 0:
            best[o.cost] = max(best.get(o.cost, o.score), o.score)
    hull: list[tuple[int, Fraction]] = []
    for c, s in sorted(best.items()):
        if hull and s <= hull[-1][1]:
            continue
        while len(hull) >= 2:
            (c0, s0), (c1, s1) = hull[-2], hull[-1]
            if (s1 - s0) * (c - c1) <= (s - s1) * (c1 - c0):
                hull.pop()
            else:
                break
        hull.append((c, s))
    incs = [(c1 - c0, s1 - s0) for (c0, s0), (c1, s1) in pairwise(hull)]
    return hull[0][1], incs


def _decided_better(a: tuple[Option, ...], b: tuple[Option, ...]) -> bool:
    """Is prefix ``a`` lexicographically better than ``b`` whatever later units both get?"""
    ua, ub = [o.unit for o in a], [o.unit for o in b]
    for x, y in zip(ua, ub):
        if x != y:
            return x < y
    if len(ua) != len(ub):
        return False  # a proper prefix: the answer depends on what follows
    return [o.rank for o in a] <= [o.rank for o in b]


def solve_pareto(options: Sequence[Sequence[Option]], budget: int) -> Solution | None:
    """The same optimum as :func:`solve_knapsack` without acceptance, by dynamic programming over
    units that keeps only non-dominated (cost, score) states: a state is dropped when another costs
    no more and scores more, or equal with a lexicographic lead no later unit can change. Exact, and
    fast when costs repeat (every MoE layer of a model costs the same)."""
    if budget < 0:
        return None
    states: list[tuple[int, Fraction, tuple[Option, ...]]] = [(0, Fraction(0), ())]
    for row in options:
        grown = list(states)
        for c, sc, picks in states:
            for o in row:
                if o.score >= 0 and c + o.cost <= budget:
                    grown.append((c + o.cost, sc + o.score, (*picks, o)))
        grown.sort(key=lambda st: (st[0], -st[1]))
        kept: list[tuple[int, Fraction, tuple[Option, ...]]] = []
        top: Fraction | None = None
        for st in grown:
            if top is not None and st[1] < top:
                continue
            if top is not None and st[1] == top and any(k[1] == top and _decided_better(k[2], st[2]) for k in kept):
                continue
            kept.append(st)
            top = st[1] if top is None else max(top, st[1])
        states = kept
    best = max(states, key=lambda st: st[1])[1]
    winners = [st[2] for st in states if st[1] == best]
    picks = min(winners, key=_key)
    return Solution(list(picks), best, _key(picks))


def solve_knapsack(options: Sequence[Sequence[Option]], budget: int,
                   accept: Callable[[list[Option]], bool] | None = None,
                   incumbent: Solution | None = None) -> Solution | None:
    """The best choice of at most one option per unit with Σ cost ≤ budget (and ``accept``), exactly.

    Maximizes the total score; among equal totals the lexicographically smallest sorted unit list
    (then donor order). Branch and bound over units in order; the bound at a node is the LP
    relaxation of the remaining units (their concave hulls taken by decreasing slope, the last one
    fractionally), which is a valid upper bound, so pruning never loses the optimum. An
    ``incumbent`` (a feasible, accepted solution) only speeds the search up. Costs must be
    ≥ 0; options with a negative score are never needed (dropping one raises the total) and skipped.
    """
    n = len(options)
    opts = [[o for o in row if o.score >= 0] for row in options]
    if any(o.cost < 0 for row in opts for o in row):
        raise PlanError("an option costs less than nothing (a donor smaller than the base); plan only upgrades")
    zero_gain = []
    incs: list[tuple[Fraction | None, int, int, Fraction]] = []  # slope, unit, dc, ds
    for i, row in enumerate(opts):
        z, inc = _hull(row)
        zero_gain.append(z)
        incs.extend((Fraction(ds, dc), i, dc, ds) for dc, ds in inc)
    incs.sort(key=lambda t: -t[0])  # type: ignore[operator]
    suffix_zero = [Fraction(0)] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_zero[i] = suffix_zero[i + 1] + zero_gain[i]

    def bound(i: int, room: int) -> Fraction:
        acc = suffix_zero[i]
        for _, u, dc, ds in incs:
            if u < i:
                continue
            if dc <= room:
                acc += ds
                room -= dc
            else:
                return acc + ds * room / dc
        return acc

    best: Solution | None = incumbent
    chosen: list[Option] = []

    def offer(score: Fraction) -> None:
        nonlocal best
        key = _key(chosen)
        if best is not None and (score < best.score or (score == best.score and key >= best.key)):
            return
        if accept is not None and not accept(list(chosen)):
            return
        best = Solution(list(chosen), score, key)

    def lex_hopeless(i: int, score: Fraction) -> bool:
        """With bound == best score: can no completion of this node be lexicographically smaller?"""
        assert best is not None
        inc_units = best.key[0]
        pre = tuple(u for u in inc_units if u < i)
        mine = tuple(o.unit for o in chosen)
        for a, b in zip(mine, pre):
            if a != b:
                return a > b
        if len(mine) < len(pre):  # only stopping here can be smaller
            if score == best.score:
                offer(score)
            return True
        if len(mine) > len(pre):
            return len(inc_units) == len(pre)
        return False

    def dfs(i: int, room: int, score: Fraction) -> None:
        if i == n:
            offer(score)
            return
        if best is not None:
            b = score + bound(i, room)
            if b < best.score or (b == best.score and lex_hopeless(i, score)):
                return
        for o in opts[i]:
            if o.cost <= room:
                chosen.append(o)
                dfs(i + 1, room - o.cost, score + o.score)
                chosen.pop()
        dfs(i + 1, room, score)

    if budget >= 0:
        if best is None:  # a good first incumbent makes the bound prune from the start
            seed = greedy(opts, lambda picks: sum(o.cost for o in picks) <= budget)
            chosen.extend(seed.picks)
            offer(seed.score)
            chosen.clear()
        dfs(0, budget, Fraction(0))
    return best


def solve_within_size(options: Sequence[Sequence[Option]], limit: int, model: SizeModel) -> Solution | None:
    """The best choice whose exact output size is at most ``limit``.

    Header growth is not additive, so the search runs on tensor-byte deltas under the additive
    budget ``limit - base - header_low``: every set that fits exactly fits that budget (header_low
    is a lower bound on any set's header growth), so its optimum is an upper bound. If that optimum
    fits exactly, it is the answer. Otherwise a feasible incumbent is found by shrinking the budget
    by the overshoot (each round removes at least one byte, and budget < 0 leaves only the empty
    choice, so this ends), and a second search under the original additive budget, seeded with it,
    accepts only sets whose exact size fits: the true optimum, visiting few leaves."""

    def fits(picks: Sequence[Option]) -> bool:
        return model.size({o.unit: o.donor for o in picks}) <= limit

    top = limit - model.base_size - model.header_low
    first = solve_pareto(options, top)
    if first is None or fits(first.picks):
        return first
    budget = top
    incumbent = first
    while not fits(incumbent.picks):
        over = model.size({o.unit: o.donor for o in incumbent.picks}) - limit
        budget -= max(over, 1)
        found = solve_pareto(options, budget)
        if found is None:
            return None
        incumbent = found
    return solve_knapsack(options, top, accept=fits, incumbent=incumbent)


def choose_count(options: Sequence[Sequence[Option]], count: int) -> Solution:
    """Exactly ``count`` units (all when fewer), best total; ties to the smallest unit list."""
    best_of = []
    for row in options:
        if row:
            best_of.append(max(row, key=lambda o: (o.score, -o.rank)))
    ranked = sorted(best_of, key=lambda o: (-o.score, o.unit))[:count]
    picks = sorted(ranked, key=lambda o: o.unit)
    return Solution(picks, sum((o.score for o in picks), Fraction(0)), _key(picks))


def greedy(options: Sequence[Sequence[Option]], fits: Callable[[list[Option]], bool], count: int | None = None) -> Solution:
    """The usual heuristic: rank every option by score per unit of cost, take while it fits."""
    flat = [o for row in options for o in row if o.score > 0 or count is not None]
    flat.sort(key=lambda o: (o.cost > 0, -(o.score / o.cost) if o.cost > 0 else -o.score, o.unit, o.rank))
    picks: list[Option] = []
    used: set[int] = set()
    for o in flat:
        if o.unit in used or (count is not None and len(picks) >= count):
            continue
        if fits([*picks, o]):
            picks.append(o)
            used.add(o.unit)
    picks.sort(key=lambda o: o.unit)
    return Solution(picks, sum((o.score for o in picks), Fraction(0)), _key(picks))


# --- the whole command --------------------------------------------------------------------------


@dataclass
class PlanRequest:
    base: str
    donors: list[tuple[str, str]]  # (id, SRC) in order
    scores: Path
    max_size: int | None = None
    target_rate: str | None = None
    layers: int | None = None
    unit: str = "layer-experts"
    out: Path | None = None


@dataclass
class PlanResult:
    report: dict
    recipe_text: str
    plan: BuildPlan
    notes: list[str]


def _ranges(layers: Sequence[int]) -> list[int | str]:
    """Recipe form: runs of three or more as "a-b", shorter runs as numbers."""
    out: list[int | str] = []
    for a, b in layer_runs(list(layers)):
        out.extend([f"{a}-{b}"] if b - a >= 2 else range(a, b + 1))
    return out


def _source_doc(spec: SourceSpec, folder: Path, recipe_dir: Path) -> dict[str, str]:
    if spec.repo is not None:
        return {"repo": spec.repo, "revision": spec.revision or ""}
    return {"path": Path(os.path.relpath(folder.resolve(), recipe_dir.resolve())).as_posix()}


def _recipe_name(base_spec: SourceSpec, folder: Path) -> str:
    stem = base_spec.repo.split("/")[-1] if base_spec.repo else folder.resolve().name
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip(".-") or "model"
    return f"{stem}-mosaic"


def recipe_text(name: str, base_doc: dict, donor_docs: dict[str, dict], units: list[Unit], choice: dict[int, str]) -> str:
    """The recipe as YAML: one rule per donor and module pattern, layers as ranges."""
    rules: dict[tuple[str, str | None], list[int]] = {}
    donor_order = list(donor_docs)
    for ui, did in sorted(choice.items()):
        u = units[ui]
        rules.setdefault((did, u.pattern), []).append(u.layer)
    replace = []
    for (did, pattern), layers in sorted(rules.items(), key=lambda kv: (donor_order.index(kv[0][0]), kv[0][1] or "")):
        rule: dict[str, object] = {"from": did, "layers": _ranges(layers)}
        if pattern:
            rule["modules"] = [pattern]
        replace.append(rule)
    used = [d for d in donor_order if d in set(choice.values())]
    doc = {"name": name, "base": base_doc, "donors": {d: donor_docs[d] for d in used}, "replace": replace}
    head = "# written by mosaic plan; build it with: mosaic build THIS_FILE\n"
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120)


def _load(spec: SourceSpec, folder: Path, sid: str) -> Analysis:
    from .census import analyze
    from .checkpoint import open_checkpoint

    a = analyze(open_checkpoint(folder))
    if a.problems:
        more = f" (and {len(a.problems) - 1} more; run `mosaic census {folder}`)" if len(a.problems) > 1 else ""
        raise SourceError(f"source {sid!r} ({spec.describe()}): {a.problems[0]}{more}")
    return a


def _check_candidates(base: Analysis, donors: dict[str, Analysis], units: list[Unit]) -> None:
    for u in units:
        for did, d in donors.items():
            for k in u.modules:
                bm, dm = base.modules[k], d.modules.get(k)
                if dm is None:
                    raise SourceError(f"donor {did!r} has no module {k} ({u.label})")
                if bm.is_exl3 != dm.is_exl3 or bm.structure() != dm.structure() or (bm.is_exl3 and bm.codebook != dm.codebook):
                    raise SourceError(f"donor {did!r}: {k} ({u.label}) differs from the base in structure or codebook")


def plan_mosaic(req: PlanRequest) -> PlanResult:
    """Solve the request and return the report, the recipe text and the real build plan of it."""
    modes = [x is not None for x in (req.max_size, req.target_rate, req.layers)]
    if sum(modes) != 1:
        raise MosaicError("give exactly one of --max-size, --target-rate, --layers")
    if not req.donors:
        raise MosaicError("give at least one --donor ID=SRC")
    ids = [d for d, _ in req.donors]
    if len(set(ids)) != len(ids):
        raise MosaicError(f"--donor: id given twice in {ids}")
    base_spec, base_dir = parse_source(req.base, "--base", "base")
    specs = {did: parse_source(src, f"--donor {did}", did) for did, src in req.donors}
    base = _load(base_spec, base_dir, "base")
    donors = {did: _load(spec, folder, did) for did, (spec, folder) in specs.items()}
    units = find_units(base, req.unit)
    _check_candidates(base, donors, units)
    scores, notes = load_scores(req.scores, units, req.unit, base, ids)
    model = SizeModel(base, donors, units)
    bw = bit_weight_deltas(base, donors, units)

    def cost_of(ui: int, did: str) -> int:
        return bw[(ui, did)] if req.target_rate is not None else model.delta[(ui, did)]

    options = [
        [Option(u.index, r, did, cost_of(u.index, did), scores[(u.index, did)]) for r, did in enumerate(ids) if (u.index, did) in scores]
        for u in units
    ]

    def size_of(picks: Sequence[Option]) -> int:
        return model.size({o.unit: o.donor for o in picks})

    smallest = min((model.size({o.unit: o.donor}) for row in options for o in row), default=None)
    if req.layers is not None:
        if req.layers < 1:
            raise MosaicError("--layers must be at least 1")
        best: Solution | None = choose_count(options, req.layers)
        greedy_sol = greedy(options, lambda picks: True, count=req.layers)
        limit = None
    elif req.target_rate is not None:
        try:
            target = Fraction(Decimal(req.target_rate))
        except (InvalidOperation, ValueError):
            raise MosaicError(f"--target-rate: {req.target_rate!r} is not a number") from None
        n_layers = base.num_hidden_layers
        num, den = Fraction(0), 0
        for m in base.modules.values():
            if is_decoder_linear(m, n_layers) and m.bits is not None:
                num += Fraction(m.bits) * m.weights
                den += m.weights
        if not den:
            raise MosaicError("the base has no quantized decoder linears; --target-rate has nothing to measure")
        room = target * den - num
        limit = int(room // 1)
        best = solve_pareto(options, limit)
        greedy_sol = greedy(options, lambda picks: sum(o.cost for o in picks) <= limit)
        if best is None or not best.picks:
            cheapest = min((o.cost for row in options for o in row), default=0)
            raise PlanError(
                f"--target-rate {req.target_rate}: the base is already at {float(num / den):.4f} bpw; no unit fits "
                f"(the cheapest adds {float(Fraction(cheapest, den)):.4f} bpw)"
            )
    else:
        assert req.max_size is not None
        limit = req.max_size
        best = solve_within_size(options, limit, model)
        greedy_sol = greedy(options, lambda picks: size_of(picks) <= limit)
        if best is None or not best.picks:
            raise PlanError(
                f"--max-size {limit:,} bytes: too small for any unit; the base alone is {model.base_size:,} bytes "
                f"and the smallest mosaic (one unit) is {smallest:,} bytes" if smallest is not None else "nothing to choose"
            )
    assert best is not None
    if not best.picks:
        raise PlanError("no unit has a usable score (all scores are negative or missing)")

    recipe_dir = (req.out.parent if req.out else Path.cwd()).resolve()
    name = _recipe_name(base_spec, base_dir)
    base_doc = _source_doc(base_spec, base_dir, recipe_dir)
    donor_docs = {did: _source_doc(spec, folder, recipe_dir) for did, (spec, folder) in specs.items()}
    choice = {o.unit: o.donor for o in best.picks}
    text = recipe_text(name, base_doc, donor_docs, units, choice)
    recipe_file = req.out.resolve() if req.out else recipe_dir / "mosaic-plan.yaml"
    recipe = parse_recipe(text.encode(), recipe_file)
    plan = _real_plan(recipe, base, donors)
    predicted = size_of(best.picks)
    if plan.shard_bytes != predicted:
        raise VerificationError(f"plan: the size model says {predicted} bytes but the build plan lays out {plan.shard_bytes}")

    def listing(sol: Solution) -> list[dict]:
        return [{"layer": units[o.unit].layer, "donor": o.donor} for o in sol.picks]

    r = plan.rates
    report = {
        "chosen": listing(best),
        "predicted_size": predicted,
        "score": float(best.score),
        "rate": {
            "exact": float(r.exact) if r.exact is not None else None,
            "by_bytes": r.by_bytes,
            "by_layer_mass": r.by_layer_mass,
        },
        "greedy": {"chosen": listing(greedy_sol), "predicted_size": size_of(greedy_sol.picks), "score": float(greedy_sol.score)},
    }
    if req.out is not None:
        req.out.parent.mkdir(parents=True, exist_ok=True)
        req.out.write_text(text, encoding="utf-8")
    return PlanResult(report, text, plan, notes)


def _real_plan(recipe: Recipe, base: Analysis, donors: dict[str, Analysis]) -> BuildPlan:
    used = {r.donor for r in recipe.rules}
    srcs = {"base": base, **{d: a for d, a in donors.items() if d in used}}
    selection = select(recipe, base, {d: a for d, a in donors.items() if d in used})
    return make_plan(recipe, srcs, selection)
