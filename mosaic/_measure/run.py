"""``mosaic measure``: what each unit of a model buys from each donor, by one of three methods.

- ``top-down`` (the default): the weight errors of every unit at every version (:mod:`.weights`, from the
  files), then the *top* model — every unit of the kind at its lowest-error version — and one candidate per
  selected unit: the top with that unit dropped back to the base's version. The drops calibrate how much
  the model feels each unit's weight error (:mod:`.calibrate`), and every (unit, donor) result is predicted
  from it. Forward passes: the teacher, the base, the top, one per selected unit.
- ``weights``: the weight errors alone, nothing runs (``dkl`` is a weight error, not nats).
- ``swaps``: every candidate "base + that one unit from that donor" run and measured (the v1 measurement).

The teacher runs exactly once (its top-k kept, as ``mosaic eval --save-reference`` keeps it), every
candidate is scored against that top-k on the rows of the text, as ``mosaic eval`` scores a model against a
saved reference. Each result is made durable as it finishes (:mod:`.journal`); ``--out`` is written only
when every candidate has run. ``--shard K/N`` runs every N-th candidate; :mod:`.shards` joins the parts into
the document one run would have written. Sources' digests come from the digest cache (or the hub's digests
that ``mosaic fetch`` verified) and are hashed only when neither knows them.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import MosaicError, OutputError, VerificationError
from mosaic._base.faults import point as fault_point
from mosaic._base.hashing import digest_file
from mosaic._base.lock import output_lock
from mosaic._base.progress import SILENT, Reporter
from mosaic._base.version import __version__
from mosaic._build.run import fsync_dir
from mosaic._eval.reference import Reference, is_reference_file, load_reference
from mosaic._eval.rows import Rows, load_rows
from mosaic._eval.run import DEFAULT_CTX, DEFAULT_TOP_K, EvalRequest, evaluate, runtime_note
from mosaic._eval.runtime import default_threads
from mosaic._eval.worker import get_runtime
from mosaic._hub.partial import atomic_write
from mosaic._measure.backends import Scorer
from mosaic._measure.calibrate import (
    BASE,
    KIND_CALIBRATIONS,
    complete,
    drop_groups,
    drop_version,
    kind_of,
    measured_record,
    mid_version,
    predicted,
    top_versions,
    unit_key,
    worst_versions,
)
from mosaic._measure.defaults import resolved, spread
from mosaic._measure.importance import CAP, load_importance
from mosaic._measure.journal import Journal, journal_path, stages
from mosaic._measure.parts import check_space
from mosaic._measure.refine import (
    kind_ratios,
    moves,
    plan_versions,
    predicted_move,
    rescale,
    scales,
    versions_key,
)
from mosaic._measure.shards import Shard, in_shard, parse_shard
from mosaic._measure.sides import Side, exl3_side, gguf_side
from mosaic._measure.weights import Errors
from mosaic._plan.gguf_units import Unit
from mosaic._plan.measurement import SCHEMA_ID, dumps, validation_errors
from mosaic._sources.gguf import is_gguf_src

METHODS = ("top-down", "weights", "swaps")
CALIBRATIONS = ("units", *KIND_CALIBRATIONS)
CURVES = ("line", "two-point", "versions")


@dataclass
class MeasureRequest:
    base: str
    donors: list[tuple[str, str]]
    reference: str | None
    text: Path | None
    unit: str | None = None
    only_layers: str | None = None
    ctx: int | None = None
    top_k: int | None = None
    out: Path = field(default_factory=lambda: Path("measurement.json"))
    resume: bool = False
    force: bool = False
    workdir: Path | None = None
    threads: int | None = None
    verbose: bool = False
    method: str = "top-down"
    calibrate: str | None = None  # None: the default (mosaic._measure.defaults), set by measure() before anything runs
    shard: str | None = None
    imatrix: str | None = None
    refine: int = 0  # rounds of measurement at the plan (top-down, GGUF)
    max_size: int | None = None  # the budget the refinement plans at
    gpu_layers: int | str | None = None  # llama.cpp's offload ("all", a count; None: the default)
    curve: str | None = None  # top-down: one drop per unit (a line), two (to the worst and a middle version), or versions
    ladder: bool = False  # the sources are a ladder's rungs: a unit alike in several (type and bytes) is one version
    imatrix_cap: bool | None = None  # --imatrix-cap: the importances held under a robust ceiling (importance.capped)
    ladder_source: tuple[str, int] | None = None  # --ladder: the SHA-256 and size of the model its rungs were made of
    sample_layers: int | None = None  # --calibrate kinds: drops at this many layers spread over the depth (0: every layer)


def _remove_stale_work(workdir: Path, name: str) -> None:
    """Work folders of measurements whose process is gone (killed): each holds a copy of the base."""
    for p in workdir.glob(f".{name}.measure-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def _sha256(path: Path) -> str:
    return digest_file(path).sha256


def _se(a: list[float], b: list[float]) -> float:
    """The paired standard error of the mean difference over rows (rows are the independent units)."""
    d = [x - y for x, y in zip(a, b)]
    return statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0


def _check_request(req: MeasureRequest, asked: MeasureRequest) -> Shard | None:
    """Everything that can be refused before a source is opened (``req`` resolved, ``asked`` as given)."""
    if req.method not in METHODS:
        raise MosaicError(f"--method {req.method}: one of {', '.join(METHODS)}")
    if req.calibrate not in CALIBRATIONS:
        raise MosaicError(f"--calibrate {req.calibrate}: one of {', '.join(CALIBRATIONS)}")
    if req.calibrate in KIND_CALIBRATIONS and req.method != "top-down":
        raise MosaicError(f"--calibrate {req.calibrate} calibrates the drops of --method top-down, not of --method {req.method}")
    if req.calibrate == "pooled" and req.curve != "versions":
        raise MosaicError(f"--calibrate pooled reads each kind's alpha from its pooled pass: it needs --curve versions, "
                          f"not --curve {req.curve}")
    if req.calibrate == "groups" and req.shard is not None:
        raise MosaicError("--calibrate groups drops each kind's units together, across every layer: not with --shard")
    if req.calibrate == "groups" and req.refine:
        raise MosaicError("--refine moves every unit from the plan it measures, and needs a drop of each: not with --calibrate groups")
    shard = parse_shard(req.shard) if req.shard is not None else None
    if req.sample_layers:
        if req.sample_layers < 0:
            raise MosaicError(f"--sample-layers {req.sample_layers}: a number of layers (0: every layer)")
        if req.calibrate != "kinds":
            raise MosaicError(f"--sample-layers fits each kind's factor from a few layers' drops: it goes with "
                              f"--calibrate kinds, not --calibrate {req.calibrate}")
        if req.only_layers is not None:
            raise MosaicError("--sample-layers and --only-layers both choose the layers whose drops run: give one of them")
        if req.refine:
            raise MosaicError("--refine moves every unit from the plan it measures: not with --sample-layers")
    if req.curve not in CURVES:
        raise MosaicError(f"--curve {req.curve}: one of {', '.join(CURVES)}")
    if req.curve != "line" and req.method != "top-down":
        raise MosaicError(f"--curve {req.curve} shapes the drops of --method top-down, not of --method {req.method}")
    if req.curve == "two-point" and req.calibrate in KIND_CALIBRATIONS:
        raise MosaicError(f"--curve {req.curve} gives each unit a curve of its own: not with --calibrate {req.calibrate}")
    if req.curve == "versions" and req.shard is not None:
        raise MosaicError("--curve versions moves each kind's units together, across every layer: not with --shard"
                          + ("" if asked.curve else " (versions is the default curve; --curve line shards)"))
    if req.curve == "versions" and req.refine:
        raise MosaicError("--curve versions and --refine both correct the line, each from its own moves: choose one")
    if req.refine < 0:
        raise MosaicError(f"--refine {req.refine}: a number of rounds, at least 1")
    if req.refine and req.max_size is None:
        raise MosaicError("--refine needs --max-size SIZE: the budget whose plan the refinement measures around")
    if req.max_size is not None and not req.refine:
        raise MosaicError("--max-size is the budget of --refine N; give both (mosaic plan takes the budget otherwise)")
    if req.refine and req.method != "top-down":
        raise MosaicError(f"--refine refines the drops of --method top-down, not --method {req.method}")
    if req.refine and req.shard is not None:
        raise MosaicError("--refine runs its rounds one after another, each planned from the last: not with --shard")
    if req.method == "weights":
        given = [flag for flag, v in (("--text", req.text), ("--ctx", req.ctx), ("--top-k", req.top_k)) if v is not None]
        if given:
            raise MosaicError(f"--method weights runs no model: {', '.join(given)} not used (they go with top-down or swaps)")
        if shard is not None:
            raise MosaicError("--shard: --method weights runs no candidate to share out")
    else:
        if req.reference is None:
            raise MosaicError(f"--method {req.method} needs --reference: the teacher the candidates are scored against")
        if req.text is None:
            raise MosaicError(f"--method {req.method} needs --text: the rows the candidates are scored on")
    if not req.donors:
        raise MosaicError("give at least one --donor ID=SRC")
    ids = [d for d, _ in req.donors]
    if len(set(ids)) != len(ids):
        raise MosaicError(f"--donor {next(d for d in ids if ids.count(d) > 1)}: given twice")
    return shard


def measure(req: MeasureRequest, progress: Reporter = SILENT) -> dict:
    """Measure, holding ``<out>.lock`` throughout: taken before ``--out``, its journal or the teacher's top-k are
    looked at, so that a second measurement of the same ``--out`` (``--force`` and ``--resume`` included) is
    refused before it could delete or append to this one's journal."""
    started = time.monotonic()
    given, req = req, resolved(req)
    shard = _check_request(req, given)
    with output_lock(req.out, "mosaic measure"):
        return _measure(req, shard, started, progress)


