"""``mosaic eval``: every candidate scored against one teacher on the same tokens, row by row.

Each row is tokenized with the model's own tokenizer (teacher and candidates must agree, token for
token) and evaluated in windows of ``ctx`` tokens, each from an empty context. With a live teacher the
KL is exact (the teacher's full distribution is at hand, a batch of positions at a time); against a saved
reference (``--reference FILE.npz``) it is the KL lower bound from the teacher's top-k. Either way the
teacher's top-k can be saved for later runs, with no candidate at all for a teacher too big to run twice.

Every model is checked by the strict GGUF reader before a runtime opens it. The models advance in lock
step, one batch of positions at a time, and log-probabilities are taken in float64 a few positions at a
time, so peak memory is the models plus O(batch × vocabulary) each, whatever ``ctx``, the rows' lengths or
their number.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mosaic._base.errors import FormatError, MosaicError, SourceError
from mosaic._base.progress import SILENT, Reporter
from mosaic._eval.backends import (
    Backend,
    Exl3Backend,
    GGUFBackend,
    GGUFCheck,
    batch_size,
    check_context,
    check_gguf,
    identity_difference,
    is_exl3_folder,
)
from mosaic._eval.panel import Scores, compare, summarize
from mosaic._eval.reference import Reference, is_reference_file, load_reference
from mosaic._eval.rowpool import RowPool
from mosaic._eval.rows import Rows, load_rows
from mosaic._eval.runtime import RuntimeInfo, default_threads
from mosaic._eval.scoring import Job, counted, positions, repeated, score
from mosaic._eval.worker import RemoteModel, get_runtime, score_in_worker

#: float32 log-probabilities of one block of positions per model (positions × vocabulary): 1 MiB each, per panel
#: thread. Small enough that a block's five arrays stay near the core's cache and a batch makes enough blocks
#: for many threads (170 positions × 49,152 tokens: 34), large enough that the Python between numpy's loops
#: (~50 µs a block, holding the GIL) is a few percent of the block's work.
CHUNK_FLOATS = 1 << 18
DEFAULT_CTX = 512
DEFAULT_TOP_K = 32


@dataclass
class EvalRequest:
    candidates: list[str]
    reference: str
    text: Path
    ctx: int | None = None
    top_k: int | None = None
    save_reference: Path | None = None
    verbose: bool = False
    runtime: str | None = None
    threads: int | None = None
    plot: Path | None = None
    gpu_layers: int | str | None = None
    per_position: bool = False


@dataclass
class _Teacher:
    """Where the teacher's numbers come from: a live model, or a saved reference."""

    name: str
    ctx: int
    k: int
    identity: dict
    row_tokens: list[list[int]]
    live: Backend | None
    saved: Reference | None

    @classmethod
    def of(cls, ref: Reference) -> _Teacher:
        return cls(ref.model, ref.ctx, ref.k, ref.tokenizer, [list(map(int, t)) for t in ref.row_tokens], None, ref)


def _model_check(path: str, ctx: int) -> GGUFCheck | None:
    p = Path(path)
    if is_exl3_folder(p):
        return None
    check = check_gguf(p)
    check_context(check, ctx, path)
    return check


def _open(path: str, check: GGUFCheck | None, ctx: int, batch: int, req: EvalRequest) -> Backend:
    if check is None:
        return Exl3Backend(Path(path), ctx, batch)
    rt = get_runtime(req.runtime, threads=req.threads, verbose=req.verbose, gpu_layers=req.gpu_layers)
    return GGUFBackend(check, path, rt, ctx, batch)


def _saved_teacher(req: EvalRequest, rows: Rows) -> _Teacher:
    saved = load_reference(req.reference)
    if saved.text_sha256 != rows.sha256:
        raise FormatError(f"{req.reference}: saved for another text (sha256 {saved.text_sha256}), not {req.text} ({rows.sha256})")
    if req.ctx is not None and req.ctx != saved.ctx:
        raise FormatError(f"{req.reference}: saved with --ctx {saved.ctx}, not {req.ctx}")
    if req.top_k is not None and req.top_k != saved.k:
        raise FormatError(f"{req.reference}: saved with --top-k {saved.k}, not {req.top_k}")
    if req.save_reference is not None:
        raise FormatError("--save-reference needs a live reference model, not a saved one")
    return _Teacher.of(saved)


