"""The rewritten JSON files: exact content, and the base's own bytes kept wherever nothing changed."""

from __future__ import annotations

import json
import re
from fractions import Fraction

from mosaic._build import metadata
from mosaic._checkpoint.qconfig import entry_span_list, entry_spans, is_top_member, parse_span


def _qconfig(bits: float, n: int, donor: bool = False, odd: bool = True) -> dict:
    storage = {}
    for i in range(n):
        key = f"model.layers.{i}.mlp.down_proj"
        storage[key] = {
            "stored_tensors": {f"{key}.trellis": {"shape": [8, 8, 48 if donor else 32], "n_bytes": 1, "dtype": "torch.int16"}},
            "quant_format": "exl3",
            "bits_per_weight": 3 if donor else 2,
        }
    if odd:  # a key with escapes: such a text is never proved, so never spliced in place
        storage['odd "quoted" \\ key'] = {"stored_tensors": {}}
    return {"quant_method": "exl3", "bits": bits, "calibration": {"rows": 250, "cols": 2048}, "tensor_storage": storage}


def test_entry_spans_find_every_member_exactly() -> None:
    q = _qconfig(2.0, 5)
    text = json.dumps(q, indent=4).encode()
    spans = entry_spans(text)
    assert set(q["tensor_storage"]) <= set(spans)
    for key, entry in q["tensor_storage"].items():
        assert parse_span(text, spans[key]) == (key, entry)


def _top(text: bytes):  # type: ignore[no-untyped-def]
    return lambda span: is_top_member(text, [(s.start, s.end) for s in entry_span_list(text)], span, "bits")


def _splice(btext: bytes, base: dict, dtext: bytes, replaced: dict, rate: Fraction, spans: bool = True):  # type: ignore[no-untyped-def]
    donor = json.loads(dtext)
    found = entry_spans(dtext)
    cut = metadata.cut_members(dtext, {k: found[k] for k in replaced}) if all(k in found for k in replaced) else None
    for key, (member, entry) in (cut or {}).items():
        assert entry == donor["tensor_storage"][key] and member.lstrip().startswith(json.dumps(key).encode())
    expected = metadata.expected_qconfig(base, {"d": donor}, replaced, rate)
    out = metadata.new_qconfig(
        btext, entry_spans(btext) if spans else None, {k: m for k, (m, _) in cut.items()} if cut else None,
        (base["bits"], expected["bits"]), lambda: expected, _top(btext),
    )
    return out, expected


def test_qconfig_spliced_keeps_untouched_bytes() -> None:
    base, donor = _qconfig(2.0, 6, odd=False), _qconfig(3.0, 6, donor=True)
    btext, dtext = json.dumps(base, indent=4).encode(), json.dumps(donor, indent=4).encode()
    replaced = {"model.layers.2.mlp.down_proj": "d", "model.layers.4.mlp.down_proj": "d"}
    spliced, expected = _splice(btext, base, dtext, replaced, Fraction(9, 4))
    assert isinstance(spliced, metadata.SplicedText)  # held as the base's text and its cuts
    out = bytes(spliced)
    assert len(spliced) == len(out)
    assert json.loads(out) == expected
    assert json.loads(out)["bits"] == 2.25
    assert out == json.dumps(expected, indent=4).encode()  # same layout as exllamav3 writes
    # the base's bytes before the first change are kept as they were
    assert out[: btext.index(b'"bits"')] == btext[: btext.index(b'"bits"')]


def test_qconfig_in_another_layout_is_written_anew() -> None:
    """A base text whose spans were not proved, or a donor text with nothing to cut: the whole
    document is written anew (from the whole base document, never from the entries held)."""
    base, donor = _qconfig(2.0, 3), _qconfig(3.0, 3, donor=True)
    replaced = {"model.layers.1.mlp.down_proj": "d"}
    minified = json.dumps(base, separators=(",", ":")).encode()  # not indent=4: no spans to cut
    out, expected = _splice(minified, base, json.dumps(donor, indent=4).encode(), replaced, Fraction(5, 2), spans=False)
    assert isinstance(out, bytes) and json.loads(out) == expected and len(expected["tensor_storage"]) == 4
    out, expected = _splice(json.dumps(base, indent=4).encode(), base, json.dumps(donor).encode(), replaced, Fraction(5, 2))
    assert isinstance(out, bytes) and json.loads(out) == expected
    assert entry_spans(json.dumps(donor).encode()) == {}
    text = json.dumps(donor, indent=4).encode()
    spans = entry_spans(text)
    key = "model.layers.1.mlp.down_proj"
    assert metadata.cut_members(text, {key: spans[key]})[key][1] == donor["tensor_storage"][key]  # type: ignore[index]
    assert metadata.cut_members(text, {key: (spans[key][0], spans[key][1] - 1)}) is None  # not the whole member


