"""The panel alone: mosaic's scoring of one batch of logits (a live teacher and one candidate: log-softmax of both,
exact KL, NLL, top-1) in process, at 1 thread, 2 and every core, on the same logits. No model runs: the panel
grows with the vocabulary and the positions, never with the weights, so random logits of the eval case's shape
(170 positions × SmolLM2's 49,152 tokens) time it as well as a model's would. Positions × vocabulary per second
per thread is printed too, so a bigger machine's scaling can be read from one run there."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator

import numpy as np
from harness import row

POSITIONS, VOCAB = 170, 49_152


class _Batch:
    """A model whose window is one fixed batch of logits."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits, self.n_vocab = logits, logits.shape[1]

    def window(self, tokens: list[int]) -> Iterator[np.ndarray]:
        yield self.logits[:len(tokens)]


def case_panel(runs: int) -> None:
    from mosaic._eval.rowpool import RowPool
    from mosaic._eval.run import CHUNK_FLOATS
    from mosaic._eval.scoring import Job, score

    rng = np.random.default_rng(0)
    t = (rng.standard_normal((POSITIONS, VOCAB)) * 3).astype(np.float32)
    c = t + (rng.standard_normal((POSITIONS, VOCAB)) * 0.3).astype(np.float32)
    job = Job([list(range(POSITIONS + 1))], POSITIONS + 1, 32, CHUNK_FLOATS)
    cores = len(os.sched_getaffinity(0))
    case = f"panel alone: {POSITIONS} positions × {VOCAB:,} logits, live teacher + one candidate, in process ({cores} cores)"
    per_batch: dict[int, float] = {}
    for threads in sorted({1, min(2, cores), cores}):
        with RowPool(threads) as pool:
            score(job, _Batch(t), [_Batch(c)], lambda _: None, pool)  # threads started, scratch faulted in
            times = []
            for _ in range(max(runs, 1) * 5):
                t0 = time.perf_counter()
                score(job, _Batch(t), [_Batch(c)], lambda _: None, pool)
                times.append(time.perf_counter() - t0)
        per_batch[threads] = statistics.median(times)
        rate = POSITIONS * VOCAB / per_batch[threads] / threads
        goal = " (goal ≥ 1.6 at 2)" if threads == 2 else ""
        row(case, f"{threads} thread(s): seconds per batch", f"{per_batch[threads] * 1e3:.1f} ms",
            f"{per_batch[1] / per_batch[threads]:.2f} × 1 thread's throughput{goal}")
        row(case, f"{threads} thread(s): positions × vocabulary per second per thread", f"{rate / 1e6:.0f} M", "")
