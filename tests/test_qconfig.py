"""quantization_config.json read entry by entry: the same verdict as the whole strict parse, always.

The reader proves, from the text, that its skeleton and its entries parsed one by one are the whole
document; these tests try to fool that proof (members that look like entries elsewhere, repeated keys
inside and outside entries, escapes, broken entries) and compare every result with the whole parse.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic._base.errors import CheckpointError, FormatError
from mosaic._checkpoint.jsonfile import parse_json
from mosaic._checkpoint.qconfig import QConfigRead, prove_spans, read_qconfig, summarize
from mosaic._formats.safetensors_reader import TensorInfo

EXAMPLES = int(os.environ.get("MOSAIC_FUZZ_EXAMPLES", "300"))
INFO = {
    f"m.{i}.{s}": TensorInfo(f"m.{i}.{s}", "I16", (2, 3), 0, 12)
    for i in range(4)
    for s in ("trellis", "suh")
}


def _entry(i: int, bits: int = 2) -> dict:
    return {
        "stored_tensors": {f"m.{i}.{s}": {"shape": [2, 3], "n_bytes": 12, "dtype": "torch.int16"} for s in ("trellis", "suh")},
        "quant_format": "exl3",
        "bits_per_weight": bits,
    }


def _doc(n: int = 4, **top: object) -> dict:
    return {"quant_method": "exl3", "bits": 2.0, **top, "tensor_storage": {f"m.{i}": _entry(i) for i in range(n)}}


def _whole(path: Path, info: dict[str, TensorInfo] = INFO) -> tuple[dict, list | None]:
    """The reference: the whole text parsed strictly, then summarized."""
    q = parse_json(path.read_bytes(), path, "quantization config")
    if not isinstance(q, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    storage = q.get("tensor_storage")
    top = {k: v for k, v in q.items() if k != "tensor_storage"}
    return top, [summarize(k, e, info) for k, e in storage.items()] if isinstance(storage, dict) else None


def _same_as_whole(tmp_path: Path, text: bytes, info: dict[str, TensorInfo] = INFO) -> QConfigRead | None:
    path = tmp_path / "quantization_config.json"
    path.write_bytes(text)
    try:
        want = _whole(path, info)
    except (FormatError, CheckpointError) as e:
        with pytest.raises(type(e)) as got:
            read_qconfig(path, info)
        assert str(got.value) == str(e)
        return None
    got_read = read_qconfig(path, info)
    assert (got_read.top, got_read.entries) == want
    return got_read


def test_exllamav3_layout_is_read_entry_by_entry(tmp_path: Path) -> None:
    text = json.dumps(_doc(), indent=4).encode()
    r = _same_as_whole(tmp_path, text)
    assert r is not None and r.offsets is not None and r.top == {"quant_method": "exl3", "bits": 2.0}
    assert [e.key for e in r.entries or []] == [f"m.{i}" for i in range(4)]
    assert all(e.problems == () and e.bits_per_weight == 2 for e in r.entries or [])
    # the names kept are the headers' own string objects, not the parser's copies
    assert r.entries and r.entries[0].names and r.entries[0].names[0] is INFO["m.0.trellis"].name


@pytest.mark.parametrize(
    "mutate, by_spans",
    [
        # a member shaped like an entry, in another top-level object: not a tensor_storage member
        (lambda d: {"extra": {"m.9": {"stored_tensors": {}}}, **d}, False),
        # the same key as a real entry, elsewhere at entry indentation
        (lambda d: {"calibration": {"m.1": {"rows": 1}}, **d}, False),
        # an escape anywhere: the placeholder could be forged, so the whole text is parsed
        (lambda d: {**d, "note": 'a "quoted" word'}, False),
        # an entry that is not an object stays in the skeleton: no proof
        (lambda d: {**d, "tensor_storage": {**d["tensor_storage"], "m.3": 5}}, False),
        # an entry without stored_tensors
        (lambda d: {**d, "tensor_storage": {**d["tensor_storage"], "m.3": {"bits_per_weight": 2}}}, True),
        # a stored tensor that disagrees with its header, one in no shard
        (lambda d: {**d, "tensor_storage": {**d["tensor_storage"], "m.2": {**_entry(2), "stored_tensors": {
            "m.2.trellis": {"shape": [3, 3], "n_bytes": 12, "dtype": "torch.int8"}, "ghost": {}}}}}, True),
    ],
)
def test_texts_that_only_look_like_the_layout(tmp_path: Path, mutate, by_spans: bool) -> None:  # type: ignore[no-untyped-def]
    r = _same_as_whole(tmp_path, json.dumps(mutate(_doc()), indent=4).encode())
    assert r is not None and (r.offsets is not None) is by_spans


def test_repeated_keys_are_refused_naming_the_key(tmp_path: Path) -> None:
    text = json.dumps(_doc(), indent=4).encode()
    # a tensor_storage key twice (two whole entries with one name)
    twice = text.replace(b'"m.1": {', b'"m.0": {', 1)
    assert _same_as_whole(tmp_path, twice) is None
    with pytest.raises(FormatError, match=r"duplicate key 'm\.0'"):
        read_qconfig(tmp_path / "quantization_config.json", INFO)
    # a key repeated inside one entry
    inside = text.replace(b'"quant_format": "exl3",', b'"quant_format": "exl3",\n            "bits_per_weight": 3,', 1)
    assert _same_as_whole(tmp_path, inside) is None
    with pytest.raises(FormatError, match="duplicate key 'bits_per_weight'"):
        read_qconfig(tmp_path / "quantization_config.json", INFO)
    # a top-level key repeated, outside every entry
    top = text.replace(b'"bits": 2.0,', b'"bits": 2.0,\n    "bits": 3.0,', 1)
    assert _same_as_whole(tmp_path, top) is None


def test_broken_entries_and_documents(tmp_path: Path) -> None:
    text = json.dumps(_doc(), indent=4).encode()
    for broken in (
        text.replace(b'"n_bytes": 12', b'"n_bytes": 12,', 1),  # trailing comma inside an entry
        text.replace(b"\n        }", b"\n        ]", 1),  # an entry that never closes as an object
        text[:-3],  # truncated
        text.replace(b'"quant_method"', b'"quant_method" "x"', 1),  # broken outside the entries
        b"[" + text + b"]",  # not an object
    ):
        _same_as_whole(tmp_path, broken)


_key = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), _key),
    lambda c: st.one_of(st.lists(c, max_size=2), st.dictionaries(_key, c, max_size=2)),
    max_leaves=6,
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    storage=st.dictionaries(st.one_of(st.sampled_from([f"m.{i}" for i in range(4)]), _key), st.one_of(
        st.builds(_entry, st.integers(0, 3), st.integers(1, 8)), st.dictionaries(_key, _value, max_size=3), _value,
    ), max_size=5),
    top=st.dictionaries(_key.filter(lambda k: k != "tensor_storage"), _value, max_size=3),
    cut=st.integers(0, 400),
    junk=st.sampled_from([b"", b",", b"}", b'"x": 1', b'\n        "m.0": {', b'\n        }', b'"\\u0000"']),
)
def test_any_text_reads_as_its_whole_parse(tmp_path_factory, storage, top, cut, junk) -> None:  # type: ignore[no-untyped-def]
    """Any document, written by exllamav3's dumps or damaged at any point: the reader's result or
    refusal is exactly the whole strict parse's."""
    tmp = tmp_path_factory.mktemp("q")
    text = json.dumps({**top, "tensor_storage": storage}, indent=4).encode()
    _same_as_whole(tmp, text)
    at = min(cut, len(text))
    _same_as_whole(tmp, text[:at] + junk + text[at:])


