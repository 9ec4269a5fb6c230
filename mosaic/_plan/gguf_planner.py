"""``mosaic plan`` for GGUF models: which layers (or layers' routed experts) to take from a donor.

The units are a whole layer (``--unit layer``: every ``blk.N`` tensor) or a layer's routed experts
(``--unit layer-experts``, the default: the ``ffn_exps`` group). Costs are exact, from each tensor's
type: a GGUF mosaic's size is its header — which does not depend on the choice, since a tensor info
has the same size whatever the type — plus every tensor's bytes padded to the alignment, so the size
of any choice is the base-with-mosaic-header size plus the sum of its units' padded byte deltas,
and the knapsack over those deltas is exact. ``--target-rate`` bounds bits per weight over all
tensors (PROVENANCE ``rate.exact``). The same per-layer JSON/CSV scores files as for EXL3; exllamav3's
measurement JSON ranks EXL3 modules and is refused here. The recipe it writes is checked by the real
preflight and layout (:func:`mosaic._build.gguf_plan.plan_gguf`): the predicted size is the built size.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path

import yaml

from mosaic._base.errors import MosaicError, VerificationError
from mosaic._build.gguf_plan import GGUFPlan, check_same_model, mosaic_keys, plan_gguf
from mosaic._checkpoint.gguf_model import GGUFModel, parse_name
from mosaic._formats.gguf_container import align, layout, type_name
from mosaic._plan.measurement import measurement_in
from mosaic._plan.planner import recipe_lock, write_recipe
from mosaic._plan.scores import ScoresError, read_scores_file
from mosaic._plan.solver import Option, Solution, choose_count, greedy, shift, solve_pareto
from mosaic._plan.units import PlanError, TooSmall
from mosaic._recipe.document import Recipe, SourceSpec, component_match, layer_runs, parse_recipe
from mosaic._recipe.gguf_rules import GROUPS, module_patterns
from mosaic._sources.gguf import gguf_source, is_gguf_src, open_gguf_source

#: The base's own version of a unit: the option every unit has, at cost 0 and score 0.
BASE = "base"


@dataclass(frozen=True)
class GUnit:
    index: int
    layer: int
    pattern: str | None
    tensors: tuple[str, ...]


def find_gguf_units(base: GGUFModel, kind: str) -> list[GUnit]:
    if kind not in ("layer", "layer-experts"):
        raise MosaicError(f"--unit {kind}: GGUF plans take whole layers (layer) or their routed experts (layer-experts)")
    by_layer: dict[int, list[str]] = {}
    for t in base.tensors:
        layer, rest = parse_name(t.name)
        if layer is None:
            continue
        if kind == "layer-experts" and not any(component_match(rest, p) for p in module_patterns(["ffn_exps"])):
            continue
        by_layer.setdefault(layer, []).append(t.name)
    if not by_layer:
        raise PlanError(f"{base.describe()}: no layer has routed experts ({', '.join(GROUPS['ffn_exps'])}); use --unit layer")
    pattern = "ffn_exps" if kind == "layer-experts" else None
    return [GUnit(i, layer, pattern, tuple(by_layer[layer])) for i, layer in enumerate(sorted(by_layer))]


def load_layer_scores(path: Path, units: list[GUnit], donor: str, layers: set[int]) -> tuple[dict[tuple[int, str], Fraction], list[str]]:
    """Per-layer JSON (``higher_is_better`` + ``scores``) or CSV (``layer,score``): (unit, donor) -> score."""
    measurement, raw = read_scores_file(path)
    if measurement is not None:
        raise ScoresError(f"{path}: exllamav3's measurement JSON ranks EXL3 modules; a GGUF plan takes per-layer scores")
    unit_of = {u.layer: u for u in units}
    out: dict[tuple[int, str], Fraction] = {}
    notes = []
    for layer, score in sorted(raw.items()):
        if layer not in layers:
            raise ScoresError(f"{path}: layer {layer} is not in the base (its layers: {min(layers)}-{max(layers)})")
        if layer not in unit_of:
            notes.append(f"layer {layer} has a score but no unit of this kind; ignored")
            continue
        out[(unit_of[layer].index, donor)] = score
    if not out:
        raise ScoresError(f"{path}: no score applies to any unit")
    return out, notes


def _ranges(layers: list[int]) -> list[int | str]:
    out: list[int | str] = []
    for a, b in layer_runs(layers):
        out.extend([f"{a}-{b}"] if b - a >= 2 else range(a, b + 1))
    return out


def _source_doc(spec: SourceSpec, recipe_dir: Path) -> dict[str, str]:
    extra = {"file": spec.file} if spec.file is not None else {}
    if spec.repo is not None:
        return {"repo": spec.repo, "revision": spec.revision or "", **extra}
    rel = Path(os.path.relpath(Path(spec.path or ".").resolve(), recipe_dir)).as_posix()
    return {"path": rel, **extra}


def _name(spec: SourceSpec, base: GGUFModel) -> str:
    stem = base.files[0].removesuffix(".gguf")
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem.split("/")[-1])
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip(".-") or "model"
    return f"{stem}-mosaic"


@dataclass(frozen=True)
class _Choice:
    """What the solver chooses among: units (any kind) and, per unit, its donors' options."""

    units: list[tuple[int | None, str | None, tuple[str, ...]]]  # (layer, group, tensors), in tie-break order
    options: list[list[Option]]
    delta: dict[tuple[int, str], int]  # (unit, donor) -> padded byte growth
    bits: dict[tuple[int, str], int]  # (unit, donor) -> 8 x byte growth (for --target-rate)
    predicted: dict[tuple[int, str], float]  # (unit, donor) -> measured dkl (measurements only)
    donors: list[tuple[str, SourceSpec, GGUFModel]]  # in --donor order
    kind: str


