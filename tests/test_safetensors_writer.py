"""The streaming writer: exact predicted size, byte equality with the library, independent read-back."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from mosaic._formats import safetensors_writer as sw
from mosaic._formats.safetensors_reader import read_header
from mosaic._formats.safetensors_writer import OutTensor, encode_header, layout_shard, write_shard


def _from_library(path: Path) -> list[OutTensor]:
    h = read_header(path)
    return [
        OutTensor(t.name, t.dtype, t.shape, t.nbytes, str(path), h.data_start + t.begin) for t in h.tensors
    ]


def _library_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    p = tmp_path / "lib.safetensors"
    save_file(
        {
            "w": rng.standard_normal((33, 7)).astype(np.float16),
            "s": np.array(3, dtype=np.int32),
            "e": np.zeros((0,), dtype=np.float32),
            "ü.name\n": rng.integers(0, 255, (11,), dtype=np.uint8),
            "big": rng.integers(-5, 5, (1000, 3), dtype=np.int16),
        },
        p,
        metadata={"format": "pt"},
    )
    return p


def test_same_bytes_as_library(tmp_path: Path) -> None:
    src = _library_file(tmp_path)
    layout = layout_shard(_from_library(src), {"format": "pt"})
    out = tmp_path / "out.safetensors"
    write_shard(layout, out)
    assert out.stat().st_size == layout.size
    assert out.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("kernel", [True, False])
def test_reordered_copy_reads_back_through_library(tmp_path: Path, kernel: bool) -> None:
    src = _library_file(tmp_path)
    tensors = list(reversed(_from_library(src)))
    layout = layout_shard(tensors)
    out = tmp_path / "out.safetensors"
    write_shard(layout, out, kernel_copy=kernel)
    assert out.stat().st_size == layout.size
    assert (len(layout.header) - 8) % 8 == 0
    with safe_open(src, "np") as a, safe_open(out, "np") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():  # noqa: SIM118 (safe_open is not iterable)
            assert np.array_equal(a.get_tensor(k), b.get_tensor(k))
    assert read_header(out).names() == [t.name for t in tensors]


def test_deterministic(tmp_path: Path) -> None:
    src = _library_file(tmp_path)
    layout = layout_shard(_from_library(src))
    write_shard(layout, tmp_path / "1")
    write_shard(layout, tmp_path / "2")
    assert (tmp_path / "1").read_bytes() == (tmp_path / "2").read_bytes()


def test_header_grows_with_offset_digits() -> None:
    small = encode_header([("t", "U8", [10], 10)])
    big = encode_header([("a", "U8", [10**10], 10**10), ("t", "U8", [10], 10)])
    assert b'"data_offsets":[10000000000,10000000010]' in big
    for h in (small, big):
        n = int.from_bytes(h[:8], "little")
        assert n == len(h) - 8 and n % 8 == 0
    # Many tensors past 10^10 bytes: the layout still predicts the size exactly, without any data.
    n = 40
    entries = [(f"t{i}", "U8", [3 * 10**9 + i], 3 * 10**9 + i) for i in range(n)]
    hdr = encode_header(entries)
    json_len = int.from_bytes(hdr[:8], "little")
    assert len(hdr) == 8 + json_len
    total = sum(e[3] for e in entries)
    assert f"[{total - entries[-1][3]},{total}]".encode() in hdr


def test_refuses_wrong_sizes_and_names() -> None:
    with pytest.raises(ValueError):
        layout_shard([OutTensor("a", "F16", (3,), 4, "x", 0)])
    with pytest.raises(ValueError):
        encode_header([("a", "U8", [1], 1), ("a", "U8", [1], 1)])
    with pytest.raises(ValueError):
        encode_header([("__metadata__", "U8", [1], 1)])


def test_refuses_existing_destination(tmp_path: Path) -> None:
    src = _library_file(tmp_path)
    dst = tmp_path / "exists"
    dst.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        write_shard(layout_shard(_from_library(src)), dst)
    assert dst.read_bytes() == b"keep me"


@pytest.mark.parametrize("err", [errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
def test_kernel_copy_refused_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    src = _library_file(tmp_path)
    layout = layout_shard(_from_library(src), {"format": "pt"})

    def refuse(*a: object) -> int:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(sw.os, "copy_file_range", refuse)
    out = tmp_path / "o"
    methods = write_shard(layout, out)
    assert methods == {"user"}
    assert out.read_bytes() == src.read_bytes()


def test_kernel_copy_short_then_zero_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _library_file(tmp_path)
    layout = layout_shard(_from_library(src), {"format": "pt"})
    real = os.copy_file_range
    calls = {"n": 0}

    def partial(s: int, d: int, count: int, so: int, do: int) -> int:
        calls["n"] += 1
        return real(s, d, min(count, 5), so, do) if calls["n"] == 1 else 0

    monkeypatch.setattr(sw.os, "copy_file_range", partial)
    out = tmp_path / "o"
    write_shard(layout, out)
    assert out.read_bytes() == src.read_bytes()


def test_source_shorter_than_planned_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "short"
    src.write_bytes(b"abc")
    layout = layout_shard([OutTensor("a", "U8", (10,), 10, str(src), 0)])
    with pytest.raises(OSError):
        write_shard(layout, tmp_path / "o", kernel_copy=False)