def _measure(req: MeasureRequest, shard: Shard | None, started: float, progress: Reporter) -> dict:
    out = Path(req.out)
    jpath = journal_path(out)
    teacher_path = jpath.with_name(jpath.name + ".teacher.npz")
    if out.exists() and not req.force:
        raise OutputError(f"{out}: exists; --force replaces it")
    if req.resume and req.force:
        raise MosaicError("--resume continues an interrupted measurement and --force discards it: give one of them")
    if req.resume and not jpath.is_file():
        raise MosaicError(f"--resume: no interrupted measurement at {jpath}")
    if jpath.exists() and not req.resume and not req.force:
        raise OutputError(f"{jpath}: an interrupted measurement is here; --resume continues it, --force starts over")

    gguf = is_gguf_src(req.base)
    if req.refine and not gguf:
        raise MosaicError(f"--refine plans and measures GGUF mosaics; the base {req.base} is an EXL3 checkpoint")
    if req.imatrix is not None and not gguf:
        raise MosaicError(f"--imatrix weights the errors of GGUF tensors, and the base {req.base} is an EXL3 checkpoint "
                          "(its quantizer weighs its own errors); leave --imatrix out")
    if req.imatrix_cap and req.imatrix is None:
        raise MosaicError("--imatrix-cap holds an importance matrix's values under a ceiling: give the matrix with --imatrix")
    rows = load_rows(req.text) if req.text is not None else None  # cheap checks first: the side hashes the sources
    side = gguf_side(req, progress) if gguf else exl3_side(req, progress)
    importance = (load_importance(req.imatrix, side.tensors, progress, CAP if req.imatrix_cap else None)
                  if req.imatrix is not None else None)
    sample = sampled_layers(req, side)
    measured_units = _measured_units(req, side, sample)

    reference: dict | None = None
    ctx = k = None
    if req.reference is not None and is_reference_file(req.reference):
        ref0 = load_reference(req.reference)
        if rows is not None and ref0.text_sha256 != rows.sha256:
            raise MosaicError(f"{req.reference}: saved for another text (sha256 {ref0.text_sha256}), not {req.text}")
        for flag, mine, theirs in (("--ctx", req.ctx, ref0.ctx), ("--top-k", req.top_k, ref0.k)):
            if mine is not None and mine != theirs:
                raise MosaicError(f"{req.reference}: saved with {flag} {theirs}, not {mine}")
        if req.method != "weights":
            ctx, k = ref0.ctx, ref0.k
        reference = {"source": req.reference, "kind": "saved", "model": ref0.model, "sha256": _sha256(Path(req.reference)),
                     "runtime": ref0.runtime}
    elif req.reference is not None:
        if req.method != "weights":
            ctx, k = req.ctx or DEFAULT_CTX, req.top_k or DEFAULT_TOP_K
        reference = {"source": req.reference, "kind": "model", "model": req.reference,
                     "files": side.reference_files(req.reference, progress)}
    threads = req.threads or default_threads()
    weights_from, weights_note = req.reference, None
    if reference is not None and reference["kind"] == "saved" and req.ladder_source is not None:
        made_of = _ladder_teacher(reference["model"], req.ladder_source)
        if made_of is not None:
            weights_from = made_of
            weights_note = (f"weights compared with {made_of}, the model the saved reference was made of and the "
                            f"ladder's source (sha256 {req.ladder_source[0]})")
    t_weights = time.monotonic()
    errors = side.weight_errors(weights_from, threads, progress, importance)
    weights_seconds = time.monotonic() - t_weights
    layers = sorted(side.layers) if side.layers is not None else None
    settings: dict = {"unit": side.unit, "ctx": ctx, "top_k": k, "layers": layers,
                      "kl": None if k is None else {"kind": "top-k lower bound", "k": k},
                      "method": req.method, "calibrate": req.calibrate, "weights_reference": errors.reference,
                      "dkl": "weight error" if req.method == "weights" else "nats"}
    if importance is not None:
        settings["imatrix"] = importance.record(errors.weighted)
    if req.method == "top-down":
        settings["curve"] = req.curve
        settings["drop"] = "worst"
    if req.refine:
        assert req.max_size is not None
        smallest = side.base_bytes + sum(min(0, *(side.dbytes[(ui, v)] for v in vs)) for ui, vs in enumerate(side.versions))
        if req.max_size < smallest:  # checked before anything runs; the plan of each round is exact
            raise MosaicError(f"--max-size {req.max_size:,} bytes: smaller than any plan (every unit at its version of "
                              f"fewest bytes is {smallest:,} bytes)")
        settings["refine"] = {"rounds": req.refine, "max_size": req.max_size}
    if sample is not None:
        settings["sampled_layers"] = sample
    pooled_units = list(range(len(side.units))) if sample is not None else measured_units
    plan = _Plan(side, errors, req.method, measured_units, shard, req.refine, req.curve, pooled_units, req.calibrate)
    if shard is not None:
        settings["shard"] = {"k": shard.k, "n": shard.n, "units": [unit_key(side.units[u].layer, side.units[u].group)
                                                                    for u in measured_units]}
    head = _head(req, side, reference, rows, settings)
    if req.method == "weights":
        rows = [_row(side, errors, ui, d) for ui in side.selected for d in side.versions[ui][1:]]
        if weights_note:
            head["notes"] = [weights_note]
        doc = {**head, "runtime": None, "seconds": round(time.monotonic() - started, 3), "seconds_per_candidate": None,
               "forward_passes": 0, "results": [{**r, **predicted(None, r["eps_base"], r["eps"], None)} for r in rows],
               "timing": {"load": 0, "decode": 0, "panel": 0, "stages": stages([], weights_seconds)}}
        return _write(doc, out)
    runtime = side.runtime()
    fingerprint = {"format": side.format, "base": side.base_files, "donors": side.donor_files,
                   "text": rows.sha256 if rows is not None else None,
                   "reference": {key: v for key, v in (reference or {}).items() if key != "source"},
                   "settings": settings, "runtime": runtime, "tool": __version__}
    if req.force:
        jpath.unlink(missing_ok=True)
        teacher_path.unlink(missing_ok=True)
    journal = Journal.resume(jpath, fingerprint) if req.resume else Journal.start(jpath, fingerprint)
    try:
        assert rows is not None and reference is not None
        notes = _runtime_notes(req, side, reference) + ([weights_note] if weights_note else [])
        return _run(req, journal, plan, rows, reference, teacher_path,
                    {**head, "runtime": runtime, **({"notes": notes} if notes else {})}, out, started, weights_seconds,
                    progress)
    finally:
        journal.close()