def _per_layer_choice(r: object, base: GGUFModel, base_spec: SourceSpec, hub: dict) -> tuple[_Choice, list[str]]:
    donors_arg: list[tuple[str, str]] = r.donors  # type: ignore[attr-defined]
    if len(donors_arg) != 1:
        raise MosaicError(f"a GGUF plan from per-layer scores takes exactly one --donor (given {len(donors_arg)}); "
                          "a measurement (mosaic measure) takes several")
    did, dsrc = donors_arg[0]
    if not is_gguf_src(dsrc):
        raise MosaicError(f"--donor {did}: {dsrc} is not a GGUF model, but the base is")
    donor_spec = gguf_source(dsrc, f"--donor {did}", did)
    donor = open_gguf_source(donor_spec, Path.cwd(), ranges=hub)
    check_same_model(base, did, donor)
    gunits = find_gguf_units(base, r.unit)  # type: ignore[attr-defined]
    layers = {t.layer for t in base.tensors if t.layer is not None}
    scores, notes = load_layer_scores(r.scores, gunits, did, layers)  # type: ignore[arg-type, attr-defined]
    bt, dt = base.by_name(), donor.by_name()
    a = base.alignment
    delta = {(u.index, did): sum(align(dt[n].nbytes, a) - align(bt[n].nbytes, a) for n in u.tensors) for u in gunits}
    bits = {(u.index, did): 8 * sum(dt[n].nbytes - bt[n].nbytes for n in u.tensors) for u in gunits}
    by_target = r.target_rate is not None  # type: ignore[attr-defined]
    options = [[Option(u.index, -1, BASE, 0, Fraction(0))]
               + ([Option(u.index, 0, did, bits[(u.index, did)] if by_target else delta[(u.index, did)], scores[(u.index, did)])]
                  if (u.index, did) in scores else []) for u in gunits]
    units = [(u.layer, u.pattern, u.tensors) for u in gunits]
    return _Choice(units, options, delta, bits, {}, [(did, donor_spec, donor)], r.unit), notes  # type: ignore[attr-defined]


