"""The panel's arithmetic, in numpy: per-position scores of a candidate against a teacher, and their summaries.

Per position (a token the model predicts the next of):

- **top-1 agreement**: the candidate's most likely next token is the teacher's;
- **KL(teacher ‖ candidate)**, in nats: exact, Σ p log(p / q) over the vocabulary, when the teacher's full
  distribution is at hand; otherwise the seed's *KL lower bound* from the teacher's top-k log-probabilities:
  Σ_top-k p log(p / q) + r log(r / q_r), where r and q_r are the mass teacher and candidate put outside the
  teacher's top-k. By the log-sum inequality it never exceeds the exact KL, and equals it when r = 0;
- **NLL** of the text's own next token under the candidate, in nats.

Elementwise work over the vocabulary is float32 (the runtimes' own precision: the logits arrive as float32),
every sum is float64, and what float32 would round is carried beside it: each position's log-sum-exp is kept
in float64 and split into its float32 part, subtracted from every logit, and the remainder, applied once to
the position's total. So the figures equal a float64 computation from the same logits to ~1e-7 (tested to
1e-6 on real models), and the order of the logits decides top-1 and top-k, never rounded log-probabilities:
ties break as in float64, the lower token id first.

Every step works on each position's row alone (a row's sums are its own), so a batch may be cut into blocks of
rows anywhere and scored on any number of threads (:mod:`.rowpool`) with the same numbers to the last bit. The
steps write into arrays the caller passes (a thread's :class:`~mosaic._eval.rowpool.Scratch`) where it has
them, and each walk over the vocabulary does what it can at once: the maximum is read at the first argmax, so
one pass gives both the shift of the exponentials and top-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mosaic._eval.rowpool import Scratch


@dataclass
class LogProbs:
    """Log-probabilities of a batch of positions: ``lp − rest`` exactly, ``lp`` float32 over the vocabulary,
    ``rest`` the float64 part of each position's log-sum-exp that float32 could not hold (|rest| ≤ 1e-6)."""

    lp: np.ndarray  # float32 [n, V]
    rest: np.ndarray  # float64 [n]
    logits: np.ndarray  # float32 [n, V]: the order of the tokens (top-1, top-k) is read here
    e: np.ndarray  # float32 [n, V]: exp(logits − max), whose float64 sum is ``total``
    total: np.ndarray  # float64 [n]
    top1: np.ndarray  # int64 [n]: each row's first maximum of the logits (ties: the lower id)

    def mass_outside(self, ids: np.ndarray) -> np.ndarray:
        """The probability outside the tokens ``ids`` [n, k], as the sum of the rest of the vocabulary (so that
        it is 0, not float noise, when ``ids`` holds every token)."""
        inside = np.take_along_axis(self.e, ids.astype(np.int64), axis=-1).sum(axis=-1, dtype=np.float64)
        return np.maximum(self.total - inside, 0.0) / self.total

    def at(self, ids: np.ndarray) -> np.ndarray:
        """float64 log-probabilities of the tokens ``ids`` ([n] or [n, k]) of each position."""
        ids = ids.astype(np.int64)
        got = np.take_along_axis(self.lp, ids if ids.ndim == 2 else ids[:, None], axis=-1).astype(np.float64)
        got -= self.rest[:, None]
        return got if ids.ndim == 2 else got[:, 0]


