"""One read gives the file digest and every range digest."""

from __future__ import annotations

import hashlib
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic._base.hashing import digest_file


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_file_and_range_digests(tmp_path: Path, chunk: int) -> None:
    data = bytes(range(256)) * 40 + b"tail"
    p = tmp_path / "f"
    p.write_bytes(data)
    ranges = [(5000, len(data)), (0, 10), (10, 10), (10, 5000)]
    d = digest_file(p, ranges, chunk_size=chunk)
    assert d.size == len(data)
    assert d.sha256 == hashlib.sha256(data).hexdigest()
    assert d.ranges == tuple(hashlib.sha256(data[a:b]).hexdigest() for a, b in ranges)


def test_range_past_end_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    with pytest.raises(ValueError):
        digest_file(p, [(0, 4)])


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"")
    d = digest_file(p, [(0, 0)])
    assert d.sha256 == hashlib.sha256(b"").hexdigest() and d.ranges == (hashlib.sha256(b"").hexdigest(),)


def test_overlapping_ranges_refused(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"abcdef")
    with pytest.raises(ValueError):
        digest_file(p, [(0, 4), (3, 5)])


def test_freed_buffers_go_back_to_the_system_where_the_allocator_allows() -> None:
    """glibc takes the fixed mmap threshold (the command line sets it before any work)."""
    import platform
    import sys

    from mosaic._base.hashing import return_freed_buffers

    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        assert return_freed_buffers() is True
    else:
        assert return_freed_buffers() in (True, False)


def test_scratch_buffers_are_reused_per_thread_and_purpose() -> None:
    """A file's hashing ring is the thread's, reused for its next file; never shared between
    threads or with the copy buffer of the same thread."""
    import threading

    from mosaic._base.hashing import scratch

    ring = scratch("ring", 3, 1024)
    assert [id(b) for b in scratch("ring", 3, 1024)] == [id(b) for b in ring]
    assert all(len(b) == 1024 for b in ring)
    copy = scratch("copy", 1, 1024)[0]
    assert all(copy is not b for b in ring)
    other: list[bytearray] = []
    t = threading.Thread(target=lambda: other.extend(scratch("ring", 3, 1024)))
    t.start()
    t.join()
    assert len(other) == 3 and not {id(b) for b in other} & {id(b) for b in ring}


@pytest.mark.parametrize("piece", [3, 1 << 20])
@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_compared_with_another_file_byte_for_byte(tmp_path: Path, chunk: int, piece: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``same_as``: equal only when every byte and the length agree, wherever they differ (the
    other file read in pieces smaller or larger than the chunks)."""
    from mosaic._base import hashing

    monkeypatch.setattr(hashing, "COMPARE_PIECE", piece)
    data = bytes(range(256)) * 40 + b"tail"
    p, q = tmp_path / "copy", tmp_path / "source"
    p.write_bytes(data)
    cases = [
        (data, True),
        (data[:-1] + b"X", False),  # the last byte
        (b"X" + data[1:], False),  # the first
        (data[:4096] + b"\xff" + data[4097:], False),  # at a chunk boundary
        (data[:-1], False),  # the source is shorter
        (data + b"\x00", False),  # or longer
        (b"", False),
    ]
    for source, same in cases:
        q.write_bytes(source)
        d = digest_file(p, [(0, 10)], chunk_size=chunk, same_as=q)
        assert d.same is same, (len(source), chunk)
        assert d.sha256 == hashlib.sha256(data).hexdigest()  # the digests are the file's own
    assert digest_file(p, chunk_size=chunk).same is None
    p.write_bytes(b"")
    q.write_bytes(b"")
    assert digest_file(p, chunk_size=chunk, same_as=q).same is True


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=14), keep=st.lists(st.booleans(), max_size=14),
       chunk=st.integers(1, 64), order=st.randoms(use_true_random=False))
def test_range_digests_any_ranges_any_chunks(tmp_path_factory, data: bytes, cuts: list[int], keep: list[bool], chunk: int, order) -> None:  # type: ignore[no-untyped-def]
    """Ranges that touch, are empty, start or end on a chunk's edge or span several chunks, in any
    order: each digest is hashlib's of those bytes."""
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    ranges = [r for r, k in zip(pairwise(points), keep) if k] + [(q, q) for q, k in zip(points, reversed(keep)) if k]
    order.shuffle(ranges)
    p = tmp_path_factory.mktemp("h") / "f"
    p.write_bytes(data)
    d = digest_file(p, ranges, chunk_size=chunk)
    assert d.ranges == tuple(hashlib.sha256(data[a:b]).hexdigest() for a, b in ranges)
