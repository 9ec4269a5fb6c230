"""``mosaic measure``: what each unit of a model buys from each donor, by one of three methods.

- ``top-down`` (the default): the weight errors of every unit at every version (:mod:`.weights`, from the
  files), then the *top* model — every unit of the kind at its lowest-error version — and from it the passes
  that calibrate how much the model feels each unit's error (:mod:`.calibrate`): over a ladder, each kind's units
  moved together to each of their versions; elsewhere one drop per unit. Every (unit, donor) result is predicted
  from them.
- ``weights``: the weight errors alone, nothing runs (``dkl`` is a weight error, not nats).
- ``swaps``: every candidate "base + that one unit from that donor" run and measured (the v1 measurement).

The stages, each a module: the request and its refusals (:mod:`.request`, its open flags set by
:mod:`.defaults`), the sources and their weight errors (:mod:`.sides`, :mod:`.weights`), the schedule of passes
(:mod:`.schedule`), their execution (:mod:`.passes`, each result durable in the journal, :mod:`.journal`) and the
document (:mod:`.document`). This module runs them in order. The teacher runs exactly once (its top-k kept, as
``mosaic eval --save-reference`` keeps it); ``--out`` is written only when every candidate has run. ``--shard
K/N`` runs every N-th candidate; :mod:`.shards` joins the parts into the document one run would have written.
Sources' digests come from the digest cache (or the hub's digests that ``mosaic fetch`` verified) and are hashed
only when neither knows them.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from mosaic._base.errors import MosaicError, OutputError
from mosaic._base.hashing import digest_file
from mosaic._base.lock import output_lock
from mosaic._base.progress import SILENT, Reporter
from mosaic._base.version import __version__
from mosaic._eval.reference import is_reference_file, load_reference
from mosaic._eval.rows import load_rows
from mosaic._eval.run import DEFAULT_CTX, DEFAULT_TOP_K, runtime_note
from mosaic._eval.runtime import default_threads
from mosaic._eval.worker import get_runtime
from mosaic._formats import ggml_dequant
from mosaic._measure.calibrate import predicted, unit_key
from mosaic._measure.defaults import resolved
from mosaic._measure.document import head as document_head
from mosaic._measure.document import row, write
from mosaic._measure.importance import CAP, load_importance
from mosaic._measure.journal import Journal, journal_path, stages
from mosaic._measure.passes import run
from mosaic._measure.request import MeasureRequest, check_request
from mosaic._measure.schedule import Schedule, measured_units
from mosaic._measure.shards import Shard
from mosaic._measure.sides import Side, exl3_side, gguf_side
from mosaic._sources.gguf import is_gguf_src

__all__ = ["MeasureRequest", "measure"]


def _sha256(path: Path) -> str:
    return digest_file(path).sha256


def measure(req: MeasureRequest, progress: Reporter = SILENT) -> dict:
    """Measure, holding ``<out>.lock`` throughout: taken before ``--out``, its journal or the teacher's top-k are
    looked at, so that a second measurement of the same ``--out`` (``--force`` and ``--resume`` included) is
    refused before it could delete or append to this one's journal."""
    started = time.monotonic()
    given, req = req, resolved(req)
    shard = check_request(req, given)
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
    if gguf:
        ggml_dequant.mode()  # a bad $MOSAIC_DEQUANTIZE is refused before anything is read
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
    measured = measured_units(side, req.calibrate, req.only_layers)

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
    decoded = ggml_dequant.record(errors.types) if gguf else None
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
    plan = Schedule(side, errors, req.method, measured, shard, req.refine, req.curve, req.calibrate)
    if shard is not None:
        settings["shard"] = {"k": shard.k, "n": shard.n, "units": [unit_key(side.units[u].layer, side.units[u].group)
                                                                    for u in measured]}
    head = document_head(req, side, reference, rows, settings)
    if decoded is not None:
        head["dequantizer"] = decoded
    if req.method == "weights":
        rows = [row(side, errors, ui, d) for ui in side.selected for d in side.versions[ui][1:]]
        if weights_note:
            head["notes"] = [weights_note]
        doc = {**head, "runtime": None, "seconds": round(time.monotonic() - started, 3), "seconds_per_candidate": None,
               "forward_passes": 0, "results": [{**r, **predicted(None, r["eps_base"], r["eps"], None)} for r in rows],
               "timing": {"load": 0, "decode": 0, "panel": 0, "stages": stages([], weights_seconds)}}
        return write(doc, out)
    runtime = side.runtime()
    fingerprint = {"format": side.format, "base": side.base_files, "donors": side.donor_files,
                   "text": rows.sha256 if rows is not None else None,
                   "reference": {key: v for key, v in (reference or {}).items() if key != "source"},
                   "settings": settings, "runtime": runtime, "tool": __version__,
                   "positions": "a context once"}  # a journal that counted a repeated context each time is refused
    if req.force:
        jpath.unlink(missing_ok=True)
        teacher_path.unlink(missing_ok=True)
    journal = Journal.resume(jpath, fingerprint) if req.resume else Journal.start(jpath, fingerprint)
    try:
        assert rows is not None and reference is not None
        notes = _runtime_notes(req, side, reference, decoded) + ([weights_note] if weights_note else [])
        doc = run(req, journal, plan, rows, reference, teacher_path,
                  {**head, "runtime": runtime, **({"notes": notes} if notes else {})}, out, weights_seconds, progress)
        doc["seconds"] = round(time.monotonic() - started, 3)
        out_doc = write(doc, out)
    finally:
        journal.close()
    journal.path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        teacher_path.unlink()
    return out_doc


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


#: What the slower setup cost on the bench's Qwen2.5-Coder-1.5B (bench/RESULTS.md, "Measure on the compiled
#: binding"): the same measurement on the prebuilt cyllama against llama-cpp-python compiled for the machine.
SLOWER = 4.5


def _runtime_notes(req: MeasureRequest, side: Side, reference: dict | None, decoded: dict | None = None) -> list[str]:
    """What the document says of where it ran: a GPU asked for and not found, a saved teacher made by another
    runtime or on another device, and a run on the slower setup (the prebuilt binding, gguf-py's decoding) where
    the faster one is not installed, with how to get it."""
    if side.format != "gguf":
        return []
    from mosaic._eval.runtime import available

    info = get_runtime(threads=req.threads, verbose=req.verbose, gpu_layers=req.gpu_layers).info
    notes = [info.note] if info.note else []
    if reference is not None and reference["kind"] == "saved":
        note = runtime_note(reference.get("runtime"), info)
        if note:
            notes.append(note)
    slow_decode = sorted(t for t, how in (decoded or {}).get("types", {}).items() if how == "gguf-py")
    if info.name == "cyllama" and "llama-cpp-python" not in available():
        notes.append(f"the forward passes ran on cyllama, the prebuilt runtime, and the weight errors were decoded by "
                     f"gguf-py: on Qwen2.5-Coder-1.5B that measurement took {SLOWER:g} x as long as on llama-cpp-python "
                     "compiled for this machine, which mosaic uses where it is installed (make llama-tools compiles it "
                     "into the project's .venv; elsewhere: pip install llama-cpp-python)")
    elif slow_decode and (decoded or {}).get("mode") == "auto":
        notes.append(f"{', '.join(slow_decode)}: decoded by gguf-py, not ggml's C ("
                     + ("the C did not match gguf-py" if decoded and decoded.get("library") else
                        "no compiled llama-cpp-python with ggml's base library here: make llama-tools") + ")")
    return notes
