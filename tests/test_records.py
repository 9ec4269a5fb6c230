"""PROVENANCE serialization and schema checks: exact round trips, and the fast path never lenient."""

from __future__ import annotations

import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic._provenance.records import _surely_valid_tensor, _validator, dumps, schema

EXAMPLES = int(os.environ.get("MOSAIC_FUZZ_EXAMPLES", "300"))
_text = st.text(max_size=12)
_tensor = st.fixed_dictionaries(
    {
        "name": st.one_of(_text, st.integers()),
        "file": st.one_of(st.sampled_from(["a.safetensors", "../x", "/abs", "d/e", "C:x", "a\\b", ""]), _text),
        "dtype": st.one_of(st.sampled_from(["F16", "I16", ""]), _text),
        "shape": st.one_of(st.lists(st.one_of(st.integers(-2, 5), st.booleans(), st.floats(0, 3)), max_size=3), st.none()),
        "nbytes": st.one_of(st.integers(-2, 10), st.floats(0, 2), st.booleans()),
        "sha256": st.one_of(st.just("a" * 64), st.just("A" * 64), st.just("a" * 63), _text),
        "source": st.one_of(st.sampled_from(["base", "q3", "Q3", "a b", ""]), _text),
    },
    optional={"extra": st.integers()},
)


@settings(max_examples=EXAMPLES * 3, deadline=None)
@given(t=_tensor)
def test_fast_tensor_check_never_accepts_what_the_schema_rejects(t: dict) -> None:
    item_schema = {**schema()["properties"]["tensors"]["items"], "$defs": schema()["$defs"]}
    if _surely_valid_tensor(t):
        assert not list(_validator().evolve(schema=item_schema).iter_errors(t))


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), _text),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(_text, children, max_size=3)),
    max_leaves=10,
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    doc=st.fixed_dictionaries(
        {
            "schema": _text,
            "sources": st.dictionaries(_text, st.fixed_dictionaries({"path": _text, "files": st.lists(_json, max_size=3)}), max_size=2),
            "tensors": st.lists(_json, max_size=4),
            "rate": _json,
        }
    )
)
def test_dumps_round_trips(doc: dict) -> None:
    data = dumps(doc)
    assert json.loads(data) == doc
    assert dumps(json.loads(data)) == data


def test_shipped_schema_is_the_project_root_schema() -> None:
    """The build validates against the packaged copy; users read the one at the project root."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "PROVENANCE.schema.json"
    assert json.loads(root.read_text()) == schema()


_ORDER = ("name", "file", "dtype", "shape", "nbytes", "sha256", "source")


@settings(max_examples=EXAMPLES * 3, deadline=None)
@given(ts=st.lists(_tensor, max_size=4))
def test_column_check_accepts_a_list_only_when_every_item_passes(ts: list) -> None:
    """The column-by-column check is the item check over a whole list, never more lenient."""
    from mosaic._provenance.records import _surely_valid_tensors

    if _surely_valid_tensors(ts):
        assert all(_surely_valid_tensor(t) for t in ts)


def test_column_check_refuses_each_kind_of_bad_record() -> None:
    from mosaic._provenance.records import _surely_valid_tensors, validation_errors

    good = {"name": "a.weight", "file": "model.safetensors", "dtype": "F16", "shape": [2, 3], "nbytes": 12, "sha256": "0" * 64, "source": "base"}
    assert _surely_valid_tensors([good, {**good, "name": "b"}])
    for field, bad in [("name", ""), ("file", "../x"), ("file", "a\\b"), ("dtype", ""), ("shape", [True]), ("shape", [-1]),
                       ("shape", None), ("nbytes", 1.0), ("sha256", "A" * 64), ("sha256", "0" * 64 + "\n"), ("sha256", "0" * 65),
                       ("source", "Q3"), ("name", 3)]:
        records = [good, {**good, field: bad}]
        assert not _surely_valid_tensors(records), (field, bad)
        doc = {"tensors": records}
        errors = [e for e in validation_errors(doc) if e.startswith("tensors/1")]
        # stricter than the schema in two places: its `$` allows a final newline, and 1.0 is an integer to it
        assert errors or (field, bad) in {("sha256", "0" * 64 + "\n"), ("nbytes", 1.0)}, (field, bad)


_plain = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    ts=st.lists(
        st.fixed_dictionaries({
            "name": _plain, "file": _plain, "dtype": _plain,
            "shape": st.lists(st.one_of(st.integers(0, 2**70), st.booleans()), max_size=3),
            "nbytes": st.one_of(st.integers(0, 2**70), st.floats(0, 2)), "sha256": _plain, "source": _plain,
        }),
        max_size=4,
    ),
    shuffle=st.booleans(),
)
def test_fast_tensor_lines_are_the_encoders_bytes(ts: list, shuffle: bool) -> None:
    """The f-string lines of ``tensors`` are byte for byte what the generic encoder writes (escapes,
    non-ASCII, booleans and floats included: those records take the encoder)."""
    from mosaic._provenance.records import _ENCODER, _dump_list

    if shuffle:
        ts = [dict(reversed(t.items())) for t in ts]
    assert _dump_list(ts, "    ", tensors=True) == _dump_list(ts, "    ")
    if ts and all(tuple(t) == _ORDER for t in ts):
        assert _dump_list(ts, "    ", tensors=True).split("\n")[1].rstrip(",") == "    " + _ENCODER.encode(ts[0])


def test_dumps_layout_is_pinned() -> None:
    """The file's layout, byte for byte: two builds, old and new code, must write the same bytes."""
    doc = {
        "schema": "mosaic.provenance/v1",
        "sources": {"base": {"path": "b", "rate": 2.0, "files": [{"name": "a", "size": 1, "sha256": "0" * 64}]}},
        "empty": [],
        "tensors": [{"name": "t", "file": "m.safetensors", "dtype": "F16", "shape": [2, 3], "nbytes": 12, "sha256": "1" * 64, "source": "base"}],
        "checks": [{"name": "c", "ok": True, "detail": "é"}],
    }
    assert dumps(doc) == (
        '{\n  "schema": "mosaic.provenance/v1",\n  "sources": {\n    "base": {\n      "path": "b",\n      "rate": 2.0,\n'
        f'      "files": [\n        {{"name": "a", "size": 1, "sha256": "{"0" * 64}"}}\n      ]\n    }}\n  }},\n  "empty": [],\n'
        f'  "tensors": [\n    {{"name": "t", "file": "m.safetensors", "dtype": "F16", "shape": [2, 3], "nbytes": 12, "sha256": "{"1" * 64}", "source": "base"}}\n  ],\n'
        '  "checks": [\n    {"name": "c", "ok": true, "detail": "é"}\n  ]\n}\n'
    ).encode()


