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

from mosaic._base.errors import SafetensorsError
from mosaic._formats.safetensors_reader import (
    MAX_HEADER_SIZE,
    DuplicateKey,
    parse_header,
    read_header,
    strict_json_loadb,
    strict_json_loads,
)

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


# --- the fast parse (orjson + a colon count) can never accept what the strict parse refuses --------

_E0 = json.dumps(entry("F16", [2], 0, 4), separators=(",", ":"))
_E1 = json.dumps(entry("F16", [2], 4, 8), separators=(",", ":"))


@pytest.mark.parametrize(
    ("header", "key"),
    [
        # the same key spelled with an escape: a plain text comparison would miss it
        ('{"a":' + _E0 + ',"\\u0061":' + _E1 + "}", "a"),
        # an escaped colon inside a string would balance the member the duplicate dropped
        ('{"a":' + _E0 + ',"a":' + _E1 + ',"__metadata__":{"k":"x\\u003ay"}}', "a"),
        # colons inside strings (names and metadata values) around a duplicate
        ('{"__metadata__":{"k:1":"v:2"},"t:0":' + _E0 + ',"t:0":' + _E1 + "}", "t:0"),
        # a duplicate inside an entry
        ('{"a":{"dtype":"F16","dtype":"F16","shape":[2],"data_offsets":[0,4]},"b":' + _E1 + "}", "dtype"),
        # a duplicate inside __metadata__, and __metadata__ twice
        ('{"__metadata__":{"k":"1","k":"2"},"a":' + _E0 + ',"b":' + _E1 + "}", "k"),
        ('{"__metadata__":{"k":"1"},"__metadata__":{"j":"2"},"a":' + _E0 + ',"b":' + _E1 + "}", "__metadata__"),
    ],
)
def test_duplicates_the_fast_parse_must_not_miss(tmp_path: Path, header: str, key: str) -> None:
    e = _rule(tmp_path, header, bytes(8))
    assert (e.rule, e.key) == ("DuplicateKey", key)


def test_colons_and_escapes_in_valid_headers_parse_the_same(tmp_path: Path) -> None:
    hdr = '{"__metadata__":{"a:b":"c::d","e":"\\u00e9\\n"},"t:0":' + _E0 + ',"t\\u003a1":' + _E1 + "}"
    h = read_header(raw_file(tmp_path / "c.safetensors", hdr, bytes(8)))
    assert h.metadata == {"a:b": "c::d", "e": "é\n"}
    assert h.names() == ["t:0", "t:1"]


def test_out_of_order_entries_are_sorted_by_offset(tmp_path: Path) -> None:
    h = read_header(raw_file(tmp_path / "o.safetensors", '{"b":' + _E1 + ',"a":' + _E0 + "}", bytes(8)))
    assert h.names() == ["a", "b"]


# JSON texts built from pieces that stress the proof: repeated keys, colons in strings, escapes,
# numbers orjson and Python read differently (huge integers, 1e400), NaN, nesting
_keys = st.sampled_from(["a", "b", "a:b", ":", "\\u0061", "\\u003a", "é", "\\\\", "\\\""])
_scalars = st.sampled_from(
    ['"x"', '"x:y"', '"\\u003a"', "1", "-0", "1.5", "1e400", "18446744073709551616", "-9223372036854775809",
     "9223372036854775808", "NaN", "Infinity", "true", "null", '"\\ud800"']
)