def _check_tokens(c: Backend, teacher: _Teacher, rows: Rows) -> None:
    diff = identity_difference(c.tokenizer_identity(), teacher.identity)
    if diff is not None:
        raise SourceError(f"{c.name}: its tokenizer differs from the reference's: {diff}; the panel compares models on the same tokens")
    for i, text in enumerate(rows.texts):
        if c.tokenize(text) != teacher.row_tokens[i]:
            raise SourceError(f"{c.name}: row {i + 1} tokenizes differently from the reference")


#: What a runtime's record may differ in without changing its numbers beyond float noise: where it ran.
PLACE = ("threads", "gpu_layers", "offloaded", "device")


def runtime_note(saved: dict | None, used: RuntimeInfo | None) -> str | None:
    """A sentence when a saved reference was made by another runtime, or on another device, than the
    candidates ran on."""
    if used is None:
        return None
    if saved is None:
        return "the reference was saved without a record of its runtime (an earlier mosaic); the candidates ran on " + used.describe()
    now = used.as_dict()
    if any(saved.get(k) != v for k, v in now.items() if k not in PLACE):
        return (f"the reference was saved by {saved.get('name')} {saved.get('version')} (llama.cpp {saved.get('llama_cpp')}); "
                f"the candidates ran on {used.describe()}: the teacher's numbers carry that runtime's float differences")
    if "device" in saved and saved["device"] != now["device"]:  # (a record of an earlier mosaic names none)
        return (f"the reference was saved on {saved['device']}, the candidates ran on {now['device']}: the same "
                "runtime, whose numbers differ between devices by float noise")
    return None


def evaluate(req: EvalRequest, progress: Reporter = SILENT) -> dict[str, object]:
    if req.plot is not None:
        from mosaic._eval.plot import check_plot

        check_plot(req.plot)  # before any model runs
        if not req.candidates:
            raise MosaicError("--plot draws the candidates: name at least one CANDIDATE")
    rows = load_rows(req.text)
    if not req.candidates and req.save_reference is None:
        raise MosaicError("name at least one CANDIDATE, or --save-reference FILE to save the teacher's top-k alone")
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if is_reference_file(req.reference):
            teacher = _saved_teacher(req, rows)
            ctx = teacher.ctx
        else:
            ctx = req.ctx or DEFAULT_CTX
        if ctx < 2:
            raise FormatError(f"--ctx {ctx}: a window needs at least 2 tokens")
        live = not is_reference_file(req.reference)
        checks = {p: _model_check(p, ctx) for p in ([req.reference] if live else []) + list(req.candidates)}
        vocab = max((c.n_vocab or 0 for c in checks.values() if c is not None), default=0)
        batch = batch_size(ctx, vocab or 1)
        if live:
            tb = _open(req.reference, checks[req.reference], ctx, batch, req)
            stack.callback(tb.close)
            teacher = _Teacher(req.reference, ctx, req.top_k or DEFAULT_TOP_K, tb.tokenizer_identity(),
                               [tb.tokenize(t) for t in rows.texts], tb, None)
        cands: list[Backend] = []
        for c in req.candidates:
            b = _open(c, checks[c], ctx, batch, req)
            stack.callback(b.close)
            _check_tokens(b, teacher, rows)
            cands.append(b)
        checks.clear()  # every header parsed (token lists, merges: megabytes) is done with once the models are open
        used = get_runtime(req.runtime, threads=req.threads, verbose=req.verbose, gpu_layers=req.gpu_layers).info if any(
            isinstance(b, GGUFBackend) for b in [*cands, *([teacher.live] if teacher.live else [])]) else None
        loaded = time.perf_counter()
        scores, kept, spent = _score(teacher, cands, ctx, progress, len(rows.texts), keep=req.save_reference is not None,
                                     threads=req.threads)
    exact = teacher.live is not None
    repeats = repeated(teacher.row_tokens, ctx)  # a prediction several rows open with counts once
    results = [summarize(c.name, s, exact, req.per_position, repeats) for c, s in zip(cands, scores)]
    counts, once = counted(teacher.row_tokens, ctx, repeats)
    doc: dict[str, object] = {
        "reference": teacher.name,
        "reference_kind": "live (exact KL)" if exact else f"saved top-{teacher.k} (KL lower bound)",
        "text": rows.path,
        "text_sha256": rows.sha256,
        "ctx": ctx,
        "top_k": teacher.k,
        "batch": batch,
        "runtime": used.as_dict() if used else None,
        "tokens": sum(len(t) for t in teacher.row_tokens),
        "positions": counts,
        "repeated": once,
        "rows": len(rows.texts),
        "candidates": results,
        "comparisons": [compare(results[0], r) for r in results[1:]],
        # where the wall time went: opening and checking the models, waiting for their logits, the panel
        "timing": {"load": round(loaded - started, 3), "decode": round(spent["decode"], 3), "panel": round(spent["panel"], 3)},
        "notes": [],
    }
    if used is not None and used.note:
        doc["notes"].append(used.note)  # type: ignore[union-attr]
    if teacher.saved is not None:
        doc["reference_runtime"] = teacher.saved.runtime
        note = runtime_note(teacher.saved.runtime, used)
        if note:
            doc["notes"].append(note)  # type: ignore[union-attr]
    if req.save_reference is not None:
        k = teacher.k
        Reference(teacher.name, rows.sha256, teacher.identity, ctx, k, [np.asarray(t, np.int32) for t in teacher.row_tokens],
                  np.concatenate(kept[0]) if kept[0] else np.zeros((0, k), np.int32),
                  np.concatenate(kept[1]) if kept[1] else np.zeros((0, k), np.float32),
                  used.as_dict() if used else None).save(req.save_reference)
        doc["saved_reference"] = str(req.save_reference)
    if req.plot is not None:
        from mosaic._eval.plot import draw, model_bytes

        teacher_size = (teacher.name, model_bytes(Path(teacher.name))) if exact else None
        draw(req.plot, results, [model_bytes(Path(c)) for c in req.candidates], teacher_size,
             f"{len(results)} candidates against {Path(teacher.name).name}: {doc['rows']} rows, {doc['positions']:,} positions"
             f" ({'exact KL' if exact else f'top-{teacher.k} KL lower bound'})")
        doc["plot"] = str(req.plot)
    return doc