@settings(max_examples=EXAMPLES, deadline=None)
@given(ts=st.lists(_tensor, max_size=5))
def test_columns_read_write_and_validate_as_the_records_they_hold(ts: list) -> None:
    """The build's tensor records as columns: the same JSON bytes, the same schema verdicts, and
    equal to the list of dicts a reader parses back, whatever the values."""
    from mosaic._provenance.records import TensorColumns, validation_errors

    plain = [{k: t[k] for k in _ORDER} for t in ts]
    cols = TensorColumns(**{k: [tuple(t[k]) if k == "shape" and isinstance(t[k], list) else t[k] for t in plain]
                            for k in _ORDER})
    as_lists = [{**t, "shape": list(t["shape"])} if isinstance(t["shape"], list) else t for t in plain]
    doc = {"schema": "x", "tensors": cols}
    assert dumps(doc) == dumps({"schema": "x", "tensors": as_lists})
    assert cols == as_lists and list(cols) == as_lists and len(cols) == len(as_lists)
    assert validation_errors(doc) == validation_errors({"schema": "x", "tensors": as_lists})


def test_columns_of_a_real_shape_stream_in_chunks(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Many records: written a chunk at a time, byte-identical to the whole-list encoding."""
    import mosaic._provenance.records as records

    monkeypatch.setattr(records, "_ROWS_PER_CHUNK", 3)
    n = 10
    cols = records.TensorColumns(
        name=[f"t{i}" for i in range(n)], file=["m.safetensors"] * n, dtype=["I16"] * n,
        shape=[(i, 2) for i in range(n)], nbytes=[4 * i for i in range(n)], sha256=["ab" * 32] * n, source=["base"] * n,
    )
    chunks = list(records.dump_chunks({"tensors": cols}))
    assert len(chunks) > 4
    assert b"".join(chunks) == dumps({"tensors": list(cols)})
    assert json.loads(b"".join(chunks))["tensors"][7] == cols[7] == cols[-3]


@settings(max_examples=EXAMPLES, deadline=None)
@given(ts=st.lists(_tensor, max_size=5), shuffle=st.booleans())
def test_parsed_records_as_columns_read_and_validate_as_themselves(ts: list, shuffle: bool) -> None:
    """An audit turns the parsed records into columns when each is a dict of exactly the seven
    fields with a list shape: they then read back as the very dicts, with the same schema
    verdicts; anything else (an extra field, a shape that is not a list) stays as it is."""
    from mosaic._provenance.records import as_columns, validation_errors

    parsed = json.loads(json.dumps([dict(reversed(t.items())) if shuffle else t for t in ts]))
    cols = as_columns(parsed)
    plain = bool(parsed) and all(set(t) == set(_ORDER) and isinstance(t["shape"], list) for t in parsed)
    assert (cols is not None) is plain
    if cols is not None:
        assert list(cols) == [{k: t[k] for k in _ORDER} for t in parsed] and cols == parsed
        assert validation_errors({"schema": "x", "tensors": cols}) == validation_errors({"schema": "x", "tensors": parsed})
