"""The strict reader: round trips against the library, one crafted file per rule, and fuzzing."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from mosaic.errors import SafetensorsError
from mosaic.formats.safetensors_reader import MAX_HEADER_SIZE, parse_header, read_header

FUZZ_EXAMPLES = int(os.environ.get("MOSAIC_FUZZ_EXAMPLES", "300"))


def raw_file(path: Path, header: bytes | str, data: bytes = b"", *, length: int | None = None) -> Path:
    hb = header.encode() if isinstance(header, str) else header
    n = len(hb) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + hb + data)
    return path


def entry(dtype: str, shape: list, a: int, b: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}


def test_round_trip_library_file(tmp_path: Path) -> None:
    tensors = {
        "b.weight": np.arange(6, dtype=np.float16).reshape(2, 3),
        "a.scalar": np.array(7, dtype=np.int32),
        "z.empty": np.zeros((0, 4), dtype=np.float32),
        "u": np.arange(5, dtype=np.uint8),
    }
    p = tmp_path / "x.safetensors"
    save_file(tensors, p, metadata={"format": "pt"})
    h = read_header(p)
    assert h.metadata == {"format": "pt"}
    assert set(h.names()) == set(tensors)
    assert h.header_len % 8 == 0
    raw = p.read_bytes()
    for name, arr in tensors.items():
        t = h[name]
        assert t.shape == arr.shape
        a, b = h.file_range(name)
        assert raw[a:b] == arr.tobytes()
    assert h["a.scalar"].shape == () and h["a.scalar"].nbytes == 4
    assert h["z.empty"].nbytes == 0


def test_minified_unpadded_header_without_metadata(tmp_path: Path) -> None:
    hdr = json.dumps({"x": entry("I16", [3], 0, 6), "y": entry("BF16", [1], 6, 8)}, separators=(",", ":"))
    assert (len(hdr)) % 8 != 0
    p = raw_file(tmp_path / "m.safetensors", hdr, bytes(8))
    h = read_header(p)
    assert h.metadata is None and h.names() == ["x", "y"] and h.data_start == 8 + len(hdr)


def test_header_only_file_with_no_tensors(tmp_path: Path) -> None:
    h = read_header(raw_file(tmp_path / "e.safetensors", "{}"))
    assert len(h) == 0 and h.data_size == 0


def _rule(tmp_path: Path, header: bytes | str, data: bytes = b"", length: int | None = None) -> SafetensorsError:
    p = raw_file(tmp_path / "bad.safetensors", header, data, length=length)
    with pytest.raises(SafetensorsError) as ei:
        read_header(p)
    assert str(p) in str(ei.value)
    return ei.value


@pytest.mark.parametrize(
    ("header", "data", "rule", "key"),
    [
        ('{"a":' + json.dumps(entry("F16", [2], 0, 4)) + ',"a":' + json.dumps(entry("F16", [2], 4, 8)) + "}", bytes(8), "DuplicateKey", "a"),
        ('{"a":' + json.dumps(entry("Q4", [2], 0, 4)) + "}", bytes(4), "UnknownDtype", "a"),
        ('{"a":' + json.dumps(entry("F16", [3], 0, 4)) + "}", bytes(4), "TensorInvalidInfo", "a"),
        ('{"a":' + json.dumps(entry("F16", [-1], 0, 4)) + "}", bytes(4), "InvalidShape", "a"),
        ('{"a":' + json.dumps(entry("F16", [True], 0, 2)) + "}", bytes(2), "InvalidShape", "a"),
        ('{"a":' + json.dumps(entry("F16", [2], 4, 0)) + "}", bytes(4), "InvalidOffset", "a"),
        ('{"a":' + json.dumps(entry("F16", [2], 2, 6)) + "}", bytes(6), "HoleInData", "a"),
        ('{"a":' + json.dumps(entry("F16", [2], 0, 4)) + ',"b":' + json.dumps(entry("F16", [2], 2, 6)) + "}", bytes(6), "OverlappingTensors", "b"),
        ('{"a":' + json.dumps(entry("F16", [2], 0, 4)) + "}", bytes(5), "TrailingBytes", None),
        ('{"a":' + json.dumps(entry("F16", [2], 0, 4)) + "}", bytes(3), "TruncatedFile", None),
        ('{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4],"extra":1}}', bytes(4), "InvalidTensorInfo", "a"),
        ('{"a":{"dtype":"F16","shape":[2]}}', bytes(4), "InvalidTensorInfo", "a"),
        ('{"a":[1,2]}', b"", "InvalidTensorInfo", "a"),
        ('{"__metadata__":{"k":1}}', b"", "InvalidMetadata", None),
        ('{"a":' + json.dumps(entry("F4", [3], 0, 2)) + "}", bytes(2), "MisalignedSlice", "a"),
        ("[1,2]", b"", "InvalidHeaderStart", None),
        ('{"a":', b"", "InvalidHeaderDeserialization", None),
        ('{"a":NaN}', b"", "InvalidHeaderDeserialization", None),
        (b'{"\xff":1}', b"", "InvalidHeaderUtf8", None),
        ("{" * 100000, b"", "InvalidHeaderDeserialization", None),
    ],
)
def test_each_rule_refused(tmp_path: Path, header: str, data: bytes, rule: str, key: str | None) -> None:
    e = _rule(tmp_path, header, data)
    assert e.rule == rule
    assert e.key == key


def test_header_size_cap_and_length_past_end(tmp_path: Path) -> None:
    assert _rule(tmp_path, b"{}", length=MAX_HEADER_SIZE + 1).rule == "HeaderTooLarge"
    assert _rule(tmp_path, b"{}", length=1 << 63).rule == "HeaderTooLarge"
    assert _rule(tmp_path, b"{}", length=100).rule == "InvalidHeaderLength"
    (tmp_path / "tiny").write_bytes(b"abc")
    with pytest.raises(SafetensorsError) as ei:
        read_header(tmp_path / "tiny")
    assert ei.value.rule == "HeaderTooSmall"


def test_huge_shape_is_refused_without_blowing_up(tmp_path: Path) -> None:
    e = _rule(tmp_path, '{"a":' + json.dumps(entry("F32", [1 << 60, 1 << 60], 0, 4)) + "}", bytes(4))
    assert e.rule == "TensorInvalidInfo"
    e = _rule(tmp_path, '{"a":' + json.dumps(entry("F32", [1], 0, 1 << 63)) + "}", bytes(4))
    assert e.rule == "TensorInvalidInfo"


def test_spaces_padding_is_accepted(tmp_path: Path) -> None:
    hdr = json.dumps({"a": entry("U8", [3], 0, 3)}) + "       "
    assert read_header(raw_file(tmp_path / "p.safetensors", hdr, b"abc"))["a"].nbytes == 3


# --- fuzzing: any input ends in a clean parse or a SafetensorsError -------------------------------

_dtypes = st.sampled_from(["F16", "BF16", "I16", "I32", "U8", "F32", "F64", "F4", "Q8", "", "f16"])
_ints = st.one_of(st.integers(-3, 40), st.integers(0, 1 << 70), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3))
_entries = st.fixed_dictionaries(
    {"dtype": _dtypes, "shape": st.lists(_ints, max_size=4), "data_offsets": st.lists(_ints, max_size=3)},
    optional={"x": st.integers()},
)
_headers = st.dictionaries(st.text(max_size=6), st.one_of(_entries, st.integers(), st.text(), st.none()), max_size=5)


def _check_parse(head: bytes, size: int) -> None:
    try:
        h = parse_header("fuzz", head, size)
    except SafetensorsError:
        return
    pos = 0
    for t in h.tensors:
        assert t.begin == pos
        pos = t.end
    assert h.data_start + pos == size


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hdr=_headers, extra=st.integers(0, 64), pad=st.integers(0, 9))
def test_fuzz_structured_headers(hdr: dict, extra: int, pad: int) -> None:
    hb = (json.dumps(hdr) + " " * pad).encode()
    _check_parse(struct.pack("<Q", len(hb)) + hb, 8 + len(hb) + extra)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(blob=st.binary(max_size=200), size_delta=st.integers(-10, 10))
def test_fuzz_raw_bytes(blob: bytes, size_delta: int) -> None:
    _check_parse(blob, max(0, len(blob) + size_delta))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data())
def test_fuzz_mutated_valid_file(data: st.DataObject) -> None:
    hb = json.dumps({"a": entry("F16", [2, 2], 0, 8), "b": entry("I32", [], 8, 12)}).encode()
    blob = bytearray(struct.pack("<Q", len(hb)) + hb + bytes(12))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    _check_parse(bytes(blob), len(blob))
