"""How bytes become digests: one sequential read of a file gives its SHA-256 and the SHA-256 of each
tensor's byte range, at once.

The read runs on the calling thread into a small ring of reused buffers (``readinto``, no per-chunk
allocation); the file digest and the per-range digests are computed on two worker threads, which
``hashlib`` lets run in parallel because it releases the GIL on large buffers. Memory is bounded by
the ring, whatever the file size. This module knows nothing of checkpoints or provenance.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

from mosaic._base.faults import CANCEL, check_cancel

CHUNK_SIZE = 8 << 20
RING = 3
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class FileDigests:
    """A file's size and SHA-256, and the SHA-256 of each requested byte range, in request order;
    with ``same_as``, whether its bytes were those of the other file (None: not compared)."""

    size: int
    sha256: str
    ranges: tuple[str, ...]
    same: bool | None = None


_local = threading.local()


def scratch(purpose: str, n: int = 1, size: int = CHUNK_SIZE) -> list[bytearray]:
    """``n`` buffers of ``size`` bytes for the calling thread's ``purpose``, made once per thread
    and reused: a fresh 8 MiB ring per file is page-faulted in again every time (about a second of
    kernel time over a GLM-5.3 build's files). Freed with the thread (worker threads end with their
    map); memory stays bounded by threads × purposes × buffers, whatever the files."""
    pool: dict[tuple[str, int], list[bytearray]] = _local.__dict__.setdefault("pool", {})
    bufs = pool.setdefault((purpose, size), [])
    while len(bufs) < n:
        bufs.append(bytearray(size))
    return bufs[:n]


def _advise_sequential(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


class _RangeHasher:
    """Feeds consecutive chunks of a file into one hash object per requested range.

    Ranges are kept sorted by start as plain lists (start, end, the hash's bound ``update``): at
    GLM-5.3's tiny bench tensors a chunk covers thousands of ranges, and each costs a few list
    reads and one call; a range crossing a chunk's end is finished by the next chunk."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        order = sorted(range(len(ranges)), key=ranges.__getitem__)
        self.hashes = [hashlib.sha256() for _ in ranges]
        self._starts = [ranges[i][0] for i in order]
        self._ends = [ranges[i][1] for i in order]
        self._updates = [self.hashes[i].update for i in order]
        self.k = 0  # next range (in sorted order) that is not yet complete

    def feed(self, pos: int, view: memoryview) -> None:
        end = pos + len(view)
        k = self.k
        starts, ends, updates = self._starts, self._ends, self._updates
        n = len(starts)
        if k < n and starts[k] < pos:  # a range begun in an earlier chunk
            b = ends[k]
            updates[k](view[: min(b, end) - pos])
            if b > end:
                return
            k += 1
        while k < n:
            a = starts[k]
            if a >= end:
                break
            b = ends[k]
            if b > end:
                updates[k](view[a - pos :])
                break
            updates[k](view[a - pos : b - pos])
            k += 1
        self.k = k


def digest_file(
    path: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]] = (),
    *,
    on_bytes: Callable[[int], None] | None = None,
    chunk_size: int = CHUNK_SIZE,
    same_as: str | os.PathLike[str] | None = None,
) -> FileDigests:
    """Read ``path`` once; return its digest and the digest of each absolute ``(start, end)`` range.

    Ranges must not overlap (tensor ranges of a valid shard never do). The file is opened read-only.
    ``same_as``: another file read alongside and compared byte for byte (``memcmp``, not a digest:
    a copy is checked against its source at memory speed, and the copy's digests are the source's).
    """
    prev_end = 0
    for a, b in sorted(ranges):
        if not 0 <= a <= b or a < prev_end:
            raise ValueError(f"bad or overlapping range ({a}, {b})")
        prev_end = b
    file_hash = hashlib.sha256()
    rh = _RangeHasher(ranges)
    bufs = scratch("ring", RING, chunk_size)
    pending: list[list[Future[None]]] = [[] for _ in range(RING)]
    size = 0
    same: bool | None = None if same_as is None else True
    with (
        open(path, "rb", buffering=0) as f,
        open(same_as, "rb", buffering=0) if same_as is not None else contextlib.nullcontext() as g,
        ThreadPoolExecutor(1, thread_name_prefix="mosaic-file-hash") as fx,
        ThreadPoolExecutor(1, thread_name_prefix="mosaic-range-hash") as rx,
    ):
        _advise_sequential(f.fileno())
        ref = scratch("compare", 1, COMPARE_PIECE)[0] if same_as is not None else None
        slot = 0
        while True:
            check_cancel()
            for fut in pending[slot]:
                fut.result()
            buf = bufs[slot]
            n = f.readinto(buf)
            if ref is not None and same:
                same = _same_chunk(g, ref, buf, n)
            if not n:
                break
            view = memoryview(buf)[:n]
            futs = [fx.submit(file_hash.update, view)]
            if ranges:
                futs.append(rx.submit(rh.feed, size, view))
            pending[slot] = futs
            size += n
            if on_bytes:
                on_bytes(n)
            slot = (slot + 1) % RING
        for futs in pending:
            for fut in futs:
                fut.result()
    for a, b in ranges:
        if b > size:
            raise ValueError(f"range ({a}, {b}) runs past the end of {path} ({size} bytes)")
    return FileDigests(size, file_hash.hexdigest(), tuple(h.hexdigest() for h in rh.hashes), same)