def _records(model: GGUFModel, spec: SourceSpec, hub: dict, sid: str) -> list[dict]:
    """A source's file records to compare with a measurement's: a hub source read by ranges has only its
    header here, so its digests are the hub's (LFS SHA-256), not a hash of the placeholder."""
    from mosaic._build.digest_cache import file_records

    if sid in hub:
        claimed = hub[sid].claimed_digests()
        return [{"name": f, "size": model.headers[f].file_size, "sha256": claimed.get(f, "")} for f in model.files]
    return file_records(model, spec)


def _measured_choice(r: object, doc: dict, base: GGUFModel, base_spec: SourceSpec, hub: dict) -> tuple[_Choice, list[str]]:
    """Units × donors from a measurement of these very sources: the score of an option is its −dkl."""
    from mosaic._plan.gguf_units import dbytes, gguf_units

    path = r.scores  # type: ignore[attr-defined]
    if doc["format"] != "gguf":
        raise ScoresError(f"{path}: a measurement of EXL3 models; the base is GGUF")
    kind = doc["settings"]["unit"]
    if r.unit_explicit and r.unit != kind:  # type: ignore[attr-defined]
        raise ScoresError(f"{path}: measures {kind} units, not {r.unit} (--unit); measure again with --unit {r.unit}")  # type: ignore[attr-defined]
    if _records(base, base_spec, hub, "base") != doc["base"]["files"]:
        raise ScoresError(f"{path}: measured another base ({doc['base']['source']}): its files' digests differ from {r.base}'s")  # type: ignore[attr-defined]
    donors: list[tuple[str, SourceSpec, GGUFModel]] = []
    for did, dsrc in r.donors:  # type: ignore[attr-defined]
        if did not in doc["donors"]:
            raise ScoresError(f"{path}: has no donor {did!r} (it measured {', '.join(doc['donors'])})")
        if not is_gguf_src(dsrc):
            raise MosaicError(f"--donor {did}: {dsrc} is not a GGUF model, but the base is")
        spec = gguf_source(dsrc, f"--donor {did}", did)
        model = open_gguf_source(spec, Path.cwd(), ranges=hub)
        check_same_model(base, did, model)
        if _records(model, spec, hub, did) != doc["donors"][did]["files"]:
            raise ScoresError(f"{path}: measured another donor {did!r} ({doc['donors'][did]['source']}): "
                              f"its files' digests differ from {dsrc}'s")
        donors.append((did, spec, model))
    units = gguf_units(base, kind, None)  # every unit: a measurement calibrated by kinds predicts every layer
    index = {(u.layer, u.group): i for i, u in enumerate(units)}
    rank = {did: i for i, (did, _, _) in enumerate(donors)}
    models = {did: m for did, _, m in donors}
    by_target = r.target_rate is not None  # type: ignore[attr-defined]
    options: list[list[Option]] = [[Option(ui, -1, BASE, 0, Fraction(0))] for ui in range(len(units))]
    delta: dict[tuple[int, str], int] = {}
    bits: dict[tuple[int, str], int] = {}
    predicted: dict[tuple[int, str], float] = {}
    notes: list[str] = []
    for res in doc["results"]:
        if res["donor"] not in rank:
            continue
        ui = index.get((res["layer"], res["group"]))
        if ui is None:
            raise ScoresError(f"{path}: unit {res['group']} of layer {res['layer']} is not in the base")
        u, did = units[ui], res["donor"]
        d = dbytes(u, base, models[did])
        if d != res["dbytes"]:
            raise ScoresError(f"{path}: unit {u.describe()} from {did}: dbytes {res['dbytes']}, the sources give {d}")
        delta[(ui, did)] = d
        bt, dt = base.by_name(), models[did].by_name()
        bits[(ui, did)] = 8 * sum(dt[n].nbytes - bt[n].nbytes for n in u.tensors)
        predicted[(ui, did)] = res["dkl"]
        # every version is a choice, one of fewer bytes than the base's included (a loss: its dkl is positive)
        gain = -Fraction(Decimal(repr(res["dkl"])))
        options[ui].append(Option(ui, rank[did], did, bits[(ui, did)] if by_target else d, gain))
    for opts in options:
        opts.sort(key=lambda o: o.rank)
    return _Choice([(u.layer, u.group, u.tensors) for u in units], options, delta, bits, predicted, donors, kind), notes