def test_the_proof_needs_every_entry_in_tensor_storage() -> None:
    doc = _doc(2)
    text = json.dumps(doc, indent=4).encode()
    proved = prove_spans(text)
    assert proved is not None and [s.key for s in proved[1]] == ["m.0", "m.1"]
    nested = json.dumps({"outer": doc}, indent=4).encode()  # entries at 12 spaces: nothing to prove
    assert prove_spans(nested) is None


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    storage=st.dictionaries(_key, st.one_of(st.dictionaries(_key, _value, max_size=2), _value), max_size=4),
    top=st.dictionaries(_key.filter(lambda k: k != "tensor_storage"), st.dictionaries(_key, _value, max_size=2), max_size=2),
    cut=st.integers(0, 300),
    junk=st.sampled_from([b"", b"\n        }", b'\n        "k": {\n', b"\n        },", b'\n        "\xff": {\n']),
)
def test_entry_spans_found_at_c_speed_are_the_line_scan_s(storage, top, cut, junk) -> None:  # type: ignore[no-untyped-def]
    from mosaic._checkpoint.qconfig import _entry_span_scan, entry_span_list

    text = json.dumps({**top, "tensor_storage": storage}, indent=4).encode()
    at = min(cut, len(text))
    for t in (text, text[:at] + junk + text[at:]):
        assert entry_span_list(t) == _entry_span_scan(t)