def _ladder_teacher(model: str | None, source: tuple[str, int]) -> str | None:
    """The file a saved reference was made of, where it is still the ladder's source (same size and SHA-256): the
    weight errors are then measured against the teacher itself, as with a live one. Without this a ladder made
    from a quantization compares every rung with its most-bits rung, and the rungs of the source's own types,
    lossless, look worse than Q8_0: the plan pays for Q8_0 where the teacher's own bytes would cost nothing."""
    if not model:
        return None
    path = Path(model)
    try:
        if not path.is_file() or path.stat().st_size != source[1]:
            return None
    except OSError:
        return None
    return str(path) if _sha256(path) == source[0] else None


def _runtime_notes(req: MeasureRequest, side: Side, reference: dict | None) -> list[str]:
    """What the document says of where it ran: a GPU asked for and not found, a saved teacher made by another
    runtime or on another device."""
    if side.format != "gguf":
        return []
    info = get_runtime(threads=req.threads, verbose=req.verbose, gpu_layers=req.gpu_layers).info
    notes = [info.note] if info.note else []
    if reference is not None and reference["kind"] == "saved":
        note = runtime_note(reference.get("runtime"), info)
        if note:
            notes.append(note)
    return notes


def sampled_layers(req: MeasureRequest, side: Side) -> list[int] | None:
    """The layers ``--sample-layers`` runs the drops of; None where every layer's run (no sample asked, or no
    fewer layers than it asks for)."""
    every = sorted({u.layer for u in side.units if u.layer is not None})
    if not req.sample_layers or req.sample_layers >= len(every):
        return None
    return spread(every, req.sample_layers)


def _measured_units(req: MeasureRequest, side: Side, sample: list[int] | None) -> list[int]:
    """The units whose candidates run: the selected ones (of ``sample``'s layers, :func:`sampled_layers`);
    under ``--calibrate kinds`` also the units outside the layers (``token_embd``, ``output``: kinds of their
    own). Every kind of the model must be among them."""
    units = list(side.selected)
    if sample is not None:
        units = [i for i in units if side.units[i].layer in sample]
    if req.calibrate in KIND_CALIBRATIONS:
        units += [i for i, u in enumerate(side.units) if u.layer is None and i not in units]
        have = {kind_of(side.units[i].group) for i in units}
        for u in side.units:
            k = kind_of(u.group)
            if k not in have:
                where = sorted({x.layer for x in side.units if kind_of(x.group) == k and x.layer is not None})
                raise MosaicError(f"--calibrate {req.calibrate}: the kind {k} (layers {where[0]}-{where[-1]}) is in none of --only-layers "
                                  f"{req.only_layers}; add a layer that has it")
    return sorted(units)


