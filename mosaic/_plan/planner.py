"""``mosaic plan``: which units to take from which donor under a size, rate or count budget.

This module owns the planning problem end to end, without writing anything but the recipe text:

* **units** — what moves together: all routed experts of a layer (``layer-experts``, the default,
  because exllamav3 fuses them at load), a whole layer (``layer``), or each module group of a layer
  (``module-group``: routed experts, shared experts, attention, dense MLP, ...);
* **scores** — per-layer numbers (JSON or CSV) or exllamav3's measurement JSON (``groups``/``alts``,
  ``dkld`` lower is better), mapped onto units, kept as exact fractions so that equal totals are equal;
* **costs** — exact, from the headers: tensor bytes for ``--max-size`` and bits × weights for
  ``--target-rate``; the output size of any chosen set is computed the way :mod:`mosaic._build.layout` lays
  shards out (header growth and padding included), so the prediction is the built size to the byte;
* **the choice** — an exact multiple-choice knapsack (Pareto dynamic programming over units; branch and bound with the LP bound
  of the remaining units' concave hulls); the non-additive header growth is handled by searching
  under a provably safe additive budget and accepting a leaf only if its exact size fits. Among
  equal totals the set whose sorted layer list is lexicographically smallest wins (CONTRACT.md);
* **the recipe** — one ``replace`` rule per donor (and module pattern), checked by the real
  preflight and planner (:func:`mosaic._recipe.exl3_rules.select`, :func:`mosaic._build.layout.make_plan`) before it
  is returned, so ``mosaic build`` accepts it unchanged and writes exactly the predicted size.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path

import yaml

from mosaic._base.errors import MosaicError, OutputError, SourceError, VerificationError
from mosaic._base.faults import point
from mosaic._base.lock import output_lock
from mosaic._build.layout import BuildPlan, make_plan
from mosaic._build.run import fsync_dir
from mosaic._checkpoint.census_exl3 import Analysis
from mosaic._checkpoint.exl3 import is_decoder_linear
from mosaic._plan.costs import SizeModel, bit_weight_deltas
from mosaic._plan.scores import ScoresError, load_scores
from mosaic._plan.solver import Option, Solution, choose_count, greedy, solve_pareto, solve_within_size
from mosaic._plan.units import PlanError, Unit, find_units
from mosaic._recipe.document import (
    _ID_RE,
    _REV_RE,
    REPO_RE,
    Recipe,
    SourceSpec,
    layer_runs,
    parse_recipe,
)
from mosaic._recipe.exl3_rules import select

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


def parse_source(text: str, what: str, source_id: str, hub_bytes: dict[str, int] | None = None) -> tuple[SourceSpec, Path]:
    """``org/name@<40-hex>`` (from the hub cache, else its configs and shard headers read by ranges,
    counted in ``hub_bytes``) or a folder."""
    from mosaic._sources.resolve import hub_folder

    repo, sep, rev = text.partition("@")
    if sep and REPO_RE.match(repo) and not Path(text).exists():
        if not _REV_RE.match(rev):
            raise MosaicError(f"{what}: {text!r}: the revision must be a full 40-hex commit hash")
        folder, snap = hub_folder(repo, rev)
        if snap is not None and hub_bytes is not None:
            hub_bytes[source_id] = snap.reader.bytes_read
        return SourceSpec(source_id, repo=repo, revision=rev), folder
    folder = Path(text)
    if not folder.is_dir():
        raise SourceError(f"{what}: {text} is not a folder (nor org/name@<40-hex commit>)")
    return SourceSpec(source_id, path=str(folder)), folder


def parse_donor_arg(text: str) -> tuple[str, str]:
    did, sep, src = text.partition("=")
    if not sep or not src:
        raise MosaicError(f"--donor: {text!r} is not ID=SRC")
    return donor_pair(did, src)


def donor_pair(did: str, src: str) -> tuple[str, str]:
    """A donor given as its id and SRC, checked as ``--donor ID=SRC`` is."""
    if not _ID_RE.match(did) or did == "base":
        raise MosaicError(f"--donor: id {did!r}: donor ids are lowercase letters, digits, '_' and '-' (and not 'base')")
    if not src:
        raise MosaicError(f"--donor: {did}: no SRC given")
    return did, src


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
    unit_explicit: bool = False  # --unit given (a measurement's own unit is used otherwise)
    pins: tuple[str, ...] = ()  # --pin PATTERN=TYPE: tensors held at a type (GGUF plans over a measurement)
    tensor_type_file: Path | None = None  # --tensor-type-file: the plan as llama-quantize --tensor-type-file reads it


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


def _load(spec: SourceSpec, folder: Path, sid: str, headers_only: bool = False) -> Analysis:
    from mosaic._checkpoint.census_exl3 import analyze
    from mosaic._checkpoint.folder import open_checkpoint

    a = analyze(open_checkpoint(folder, headers_only=headers_only))
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


def _measurement(req: PlanRequest, base: Analysis, donors: dict[str, Analysis]) -> tuple[str, dict] | None:
    """(unit, document) when the scores file is a ``mosaic measure`` document of these very sources."""
    from mosaic._build.digest_cache import folder_records
    from mosaic._plan.measurement import measurement_in

    doc = measurement_in(req.scores)
    if doc is None:
        return None
    if doc["format"] != "exl3":
        raise ScoresError(f"{req.scores}: a measurement of GGUF models; the base is an EXL3 folder")
    kind = doc["settings"]["unit"]
    if req.unit_explicit and req.unit != kind:
        raise ScoresError(f"{req.scores}: measures {kind} units, not {req.unit} (--unit); measure again with --unit {req.unit}")
    if folder_records(base) != doc["base"]["files"]:
        raise ScoresError(f"{req.scores}: measured another base ({doc['base']['source']}): its shards' digests differ from {req.base}'s")
    for did, d in donors.items():
        if did not in doc["donors"]:
            raise ScoresError(f"{req.scores}: has no donor {did!r} (it measured {', '.join(doc['donors'])})")
        if folder_records(d) != doc["donors"][did]["files"]:
            raise ScoresError(f"{req.scores}: measured another donor {did!r}: its shards' digests differ")
    return kind, doc


def _measured_scores(req: PlanRequest, doc: dict, units: list[Unit]) -> tuple[dict, dict, list[str]]:
    index = {(u.layer, u.pattern): u.index for u in units}
    scores: dict[tuple[int, str], Fraction] = {}
    predicted: dict[tuple[int, str], float] = {}
    for res in doc["results"]:
        ui = index.get((res["layer"], res["group"]))
        if ui is None:
            raise ScoresError(f"{req.scores}: unit {res['group']} of layer {res['layer']} is not in the base")
        predicted[(ui, res["donor"])] = res["dkl"]
        gain = -Fraction(Decimal(repr(res["dkl"])))
        if gain > 0:
            scores[(ui, res["donor"])] = gain
    if not scores:
        raise ScoresError(f"{req.scores}: no measured unit lowers the KL")
    return scores, predicted, []


def recipe_lock(out: Path | None) -> AbstractContextManager[object]:
    """``plan --out``: ``<out>.lock`` beside the recipe (``planned.yaml.lock``), to be held from before the recipe's
    folder is looked at until it is written, so that a second plan of the same file is refused naming this one;
    without ``--out`` nothing is written and nothing is locked. Creates the recipe's folder (the lock's)."""
    if out is None:
        return nullcontext()
    parent = Path(os.path.abspath(out)).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{parent}: cannot create the recipe's folder: {e.strerror or e}") from None
    return output_lock(out, "mosaic plan")


def write_recipe(out: Path, text: str) -> None:
    """Write the planned recipe under its lock: whole or not at all. The text goes to a temporary sibling
    (``planned.yaml.<pid>.tmp``, in the recipe's folder so the rename stays on one file system), is fsynced and
    renamed over ``out``, so a plan killed mid-write leaves the previous recipe (or none), never part of one; a
    failure removes the temporary. A temporary a killed plan left is removed here: under the lock, no other plan
    of this recipe is writing one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f"{glob.escape(out.name)}.*.tmp"):
        if stale.name[len(out.name) + 1:-len(".tmp")].isdigit():
            with contextlib.suppress(OSError):
                stale.unlink()
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        point("plan-write")
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(out.parent)


