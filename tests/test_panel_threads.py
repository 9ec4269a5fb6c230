"""The panel on threads: the same numbers to the last bit at 1, 2 and 3 threads, and as the serial panel had them.

Random logits stand in for a model's (the arithmetic does not know where they come from); the shapes cover a
single position, positions that no thread count divides, a vocabulary that is no power of two, and one large
enough that a block is megabytes. The serial panel as it was before the threads is kept here, frozen, as the
reference: the threaded panel must equal it bitwise, not merely within float noise.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from mosaic._eval import panel, worker_main
from mosaic._eval.rowpool import RowPool, Scratch
from mosaic._eval.run import CHUNK_FLOATS
from mosaic._eval.scoring import Job, Outcome, score

THREADS = (1, 2, 3)
#: (positions, vocabulary, rows per block): one position; 23 positions in blocks of 3 (8 blocks, the last of 2);
#: 170 positions of SmolLM2's vocabulary in the run's own blocks (5 rows, 34 blocks). The serial panel took
#: 1 << 20 floats' worth of rows at a time (21 here): the blocks differ from its, the numbers may not.
SHAPES = ((1, 4099, 1), (23, 32003, 3), (170, 49152, max(1, CHUNK_FLOATS // 49152)))


def _serial_rows(vocab: int) -> int:
    """The serial panel's positions at a time: 1 << 20 floats' worth."""
    return max(1, (1 << 20) // vocab)


# ------------------------------------------------------------------------------- the serial panel, frozen


@dataclass
class _OldLogProbs:
    lp: np.ndarray
    rest: np.ndarray
    logits: np.ndarray
    e: np.ndarray
    total: np.ndarray

    def mass_outside(self, ids: np.ndarray) -> np.ndarray:
        inside = np.take_along_axis(self.e, ids.astype(np.int64), axis=-1).sum(axis=-1, dtype=np.float64)
        return np.maximum(self.total - inside, 0.0) / self.total

    def at(self, ids: np.ndarray) -> np.ndarray:
        ids = ids.astype(np.int64)
        got = np.take_along_axis(self.lp, ids if ids.ndim == 2 else ids[:, None], axis=-1).astype(np.float64)
        got -= self.rest[:, None]
        return got if ids.ndim == 2 else got[:, 0]


def _old_log_probs(logits: np.ndarray) -> _OldLogProbs:
    x = np.asarray(logits, dtype=np.float32)
    lp = x - x.max(axis=-1, keepdims=True)
    e = np.exp(lp)
    total = e.sum(axis=-1, dtype=np.float64)
    lse = np.log(total)
    head = lse.astype(np.float32)
    lp -= head[:, None]
    return _OldLogProbs(lp, lse - head.astype(np.float64), x, e, total)


def _old_kl_exact(t: _OldLogProbs, c: _OldLogProbs) -> np.ndarray:
    d = t.lp - c.lp
    d *= t.e
    return np.maximum(d.sum(axis=-1, dtype=np.float64) / t.total - (t.rest - c.rest), 0.0)


def _old_top_k(lps: _OldLogProbs, k: int) -> tuple[np.ndarray, np.ndarray]:
    x = lps.logits
    k = min(k, x.shape[-1])
    part = np.argpartition(-x, k - 1, axis=-1)[..., :k]
    vals = np.take_along_axis(x, part, axis=-1)
    ids = np.take_along_axis(part, np.lexsort((part, -vals), axis=-1), axis=-1)
    return ids.astype(np.int32), lps.at(ids).astype(np.float32)


def _old_kl_lower_bound(top_ids: np.ndarray, top_lp: np.ndarray, cand: _OldLogProbs) -> np.ndarray:
    resolution = float(np.finfo(top_lp.dtype).eps)
    top_lp = np.asarray(top_lp, dtype=np.float64)
    q_top = cand.at(top_ids)
    q_r = np.clip(cand.mass_outside(top_ids), 1e-300, 1.0)
    p_top = np.exp(top_lp)
    head = (p_top * (top_lp - q_top)).sum(axis=-1)
    r = np.clip(1.0 - p_top.sum(axis=-1), 0.0, 1.0)
    r = np.where(r > resolution * (p_top * np.abs(top_lp)).sum(axis=-1) + 1e-15, r, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(r > 0, r * (np.log(np.maximum(r, 1e-300)) - np.log(q_r)), 0.0)
    return np.maximum(head + tail, 0.0)


def _old_panel(t_logits: np.ndarray | None, saved: tuple[np.ndarray, np.ndarray] | None, c_logits: np.ndarray,
               nxt: np.ndarray, k: int, rows: int) -> dict[str, np.ndarray]:
    """The serial loop's numbers for one batch: ``rows`` positions at a time, as ``scoring.score`` had them."""
    out: dict[str, list[np.ndarray]] = {"top1": [], "kl": [], "nll": [], "ids": [], "lp": []}
    for a in range(0, c_logits.shape[0], rows):
        b = min(a + rows, c_logits.shape[0])
        c = _old_log_probs(c_logits[a:b])
        if t_logits is not None:
            t = _old_log_probs(t_logits[a:b])
            ids, lps = _old_top_k(t, k)
            kl = _old_kl_exact(t, c)
        else:
            assert saved is not None
            ids, lps = saved[0][a:b], saved[1][a:b]
            kl = _old_kl_lower_bound(ids, lps, c)
        out["top1"].append((c.logits.argmax(axis=-1) == ids[:, 0]).astype(np.float64))
        out["kl"].append(kl)
        out["nll"].append(-c.at(nxt[a:b]))
        out["ids"].append(ids)
        out["lp"].append(lps)
    return {key: np.concatenate(v) for key, v in out.items()}