class _Plan:
    """What runs: the versions of the top, the candidates of this run (its shard), the laid-out versions."""

    def __init__(self, side: Side, errors: Errors, method: str, measured_units: list[int], shard: Shard | None,
                 refine: int = 0, curve: str = "line", pooled_units: list[int] | None = None, calibrate: str = "units") -> None:
        self.side, self.errors, self.method, self.refine = side, errors, method, refine
        self.measured_units = measured_units
        mine = [u for i, u in enumerate(measured_units) if shard is None or in_shard(i, shard)]
        self.top = top_versions(side.versions, errors.eps, side.dbytes) if method == "top-down" else None
        if self.top is not None:
            self.top_map = {ui: v for ui, v in enumerate(self.top) if v != BASE}
            #: each unit's drop goes to its worst version (the base's, or a smaller donor's where that is worse)
            self.to = worst_versions(side.versions, errors.eps, side.dbytes)
            self.drops = [ui for ui in mine if self.top[ui] != self.to[ui]]  # one version, or all alike: no drop
            self.mids: dict[int, str] = {}
            if curve == "two-point":  # the second point of each unit's curve, where a version lies between
                for ui in self.drops:
                    vs = side.versions[ui]
                    mid = mid_version(vs, {v: errors.eps[(ui, v)] for v in vs}, {v: side.dbytes[(ui, v)] for v in vs},
                                      self.top[ui], self.to[ui])
                    if mid is not None:
                        self.mids[ui] = mid
            #: --curve versions: (kind, version, the units moved there) for every version of each kind's units:
            #: the measured ones, or every layer's where the drops ran at a sample of layers
            self.pooled = (_pooled(side, measured_units if pooled_units is None else pooled_units, self.top, self.to)
                           if curve == "versions" else [])
            #: --calibrate pooled: each kind's pass at its drop version gives its alpha; only a kind without one
            #: (a single unit, whose drop is that pass) keeps its drop
            self.alpha_passes = _alpha_passes(side, self.pooled, self.to) if calibrate == "pooled" else set()
            #: --calibrate groups: (kind, its units dropped together), a few per kind whatever the depth
            self.groups = _groups(side, self.drops) if calibrate == "groups" else []
            calibrated = {k for k, _ in self.alpha_passes} | {k for k, _ in self.groups}
            self.drops = [ui for ui in self.drops if kind_of(side.units[ui].group) not in calibrated]
            self.pairs = (set(self.top_map.items()) | set(self.mids.items())
                          | {(ui, self.to[ui]) for ui in self.drops if self.to[ui] != BASE}
                          | {(ui, self.to[ui]) for _, moved in self.groups for ui in moved if self.to[ui] != BASE}
                          | {(ui, v) for _, v, moved in self.pooled if v != BASE for ui in moved})
            if refine:  # a plan may take any version of any unit
                self.pairs |= {(ui, d) for ui, vs in enumerate(side.versions) for d in vs[1:]}
            self.swaps: list[tuple[int, str]] = []
        else:
            self.top_map = {}
            self.to = []
            self.drops = []
            self.mids = {}
            self.pooled = []
            self.alpha_passes = set()
            self.groups = []
            self.swaps = [(ui, d) for ui in mine for d in side.versions[ui][1:]]
            self.pairs = set(self.swaps)
        self.mine = mine
        self.shard = shard


def _pooled(side: Side, measured_units: list[int], top: list[str], to: list[str]) -> list[tuple[str, str, list[int]]]:
    """The candidates of ``--curve versions``: per kind and per version any of its measured units has, the top
    with every one of them that has that version (and is not at it already) moved there together. A kind's
    units summed at a version rise out of the noise where one unit's drop does not, and they measure the one
    thing a unit's line assumes and never checks: that a version costs what its weight error says, whatever
    its type. A kind of one unit at its worst version is that unit's drop, already measured: not run again.
    Nor is a version with no fewer bytes than the top's for every unit it would move: the top has the least
    weight error and the least loss, so no plan takes such a version and nothing it measured would reach a plan
    (over a ladder made from a quantization, the rungs above the source's own lossless types)."""
    kinds: dict[str, list[int]] = {}
    for ui in measured_units:
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


def _groups(side: Side, drops: list[int]) -> list[tuple[str, list[int]]]:
    """``--calibrate groups``: per kind of more than one unit, its units that have a drop dealt into
    :data:`DROP_GROUPS` groups over the depth (:func:`.calibrate.drop_groups`), each run as one pass with its units
    at their drop versions together. A kind's alpha is the sum of its drops over the sum of their weight errors;
    a pass that drops a group measures its share of that sum at once, so the passes are fixed by the kinds, not
    by the depth. A one-unit kind keeps its drop."""
    kinds: dict[str, list[int]] = {}
    for ui in drops:
        kinds.setdefault(kind_of(side.units[ui].group), []).append(ui)
    out = []
    for k, uis in sorted(kinds.items()):
        if len(uis) > 1:
            out += [(k, [uis[i] for i in g]) for g in drop_groups([side.units[ui].layer for ui in uis])]
    return out


def _alpha_passes(side: Side, pooled: list[tuple[str, str, list[int]]], to: list[str]) -> set[tuple[str, str]]:
    """``(kind, version)`` of each kind's pooled pass at its drop version (the version most of its moved units'
    drops would go to), where one runs."""
    out = set()
    runs = {(k, v) for k, v, _ in pooled}
    for k in {k for k, _, _ in pooled}:
        v = drop_version([to[ui] for k2, _, moved in pooled if k2 == k for ui in moved])
        if (k, v) in runs:
            out.add((k, v))
    return out


def _head(req: MeasureRequest, side: Side, reference: dict | None, rows: Rows | None, settings: dict) -> dict:
    return {
        "schema": SCHEMA_ID,
        "tool": {"name": "mosaic", "version": __version__},
        "format": side.format,
        "base": {"source": req.base, "files": side.base_files, "bytes": side.base_bytes, "kl": None, "top1": None, "nll": None},
        "donors": {d: {"source": src, "files": side.donor_files[d]} for d, src in req.donors},
        "reference": reference,
        "text": None if rows is None else {"file": str(req.text), "sha256": rows.sha256, "rows": len(rows.texts), "positions": 0},
        "settings": settings,
    }


