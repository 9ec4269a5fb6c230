"""Scores for ``mosaic plan``: per-layer numbers (JSON or CSV) or exllamav3's measurement JSON
(``groups``/``alts``, ``dkld`` lower is better), mapped onto units and kept as exact fractions so that
equal totals are equal.
"""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path

from mosaic._base.errors import FormatError
from mosaic._checkpoint.census_exl3 import Analysis
from mosaic._checkpoint.exl3 import parse_key
from mosaic._plan.units import Unit


class ScoresError(FormatError):
    """A scores file is malformed or does not fit the sources (unknown layers, wrong alternatives)."""


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


def read_scores_file(path: Path) -> tuple[dict | None, dict[int, Fraction]]:
    """A scores file read strictly: (exllamav3's measurement JSON, {}) when it is one, else
    (None, layer -> score with higher better) from the per-layer JSON or CSV. Shared by both planners."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ScoresError(f"{path}: cannot read scores: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ScoresError(f"{path}: scores file is not UTF-8") from None
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text, parse_float=Decimal, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except (ValueError, RecursionError) as e:
            raise ScoresError(f"{path}: not valid JSON: {e}") from None
        if "groups" in doc and "alts" in doc:
            return doc, {}
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
        return None, {_layer_key(k, f"{path}: scores"): sign * _number(v, f"{path}: scores[{k!r}]") for k, v in raw_scores.items()}
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(c.strip() for c in r)]
    if not rows or [c.strip().lower() for c in rows[0]] != ["layer", "score"]:
        raise ScoresError(f"{path}: neither JSON nor CSV with the header line 'layer,score'")
    raw: dict[int, Fraction] = {}
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
    return None, raw


def load_scores(path: Path, units: list[Unit], kind: str, base: Analysis, donors: list[str]) -> tuple[dict[tuple[int, str], Fraction], list[str]]:
    """(unit index, donor id) -> score, higher is better; plus notes about ignored entries."""
    measurement, raw = read_scores_file(path)
    if measurement is not None:
        scores, notes = _measurement(measurement, units, base, donors, path)
    else:
        scores, notes = _per_layer(raw, units, kind, donors, path, set(base.layers()))
    if not scores:
        raise ScoresError(f"{path}: no score applies to any unit of kind {kind} (missing scores)")
    return scores, notes