# ------------------------------------------------------------------------------------------ helpers


def _logits(n: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A teacher's logits, a candidate's near them, and the text's next tokens; a few exact ties of the top."""
    rng = np.random.default_rng(seed)
    t = (rng.standard_normal((n, vocab)) * 3.0).astype(np.float32)
    c = t + (rng.standard_normal((n, vocab)) * 0.4).astype(np.float32)
    for i in range(0, n, 4):  # the top logit copied onto a lower and a higher id: ties break to the lower id
        top = int(t[i].argmax())
        t[i, [0, vocab - 1]] = t[i, top]
    return t, c, rng.integers(0, vocab, n)


class _Decoder:
    """A model whose window's logits are fixed, handed back ``batch`` positions at a time."""

    def __init__(self, logits: np.ndarray, batch: int) -> None:
        self.logits, self.batch, self.n_vocab = logits, batch, logits.shape[1]

    def window(self, tokens: list[int]) -> Iterator[np.ndarray]:
        for s in range(0, len(tokens), self.batch):
            yield self.logits[s:s + min(self.batch, len(tokens) - s)]


def _job(n: int, vocab: int, rows: int, keep: bool, saved: tuple[np.ndarray, np.ndarray] | None = None,
         k: int = 8) -> Job:
    # one row of n + 1 tokens, one window: the decoders hand back positions 0..n-1 of the logits
    return Job([list(range(n + 1))], n + 1, k, rows * vocab, keep,
               saved[0] if saved else None, saved[1] if saved else None)


def _outcome_arrays(o: Outcome) -> dict[str, np.ndarray]:
    got = {}
    for ci, s in enumerate(o.scores):
        for key in ("top1", "kl", "nll"):
            got[f"{key}{ci}"] = np.concatenate(getattr(s, key))
    if o.kept_ids:
        got["ids"], got["lp"] = np.concatenate(o.kept_ids), np.concatenate(o.kept_lp)
    return got


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert np.array_equal(a[key], b[key]), (key, float(np.max(np.abs(a[key].astype(float) - b[key].astype(float)))))


# ------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize(("n", "vocab", "rows"), SHAPES)
def test_exact_kl_top1_nll_and_top_k_are_the_same_at_every_thread_count(n: int, vocab: int, rows: int) -> None:
    t, c, _ = _logits(n, vocab, seed=n)
    c2 = c[::-1].copy()  # a second candidate, so a block holds the teacher while two candidates pass
    results = []
    for threads in THREADS:
        with RowPool(threads) as pool:
            for batch in (n, 7):  # the whole window in one batch, and batches that cut across blocks
                o = score(_job(n, vocab, rows, keep=True), _Decoder(t, batch), [_Decoder(c, batch), _Decoder(c2, batch)],
                          lambda _: None, pool)
                results.append(_outcome_arrays(o))
    for r in results[1:]:
        _assert_same(results[0], r)
    # the previous serial panel's numbers, bitwise, in its own blocks (nxt: the job's text is 0..n, so its next
    # tokens are 1..n)
    old = _old_panel(t, None, c, np.arange(1, n + 1), 8, _serial_rows(vocab))
    got = results[0]
    for key, mine in (("top1", "top10"), ("kl", "kl0"), ("nll", "nll0"), ("ids", "ids"), ("lp", "lp")):
        assert np.array_equal(old[key], got[mine]), key


@pytest.mark.parametrize(("n", "vocab", "rows"), SHAPES)
def test_the_top_k_lower_bound_is_the_same_at_every_thread_count(n: int, vocab: int, rows: int) -> None:
    t, c, _ = _logits(n, vocab, seed=n + 1)
    saved = panel.top_k(panel.log_probs(t), 8)
    results = []
    for threads in THREADS:
        with RowPool(threads) as pool:
            o = score(_job(n, vocab, rows, keep=False, saved=saved), None, [_Decoder(c, 5)], lambda _: None, pool)
            results.append(_outcome_arrays(o))
    for r in results[1:]:
        _assert_same(results[0], r)
    old = _old_panel(None, saved, c, np.arange(1, n + 1), 8, _serial_rows(vocab))
    for key in ("top1", "kl", "nll"):
        assert np.array_equal(old[key], results[0][f"{key}0"]), key
    assert np.all(results[0]["kl0"] >= 0.0)


def test_only_the_teacher_top1_is_scored_without_keep_and_it_is_top_k_first() -> None:
    t, c, _ = _logits(23, 32003, seed=3)
    got = []
    for keep in (False, True):
        with RowPool(2) as pool:
            got.append(_outcome_arrays(score(_job(23, 32003, 3, keep=keep), _Decoder(t, 23), [_Decoder(c, 23)],
                                             lambda _: None, pool)))
    for key in ("top10", "kl0", "nll0"):
        assert np.array_equal(got[0][key], got[1][key]), key


def test_a_row_scored_in_any_block_has_the_same_numbers() -> None:
    """What the threads rely on: every step reads its own row only, so a block cut anywhere, on any scratch
    (reused: it holds the previous block's values), gives each row the numbers of the whole batch."""
    t, c, nxt = _logits(17, 10007, seed=9)
    whole_t, whole_c = panel.log_probs(t), panel.log_probs(c)
    whole_kl = panel.kl_exact(whole_t, whole_c)
    scratch = Scratch()
    for a, b in ((0, 17), (0, 1), (3, 11), (16, 17), (5, 6)):
        bt = panel.log_probs(t[a:b], scratch, "t.")
        bc = panel.log_probs(c[a:b], scratch, "c.")
        for f in ("lp", "rest", "e", "total", "top1"):
            assert np.array_equal(getattr(bt, f), getattr(whole_t, f)[a:b]), f
            assert np.array_equal(getattr(bc, f), getattr(whole_c, f)[a:b]), f
        assert np.array_equal(panel.kl_exact(bt, bc, scratch.array("kl", bt.lp.shape)), whole_kl[a:b])
        assert np.array_equal(bc.at(nxt[a:b]), whole_c.at(nxt)[a:b])


def test_log_probs_reads_the_maximum_at_the_first_argmax_as_max_would() -> None:
    x = np.array([[1.0, 3.0, 3.0, -2.0], [np.nan, 1.0, 2.0, 0.0], [-np.inf, -np.inf, -np.inf, -np.inf]], np.float32)
    with np.errstate(invalid="ignore"):
        lp = panel.log_probs(x)
        old = _old_log_probs(x)
    assert lp.top1.tolist() == [1, 0, 0]
    assert np.array_equal(lp.lp, old.lp, equal_nan=True) and np.array_equal(lp.total, old.total, equal_nan=True)


def test_the_worker_scores_on_its_own_pool_the_same_at_every_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's ``score`` operation (what a GGUF eval and measure run): its pool is made at ``init`` with the
    runtime's thread count, the wire's arrays are the same at 1, 2 and 3, and the pool ends with the worker."""
    n, vocab = 40, 20011
    t, c, _ = _logits(n, vocab, seed=4)
    replies = []
    for threads in THREADS:
        rt = SimpleNamespace(info=SimpleNamespace(threads=threads, note=None, as_dict=lambda: {}))
        monkeypatch.setattr(worker_main, "in_process_runtime", lambda *a, rt=rt, **k: rt)
        server = worker_main._Server(io.BytesIO())
        server.handle({"op": "init", "runtime": None, "threads": threads, "verbose": False}, {})
        assert server.pool is not None and server.pool.threads == threads
        pool = server.pool
        server.models = {1: _Decoder(t, 16), 2: _Decoder(c, 16)}  # type: ignore[dict-item]
        head = {"row_tokens": [list(range(n + 1))], "ctx": n + 1, "k": 4, "chunk": 6 * vocab, "keep": True,
                "live": 1, "cands": [2]}
        replies.append(server.score(head, {}))
        server.close()
        assert server.pool is None and pool._ex is None
    timed = ("decode_seconds", "panel_seconds")  # where the time went: the one part that may differ
    first = {k: v for k, v in replies[0][0].items() if k not in timed}
    for head, arrays in replies[1:]:
        assert all(head[k] >= 0 for k in timed)
        assert {k: v for k, v in head.items() if k not in timed} == first
        _assert_same(replies[0][1], arrays)


# ---------------------------------------------------------------------------------------- the pool


def test_the_pool_hands_results_back_in_block_order_and_reuses_one_scratch_per_thread() -> None:
    seen: dict[int, set[int]] = {}
    lock = threading.Lock()

    def fn(i: int, s: Scratch) -> int:
        with lock:
            seen.setdefault(id(s), set()).add(threading.get_ident())
        s.array("x", (i + 1, 3))[:] = i
        return i * i

    with RowPool(3) as pool:
        assert pool.map(fn, 50) == [i * i for i in range(50)]
        assert pool.map(fn, 0) == []
    assert all(len(threads) == 1 for threads in seen.values())  # a scratch is never shared by two threads at once
    assert len(seen) <= 3


def test_the_pool_raises_the_lowest_blocks_error_and_starts_no_block_after_it() -> None:
    started: list[int] = []
    gate = threading.Event()

    def fn(i: int, s: Scratch) -> int:
        started.append(i)
        if i == 1:
            gate.wait(5)  # block 1 fails last: block 4's error is in first, the lower block's wins
            raise ValueError("block 1")
        if i == 4:
            gate.set()
            raise ValueError("block 4")
        return i

    with RowPool(2) as pool, pytest.raises(ValueError, match="block 1"):
        pool.map(fn, 200)
    assert len(started) < 200


def test_a_closed_pool_ends_its_threads_and_runs_on_the_callers() -> None:
    pool = RowPool(3)
    before = threading.active_count()
    pool.map(lambda i, s: i, 9)
    assert threading.active_count() > before
    pool.close()
    assert threading.active_count() == before
    assert pool.map(lambda i, s: threading.get_ident(), 3) == [threading.get_ident()] * 3