#: The other file of a comparison is read a piece of this size at a time (one buffer per thread).
COMPARE_PIECE = 1 << 20


def _same_chunk(g: BinaryIO, ref: bytearray, buf: bytearray, n: int) -> bool:
    """Whether the next ``n`` bytes of ``g`` (all that is left of it when ``n`` is 0) are
    ``buf[:n]``, read into ``ref`` a piece at a time and compared with ``memcmp`` (a bytearray
    compared with a memoryview compares their buffers; the other way round goes item by item)."""
    if n == 0:
        return g.readinto(ref) == 0
    view, piece = memoryview(buf), memoryview(ref)
    pos = 0
    while pos < n:
        want = min(len(ref), n - pos)
        got = 0
        while got < want:  # a regular file reads short only at its end
            k = g.readinto(piece[got:want])
            if not k:
                return False
            got += k
        if (ref if want == len(ref) else bytearray(piece[:want])) != view[pos : pos + want]:
            return False
        pos += want
    return True


def digest_ranges(
    path: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]],
    *,
    on_bytes: Callable[[int], None] | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[str, ...]:
    """The digest of each byte range, reading only those ranges (no whole-file digest).

    For sources whose file digest is already known and trusted (verified at download), only the
    tensors actually used need to be read."""
    hashes = [hashlib.sha256() for _ in ranges]
    buf = scratch("ranges", 1, chunk_size)[0]
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        for i in sorted(range(len(ranges)), key=lambda i: ranges[i]):
            a, b = ranges[i]
            pos = a
            while pos < b:
                check_cancel()
                want = min(chunk_size, b - pos)
                n = os.preadv(f.fileno(), [mv[:want]], pos)
                if n <= 0:
                    raise ValueError(f"range ({a}, {b}) runs past the end of {path}")
                hashes[i].update(mv[:n])
                pos += n
                if on_bytes:
                    on_bytes(n)
    return tuple(h.hexdigest() for h in hashes)


#: glibc's mallopt parameter M_MMAP_THRESHOLD (malloc.h)
_M_MMAP_THRESHOLD = -3


def return_freed_buffers(threshold: int = 4 << 20) -> bool:
    """Make every allocation of ``threshold`` bytes or more a mapping of its own, given back to the
    system when freed. Returns whether the allocator took the setting.

    glibc serves large blocks by mmap, but after the first is freed it raises its threshold (up to
    32 MiB) and serves the hashing rings, copy buffers and file texts that follow from heaps that
    keep their pages: on a GLM-5.3 build that is ~80 MB of the peak resident memory that nothing
    uses any more. A fixed threshold turns that off. Elsewhere (macOS, musl) this does nothing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parallel_map(fn: Callable[[T], R], items: Iterable[T], jobs: int) -> list[R]:
    """Map over items on ``jobs`` threads (file I/O and hashlib release the GIL); errors propagate."""
    items = list(items)
    if jobs <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    ex = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="mosaic-io")
    futures = [ex.submit(fn, i) for i in items]
    try:
        return [f.result() for f in futures]
    except BaseException:
        # stop the other workers between chunks rather than after their whole file
        CANCEL.set()
        for f in futures:
            f.cancel()
        raise
    finally:
        _join(ex)


def _join(ex: ThreadPoolExecutor) -> None:
    """Wait for every worker, through a second Ctrl-C too: the caller removes a temporary folder only once
    nothing writes into it any more. An interrupt during the wait is raised after it."""
    interrupted = False
    while True:
        try:
            ex.shutdown(wait=True)
            break
        except KeyboardInterrupt:
            interrupted = True
            CANCEL.set()
    CANCEL.clear()
    if interrupted:
        raise KeyboardInterrupt