def log_probs(logits: np.ndarray, scratch: Scratch | None = None, name: str = "") -> LogProbs:
    """Five walks over the vocabulary (argmax, shift, exp, float64 sum, the log-sum-exp's float32 part off),
    float32 temporaries the size of ``logits`` (``scratch``'s ``name`` arrays, when given), the sums in float64.
    The maximum is the logit at the first argmax: the same value as ``max`` (a NaN included), found in the
    pass that gives top-1."""
    x = np.asarray(logits, dtype=np.float32)
    top1 = x.argmax(axis=-1)
    lp = scratch.array(f"{name}lp", x.shape) if scratch is not None else None
    e = scratch.array(f"{name}e", x.shape) if scratch is not None else None
    lp = np.subtract(x, np.take_along_axis(x, top1[:, None], axis=-1), out=lp)
    e = np.exp(lp, out=e)
    total = e.sum(axis=-1, dtype=np.float64)
    lse = np.log(total)
    head = lse.astype(np.float32)
    lp -= head[:, None]
    return LogProbs(lp, lse - head.astype(np.float64), x, e, total, top1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities (tests and small arrays; the panel itself uses :func:`log_probs`)."""
    x = np.array(logits, dtype=np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def kl_exact(teacher: LogProbs, cand: LogProbs, out: np.ndarray | None = None) -> np.ndarray:
    """Σ p (log p − log q) per position. The teacher's p is ``e / total`` (its exponentials, already at hand, over
    their float64 sum, which is 1 × total exactly), and log p − log q is ``(lp_t − rest_t) − (lp_c − rest_c)``:
    Σ e (lp_t − lp_c) is formed in float32 products and a float64 sum, divided by the total, and the rests are
    applied once. No second exponential over the vocabulary; the products are formed in ``out`` when given."""
    d = np.subtract(teacher.lp, cand.lp, out=out)
    d *= teacher.e
    kl = d.sum(axis=-1, dtype=np.float64) / teacher.total - (teacher.rest - cand.rest)
    return np.maximum(kl, 0.0)


def kl_lower_bound(top_ids: np.ndarray, top_lp: np.ndarray, cand: LogProbs | np.ndarray) -> np.ndarray:
    """The KL lower bound from the teacher's top-k (ids and log-probabilities) and the candidate's log-probs
    (:class:`LogProbs`, or float64 log-probabilities)."""
    resolution = float(np.finfo(np.asarray(top_lp).dtype).eps) if np.asarray(top_lp).dtype.kind == "f" else 0.0
    top_lp = np.asarray(top_lp, dtype=np.float64)
    if isinstance(cand, LogProbs):
        q_top = cand.at(top_ids)
        q_r = np.clip(cand.mass_outside(top_ids), 1e-300, 1.0)
    else:
        q_top = np.take_along_axis(cand, top_ids.astype(np.int64), axis=-1)
        q_r = np.clip(1.0 - np.exp(q_top).sum(axis=-1), 1e-300, 1.0)
    p_top = np.exp(top_lp)
    head = (p_top * (top_lp - q_top)).sum(axis=-1)
    r = np.clip(1.0 - p_top.sum(axis=-1), 0.0, 1.0)
    # saved log-probabilities are float32: each p carries a relative error up to 2^-24 × |log p|, so a mass
    # outside the top-k below twice their sum is indistinguishable from none (every token kept), and is none
    r = np.where(r > resolution * (p_top * np.abs(top_lp)).sum(axis=-1) + 1e-15, r, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(r > 0, r * (np.log(np.maximum(r, 1e-300)) - np.log(q_r)), 0.0)
    return np.maximum(head + tail, 0.0)


def top_k(lps: LogProbs, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens per position, most likely first (ties: the lower id first), ordered by the
    logits themselves; their log-probabilities from float64."""
    x = lps.logits
    k = min(k, x.shape[-1])
    part = np.argpartition(-x, k - 1, axis=-1)[..., :k]
    vals = np.take_along_axis(x, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1)
    return ids.astype(np.int32), lps.at(ids).astype(np.float32)


@dataclass
class Scores:
    """Per-position scores of one candidate, grouped by row."""

    top1: list[np.ndarray]
    kl: list[np.ndarray]
    nll: list[np.ndarray]


def position_scores(teacher_top1: np.ndarray, kl: np.ndarray, cand: LogProbs, next_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-1 agreement (float64 0/1), the KL as given, and the NLL of the text's next tokens, per position."""
    agree = (cand.top1 == teacher_top1).astype(np.float64)
    nll = -cand.at(next_tokens)
    return agree, kl, nll


def _stats(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(x.max())}


def summarize(model: str, s: Scores, exact: bool, per_position: bool = False,
              repeats: list[np.ndarray] | None = None) -> dict[str, object]:
    """The candidate's panel: its stats over every position and per row. ``per_position``: each row also carries
    its KL at every position (``kl_positions``), so that a reader can resample rows, the independent units, and
    put a standard error on the tail (p99) as it can on the mean. ``repeats`` (per row, as
    :func:`~mosaic._eval.scoring.repeated` marks them): positions left out, their prediction counted where it
    was first made."""
    if repeats is not None:
        s = Scores(*([x[~m] for x, m in zip(part, repeats, strict=True)] for part in (s.top1, s.kl, s.nll)))
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in (("top1", s.top1), ("kl", s.kl), ("nll", s.nll))}
    rows = [
        {"row": i, "positions": int(t.size), "top1": float(t.mean()) if t.size else 0.0,
         "kl": float(k.mean()) if k.size else 0.0, "nll": float(n.mean()) if n.size else 0.0,
         **({"kl_positions": [float(x) for x in k]} if per_position else {})}
        for i, (t, k, n) in enumerate(zip(s.top1, s.kl, s.nll))
    ]
    return {
        "model": model,
        "positions": int(cat["top1"].size),
        "top1": float(cat["top1"].mean()) if cat["top1"].size else 0.0,
        "kl": {**_stats(cat["kl"]), "exact": exact},
        "nll": float(cat["nll"].mean()) if cat["nll"].size else 0.0,
        "rows": rows,
    }


def compare(first: dict, other: dict) -> dict[str, object]:
    """Rows improved / regressed / tied from ``first`` to ``other``: top-1 higher is better, KL and NLL lower."""
    out: dict[str, object] = {"from": first["model"], "to": other["model"]}
    for key, better in (("top1", 1.0), ("kl", -1.0), ("nll", -1.0)):
        imp = reg = tie = 0
        for a, b in zip(first["rows"], other["rows"]):
            d = (b[key] - a[key]) * better
            if d > 0:
                imp += 1
            elif d < 0:
                reg += 1
            else:
                tie += 1
        out[key] = {"improved": imp, "regressed": reg, "tied": tie}
    return out