def plan_mosaic(req: PlanRequest) -> PlanResult:
    """Solve the request and return the report, the recipe text and the real build plan of it (with ``out``,
    written there under its lock)."""
    modes = [x is not None for x in (req.max_size, req.target_rate, req.layers)]
    if sum(modes) != 1:
        raise MosaicError("give exactly one of --max-size, --target-rate, --layers")
    if not req.donors:
        raise MosaicError("give at least one --donor ID=SRC")
    ids = [d for d, _ in req.donors]
    if len(set(ids)) != len(ids):
        raise MosaicError(f"--donor: id given twice in {ids}")
    with recipe_lock(req.out):
        return _plan_mosaic(req, ids)


def _plan_mosaic(req: PlanRequest, ids: list[str]) -> PlanResult:
    hub_bytes: dict[str, int] = {}
    base_spec, base_dir = parse_source(req.base, "--base", "base", hub_bytes)
    specs = {did: parse_source(src, f"--donor {did}", did, hub_bytes) for did, src in req.donors}
    base = _load(base_spec, base_dir, "base", "base" in hub_bytes)
    donors = {did: _load(spec, folder, did, did in hub_bytes) for did, (spec, folder) in specs.items()}
    measured = _measurement(req, base, donors)
    kind = measured[0] if measured else req.unit
    units = find_units(base, kind)
    _check_candidates(base, donors, units)
    measured_dkl: dict[tuple[int, str], float] = {}
    if measured:
        scores, measured_dkl, notes = _measured_scores(req, measured[1], units)
    else:
        scores, notes = load_scores(req.scores, units, req.unit, base, ids)
    model = SizeModel(base, donors, units)
    bw = bit_weight_deltas(base, donors, units)

    def cost_of(ui: int, did: str) -> int:
        return bw[(ui, did)] if req.target_rate is not None else model.delta[(ui, did)]

    options = [
        [Option(u.index, r, did, cost_of(u.index, did), scores[(u.index, did)]) for r, did in enumerate(ids) if (u.index, did) in scores]
        for u in units
    ]

    down = next((o for row in options for o in row if model.delta[(o.unit, o.donor)] < 0), None)
    if down is not None:  # an EXL3 mosaic is the base's shards with donors' tensors spliced in: upgrades only
        raise PlanError(f"--donor {down.donor}: its version of {units[down.unit].label} has fewer bytes than the base's; "
                        "EXL3 plans take upgrades only (a smaller base, or GGUF models, plan in both directions)")

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
        if measured:
            return [{"layer": units[o.unit].layer, "group": units[o.unit].pattern, "donor": o.donor,
                     "predicted_dkl": measured_dkl[(o.unit, o.donor)]} for o in sol.picks]
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
    if hub_bytes:
        report["hub_bytes_read"] = hub_bytes
        notes.append("read from the hub by ranges (configs and shard headers only): "
                     + ", ".join(f"{sid} {n:,} bytes" for sid, n in hub_bytes.items()))
    if req.out is not None:
        write_recipe(req.out, text)
    return PlanResult(report, text, plan, notes)


def _real_plan(recipe: Recipe, base: Analysis, donors: dict[str, Analysis]) -> BuildPlan:
    used = {r.donor for r in recipe.rules}
    srcs = {"base": base, **{d: a for d, a in donors.items() if d in used}}
    selection = select(recipe, base, {d: a for d, a in donors.items() if d in used})
    return make_plan(recipe, srcs, selection)