def _row(side: Side, errors: Errors, ui: int, donor: str, measured: dict | None = None) -> dict:
    """A result in the document's field order: its unit, donor, bytes and weight errors, with the measured
    figures (a swap that ran) or, left ``None``, the ones a prediction fills in."""
    u = side.units[ui]
    row = {"layer": u.layer, "group": u.group, "donor": donor, "dbytes": side.dbytes[(ui, donor)], "kl": None, "dkl": None,
           "dkl_se": None, "dtop1": None, "dnll": None, "eps": errors.eps[(ui, donor)], "eps_base": errors.eps[(ui, BASE)],
           "predicted": measured is None, "tensors": list(u.tensors)}
    if measured:
        row.update(measured)
    return row


def _teacher(req: MeasureRequest, journal: Journal, reference: dict, teacher_path: Path, ctx: int, k: int,
             progress: Reporter) -> Reference:
    assert req.reference is not None and req.text is not None
    if reference["kind"] == "saved":
        return load_reference(req.reference)
    done = [r for r in journal.records if r["kind"] == "teacher"]
    if done and teacher_path.is_file() and _sha256(teacher_path) == done[0]["sha256"]:
        return load_reference(teacher_path)
    if done:
        raise MosaicError(f"--resume: the teacher's saved top-k {teacher_path} is missing or changed; measure again without --resume")
    tmp = teacher_path.with_name(teacher_path.name + ".tmp.npz")
    t0 = time.monotonic()
    evaluate(EvalRequest([], req.reference, req.text, ctx, k, save_reference=tmp, threads=req.threads, verbose=req.verbose,
                         gpu_layers=req.gpu_layers), progress)
    with open(tmp, "rb") as f:  # durable before the journal names it
        os.fsync(f.fileno())
    os.replace(tmp, teacher_path)
    fsync_dir(teacher_path.parent)
    journal.add({"kind": "teacher", "sha256": _sha256(teacher_path), "seconds": time.monotonic() - t0})
    return load_reference(teacher_path)


def _panel_record(kind: str, p: dict, t0: float, **extra: object) -> dict:
    return {"kind": kind, **extra, "kl": p["kl"]["mean"], "top1": p["top1"], "nll": p["nll"],
            "rows": [[r["kl"], r["top1"], r["nll"]] for r in p["rows"]], "seconds": time.monotonic() - t0}


#: One candidate of the loop: its versions, its name, and the journal record its panel makes (given its start).
_Job = tuple[dict[int, str], str, Callable[[dict, float], dict]]


def _mark_job(kind: str, versions: dict[int, str], marks: dict[str, dict | None]) -> _Job:
    """The base or the top, kept in ``marks`` for the records told against it."""

    def record(p: dict, t0: float) -> dict:
        marks[kind] = rec = _panel_record(kind, p, t0)
        return rec

    return versions, kind, record


def _same_as_base(plan: _Plan, base_rec: dict | None, same: list[tuple[int, str]], journal: Journal) -> None:
    """Donor versions with the base's own bytes: the base's panel, not run."""
    assert base_rec is not None
    for ui, d in same:
        u = plan.side.units[ui]
        journal.add({"kind": "result", "layer": u.layer, "group": u.group, "donor": d, "kl": base_rec["kl"], "dkl": 0.0,
                     "dkl_se": 0.0, "dtop1": 0.0, "dnll": 0.0, "same_as_base": True, "seconds": 0.0})


def _swap_job(plan: _Plan, marks: dict[str, dict | None], ui: int, d: str) -> _Job:
    """The base with unit ``ui`` at donor ``d``'s version: the gain of taking it."""
    u = plan.side.units[ui]

    def record(p: dict, t0: float) -> dict:
        base_rec = marks["base"]
        assert base_rec is not None
        c_kl = [r["kl"] for r in p["rows"]]
        return {"kind": "result", "layer": u.layer, "group": u.group, "donor": d, "kl": p["kl"]["mean"],
                "dkl": p["kl"]["mean"] - base_rec["kl"], "dkl_se": _se(c_kl, [r[0] for r in base_rec["rows"]]),
                "dtop1": p["top1"] - base_rec["top1"], "dnll": p["nll"] - base_rec["nll"], "seconds": time.monotonic() - t0}

    return {ui: d}, f"{u.describe()} from {d}", record


def _drop_record(marks: dict[str, dict | None], kind: str, u: Unit, **extra: object) -> Callable[[dict, float], dict]:
    def record(p: dict, t0: float) -> dict:
        top_rec = marks["top"]
        assert top_rec is not None
        rec = _panel_record(kind, p, t0, layer=u.layer, group=u.group, **extra)
        rec["dkl_drop_se"] = _se([r["kl"] for r in p["rows"]], [r[0] for r in top_rec["rows"]])
        return rec

    return record


def _drop_job(plan: _Plan, marks: dict[str, dict | None], ui: int) -> _Job:
    """The top with unit ``ui`` at its worst version (the base's, or a donor's of fewer bytes): the loss of it."""
    u = plan.side.units[ui]
    to = plan.to[ui]
    return _moved(plan.top_map, ui, to), f"the top with {u.describe()} at {'the base' if to == BASE else to}'s version", _drop_record(marks, "drop", u)


def _mid_job(plan: _Plan, marks: dict[str, dict | None], ui: int) -> _Job:
    """The top with unit ``ui`` at its middle version: the curve's second point."""
    u, mid = plan.side.units[ui], plan.mids[ui]
    return ({**plan.top_map, ui: mid}, f"the top with {u.describe()} at {mid}'s version",
            _drop_record(marks, "drop-mid", u, donor=mid))


def _pooled_job(plan: _Plan, marks: dict[str, dict | None], kind: str, v: str, moved: list[int]) -> _Job:
    """The top with a kind's measured units at version ``v`` together: the kind's curve at that version."""
    versions = {ui: t for ui, t in plan.top_map.items() if ui not in moved}
    if v != BASE:  # the base's version: no entry
        versions.update(dict.fromkeys(moved, v))
    units = [unit_key(plan.side.units[ui].layer, plan.side.units[ui].group) for ui in sorted(moved)]

    def record(p: dict, t0: float) -> dict:
        top_rec = marks["top"]
        assert top_rec is not None
        rec = _panel_record("pooled", p, t0, unit_kind=kind, to=v, units=units)
        rec["dkl_se"] = _se([r["kl"] for r in p["rows"]], [r[0] for r in top_rec["rows"]])
        return rec

    where = "the base's version" if v == BASE else f"{v}'s version"
    return versions, f"the top with the {len(units)} {kind} units at {where}", record


