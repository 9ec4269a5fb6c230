"""The panel's loop: every candidate against one teacher, window by window, the models in lock step.

It runs where the logits are: in the llama.cpp worker process for GGUF models (:mod:`.worker_main`), so a
batch of logits is never copied between processes, and in mosaic's own process for EXL3 models on a GPU. The
teacher is a live model (the exact KL) or a saved top-k (the KL lower bound); each batch of positions is cut
into blocks of ``chunk`` floats' worth of rows (:mod:`.panel`), scored on a pool of threads (:mod:`.rowpool`,
as many as the decode's ``--threads``: decode and panel take turns, so the panel uses the cores the decode
just used). The panel's temporaries are five arrays of ``chunk`` floats per thread at work (no more threads
work than a batch has blocks), whatever the window, the row or the text, and the numbers do not depend on the
thread count: the blocks are the same at any count and gathered in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np

from mosaic._base.errors import FormatError, MosaicError
from mosaic._eval.panel import LogProbs, Scores, kl_exact, kl_lower_bound, log_probs, position_scores, top_k
from mosaic._eval.rowpool import RowPool, Scratch


class Decoder(Protocol):
    """What the loop needs of a model: its vocabulary and a window's logits a batch at a time."""

    n_vocab: int

    def window(self, tokens: list[int]) -> Iterator[np.ndarray]: ...


def windows(tokens: Sequence[int] | np.ndarray, ctx: int) -> list[list[int]]:
    """Consecutive windows of at most ``ctx`` tokens; a window of one token predicts nothing and is dropped."""
    out = [list(map(int, tokens[i:i + ctx])) for i in range(0, len(tokens), ctx)]
    return [w for w in out if len(w) > 1]


def positions(row_tokens: Sequence[Sequence[int]], ctx: int) -> int:
    return sum(len(w) - 1 for t in row_tokens for w in windows(t, ctx))


def repeated(row_tokens: Sequence[Sequence[int]], ctx: int) -> list[np.ndarray]:
    """Per row, over its positions in scoring order: whether the position's context (its window up to it) is one
    an earlier position already had. Rows that open alike ("The …") predict their second token from the same
    context, so every model scores it the same each time: a panel that counted it once per row would weigh one
    prediction by how many rows share an opening, and its tail (a p99 of a few thousand positions) can land on
    that one value. Contexts are walked in a trie of the windows' tokens: memory is the tokens', time linear."""
    root: dict[int, dict] = {}
    out = []
    for t in row_tokens:
        marks: list[bool] = []
        for w in windows(t, ctx):
            node = root
            for tok in w[:-1]:
                nxt = node.get(tok)
                marks.append(nxt is not None)
                if nxt is None:
                    nxt = node[tok] = {}
                node = nxt
        out.append(np.array(marks, dtype=bool))
    return out


def counted(row_tokens: Sequence[Sequence[int]], ctx: int, repeats: list[np.ndarray] | None = None) -> tuple[int, int]:
    """The positions a panel counts and the repeated ones it leaves out, as every document reports them (from
    ``repeats`` where the caller has walked them already)."""
    once = sum(int(m.sum()) for m in (repeated(row_tokens, ctx) if repeats is None else repeats))
    return positions(row_tokens, ctx) - once, once


@dataclass
class Job:
    """One scoring: the rows' tokens, the teacher (``live``, or a saved top-k) and what to keep."""

    row_tokens: list[list[int]]
    ctx: int
    k: int
    chunk: int  # positions × vocabulary floats scored at a time
    keep: bool = False  # keep the live teacher's top-k of every position
    saved_ids: np.ndarray | None = None  # [positions, k] of a saved teacher
    saved_lp: np.ndarray | None = None


@dataclass
class Outcome:
    scores: list[Scores]
    kept_ids: list[np.ndarray] = field(default_factory=list)
    kept_lp: list[np.ndarray] = field(default_factory=list)
    #: wall seconds spent waiting for the models' logits (the decode) and scoring them (the panel)
    decode_seconds: float = 0.0
    panel_seconds: float = 0.0


@dataclass
class _Block:
    """One block of rows scored: the live teacher's kept top-k (with ``Job.keep``), each candidate's scores."""

    kept: tuple[np.ndarray, np.ndarray] | None
    cands: list[tuple[np.ndarray, np.ndarray, np.ndarray]]


