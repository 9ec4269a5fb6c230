"""``mosaic measure``: every unit of the selected layers × every donor that has it, scored on the model.

The teacher runs exactly once (its top-k kept, as ``mosaic eval --save-reference`` keeps it), the base once,
then each candidate "base + that one unit from that donor" against the teacher's top-k, on the rows of the
text, as ``mosaic eval`` scores a model against a saved reference. A unit whose donor bytes equal the base's
is not run. Each result is made durable as it finishes (:mod:`.journal`); ``--out`` is written only when
every candidate has run. Sources' digests come from the digest cache (or the hub's digests that
``mosaic fetch`` verified) and are hashed only when neither knows them.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import MosaicError, OutputError, VerificationError
from mosaic._base.faults import point as fault_point
from mosaic._base.hashing import digest_file
from mosaic._base.progress import SILENT, Reporter
from mosaic._base.version import __version__
from mosaic._build.run import fsync_dir
from mosaic._eval.reference import Reference, is_reference_file, load_reference
from mosaic._eval.rows import Rows, load_rows
from mosaic._eval.run import DEFAULT_CTX, DEFAULT_TOP_K, EvalRequest, evaluate
from mosaic._hub.partial import atomic_write
from mosaic._measure.backends import Scorer
from mosaic._measure.journal import Journal, journal_path
from mosaic._measure.parts import check_space
from mosaic._measure.sides import Side, exl3_side, gguf_side
from mosaic._plan.gguf_units import Unit
from mosaic._plan.measurement import SCHEMA_ID, dumps, validation_errors
from mosaic._sources.gguf import is_gguf_src


@dataclass
class MeasureRequest:
    base: str
    donors: list[tuple[str, str]]
    reference: str
    text: Path
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


def measure(req: MeasureRequest, progress: Reporter = SILENT) -> dict:
    started = time.monotonic()
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
    if not req.donors:
        raise MosaicError("give at least one --donor ID=SRC")
    ids = [d for d, _ in req.donors]
    if len(set(ids)) != len(ids):
        raise MosaicError(f"--donor {next(d for d in ids if ids.count(d) > 1)}: given twice")

    rows = load_rows(req.text)  # cheap checks first: the side hashes the sources
    side = gguf_side(req, progress) if is_gguf_src(req.base) else exl3_side(req, progress)
    only = side.layers

    saved = is_reference_file(req.reference)
    if saved:
        ref0 = load_reference(req.reference)
        if ref0.text_sha256 != rows.sha256:
            raise MosaicError(f"{req.reference}: saved for another text (sha256 {ref0.text_sha256}), not {req.text}")
        for flag, mine, theirs in (("--ctx", req.ctx, ref0.ctx), ("--top-k", req.top_k, ref0.k)):
            if mine is not None and mine != theirs:
                raise MosaicError(f"{req.reference}: saved with {flag} {theirs}, not {mine}")
        ctx, k = ref0.ctx, ref0.k
        reference = {"source": req.reference, "kind": "saved", "model": ref0.model, "sha256": _sha256(Path(req.reference)),
                     "runtime": ref0.runtime}
    else:
        ctx, k = req.ctx or DEFAULT_CTX, req.top_k or DEFAULT_TOP_K
        reference = {"source": req.reference, "kind": "model", "model": req.reference,
                     "files": side.reference_files(req.reference, progress)}
    runtime = side.runtime
    base_files, donor_files = side.base_files, side.donor_files
    runs = side.runs
    if not runs:
        raise MosaicError("no donor has any unit of the selected layers")
    layers = sorted(only) if only is not None else None
    settings = {"unit": side.unit, "ctx": ctx, "top_k": k, "layers": layers, "kl": {"kind": "top-k lower bound", "k": k}}
    fingerprint = {"format": side.format, "base": base_files, "donors": donor_files, "text": rows.sha256,
                   "reference": {key: v for key, v in reference.items() if key != "source"},
                   "settings": settings, "runtime": runtime, "tool": __version__}
    if req.force:
        jpath.unlink(missing_ok=True)
        teacher_path.unlink(missing_ok=True)
    journal = Journal.resume(jpath, fingerprint) if req.resume else Journal.start(jpath, fingerprint)
    try:
        return _run(req, journal, side, rows, reference, teacher_path, settings, out, started, progress)
    finally:
        journal.close()


def _teacher(req: MeasureRequest, journal: Journal, reference: dict, teacher_path: Path, ctx: int, k: int,
             progress: Reporter) -> Reference:
    if reference["kind"] == "saved":
        return load_reference(req.reference)
    done = [r for r in journal.records if r["kind"] == "teacher"]
    if done and teacher_path.is_file() and _sha256(teacher_path) == done[0]["sha256"]:
        return load_reference(teacher_path)
    if done:
        raise MosaicError(f"--resume: the teacher's saved top-k {teacher_path} is missing or changed; measure again without --resume")
    tmp = teacher_path.with_name(teacher_path.name + ".tmp.npz")
    evaluate(EvalRequest([], req.reference, req.text, ctx, k, save_reference=tmp, threads=req.threads, verbose=req.verbose),
             progress)
    with open(tmp, "rb") as f:  # durable before the journal names it
        os.fsync(f.fileno())
    os.replace(tmp, teacher_path)
    fsync_dir(teacher_path.parent)
    journal.add({"kind": "teacher", "sha256": _sha256(teacher_path)})
    return load_reference(teacher_path)


def _run(req: MeasureRequest, journal: Journal, side: Side, rows: Rows, reference: dict, teacher_path: Path,
         settings: dict, out: Path, started: float, progress: Reporter) -> dict:
    units, runs = side.units, side.runs
    ref = _teacher(req, journal, reference, teacher_path, settings["ctx"], settings["top_k"], progress)
    done = {(r["layer"], r["group"], r["donor"]): r for r in journal.records if r["kind"] == "result"}
    same = [(ui, d) for ui, d in runs if (units[ui].layer, units[ui].group, d) not in done and side.same_bytes(ui, d)]
    todo = [(ui, d) for ui, d in runs if (units[ui].layer, units[ui].group, d) not in done and (ui, d) not in same]
    base_rec = next((r for r in journal.records if r["kind"] == "base"), None)
    workdir = (Path(req.workdir) if req.workdir is not None else out.parent).resolve()
    scorer: Scorer | None = None
    work: Path | None = None
    try:
        if todo or base_rec is None:
            check_space(workdir, side.space_needed(todo))
            _remove_stale_work(workdir, out.name)
            work = workdir / f".{out.name}.measure-{os.getpid()}"
            shutil.rmtree(work, ignore_errors=True)
            scorer = side.scorer(todo, ref, rows, work, req, progress)
        if base_rec is None:
            assert scorer is not None
            t0 = time.monotonic()
            p = scorer.base()
            base_rec = {"kind": "base", "kl": p["kl"]["mean"], "top1": p["top1"], "nll": p["nll"],
                        "rows": [[r["kl"], r["top1"], r["nll"]] for r in p["rows"]], "seconds": time.monotonic() - t0}
            journal.add(base_rec)
        b_rows = list(zip(*base_rec["rows"])) if base_rec["rows"] else ([], [], [])
        for ui, d in same:
            u = units[ui]
            journal.add({"kind": "result", "layer": u.layer, "group": u.group, "donor": d, "dbytes": side.dbytes[(ui, d)],
                         "kl": base_rec["kl"], "dkl": 0.0, "dkl_se": 0.0, "dtop1": 0.0, "dnll": 0.0, "same_as_base": True,
                         "seconds": 0.0})
        advance = progress.step(f"{len(todo)} candidates ({len(done)} measured before)", len(todo))
        for ui, d in todo:
            assert scorer is not None
            u = units[ui]
            t0 = time.monotonic()
            p = scorer.candidate(ui, d)
            c_kl = [r["kl"] for r in p["rows"]]
            journal.add({"kind": "result", "layer": u.layer, "group": u.group, "donor": d, "dbytes": side.dbytes[(ui, d)],
                         "kl": p["kl"]["mean"], "dkl": p["kl"]["mean"] - base_rec["kl"], "dkl_se": _se(c_kl, list(b_rows[0])),
                         "dtop1": p["top1"] - base_rec["top1"], "dnll": p["nll"] - base_rec["nll"],
                         "seconds": time.monotonic() - t0})
            fault_point("candidate")
            advance(1)
    finally:
        if scorer is not None:
            scorer.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    results = {(r["layer"], r["group"], r["donor"]): r for r in journal.records if r["kind"] == "result"}
    order = [(units[ui].layer, units[ui].group, d) for ui, d in runs]
    cand_seconds = [results[key]["seconds"] for key in order if not results[key].get("same_as_base")]
    doc = {
        "schema": SCHEMA_ID,
        "tool": {"name": "mosaic", "version": __version__},
        "format": side.format,
        "base": {"source": req.base, "files": side.base_files, "bytes": side.base_bytes, "kl": base_rec["kl"],
                 "top1": base_rec["top1"], "nll": base_rec["nll"]},
        "donors": {d: {"source": src, "files": side.donor_files[d]} for d, src in req.donors},
        "reference": reference,
        "text": {"file": str(req.text), "sha256": ref.text_sha256, "rows": len(ref.row_tokens),
                 "positions": int(ref.top_ids.shape[0])},
        "settings": settings,
        "runtime": side.runtime,
        "seconds": round(time.monotonic() - started, 3),
        "seconds_per_candidate": round(statistics.mean(cand_seconds), 3) if cand_seconds else None,
        "results": [_result(results[key], units[ui]) for key, (ui, _) in zip(order, runs)],
    }
    errs = validation_errors(doc)
    if errs:
        raise VerificationError(f"the measurement does not match its schema: {errs[0]}")
    atomic_write(out, dumps(doc))
    fsync_dir(out.resolve().parent)  # --out is durable before its journal goes
    journal.close()
    journal.path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        teacher_path.unlink()
    return doc


def _result(rec: dict, unit: Unit) -> dict:
    keys = ("layer", "group", "donor", "dbytes", "kl", "dkl", "dkl_se", "dtop1", "dnll")
    out = {k: rec[k] for k in keys}
    out["tensors"] = list(unit.tensors)
    if rec.get("same_as_base"):
        out["same_as_base"] = True
    return out