def _group_job(plan: _Plan, marks: dict[str, dict | None], kind: str, moved: list[int]) -> _Job:
    """The top with a group of a kind's units at their drop versions together: its share of the kind's drops."""
    versions = {ui: t for ui, t in plan.top_map.items() if ui not in moved}
    versions.update({ui: plan.to[ui] for ui in moved if plan.to[ui] != BASE})
    units = [unit_key(plan.side.units[ui].layer, plan.side.units[ui].group) for ui in moved]

    def record(p: dict, t0: float) -> dict:
        top_rec = marks["top"]
        assert top_rec is not None
        rec = _panel_record("group", p, t0, unit_kind=kind, units=units, to=[plan.to[ui] for ui in moved])
        rec["dkl_se"] = _se([r["kl"] for r in p["rows"]], [r[0] for r in top_rec["rows"]])
        return rec

    layers = ",".join(str(plan.side.units[ui].layer) for ui in moved)
    return versions, f"the top with {kind} of layers {layers} at their drop versions", record


def _run(req: MeasureRequest, journal: Journal, plan: _Plan, rows: Rows, reference: dict, teacher_path: Path,
         head: dict, out: Path, started: float, weights_seconds: float, progress: Reporter) -> dict:
    side = plan.side
    units = side.units
    settings = head["settings"]
    ref = _teacher(req, journal, reference, teacher_path, settings["ctx"], settings["top_k"], progress)
    recs = journal.records
    base_rec = next((r for r in recs if r["kind"] == "base"), None)
    top_rec = next((r for r in recs if r["kind"] == "top"), None)
    done = {(r["layer"], r["group"], r["donor"]) for r in recs if r["kind"] == "result"}
    dropped = {(r["layer"], r["group"]) for r in recs if r["kind"] == "drop"}
    same = [(ui, d) for ui, d in plan.swaps if (units[ui].layer, units[ui].group, d) not in done and side.same_bytes(ui, d)]
    swaps = [(ui, d) for ui, d in plan.swaps if (units[ui].layer, units[ui].group, d) not in done and (ui, d) not in same]
    drops = [ui for ui in plan.drops if (units[ui].layer, units[ui].group) not in dropped]
    mid_done = {(r["layer"], r["group"]) for r in recs if r["kind"] == "drop-mid"}
    mids = [ui for ui in plan.drops if ui in plan.mids and (units[ui].layer, units[ui].group) not in mid_done]
    pooled_done = {(r["unit_kind"], r["to"]) for r in recs if r["kind"] == "pooled"}
    pooled = [p for p in plan.pooled if (p[0], p[1]) not in pooled_done]
    groups_done = {(r["unit_kind"], tuple(r["units"])) for r in recs if r["kind"] == "group"}
    groups = [(k, moved) for k, moved in plan.groups
              if (k, tuple(unit_key(units[ui].layer, units[ui].group) for ui in moved)) not in groups_done]
    need_top = plan.top is not None and top_rec is None
    workdir = (Path(req.workdir) if req.workdir is not None else out.parent).resolve()
    scorer: Scorer | None = None
    work: Path | None = None
    marks = {"base": base_rec, "top": top_rec}  # the panels the candidates' records are told against
    ends = [*([_mark_job("base", {}, marks)] if base_rec is None else []),
            *([_mark_job("top", plan.top_map, marks)] if need_top else [])]
    # a version's parts are laid out for the first candidate that takes it and removed after the last: the
    # pooled candidates go version by version, so that one version of every kind is laid out at a time
    jobs = [*(_swap_job(plan, marks, ui, d) for ui, d in swaps), *(_drop_job(plan, marks, ui) for ui in drops),
            *(_mid_job(plan, marks, ui) for ui in mids), *(_group_job(plan, marks, k, moved) for k, moved in groups),
            *(_pooled_job(plan, marks, *p) for p in sorted(pooled, key=lambda p: (p[1] != BASE, p[1], p[0])))]
    seq = [*ends, *jobs]
    last_use = {pair: i for i, (versions, _, _) in enumerate(seq) for pair in versions.items()}
    try:
        if seq or plan.refine:
            check_space(workdir, _space_needed(plan, seq))
            _remove_stale_work(workdir, out.name)
            work = workdir / f".{out.name}.measure-{os.getpid()}"
            shutil.rmtree(work, ignore_errors=True)
            scorer = side.scorer(ref, rows, work, req, progress)
            head = {**head, "runtime": scorer.runtime}  # after a load: what it offloaded, and where
        advance: Callable[[int], None] = lambda n: None  # noqa: E731  (the candidates' step starts after the ends)
        for i, (versions, name, record) in enumerate(seq):  # the next one loaded while this one decodes
            assert scorer is not None
            if i == len(ends):
                _same_as_base(plan, marks["base"], same, journal)
                before = len(done) + len(dropped) + len(mid_done) + len(pooled_done) + len(groups_done)
                advance = progress.step(f"{len(jobs)} candidates ({before} measured before)", len(jobs))
            t0 = time.monotonic()
            then = (seq[i + 1][0], seq[i + 1][1]) if i + 1 < len(seq) else None
            journal.add(record(scorer.score(versions, name, then), t0))
            scorer.release([pair for pair in versions.items() if last_use[pair] == i])
            if i >= len(ends):
                fault_point("candidate")
                advance(1)
        if not jobs:
            _same_as_base(plan, marks["base"], same, journal)
        if plan.refine:
            _refine(req, journal, plan, head, ref, scorer, work, progress)
    finally:
        if scorer is not None:
            scorer.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    doc = _document(plan, journal.records, head, ref)
    doc["seconds"] = round(time.monotonic() - started, 3)
    if scorer is not None:  # this run's (a resumed one's own): loading candidates, their decode, the panel
        doc["timing"] = {k: round(v, 3) for k, v in scorer.timing.items()}
        doc["timing"]["stages"] = stages(journal.records, weights_seconds)
    out_doc = _write(doc, out)
    journal.close()
    journal.path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        teacher_path.unlink()
    return out_doc


