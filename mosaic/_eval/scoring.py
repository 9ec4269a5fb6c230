"""The panel's loop: every candidate against one teacher, window by window, the models in lock step.

It runs where the logits are: in the llama.cpp worker process for GGUF models (:mod:`.worker_main`), so a
batch of logits is never copied between processes, and in mosaic's own process for EXL3 models on a GPU. The
teacher is a live model (the exact KL) or a saved top-k (the KL lower bound); each batch of positions is
scored ``chunk`` positions at a time (:mod:`.panel`), so the panel's temporaries stay
O(chunk × vocabulary) whatever the window, the row or the text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from mosaic._base.errors import FormatError, MosaicError
from mosaic._eval.panel import LogProbs, Scores, kl_exact, kl_lower_bound, log_probs, position_scores, top_k


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


def score(job: Job, live: Decoder | None, cands: Sequence[Decoder], advance: Callable[[int], None]) -> Outcome:
    """Every candidate's per-position scores; with ``job.keep``, the live teacher's top-k of every position."""
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
            for pieces in zip(*streams):
                m_ = pieces[0].shape[0]
                if any(p.shape[0] != m_ for p in pieces):
                    raise MosaicError("the models handed back batches of different sizes")
                for a in range(0, m_, chunk):
                    b = min(a + chunk, m_)
                    s0, s1 = off + a, off + b
                    t_lp: LogProbs | None = None
                    if live is not None:
                        t_lp = log_probs(pieces[0][a:b])
                        if job.keep:
                            ids, lps = top_k(t_lp, job.k)
                            out.kept_ids.append(ids)
                            out.kept_lp.append(lps)
                        else:  # only the teacher's top-1 is scored: the first maximum is top_k's first, ties included
                            ids = t_lp.logits.argmax(axis=-1)[:, None]
                        cand_pieces = pieces[1:]
                    else:
                        assert job.saved_ids is not None and job.saved_lp is not None
                        ids = job.saved_ids[pos + s0:pos + s1]
                        lps = job.saved_lp[pos + s0:pos + s1]
                        if ids.shape[0] != s1 - s0:
                            raise FormatError("the saved reference holds fewer positions than the text needs; saved for another --ctx?")
                        cand_pieces = pieces
                    if cand_pieces and int(ids.max(initial=0)) >= cand_pieces[0].shape[1]:
                        raise FormatError("the saved reference names tokens beyond the candidates' vocabulary")
                    for ci, cp in enumerate(cand_pieces):
                        c_lp = log_probs(cp[a:b])
                        kl = kl_exact(t_lp, c_lp) if t_lp is not None else kl_lower_bound(ids, lps, c_lp)
                        agree, kl, nll = position_scores(ids[:, 0], kl, c_lp, nxt[s0:s1])
                        parts[ci][0].append(agree)
                        parts[ci][1].append(kl)
                        parts[ci][2].append(nll)
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