def test_a_bits_line_that_is_not_the_top_level_member_is_not_patched() -> None:
    base = _qconfig(2.0, 2, odd=False)
    base.pop("calibration")
    text = json.dumps(base, indent=4).encode().replace(b'    "bits": 2.0', b'    "bits": 7', 1)
    out = metadata.new_qconfig(text, entry_spans(text), {}, (2.0, 2.5), lambda: {"anew": True}, _top(text))
    assert out == metadata.dumps({"anew": True})
    once = json.dumps(base, indent=4).encode()
    assert b'    "bits": 2.5,' in bytes(metadata.new_qconfig(once, entry_spans(once), {}, (2.0, 2.5), lambda: {"anew": True}, _top(once)))
    # without the proof of where it sits, the line is not patched
    assert metadata.new_qconfig(once, entry_spans(once), {}, (2.0, 2.5), lambda: {"anew": True}) == metadata.dumps({"anew": True})
    # a hand-formatted look-alike with the same value, in another object (before the member) or in an
    # entry (after it): never patched in the member's place
    for nested, anew in (
        ({"extra": {"bits": 2.0}, **base}, True),
        ({**base, "tensor_storage": {**base["tensor_storage"], "model.layers.0.mlp.down_proj": {"bits": 2.0, "stored_tensors": {}}}}, False),
    ):
        text = re.sub(rb'\n {8,}"bits": 2\.0', b'\n    "bits": 2.0', json.dumps(nested, indent=4).encode(), count=1)
        assert json.loads(text) == nested and text.count(b'\n    "bits": 2.0') == 2
        out = metadata.new_qconfig(text, entry_spans(text), {}, (2.0, 2.5), lambda: {"anew": True}, _top(text))
        if anew:
            assert out == metadata.dumps({"anew": True})
        else:
            assert json.loads(bytes(out)) == {**nested, "bits": 2.5}  # the member, found first, and only it


def test_index_total_size_patched_in_place() -> None:
    idx = {"metadata": {"total_size": 123}, "weight_map": {"a": "x.safetensors", "b": "y.safetensors"}}
    text = json.dumps(idx, indent=2).encode()  # any layout: only the number changes
    spliced = metadata.new_index(text, {"metadata": idx["metadata"]}, 98765)
    assert isinstance(spliced, metadata.SplicedText)
    out = bytes(spliced)
    assert out == text.replace(b"123", b"98765") and len(spliced) == len(out)
    assert json.loads(out)["metadata"]["total_size"] == 98765


def test_index_patched_only_where_the_text_proves_the_member() -> None:
    """The number is patched in place only when the one match can be nothing but the member; any
    doubt (an escape, a second match, a number that is not the parsed one) writes the index anew,
    and every way the result is the base's index with only total_size changed."""
    wm = {"a": "x.safetensors"}
    cases = [
        {"metadata": {"total_size": 7, "nested": {"total_size": 7}}, "weight_map": wm},  # two matches
        {"metadata": {"total_size": 7, "note": "quote \" here"}, "weight_map": wm},  # an escape
        {"metadata": {"total_size": 7.0}, "weight_map": wm},  # not an integer
        {"metadata": {"nested": {"total_size": 7}}, "weight_map": wm},  # no member at all
        {"weight_map": wm},
        {"metadata": {"total_size": -0}, "extra": {"total_size": 0}, "weight_map": wm},  # -0 is 0, spelled otherwise
    ]
    for idx in cases:
        text = json.dumps(idx, indent=2).encode()
        out = metadata.new_index(text, {k: v for k, v in idx.items() if k != "weight_map"}, 98765)
        assert isinstance(out, bytes)  # written anew
        want = {**idx, "metadata": {**idx.get("metadata", {}), "total_size": 98765}}
        assert json.loads(out) == want, idx


def test_config_only_bits_change() -> None:
    cfg = {"architectures": ["X"], "quantization_config": {"bits": 2.05, "head_bits": 6}, "hidden_size": 64}
    out = json.loads(metadata.new_config(cfg, Fraction(231, 100)))
    assert out == {**cfg, "quantization_config": {"bits": 2.31, "head_bits": 6}}


def test_a_repeated_key_inside_an_entry_is_refused_when_read_alone(ckpt_factory, copy_of) -> None:  # type: ignore[no-untyped-def]
    """A donor is opened for some modules only, their quantization_config.json entries cut out of the
    text: a key repeated inside such an entry is refused (naming it) as it is in a whole file."""
    import pytest

    from mosaic._base.errors import FormatError
    from mosaic._checkpoint.folder import open_checkpoint
    from mosaic.testing.exl3 import demo_geometry

    folder = copy_of(ckpt_factory(demo_geometry()))
    path = folder / "quantization_config.json"
    text = path.read_bytes()
    spans = entry_spans(text)
    key = next(k for k in spans if ".mlp.experts." in k)
    a, b = spans[key]
    entry = text[a:b]
    path.write_bytes(text[:a] + entry.replace(b'"stored_tensors": {', b'"bits_per_weight": 1,\n            "stored_tensors": {', 1) + text[b:])
    assert parse_span(path.read_bytes(), entry_spans(path.read_bytes())[key]) is None
    with pytest.raises(FormatError, match="duplicate key 'bits_per_weight'"):
        open_checkpoint(folder, modules={key})


def test_a_spliced_text_read_again_from_its_file_must_be_the_planned_text(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Streamed from the base's file at write time, in pieces smaller than the cuts' gaps, the bytes
    are the planned ones; a file changed since (a byte, shorter, longer) fails instead of writing."""
    import pytest

    from mosaic._base.errors import CheckpointError

    monkeypatch.setattr(metadata, "_READ_CHUNK", 5)
    idx = {"metadata": {"total_size": 17}, "weight_map": {f"model.layers.{i}.mlp.down_proj.trellis": "x" for i in range(9)}}
    spliced = metadata.new_index(json.dumps(idx, indent=2).encode(), {"metadata": idx["metadata"]}, 123456)
    assert isinstance(spliced, metadata.SplicedText)
    path = tmp_path / "index.json"
    path.write_bytes(spliced.text)  # type: ignore[arg-type]
    on_file = spliced.from_file(path)
    assert on_file.text is None and len(on_file) == len(spliced)
    assert bytes(on_file) == bytes(spliced) and b'"total_size": 123456' in bytes(on_file)
    original = path.read_bytes()
    for changed in (original.replace(b"down_proj", b"down_prox", 1), original[:-1], original + b"\n"):
        path.write_bytes(changed)
        with pytest.raises(CheckpointError, match="changed since it was read"):
            bytes(on_file)