def _space_needed(plan: _Plan, seq: list[_Job]) -> int:
    """The most bytes the layout holds at once: the base's parts, and every version from the candidate before
    the first that takes it (loaded ahead while that one decodes) to the last; with ``--refine``, at least a
    round's: each unit at its largest version and two moves."""
    side = plan.side
    base = side.space_needed(())
    first: dict[tuple[int, str], int] = {}
    last: dict[tuple[int, str], int] = {}
    for i, (versions, _, _) in enumerate(seq):
        for pair in versions.items():
            first.setdefault(pair, max(0, i - 1))
            last[pair] = i
    change = [0] * (len(seq) + 1)
    largest = 0
    for pair in first:
        n = side.space_needed((pair,)) - base
        change[first[pair]] += n
        change[last[pair] + 1] -= n
        largest = max(largest, n)
    held = peak = 0
    for c in change:
        held += c
        peak = max(peak, held)
    if plan.refine:
        each = [max((side.space_needed(((ui, v),)) - base for v in vs[1:]), default=0) for ui, vs in enumerate(side.versions)]
        peak = max(peak, sum(each) + 2 * max(each, default=0))
    return base + peak


def _document(plan: _Plan, records: list[dict], head: dict, ref: Reference) -> dict:
    side, errors = plan.side, plan.errors
    units = side.units
    base_rec = next(r for r in records if r["kind"] == "base")
    doc = dict(head)
    doc["base"] = {**head["base"], "kl": base_rec["kl"], "top1": base_rec["top1"], "nll": base_rec["nll"]}
    doc["text"] = {**head["text"], "sha256": ref.text_sha256, "rows": len(ref.row_tokens), "positions": int(ref.top_ids.shape[0])}
    teacher_runs = 1 if head["reference"]["kind"] == "model" else 0
    if plan.top is None:  # swaps: every result measured
        res = {(r["layer"], r["group"], r["donor"]): r for r in records if r["kind"] == "result"}
        rows = []
        ran = []
        for ui, d in plan.swaps:
            u = units[ui]
            r = res[(u.layer, u.group, d)]
            row = _row(side, errors, ui, d, {k: r[k] for k in ("kl", "dkl", "dkl_se", "dtop1", "dnll")})
            if r.get("same_as_base"):
                row["same_as_base"] = True
            else:
                ran.append(r["seconds"])
            rows.append(row)
        doc.update({"seconds": 0.0, "seconds_per_candidate": round(statistics.mean(ran), 3) if ran else None,
                    "forward_passes": teacher_runs + 1 + len(ran), "results": rows})
        return doc
    top_rec = next(r for r in records if r["kind"] == "top")
    drops = {(r["layer"], r["group"]): r for r in records if r["kind"] == "drop"}
    mids = {(r["layer"], r["group"]): r for r in records if r["kind"] == "drop-mid"}
    measured = []
    for ui in plan.drops:
        u = units[ui]
        r = drops[(u.layer, u.group)]
        m = mids.get((u.layer, u.group)) if ui in plan.mids else None
        mid = None if m is None else {"donor": m["donor"], "eps": errors.eps[(ui, m["donor"])], "kl": m["kl"],
                                      "dkl_drop": m["kl"] - top_rec["kl"], "dkl_drop_se": m["dkl_drop_se"]}
        measured.append(measured_record(u.layer, u.group, r["kl"], r["top1"], r["nll"], top_rec["kl"], r["dkl_drop_se"],
                                        errors.eps[(ui, BASE)], errors.eps[(ui, plan.top[ui])], mid,  # type: ignore[index]
                                        to=plan.to[ui], eps_to=errors.eps[(ui, plan.to[ui])]))
    calibrate = head["settings"]["calibrate"]
    row_units = range(len(units)) if calibrate in KIND_CALIBRATIONS else plan.measured_units
    rows = [_row(side, errors, ui, d) for ui in row_units for d in side.versions[ui][1:]]
    seconds = [drops[(units[ui].layer, units[ui].group)]["seconds"] for ui in plan.drops]
    seconds += [r["seconds"] for r in mids.values()]
    pooled = [r for r in records if r["kind"] == "pooled"]
    seconds += [r["seconds"] for r in pooled]
    group_recs = {(r["unit_kind"], tuple(r["units"])): r for r in records if r["kind"] == "group"}
    groups = [group_recs[(k, tuple(unit_key(units[ui].layer, units[ui].group) for ui in moved))] for k, moved in plan.groups]
    seconds += [r["seconds"] for r in groups]
    doc.update({
        "seconds": 0.0, "seconds_per_candidate": round(statistics.mean(seconds), 3) if seconds else None,
        "forward_passes": teacher_runs + 2 + len(measured) + sum("mid" in m for m in measured) + len(pooled) + len(groups),
        "top": {"kl": top_rec["kl"], "top1": top_rec["top1"], "nll": top_rec["nll"],
                "versions": {unit_key(u.layer, u.group): plan.top[i] for i, u in enumerate(units)}},  # type: ignore[index]
        "measured": measured,
    })
    doc["results"] = rows
    if plan.groups:
        doc["groups"] = [{"kind": r["unit_kind"], "units": r["units"], "to": r["to"], "kl": r["kl"], "top1": r["top1"],
                          "nll": r["nll"], "dkl": r["kl"] - top_rec["kl"], "dkl_se": r["dkl_se"]} for r in groups]
    if plan.pooled:
        order = {(k, v): i for i, (k, v, _) in enumerate(plan.pooled)}
        doc["pooled"] = [{"kind": r["unit_kind"], "to": r["to"], "units": r["units"], "kl": r["kl"], "top1": r["top1"],
                          "nll": r["nll"], "dkl": r["kl"] - top_rec["kl"], "dkl_se": r["dkl_se"],
                          **({"alpha": True} if (r["unit_kind"], r["to"]) in plan.alpha_passes else {})}
                         for r in sorted(pooled, key=lambda r: order[(r["unit_kind"], r["to"])])]
    if plan.shard is not None:  # a part: the calibration needs every shard's drops (mosaic measure --merge)
        return doc
    doc = complete(doc)
    return _with_refinement(doc, records, head) if plan.refine else doc


