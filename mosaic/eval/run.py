"""``mosaic eval``: every candidate scored against one teacher on the same tokens, row by row.

Each row is tokenized with the model's own tokenizer (teacher and candidates must agree, token for
token) and evaluated in windows of ``ctx`` tokens, each from an empty context. With a live teacher the
KL is exact (the teacher's full distribution is at hand, window by window); against a saved reference
(``--reference FILE.npz``) it is the KL lower bound from the teacher's top-k. Either way the teacher's
top-k can be saved for later runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mosaic.errors import FormatError, SourceError
from mosaic.eval.backends import Backend, open_backend
from mosaic.eval.panel import (
    Scores,
    compare,
    kl_exact,
    kl_lower_bound,
    log_softmax,
    position_scores,
    summarize,
    top_k,
)
from mosaic.eval.reference import Reference, is_reference_file, load_reference
from mosaic.eval.rows import load_rows
from mosaic.progress import SILENT, Reporter

#: Positions turned into float64 log-probabilities at a time (bounds memory at large vocabularies).
CHUNK = 64
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


def windows(tokens: list[int] | np.ndarray, ctx: int) -> list[list[int]]:
    """Consecutive windows of at most ``ctx`` tokens; a window of one token predicts nothing and is dropped."""
    out = [list(map(int, tokens[i:i + ctx])) for i in range(0, len(tokens), ctx)]
    return [w for w in out if len(w) > 1]


def _logprob_chunks(logits: np.ndarray) -> list[np.ndarray]:
    return [log_softmax(logits[i:i + CHUNK]) for i in range(0, logits.shape[0], CHUNK)]


def evaluate(req: EvalRequest, progress: Reporter = SILENT) -> dict[str, object]:
    rows = load_rows(req.text)
    saved: Reference | None = None
    teacher: Backend | None = None
    if is_reference_file(req.reference):
        saved = load_reference(req.reference)
        if saved.text_sha256 != rows.sha256:
            raise FormatError(f"{req.reference}: saved for another text (sha256 {saved.text_sha256}), not {req.text} ({rows.sha256})")
        if req.ctx is not None and req.ctx != saved.ctx:
            raise FormatError(f"{req.reference}: saved with --ctx {saved.ctx}, not {req.ctx}")
        if req.top_k is not None and req.top_k != saved.k:
            raise FormatError(f"{req.reference}: saved with --top-k {saved.k}, not {req.top_k}")
        ctx, k = saved.ctx, saved.k
        identity = saved.tokenizer
        row_tokens = [list(map(int, t)) for t in saved.row_tokens]
        ref_name = saved.model
    else:
        ctx, k = req.ctx or DEFAULT_CTX, req.top_k or DEFAULT_TOP_K
        teacher = open_backend(req.reference, ctx)
        identity = teacher.tokenizer_identity()
        row_tokens = [teacher.tokenize(t) for t in rows.texts]
        ref_name = req.reference
    if ctx < 2:
        raise FormatError(f"--ctx {ctx}: a window needs at least 2 tokens")
    cands = [open_backend(c, ctx) for c in req.candidates]
    for c in cands:
        ident = c.tokenizer_identity()
        if ident != identity:
            raise SourceError(f"{c.name}: its tokenizer differs from the reference's ({ident} vs {identity}); "
                              "the panel compares models on the same tokens")
        for i, text in enumerate(rows.texts):
            if c.tokenize(text) != row_tokens[i]:
                raise SourceError(f"{c.name}: row {i + 1} tokenizes differently from the reference")

    work = sum(len(w) for t in row_tokens for w in windows(t, ctx))
    advance = progress.step(f"{len(rows.texts)} rows, {len(cands)} candidate(s) against {ref_name}", work)
    scores = [Scores([], [], []) for _ in cands]
    kept_ids: list[np.ndarray] = []
    kept_lp: list[np.ndarray] = []
    pos = 0
    for toks in row_tokens:
        row = [([], [], []) for _ in cands]  # type: list[tuple[list, list, list]]
        for w in windows(toks, ctx):
            n = len(w) - 1
            nxt = np.asarray(w[1:])
            if teacher is not None:
                t_chunks = _logprob_chunks(teacher.logits(w)[:n])
                tk = [top_k(c, k) for c in t_chunks]
                ids = np.concatenate([a for a, _ in tk])
                lps = np.concatenate([b for _, b in tk])
            else:
                assert saved is not None
                ids, lps = saved.top_ids[pos:pos + n], saved.top_lp[pos:pos + n]
                if ids.shape[0] != n:
                    raise FormatError(f"{req.reference}: fewer positions than the text needs; saved for another --ctx?")
            kept_ids.append(ids)
            kept_lp.append(lps)
            for ci, c in enumerate(cands):
                for ch, c_lp in enumerate(_logprob_chunks(c.logits(w)[:n])):
                    a = ch * CHUNK
                    if teacher is not None:
                        kl = kl_exact(t_chunks[ch], c_lp)
                    else:
                        kl = kl_lower_bound(ids[a:a + CHUNK], lps[a:a + CHUNK], c_lp)
                    agree, kl, nll = position_scores(ids[a:a + CHUNK, 0], kl, c_lp, nxt[a:a + CHUNK])
                    row[ci][0].append(agree)
                    row[ci][1].append(kl)
                    row[ci][2].append(nll)
            pos += n
            advance(len(w))
        for ci in range(len(cands)):
            for j, part in enumerate(row[ci]):
                target = (scores[ci].top1, scores[ci].kl, scores[ci].nll)[j]
                target.append(np.concatenate(part) if part else np.zeros(0))
    exact = teacher is not None
    results = [summarize(c.name, s, exact) for c, s in zip(cands, scores)]
    if req.save_reference is not None:
        if teacher is None:
            raise FormatError("--save-reference needs a live reference model, not a saved one")
        Reference(ref_name, rows.sha256, identity, ctx, k, [np.asarray(t, np.int32) for t in row_tokens],
                  np.concatenate(kept_ids) if kept_ids else np.zeros((0, k), np.int32),
                  np.concatenate(kept_lp) if kept_lp else np.zeros((0, k), np.float32)).save(req.save_reference)
    return {
        "reference": ref_name,
        "reference_kind": "live (exact KL)" if exact else f"saved top-{k} (KL lower bound)",
        "text": rows.path,
        "text_sha256": rows.sha256,
        "ctx": ctx,
        "top_k": k,
        "tokens": sum(len(t) for t in row_tokens),
        "positions": pos,
        "rows": len(rows.texts),
        "candidates": results,
        "comparisons": [compare(results[0], r) for r in results[1:]],
    }

