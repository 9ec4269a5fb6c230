"""The panel alone: mosaic's scoring of one batch of logits (a live teacher and one candidate: log-softmax of both,
exact KL, NLL, top-1) in process, at 1 thread, 2 and every core, on the same logits, beside the serial panel the
threads replaced (frozen in ``tests/test_panel_threads.py``, the reference the threaded panel equals bit for bit).
No model runs: the panel grows with the vocabulary and the positions, never with the weights, so random logits of
the eval case's shape time it as well as a model's would. Two widths: SmolLM2's 49,152 tokens, and 131,072 (the
scale case's, the width of today's large vocabularies), where a GPU's decode of a batch takes tens of
milliseconds and the panel is what is left. Positions × vocabulary per second per thread is printed too, so a
bigger machine's scaling can be read from one run there."""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
from harness import ROOT, row

POSITIONS = 170
VOCABS = (49_152, 131_072)


class _Batch:
    """A model whose window is one fixed batch of logits."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits, self.n_vocab = logits, logits.shape[1]

    def window(self, tokens: list[int]) -> Iterator[np.ndarray]:
        yield self.logits[:len(tokens)]


def _ignore(_: object) -> None:
    """The progress callback: nothing to report."""


def _serial_panel() -> Callable[..., dict]:
    """The serial panel as it was before the threads, from the test that holds it frozen."""
    spec = importlib.util.spec_from_file_location("_frozen_panel", ROOT / "tests" / "test_panel_threads.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._old_panel


def _median_seconds(fn: Callable[[], object], runs: int) -> float:
    fn()  # threads started, scratch faulted in
    times = []
    for _ in range(max(runs, 1) * 5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def case_panel(runs: int) -> None:
    from mosaic._eval.rowpool import RowPool
    from mosaic._eval.run import CHUNK_FLOATS
    from mosaic._eval.scoring import Job, score

    serial = _serial_panel()
    cores = len(os.sched_getaffinity(0))
    job = Job([list(range(POSITIONS + 1))], POSITIONS + 1, 32, CHUNK_FLOATS)
    nxt = np.arange(1, POSITIONS + 1)
    for vocab in VOCABS:
        rng = np.random.default_rng(0)
        t = (rng.standard_normal((POSITIONS, vocab)) * 3).astype(np.float32)
        c = t + (rng.standard_normal((POSITIONS, vocab)) * 0.3).astype(np.float32)
        case = (f"panel alone: {POSITIONS} positions × {vocab:,} logits, live teacher + one candidate, in process "
                f"({cores} cores)")
        before = _median_seconds(partial(serial, t, None, c, nxt, 32, max(1, (1 << 20) // vocab)), runs)
        row(case, "the serial panel before the threads: seconds per batch", f"{before * 1e3:.1f} ms", "1.00")
        per_batch: dict[int, float] = {}
        for threads in sorted({1, min(2, cores), cores}):
            with RowPool(threads) as pool:
                per_batch[threads] = _median_seconds(partial(score, job, _Batch(t), [_Batch(c)], _ignore, pool), runs)
            rate = POSITIONS * vocab / per_batch[threads] / threads
            goal = " (goal ≥ 1.6 at 2)" if threads == 2 else ""
            scale_goal = " (goal ≤ 0.5 at 131,072)" if vocab == VOCABS[-1] and threads == cores else ""
            row(case, f"{threads} thread(s): seconds per batch", f"{per_batch[threads] * 1e3:.1f} ms",
                f"{per_batch[threads] / before:.2f} × the serial panel's{scale_goal}; "
                f"{per_batch[1] / per_batch[threads]:.2f} × 1 thread's throughput{goal}")
            row(case, f"{threads} thread(s): positions × vocabulary per second per thread", f"{rate / 1e6:.0f} M", "")