def _stored(names: list[str], shape: list[int], dtype: str = "torch.int16") -> dict:
    return {n: {"shape": shape, "n_bytes": 2 * shape[0], "dtype": dtype} for n in names}


def test_entries_alike_but_for_their_key_are_parsed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """exllamav3's entries differ in key and shapes only: one parse per shape, not per entry."""
    import mosaic._checkpoint.qconfig as q

    keys = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(3) for e in range(20) for p in ("up_proj", "down_proj")]
    info = {f"{k}.{s}": TensorInfo(f"{k}.{s}", "I16", (8 if "up" in k else 4,), 0, 16 if "up" in k else 8) for k in keys for s in ("trellis", "suh")}
    storage = {k: {"stored_tensors": _stored([f"{k}.trellis", f"{k}.suh"], [8 if "up" in k else 4]), "bits_per_weight": 2} for k in keys}
    text = json.dumps({"bits": 2, "tensor_storage": storage}, indent=4).encode()
    parses: list[str] = []
    real = q.strict_json_loads
    monkeypatch.setattr(q, "strict_json_loads", lambda t: parses.append(t) or real(t))
    monkeypatch.setattr(q, "member_batches", None)  # the batched parse of every entry is not reached
    r = _same_as_whole(tmp_path, text, info)
    assert r is not None and r.offsets is not None and len(parses) == 2  # two shapes, 120 entries
    assert all(e.problems == () and e.names == (f"{e.key}.trellis", f"{e.key}.suh") for e in r.entries or [])
    assert r.entries and r.entries[0].names and r.entries[0].names[0] is info[f"{keys[0]}.trellis"].name


_tkey = st.text(alphabet="m.1tx\"é\u2028", min_size=1, max_size=4)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    keys=st.lists(_tkey, min_size=1, max_size=6, unique=True),
    names=st.lists(st.sampled_from(["{k}.a", "{k}.b", "{k}{k}", "x{k}", "{k}", "m.1.a", "t.a"]), min_size=0, max_size=3, unique=True),
    dtype=st.sampled_from(["torch.int16", "torch.{k}", "torch.int8"]),
    wrong=st.sets(st.integers(0, 5), max_size=2),
    missing=st.sets(st.integers(0, 5), max_size=1),
    ascii_only=st.booleans(),
)
def test_templated_entries_read_as_their_whole_parse(tmp_path_factory, keys, names, dtype, wrong, missing, ascii_only) -> None:  # type: ignore[no-untyped-def]
    """Keys that recur elsewhere in their entry (in a dtype, twice in a name, inside another
    name), names not made from the key, headers that disagree or are missing for some entries:
    whatever the templates make of them, the result is the whole strict parse's."""
    storage, info = {}, {}
    for i, k in enumerate(keys):
        ns = list(dict.fromkeys(n.format(k=k) for n in names))
        storage[k] = {"stored_tensors": _stored(ns, [2], dtype.format(k=k)), "bits_per_weight": 2}
        for n in ns:
            if i not in missing:
                info[n] = TensorInfo(n, "I8" if i in wrong else "I16", (2,), 0, 4)
    text = json.dumps({"bits": 2, "tensor_storage": storage}, indent=4, ensure_ascii=ascii_only).encode()
    _same_as_whole(tmp_path_factory.mktemp("t"), text, info)


@pytest.mark.parametrize("depth", [30, 31, 40, 900, *range(940, 960), 990, 1100])
def test_a_deep_entry_reads_as_the_whole_parse(tmp_path: Path, depth: int) -> None:
    """An entry nested deeper than exllamav3 writes takes the batched parse: whether a parser's
    recursion limit refuses it is then decided as for the whole document."""
    info = {"m.0.a": TensorInfo("m.0.a", "I16", (2,), 0, 4)}
    storage = {"m.0": {"stored_tensors": _stored(["m.0.a"], [2]), "bits_per_weight": 2, "x": "@@"}}
    text = json.dumps({"bits": 2, "tensor_storage": storage}, indent=4).replace('"@@"', "[" * depth + "]" * depth).encode()
    _same_as_whole(tmp_path, text, info)