def _score_block(job: Job, teacher: np.ndarray | None, saved: tuple[np.ndarray, np.ndarray] | None,
                 cands: Sequence[np.ndarray], nxt: np.ndarray, scratch: Scratch) -> _Block:
    """The panel of one block of rows, every model's walks over the vocabulary in the thread's own scratch:
    the teacher's log-probabilities are kept while each candidate's are made, compared and dropped."""
    t_lp: LogProbs | None = None
    kept = None
    if teacher is not None:
        t_lp = log_probs(teacher, scratch, "teacher.")
        if job.keep:
            ids, lps = top_k(t_lp, job.k)
            kept = (ids, lps)
        else:  # only the teacher's top-1 is scored: the first maximum is top_k's first, ties included
            ids = t_lp.top1[:, None]
    else:
        assert saved is not None
        ids, lps = saved
    if cands and int(ids.max(initial=0)) >= cands[0].shape[1]:
        raise FormatError("the saved reference names tokens beyond the candidates' vocabulary")
    got = []
    for cp in cands:
        c_lp = log_probs(cp, scratch, "cand.")
        if t_lp is not None:
            kl = kl_exact(t_lp, c_lp, scratch.array("kl", c_lp.lp.shape))
        else:
            kl = kl_lower_bound(ids, lps, c_lp)
        got.append(position_scores(ids[:, 0], kl, c_lp, nxt))
    return _Block(kept, got)


def _score_at(job: Job, teacher: np.ndarray | None, cands: Sequence[np.ndarray],
              saved: tuple[np.ndarray, np.ndarray] | None, nxt: np.ndarray, bounds: Sequence[tuple[int, int]],
              i: int, scratch: Scratch) -> _Block:
    """Block ``i`` (rows ``bounds[i]``) of a batch: what :meth:`RowPool.map` runs."""
    a, b = bounds[i]
    return _score_block(job, teacher[a:b] if teacher is not None else None,
                        (saved[0][a:b], saved[1][a:b]) if saved is not None else None,
                        [cp[a:b] for cp in cands], nxt[a:b], scratch)


def score(job: Job, live: Decoder | None, cands: Sequence[Decoder], advance: Callable[[int], None],
          pool: RowPool | None = None) -> Outcome:
    """Every candidate's per-position scores; with ``job.keep``, the live teacher's top-k of every position.
    Each batch is cut into blocks of ``job.chunk`` floats' worth of rows, whatever the threads, and the blocks
    are scored on ``pool`` (the caller's thread without one) and gathered in order: the numbers are the same at
    any thread count."""
    pool = pool or RowPool(1)
    scores = [Scores([], [], []) for _ in cands]
    out = Outcome(scores)
    models: list[Decoder] = ([live] if live is not None else []) + list(cands)
    vocab = max(m.n_vocab for m in models)
    chunk = max(1, job.chunk // vocab)
    pos = 0
    for toks in job.row_tokens:
        parts: list[tuple[list, list, list]] = [([], [], []) for _ in cands]
        for w in windows(toks, job.ctx):
            n = len(w) - 1
            nxt = np.asarray(w[1:])
            # the last token predicts nothing scored: positions 0..n-1 are decoded, in lock step
            streams: list[Iterator[np.ndarray]] = [m.window(w[:-1]) for m in models]
            off = 0
            batches = zip(*streams)
            while True:
                t0 = time.perf_counter()
                pieces = next(batches, None)
                out.decode_seconds += time.perf_counter() - t0
                if pieces is None:
                    break
                m_ = pieces[0].shape[0]
                if any(p.shape[0] != m_ for p in pieces):
                    raise MosaicError("the models handed back batches of different sizes")
                saved: tuple[np.ndarray, np.ndarray] | None = None
                if live is None:
                    assert job.saved_ids is not None and job.saved_lp is not None
                    saved = (job.saved_ids[pos + off:pos + off + m_], job.saved_lp[pos + off:pos + off + m_])
                    if saved[0].shape[0] != m_:
                        raise FormatError("the saved reference holds fewer positions than the text needs; saved for another --ctx?")
                teacher, cand_pieces = (pieces[0], pieces[1:]) if live is not None else (None, pieces)
                bounds = [(a, min(a + chunk, m_)) for a in range(0, m_, chunk)]
                score_one = partial(_score_at, job, teacher, cand_pieces, saved, nxt[off:off + m_], bounds)
                t0 = time.perf_counter()
                for blk in pool.map(score_one, len(bounds)):
                    if blk.kept is not None:
                        out.kept_ids.append(blk.kept[0])
                        out.kept_lp.append(blk.kept[1])
                    for ci, (agree, kl, nll) in enumerate(blk.cands):
                        parts[ci][0].append(agree)
                        parts[ci][1].append(kl)
                        parts[ci][2].append(nll)
                out.panel_seconds += time.perf_counter() - t0
                off += m_
                advance(m_)
            if off != n:
                raise MosaicError(f"a model handed back {off} positions of a window of {n}")
            pos += n
        for ci in range(len(cands)):
            for j, target in enumerate((scores[ci].top1, scores[ci].kl, scores[ci].nll)):
                target.append(np.concatenate(parts[ci][j]) if parts[ci][j] else np.zeros(0))
    if job.saved_ids is not None and pos != job.saved_ids.shape[0]:
        raise FormatError(f"the saved reference holds {job.saved_ids.shape[0]} positions, the text {pos}; saved for another --ctx?")
    return out