def _rules(choice: _Choice, picks: list[Option]) -> list[dict[str, object]]:
    """The recipe's rules expressing ``picks``: per donor, its layers (with ``modules`` for routed experts)
    or, for single tensor kinds, the tensors' names."""
    rules: list[dict[str, object]] = []
    for did, _, _ in choice.donors:
        mine = [choice.units[o.unit] for o in picks if o.donor == did]
        if not mine:
            continue
        if choice.kind == "module-group":
            rules.append({"from": did, "keys": [n for _, _, ts in mine for n in ts]})
            continue
        rule: dict[str, object] = {"from": did, "layers": _ranges(sorted(layer for layer, _, _ in mine if layer is not None))}
        if choice.kind == "layer-experts":
            rule["modules"] = ["ffn_exps"]
        rules.append(rule)
    return rules


def _both_ways(options: list[list[Option]], room: int, asked: str, smallest: Callable[[int], str]) -> tuple[Solution, Solution]:
    """The exact and the greedy choice of every unit's version within ``room`` (bytes or bits over the base),
    versions of fewer bytes than the base's included: solved relative to each unit's cheapest version, where
    every option costs ≥ 0 (:func:`mosaic._plan.solver.shift`). ``room`` below what the cheapest versions
    together save is refused, naming the smallest plan there is."""
    sh = shift(options)
    if room < sh.floor_cost:
        raise TooSmall(f"{asked}: no plan is that small; the smallest possible (every unit at its version of fewest "
                        f"bytes) is {smallest(sh.floor_cost)}")
    exact = solve_pareto(sh.rows, room - sh.floor_cost)
    assert exact is not None  # the floors alone fit

    def cost(picks: list[Option]) -> int:
        return sh.floor_cost + sum(o.cost for o in picks)

    rough = greedy(sh.rows, lambda picks: cost(picks) <= room)
    return _unshifted(sh.unshift(exact), exact.gap), _unshifted(sh.unshift(rough))


def _unshifted(versions: list[Option], gap: float = 0.0) -> Solution:
    """A solution in the original space: the units away from the base's version, with their own costs and scores."""
    picks = [o for o in versions if o.donor != BASE]
    return Solution(picks, sum((o.score for o in picks), Fraction(0)),
                    (tuple(o.unit for o in picks), tuple(o.rank for o in picks)), gap)


def plan_gguf_mosaic(req: object) -> tuple[dict, str, GGUFPlan, list[str]]:
    """Solve a :class:`mosaic._plan.planner.PlanRequest` whose sources are GGUF; returns the report, the
    recipe text, the real build plan of it and notes."""
    r = req  # PlanRequest: base, donors, scores, max_size, target_rate, layers, unit, out
    modes = [x is not None for x in (r.max_size, r.target_rate, r.layers)]  # type: ignore[attr-defined]
    if sum(modes) != 1:
        raise MosaicError("give exactly one of --max-size, --target-rate, --layers")
    with recipe_lock(r.out):  # type: ignore[attr-defined]  # with --out: held until the recipe is written
        return _plan_gguf_mosaic(r)