def _with_refinement(doc: dict, records: list[dict], head: dict) -> dict:
    """The document with the rounds of the refinement that are complete in ``records``: every result's dkl
    scaled by its kind's ratios, the rounds themselves, and (once the refinement ended) its final plan."""
    done = {r["round"] for r in records if r["kind"] == "round-done"}
    rounds = []
    for r in records:
        if r["kind"] != "round" or r["round"] not in done:
            continue
        mv = [{k: m[k] for k in ("layer", "group", "from", "to", "kl", "dkl", "dkl_se", "predicted")}
              for m in records if m["kind"] == "move" and m["round"] == r["round"]]
        rounds.append({"round": r["round"], "versions": r["versions"], "bytes": r["bytes"], "kl": r["kl"], "top1": r["top1"],
                       "nll": r["nll"], "predicted_kl": r["predicted_kl"], "ratios": kind_ratios(mv), "moves": mv})
    scale = scales(rounds)
    doc["results"] = rescale(doc["results"], scale, doc["base"]["kl"])
    end = next((r for r in records if r["kind"] == "refined"), None)
    doc["forward_passes"] += sum(1 + len(rd["moves"]) for rd in rounds)
    doc["refinement"] = {"max_size": head["settings"]["refine"]["max_size"], "rounds": rounds,
                         "scales": {k: scale[k] for k in sorted(scale)},
                         "versions": None if end is None else end["versions"],
                         "converged": None if end is None else end["converged"]}
    return doc


def _plan_at(req: MeasureRequest, side: Side, doc: dict, work: Path) -> tuple[dict[int, str], dict]:
    """The plan ``mosaic plan --max-size`` makes of ``doc`` at the refinement's budget: ``{unit: donor}`` and
    the planner's report."""
    from mosaic._plan.gguf_planner import plan_gguf_mosaic
    from mosaic._plan.planner import PlanRequest

    path = work / "refine-measurement.json"
    atomic_write(path, dumps({k: v for k, v in doc.items() if k != "refinement"}))
    report, _, _, _ = plan_gguf_mosaic(PlanRequest(req.base, req.donors, path, max_size=req.max_size, unit=side.unit))
    index = {(u.layer, u.group): i for i, u in enumerate(side.units)}
    return plan_versions(report["chosen"], index), report


def _refine(req: MeasureRequest, journal: Journal, plan: _Plan, head: dict, ref: Reference, scorer: Scorer | None,
            work: Path | None, progress: Reporter) -> None:
    """The rounds of ``--refine``: plan from the current predictions, run the plan and one move of every measured
    unit from it (:mod:`.refine`), until the plan repeats or the rounds are spent; each run kept in the journal."""
    assert scorer is not None and work is not None
    side, units = plan.side, plan.side.units
    last: dict[int, str] | None = None
    converged = False
    for rnd in range(1, plan.refine + 1):
        doc = _document(plan, journal.records, head, ref)
        chosen, report = _plan_at(req, side, doc, work)
        if last is not None and chosen == last:
            converged = True
            break
        key = versions_key(chosen, units)
        by_unit: dict[tuple[object, object], dict[str, dict]] = {}
        for r in doc["results"]:
            by_unit.setdefault((r["layer"], r["group"]), {})[r["donor"]] = r
        done = {(m["layer"], m["group"]) for m in journal.records if m["kind"] == "move" and m["round"] == rnd}
        todo = [mv for mv in moves(chosen, plan.measured_units, side.versions, plan.errors.eps, side.dbytes)
                if (units[mv[0]].layer, units[mv[0]].group) not in done]
        cands = [_moved(chosen, ui, to) for ui, _, to in todo]
        names = [f"round {rnd}: the plan with {units[ui].describe()} at {to}'s version" for ui, _, to in todo]
        rec = next((r for r in journal.records if r["kind"] == "round" and r["round"] == rnd), None)
        if rec is None:
            t0 = time.monotonic()
            p = scorer.score(chosen, f"round {rnd}: the plan at {req.max_size:,} bytes", (cands[0], names[0]) if todo else None)
            rec = _panel_record("round", p, t0, round=rnd, versions=key, bytes=report["predicted_size"],
                                predicted_kl=doc["base"]["kl"] + report["predicted_dkl"])
            journal.add(rec)
        elif rec["versions"] != key:
            raise MosaicError(f"--resume: round {rnd} of the refinement planned another mosaic than the interrupted run; "
                              "measure again without --resume")
        advance = progress.step(f"refinement round {rnd}: {len(todo)} moves from the plan", len(todo))
        plan_kl = [row[0] for row in rec["rows"]]
        for i, (ui, here, to) in enumerate(todo):
            u = units[ui]
            t0 = time.monotonic()
            p = scorer.score(cands[i], names[i], (cands[i + 1], names[i + 1]) if i + 1 < len(todo) else None)
            c_kl = [r["kl"] for r in p["rows"]]
            journal.add({"kind": "move", "round": rnd, "layer": u.layer, "group": u.group, "from": here, "to": to,
                         "kl": p["kl"]["mean"], "dkl": p["kl"]["mean"] - rec["kl"], "dkl_se": _se(c_kl, plan_kl),
                         "predicted": predicted_move(by_unit, u.layer, u.group, here, to), "seconds": time.monotonic() - t0})
            fault_point("candidate")
            advance(1)
        if not any(r["kind"] == "round-done" and r["round"] == rnd for r in journal.records):
            journal.add({"kind": "round-done", "round": rnd})
        scorer.release({pair for c in (chosen, *cands) for pair in c.items()})  # the next round lays out its own
        last = chosen
    if not converged:
        final, _ = _plan_at(req, side, _document(plan, journal.records, head, ref), work)
        converged = final == last
        last = final
    if not any(r["kind"] == "refined" for r in journal.records):
        assert last is not None
        journal.add({"kind": "refined", "versions": versions_key(last, units), "converged": converged})


def _moved(versions: dict[int, str], ui: int, to: str) -> dict[int, str]:
    """``versions`` with unit ``ui`` at ``to``'s version (the base's: no entry)."""
    out = {x: v for x, v in versions.items() if x != ui}
    if to != BASE:
        out[ui] = to
    return out


def _write(doc: dict, out: Path) -> dict:
    errs = validation_errors(doc)
    if errs:
        raise VerificationError(f"the measurement does not match its schema: {errs[0]}")
    atomic_write(out, dumps(doc))
    fsync_dir(out.resolve().parent)  # --out is durable before its journal goes
    return doc
