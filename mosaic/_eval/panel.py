"""The panel's arithmetic, in numpy: per-position scores of a candidate against a teacher, and their summaries.

Per position (a token the model predicts the next of):

- **top-1 agreement**: the candidate's most likely next token is the teacher's;
- **KL(teacher ‖ candidate)**, in nats: exact, Σ p log(p / q) over the vocabulary, when the teacher's full
  distribution is at hand; otherwise the seed's *KL lower bound* from the teacher's top-k log-probabilities:
  Σ_top-k p log(p / q) + r log(r / q_r), where r and q_r are the mass teacher and candidate put outside the
  teacher's top-k. By the log-sum inequality it never exceeds the exact KL, and equals it when r = 0;
- **NLL** of the text's own next token under the candidate, in nats.

Everything is computed in float64 from the runtimes' logits, so two machines give the same numbers to
within the runtimes' own float differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """In float64, with two temporaries the size of ``logits`` (it runs over the whole vocabulary at every
    position: the panel's largest cost after the runtime's)."""
    x = np.array(logits, dtype=np.float64)
    x -= x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    x -= np.log(e.sum(axis=-1, keepdims=True))
    return x


def kl_exact(teacher_lp: np.ndarray, cand_lp: np.ndarray) -> np.ndarray:
    p = np.exp(teacher_lp)
    return np.maximum((p * (teacher_lp - cand_lp)).sum(axis=-1), 0.0)


def kl_lower_bound(top_ids: np.ndarray, top_lp: np.ndarray, cand_lp: np.ndarray) -> np.ndarray:
    """The KL lower bound from the teacher's top-k (ids and log-probabilities) and the candidate's full log-probs."""
    top_lp = np.asarray(top_lp, dtype=np.float64)
    q_top = np.take_along_axis(cand_lp, top_ids.astype(np.int64), axis=-1)
    p_top = np.exp(top_lp)
    head = (p_top * (top_lp - q_top)).sum(axis=-1)
    r = np.clip(1.0 - p_top.sum(axis=-1), 0.0, 1.0)
    q_r = np.clip(1.0 - np.exp(q_top).sum(axis=-1), 1e-300, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(r > 0, r * (np.log(np.maximum(r, 1e-300)) - np.log(q_r)), 0.0)
    return np.maximum(head + tail, 0.0)


def top_k(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens per position, most likely first (ties: the lower id first)."""
    k = min(k, lp.shape[-1])
    part = np.argpartition(-lp, k - 1, axis=-1)[..., :k]
    vals = np.take_along_axis(lp, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1)
    return ids.astype(np.int32), np.take_along_axis(lp, ids, axis=-1).astype(np.float32)


@dataclass
class Scores:
    """Per-position scores of one candidate, grouped by row."""

    top1: list[np.ndarray]
    kl: list[np.ndarray]
    nll: list[np.ndarray]


def position_scores(teacher_top1: np.ndarray, kl: np.ndarray, cand_lp: np.ndarray, next_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    agree = (cand_lp.argmax(axis=-1) == teacher_top1).astype(np.float64)
    nll = -np.take_along_axis(cand_lp, next_tokens.astype(np.int64)[:, None], axis=-1)[:, 0]
    return agree, kl, nll


def _stats(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(x.max())}


def summarize(model: str, s: Scores, exact: bool) -> dict[str, object]:
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in (("top1", s.top1), ("kl", s.kl), ("nll", s.nll))}
    rows = [
        {"row": i, "positions": int(t.size), "top1": float(t.mean()) if t.size else 0.0,
         "kl": float(k.mean()) if k.size else 0.0, "nll": float(n.mean()) if n.size else 0.0}
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