def score_against(ref: Reference, cands: list[Backend], progress: Reporter = SILENT,
                  timing: dict[str, float] | None = None) -> list[dict[str, object]]:
    """Each candidate scored against a saved reference as ``mosaic eval`` scores it (the KL lower bound),
    the candidates already known to tokenize as the reference did; their panels (``summarize``). ``timing``
    (``decode``, ``panel`` seconds) is added to where given."""
    scores, _, spent = _score(_Teacher.of(ref), cands, ref.ctx, progress, len(ref.row_tokens))
    if timing is not None:
        for k, v in spent.items():
            timing[k] = timing.get(k, 0.0) + v
    repeats = repeated(ref.row_tokens, ref.ctx)  # counted once, as ``mosaic eval`` counts them
    return [summarize(c.name, s, False, repeats=repeats) for c, s in zip(cands, scores)]


def check_tokens(c: Backend, ref: Reference, rows: Rows) -> None:
    """``c`` tokenizes every row as the reference did (its tokenizer's identity first)."""
    _check_tokens(c, _Teacher.of(ref), rows)


def _remote(b: Backend) -> RemoteModel | None:
    m = getattr(b, "loaded", None)
    return m if isinstance(m, RemoteModel) else None


def _score(teacher: _Teacher, cands: list[Backend], ctx: int, progress: Reporter, n_rows: int,
           keep: bool = False, threads: int | None = None
           ) -> tuple[list[Scores], tuple[list[np.ndarray], list[np.ndarray]], dict[str, float]]:
    """Every candidate's per-position scores; with ``keep``, the live teacher's top-k of every position. GGUF
    models are scored in their llama.cpp worker, where their logits are (on the worker's own panel threads);
    EXL3 models here, on ``threads`` panel threads (default: every core) for this one panel."""
    what = f"{n_rows} rows, {len(cands)} candidate(s)" if cands else f"{n_rows} rows, the teacher alone"
    advance = progress.step(f"{what} against {teacher.name}", positions(teacher.row_tokens, ctx))
    saved = teacher.saved
    job = Job(teacher.row_tokens, ctx, teacher.k, CHUNK_FLOATS, keep,
              saved.top_ids if saved is not None else None, saved.top_lp if saved is not None else None)
    live = _remote(teacher.live) if teacher.live else None
    remote = [r for r in map(_remote, cands) if r is not None]
    if len(remote) == len(cands) and (live is not None) == (teacher.live is not None):
        out = score_in_worker(job, live, remote, advance)
    else:
        with RowPool(threads or default_threads()) as pool:
            out = score(job, teacher.live, cands, advance, pool)
    return out.scores, (out.kept_ids, out.kept_lp), {"decode": out.decode_seconds, "panel": out.panel_seconds}
