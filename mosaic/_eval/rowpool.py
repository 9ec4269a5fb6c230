"""Threads for the panel: a batch's positions scored a block of rows at a time on every core the decode used.

The panel's work over the vocabulary is numpy's array loops, which release the GIL, so plain threads run it in
parallel without copying the logits anywhere. Each block of rows is scored whole by one thread and each row's
sums are its own, so the numbers do not depend on how many threads there are or which one took a block: the
blocks are the same whatever the thread count, and their results are handed back in block order.

A pool lives as long as its owner (the llama.cpp worker process, or one in-process panel), never one batch:
threads and their scratch buffers are made once, and a batch only hands out blocks.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

R = TypeVar("R")


class Scratch:
    """Arrays one thread reuses from block to block, by purpose: a fresh array per block is page-faulted in
    again every time, and the panel's blocks are megabytes each. Grown to the largest block asked for, so the
    memory is bounded by the pool's threads × purposes × the largest block."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, np.dtype], np.ndarray] = {}

    def array(self, purpose: str, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
        """A C-contiguous array of ``shape`` whose contents are undefined (the previous block's values)."""
        key = (purpose, np.dtype(dtype))
        n = int(np.prod(shape))
        buf = self._bufs.get(key)
        if buf is None or buf.size < n:
            buf = self._bufs[key] = np.empty(n, dtype)
        return buf[:n].reshape(shape)


class RowPool:
    """``threads`` threads that score blocks of rows; with one thread, the caller's own, no pool at all."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, int(threads))
        self._scratch = [Scratch() for _ in range(self.threads)]
        self._ex = ThreadPoolExecutor(self.threads, thread_name_prefix="mosaic-panel") if self.threads > 1 else None

    def map(self, fn: Callable[[int, Scratch], R], n: int) -> list[R]:
        """``[fn(i, scratch) for i in range(n)]``, the blocks handed out in order to whichever thread is free
        (each with its own scratch). An error is raised as a serial loop would raise it: the one of the lowest
        block, once every block already started has finished (none is abandoned while it writes its scratch);
        no block is started after an error."""
        if self._ex is None or n <= 1:
            return [fn(i, self._scratch[0]) for i in range(n)]
        out: list[R | None] = [None] * n
        errors: dict[int, BaseException] = {}
        stop = threading.Event()
        taken = itertools.count()  # next() of a count is atomic under the GIL

        def drain(slot: int) -> None:
            s = self._scratch[slot]
            while not stop.is_set():
                i = next(taken)
                if i >= n:
                    return
                try:
                    out[i] = fn(i, s)
                except BaseException as e:  # re-raised by the caller, in block order
                    errors[i] = e
                    stop.set()
                    return

        futures = [self._ex.submit(drain, slot) for slot in range(min(self.threads, n))]
        try:
            for f in futures:
                f.result()
        finally:
            stop.set()  # on an interrupt of the caller: the threads finish their block and take no other
            for f in futures:
                f.exception()  # waits
        if errors:
            raise errors[min(errors)]
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Ends the threads (after any block in progress) and frees the scratch; blocks mapped afterwards run on
        the caller's thread."""
        if self._ex is not None:
            self._ex.shutdown(wait=True)
            self._ex = None
        self._scratch = [Scratch()]

    def __enter__(self) -> RowPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