def _json_texts() -> st.SearchStrategy[str]:
    def obj(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        member = st.tuples(_keys, children).map(lambda kv: f'"{kv[0]}":{kv[1]}')
        return st.lists(member, max_size=4).map(lambda ms: "{" + ",".join(ms) + "}")

    def arr(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.lists(children, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")

    return st.recursive(_scalars, lambda c: st.one_of(obj(c), arr(c)), max_leaves=12)


def _outcome(fn: object, arg: object) -> object:
    try:
        return ("ok", repr(fn(arg)))  # type: ignore[operator]
    except DuplicateKey as e:
        return ("dup", e.key)
    except (ValueError, RecursionError) as e:
        return ("error", type(e).__name__)


@settings(max_examples=FUZZ_EXAMPLES * 3, deadline=None)
@given(text=_json_texts())
def test_fuzz_fast_json_equals_strict_json(text: str) -> None:
    assert _outcome(strict_json_loadb, text.encode()) == _outcome(strict_json_loads, text)


def test_fast_json_keeps_huge_integers_exact() -> None:
    assert strict_json_loadb(b'{"n": 18446744073709551616, "m": [-9223372036854775809]}') == {
        "n": 18446744073709551616,
        "m": [-9223372036854775809],
    }
    with pytest.raises(DuplicateKey) as ei:
        strict_json_loadb(b'{"x": {"k": 1, "k:": 2, "k": 3}}')
    assert ei.value.key == "k"


def test_plain_documents_take_the_fast_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A header or document without escapes or duplicates never needs the slow parser (the speed the
    bench measures depends on it); one with a duplicate always gets it, to name the key."""
    import mosaic._formats.safetensors_reader as reader

    calls: list[str] = []
    slow = reader.strict_json_loads
    monkeypatch.setattr(reader, "strict_json_loads", lambda text: calls.append(text) or slow(text))
    h = read_header(raw_file(tmp_path / "f.safetensors", '{"__metadata__":{"format":"pt"},"a":' + _E0 + ',"b":' + _E1 + "}", bytes(8)))
    assert h.names() == ["a", "b"] and reader.strict_json_loadb(b'{"x": [1, {"y": "a:b"}]}') == {"x": [1, {"y": "a:b"}]}
    assert calls == []
    with pytest.raises(DuplicateKey):
        reader.strict_json_loadb(b'{"x": 1, "x": 1}')
    assert calls == ['{"x": 1, "x": 1}']


@pytest.mark.parametrize(
    ("text", "slow"),
    [
        (b"1234567890123456789", True),
        (b"-1234567890123456789", True),
        (b'{"a": [1, 12345678901234567890123]}', True),
        (b'{"a":\n-9223372036854775809}', True),
        (b'{"a": "12345678901234567890123"}', False),
        (b'{"a": "x-12345678901234567890123"}', False),
        (b'{"a": 1.12345678901234567890123}', False),
        (b'{"a": 123456789012345678}', False),
    ],
)
def test_long_integers_are_found_outside_strings(text: bytes, slow: bool) -> None:
    from mosaic._formats.safetensors_reader import _has_long_integer

    assert _has_long_integer(text) is slow
    assert strict_json_loadb(text) == strict_json_loads(text.decode())


@pytest.mark.parametrize(
    "raw",
    [b"\xef\xbb\xbf{}", b"{} x", b'{"a":1}\x00', b'\t{"a" : 1 }\n', b'{"a":"\x01"}', b'{"a":"\x7f"}',
     b"[1e5, -0.0, 1E-400]", b'{"a": 1.7976931348623157e309}', b'"\xed\xa0\x80"', b'{"":1, "":2}', b"null", b'{"a":tru}'],
)
def test_fast_json_edges_match_the_strict_parse(raw: bytes) -> None:
    """Byte-level edges where orjson and Python's json could part: BOM, trailing bytes, control
    characters, overflowing floats, surrogates, empty keys."""
    try:
        want = _outcome(strict_json_loads, raw.decode("utf-8"))
    except UnicodeDecodeError:
        want = ("error", "UnicodeDecodeError")
    assert _outcome(strict_json_loadb, raw) == want


@pytest.mark.parametrize("literal", ["1e400", "-1e400", "1.5e309"])
def test_a_float_literal_that_overflows_is_refused_like_infinity(literal: str) -> None:
    from mosaic._formats.safetensors_reader import strict_json_loadb, strict_json_loads

    for parse in (strict_json_loads, lambda t: strict_json_loadb(t.encode())):
        with pytest.raises(ValueError, match="overflows"):
            parse('{"rate": {"exact": ' + literal + '}}')


_dtypes = st.sampled_from(["F16", "I16", "U8", "F4", "F6_E2M3", "BOOL", "X9", "f16"])
_dims = st.one_of(st.integers(0, 5), st.sampled_from([-1, True, 1.0, "2", None]))
_entry_values = st.fixed_dictionaries(
    {
        "dtype": st.one_of(_dtypes, st.integers(0, 2), st.lists(st.integers(), max_size=1)),
        "shape": st.one_of(st.lists(_dims, max_size=3), st.integers(0, 3)),
        "data_offsets": st.one_of(st.lists(st.integers(-1, 40), min_size=0, max_size=3), st.none()),
    },
    optional={"extra": st.integers(0, 1)},
)


@settings(max_examples=FUZZ_EXAMPLES * 3, deadline=None)
@given(
    entries=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), _entry_values), max_size=4, unique_by=lambda kv: kv[0]),
    metadata=st.one_of(st.none(), st.just({"format": "pt"}), st.just({"n": 1}), st.just("pt")),
    data=st.integers(0, 48),
    tiled=st.booleans(),
)
def test_fast_header_columns_equal_the_strict_reader(entries: list, metadata: object, data: int, tiled: bool) -> None:
    """The column-wise fast header never accepts what the rule-by-rule reader refuses, and what it
    accepts reads the same: names, dtypes, shapes, ranges, data order, metadata."""
    import mosaic._formats.safetensors_reader as reader

    if tiled:  # mostly valid headers: offsets that tile the data exactly, from their sizes
        pos, fixed = 0, []
        for name, e in entries:
            shape = e["shape"] if isinstance(e["shape"], list) else []
            n = 1
            for d in shape:
                n *= d if type(d) is int and d > 0 else 1
            size = n * 2
            fixed.append((name, {**e, "data_offsets": [pos, pos + size]}))
            pos += size
        entries, data = fixed, pos
    doc = dict(entries)
    if metadata is not None:
        doc = {"__metadata__": metadata, **doc}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    head = len(raw).to_bytes(8, "little") + raw
    size = len(head) + data

    def outcome(fast: bool) -> object:
        try:
            if fast:
                h = reader._fast_header("f", raw, size)
            else:
                real = reader._fast_header
                reader._fast_header = lambda *a: (_ for _ in ()).throw(reader._Unproven())  # type: ignore[assignment]
                try:
                    h = reader.parse_header("f", head, size)
                finally:
                    reader._fast_header = real  # type: ignore[assignment]
        except reader._Unproven:
            return "unproven"
        except SafetensorsError as e:
            return ("error", e.rule)
        return ("ok", h.tensors, h.metadata, h.header_len)

    fast, slow = outcome(True), outcome(False)
    if fast != "unproven":
        assert fast == slow