def _plan_gguf_mosaic(r: object) -> tuple[dict, str, GGUFPlan, list[str]]:
    recipe_dir = (r.out.parent if r.out else Path.cwd()).resolve()  # type: ignore[attr-defined]
    recipe_dir.mkdir(parents=True, exist_ok=True)  # the recipe's sources are resolved from its folder
    base_spec = gguf_source(r.base, "--base", "base")  # type: ignore[attr-defined]
    hub: dict = {}  # hub sources not in the cache: their headers read by ranges
    base = open_gguf_source(base_spec, Path.cwd(), ranges=hub)
    doc = measurement_in(r.scores)  # type: ignore[attr-defined]
    choice, notes = (_measured_choice(r, doc, base, base_spec, hub) if doc is not None
                     else _per_layer_choice(r, base, base_spec, hub))
    held = _pinned(r, choice, base, doc is not None)
    name = _name(base_spec, base)
    # the header does not depend on the choice: lay it out once with the keys the build writes
    probe = Recipe(name, base_spec, {}, (), None, (), recipe_dir / "x.yaml", b"")
    kvs = [kv for kv in base.metadata.values() if not kv.key.startswith("mosaic.")] + mosaic_keys(probe, 0)
    head = layout(kvs, [(t.name, t.ne, t.type_id, t.nbytes) for t in base.tensors], base.alignment)
    base_size = head.size

    def size(picks: list[Option]) -> int:
        return base_size + sum(choice.delta[(o.unit, o.donor)] for o in picks)

    options = choice.options
    weights = sum(t.elements for t in base.tensors)
    if r.layers is not None:  # type: ignore[attr-defined]
        if r.layers < 1:  # type: ignore[attr-defined]
            raise MosaicError("--layers must be at least 1")
        moves = [[o for o in row if o.donor != BASE] for row in options]  # N units away from the base's version
        best: Solution = choose_count(moves, r.layers)  # type: ignore[attr-defined]
        greedy_sol = greedy(moves, lambda picks: True, count=r.layers)  # type: ignore[attr-defined]
    elif r.target_rate is not None:  # type: ignore[attr-defined]
        try:
            target = Fraction(Decimal(r.target_rate))  # type: ignore[attr-defined]
        except (InvalidOperation, ValueError):
            raise MosaicError(f"--target-rate: {r.target_rate!r} is not a number") from None  # type: ignore[attr-defined]
        room = int((target * weights - 8 * sum(t.nbytes for t in base.tensors)) // 1)
        best, greedy_sol = _both_ways(options, room, f"--target-rate {r.target_rate}{held}", lambda c: (  # type: ignore[attr-defined]
            f"{float(Fraction(8 * sum(t.nbytes for t in base.tensors) + c, weights)):.4f} bits per weight"))
    else:
        limit = r.max_size  # type: ignore[attr-defined]
        best, greedy_sol = _both_ways(options, limit - base_size, f"--max-size {limit:,} bytes{held}",
                                      lambda c: f"{base_size + c:,} bytes")
    if not best.picks:
        ups = [o for row in options for o in row if o.donor != BASE and o.score > 0]
        if r.max_size is not None and ups:  # type: ignore[attr-defined]
            raise PlanError(f"--max-size {r.max_size:,} bytes: too small for any unit; the base alone is {base_size:,} bytes "  # type: ignore[attr-defined]
                            f"and the smallest mosaic (one unit) is {base_size + min(o.cost for o in ups):,} bytes")
        if r.target_rate is not None and ups:  # type: ignore[attr-defined]
            raise PlanError(f"--target-rate {r.target_rate}: no unit fits")  # type: ignore[attr-defined]
        raise PlanError("no unit has a usable score (all scores are negative or missing)")
    out_doc = {"name": name, "base": _source_doc(base_spec, recipe_dir),
               "donors": {did: _source_doc(spec, recipe_dir) for did, spec, _ in choice.donors
                          if any(o.donor == did for o in best.picks)},
               "replace": _rules(choice, best.picks)}
    text = "# written by mosaic plan; build it with: mosaic build THIS_FILE\n" + yaml.safe_dump(
        out_doc, sort_keys=False, default_flow_style=None, width=120, allow_unicode=True)
    recipe = parse_recipe(text.encode(), (r.out.resolve() if r.out else recipe_dir / "mosaic-plan.yaml"))  # type: ignore[attr-defined]
    plan = plan_gguf(recipe, ranges=dict(hub))
    predicted = size(best.picks)
    if plan.size != predicted:
        raise VerificationError(f"plan: the size model says {predicted} bytes but the build plan lays out {plan.size}")
    rates = plan.rates()

    def listing(sol: Solution) -> list[dict]:
        picks = sorted(sol.picks, key=lambda o: (o.unit, o.rank))
        out = []
        for o in picks:
            layer, group, _ = choice.units[o.unit]
            item: dict[str, object] = {"layer": layer, "donor": o.donor}
            if doc is not None:
                item = {"layer": layer, "group": group, "donor": o.donor, "predicted_dkl": choice.predicted[(o.unit, o.donor)]}
            out.append(item)
        return out

    def f(x: object) -> float | None:
        return None if x is None else round(float(x), 6)  # type: ignore[arg-type]

    report = {
        "chosen": listing(best),
        "predicted_size": predicted,
        "score": float(best.score),
        "rate": {"exact": f(rates["exact"]), "by_bytes": f(rates["by_bytes"]), "by_layer_mass": f(rates["by_layer_mass"])},
        "greedy": {"chosen": listing(greedy_sol), "predicted_size": size(greedy_sol.picks), "score": float(greedy_sol.score)},
        # 0: the choice is proven optimal; else the most the optimum can exceed "score" (a search cut short)
        "gap": best.gap,
    }
    if best.gap > 0:
        notes.append(f"the search was cut short: the optimum scores at most {best.gap:.3g} more than this plan")
    if hub:
        report["hub_bytes_read"] = {sid: snap.reader.bytes_read for sid, snap in hub.items()}
        notes.append("read from the hub by ranges (GGUF headers only): " + ", ".join(
            f"{sid} {snap.reader.bytes_read:,} bytes" for sid, snap in hub.items()))
    if doc is not None:
        report["predicted_dkl"] = round(sum(choice.predicted[(o.unit, o.donor)] for o in best.picks), 9)
        report["unit"] = choice.kind
    if r.tensor_type_file is not None:  # type: ignore[attr-defined]
        from mosaic._plan.replay import write_tensor_types

        report["tensor_type_file"] = {"path": str(r.tensor_type_file), "entries": write_tensor_types(  # type: ignore[attr-defined]
            r.tensor_type_file, [(t.name, t.ne, t.type_id) for t in plan.tensors])}  # type: ignore[attr-defined]
    if r.out is not None:  # type: ignore[attr-defined]
        write_recipe(r.out, text)  # type: ignore[attr-defined]
    return report, text, plan, notes


def _pinned(r: object, choice: _Choice, base: GGUFModel, measured: bool) -> str:
    """``--pin``: each unit's versions narrowed to those holding its pinned tensors at their types (in place);
    the words a budget no plan meets then adds."""
    if not r.pins:  # type: ignore[attr-defined]
        return ""
    from mosaic._plan.pins import held_options, parse_pins

    if not measured or r.layers is not None:  # type: ignore[attr-defined]
        raise MosaicError("--pin: a GGUF plan over a measurement, with --max-size or --target-rate")
    pins = parse_pins(r.pins)  # type: ignore[attr-defined]
    tables = {did: m.by_name() for did, _, m in choice.donors} | {BASE: base.by_name()}
    shape = base.by_name()

    def missing(type_: str, tensor: str) -> str:
        from mosaic._sources.rung_set import DEFAULT_MIN_BPW, bits_per_weight

        if bits_per_weight(type_) < DEFAULT_MIN_BPW:
            return f"a ladder holds it only when made with --min-bpw 0 (mosaic ladder --min-bpw 0 --types ...,{type_})"
        return f"a ladder of the types {type_} is among holds it (mosaic ladder --types ...,{type_})"

    choice.options[:], counts = held_options(pins, choice.units, choice.options,
                                             lambda did, n: type_name(tables[did][n].type_id),
                                             lambda n: shape[n].ne, missing)
    return " with the pins held (" + ", ".join(f"{p} on {k} tensor{'s' if k != 1 else ''}" for p, k in counts.items()) + ")"
