"""The streaming safetensors writer: the one piece no library provides.

The ``safetensors`` library serializes only what it holds in memory; a 96 GB checkpoint on a 24 GB
machine must be written by computing the whole header first and then copying raw byte ranges from
the source files. :func:`layout_shard` fixes every byte position and the exact file size before
anything is written (header growth from longer offsets and from padding included), and
:func:`write_shard` then copies ranges in bounded chunks, in the kernel where it can.

The header is compact JSON in the tensors' data order, ``__metadata__`` first, padded with spaces to
a multiple of 8 as the reference writer does, so that the same inputs always give the same bytes and
a file the library wrote is reproduced byte for byte.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mosaic._base.faults import check_cancel
from mosaic._base.faults import point as fault_point
from mosaic._base.hashing import scratch
from mosaic._formats.safetensors_reader import DTYPE_BITS, tensor_nbytes

#: Bytes copied per step when the kernel copy is not available; bounds memory per shard.
CHUNK_SIZE = 8 << 20

_FALLBACK_ERRNOS = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM, errno.ETXTBSY}
)


@dataclass(frozen=True, slots=True)
class OutTensor:
    """A tensor to write: its header entry and where its bytes come from (a range of a file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source_path: str
    source_offset: int


@dataclass(frozen=True)
class ShardLayout:
    """Everything about an output file that is known before its first byte is written."""

    header: bytes  # length prefix + JSON + padding
    tensors: tuple[OutTensor, ...]
    offsets: tuple[int, ...]  # absolute file position of each tensor's first byte

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)

    @property
    def data_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def encode_header(
    entries: Sequence[tuple[str, str, Sequence[int], int]],
    metadata: dict[str, str] | None = None,
    *,
    align: int = 8,
) -> bytes:
    """Header bytes (length prefix included) for ``(name, dtype, shape, nbytes)`` in data order."""
    obj: dict[str, object] = {}
    if metadata is not None:
        obj["__metadata__"] = metadata
    pos = 0
    for name, dtype, shape, nbytes in entries:
        if name == "__metadata__" or name in obj:
            raise ValueError(f"tensor name {name!r} is reserved or repeated")
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % align)
    return struct.pack("<Q", len(text)) + text


def layout_shard(tensors: Sequence[OutTensor], metadata: dict[str, str] | None = None) -> ShardLayout:
    """Fix the header, every tensor's offset and the file size of one output shard."""
    for t in tensors:
        if t.dtype not in DTYPE_BITS:
            raise ValueError(f"unknown dtype {t.dtype!r} for {t.name!r}")
        if tensor_nbytes(t.dtype, t.shape) != t.nbytes:
            raise ValueError(f"{t.name!r}: {t.dtype} {list(t.shape)} is not {t.nbytes} bytes")
    header = encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], metadata)
    offsets = []
    pos = len(header)
    for t in tensors:
        offsets.append(pos)
        pos += t.nbytes
    return ShardLayout(header, tuple(tensors), tuple(offsets))


# --- copying --------------------------------------------------------------------------------------


def _copy_range_kernel(src: int, dst: int, count: int, src_off: int, dst_off: int) -> int:
    """Copy with copy_file_range; returns bytes copied before the kernel refused (0 = not supported)."""
    done = 0
    while done < count:
        try:
            n = os.copy_file_range(src, dst, count - done, src_off + done, dst_off + done)
        except OSError as e:
            if e.errno in _FALLBACK_ERRNOS and done == 0:
                return 0
            if e.errno in _FALLBACK_ERRNOS:
                return done
            raise
        if n == 0:
            return done
        done += n
    return done


def _copy_range_user(src: int, dst: int, count: int, src_off: int, dst_off: int, buf: bytearray) -> None:
    mv = memoryview(buf)
    done = 0
    while done < count:
        want = min(len(buf), count - done)
        n = os.preadv(src, [mv[:want]], src_off + done)
        if n <= 0:
            raise OSError(errno.EIO, f"source ended {count - done} bytes early")
        view = mv[:n]
        w = 0
        while w < n:
            w += os.pwrite(dst, view[w:], dst_off + done + w)
        done += n


CopyMethod = Callable[[int, int, int, int, int], int]


def copy_range(
    src: int, dst: int, count: int, src_off: int, dst_off: int, *, buf: bytearray, kernel: bool = True
) -> str:
    """Copy ``count`` bytes between open files; returns the method that did it ("kernel"/"user")."""
    done = _copy_range_kernel(src, dst, count, src_off, dst_off) if kernel and count else 0
    if done < count:
        _copy_range_user(src, dst, count - done, src_off + done, dst_off + done, buf)
        return "user" if done == 0 else "kernel+user"
    return "kernel"


def copy_in_steps(src: int, dst: int, count: int, src_off: int, dst_off: int, *, buf: bytearray, kernel: bool = True,
                  on_bytes: Callable[[int], None] | None = None) -> set[str]:
    """:func:`copy_range` in bounded steps, so that progress moves and Ctrl-C is honoured on large tensors too
    (each step is also the ``copy`` fault point); returns the methods used."""
    methods: set[str] = set()
    pos = 0
    while pos < count:
        check_cancel()
        step = min(count - pos, 64 << 20)
        methods.add(copy_range(src, dst, step, src_off + pos, dst_off + pos, buf=buf, kernel=kernel))
        pos += step
        if on_bytes:
            on_bytes(step)
        fault_point("copy")
    return methods


def write_shard(
    layout: ShardLayout,
    dst_path: str | os.PathLike[str],
    *,
    kernel_copy: bool = True,
    on_bytes: Callable[[int], None] | None = None,
    hand_off: Callable[[int], None] | None = None,
) -> set[str]:
    """Write one planned shard: the header, then every tensor's bytes from its source range.

    Source files are opened read-only. The destination must not exist. Returns the copy methods used.
    The shard is made durable (fsync) before this returns, unless ``hand_off`` is given: it then
    receives the written file's descriptor (its own duplicate, to fsync and close) once every byte is written.
    """
    buf = scratch("copy")[0]
    methods: set[str] = set()
    fds: dict[str, int] = {}
    dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.pwrite(dst, layout.header, 0)
        # Coalesce neighbouring ranges of one source file: fewer calls, larger kernel copies.
        runs: list[list] = []  # [source path, source offset, destination offset, count]
        for t, off in zip(layout.tensors, layout.offsets, strict=False):
            if not t.nbytes:
                continue
            if t.source_path not in fds:
                fds[t.source_path] = os.open(t.source_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            last = runs[-1] if runs else None
            if last and last[0] == t.source_path and last[1] + last[3] == t.source_offset:
                last[3] += t.nbytes
            else:
                runs.append([t.source_path, t.source_offset, off, t.nbytes])
        for src_path, src_off, dst_off, count in runs:
            methods |= copy_in_steps(fds[src_path], dst, count, src_off, dst_off, buf=buf, kernel=kernel_copy, on_bytes=on_bytes)
        os.ftruncate(dst, layout.size)
        if hand_off is None:
            os.fsync(dst)
        else:
            hand_off(os.dup(dst))
    finally:
        os.close(dst)
        for fd in fds.values():
            os.close(fd)
    return methods
