"""The rewritten JSON files: exact content, and the base's own bytes kept wherever nothing changed."""

from __future__ import annotations

import json
from fractions import Fraction

from mosaic.build import metadata
from mosaic.checkpoint.folder import entry_spans, parse_span


def _qconfig(bits: float, n: int, donor: bool = False) -> dict:
    storage = {}
    for i in range(n):
        key = f"model.layers.{i}.mlp.down_proj"
        storage[key] = {
            "stored_tensors": {f"{key}.trellis": {"shape": [8, 8, 48 if donor else 32], "n_bytes": 1, "dtype": "torch.int16"}},
            "quant_format": "exl3",
            "bits_per_weight": 3 if donor else 2,
        }
    storage['odd "quoted" \\ key'] = {"stored_tensors": {}}
    return {"quant_method": "exl3", "bits": bits, "calibration": {"rows": 250, "cols": 2048}, "tensor_storage": storage}


def test_entry_spans_find_every_member_exactly() -> None:
    q = _qconfig(2.0, 5)
    text = json.dumps(q, indent=4).encode()
    spans = entry_spans(text)
    assert set(q["tensor_storage"]) <= set(spans)
    for key, entry in q["tensor_storage"].items():
        assert parse_span(text, spans[key]) == (key, entry)


def test_qconfig_spliced_keeps_untouched_bytes() -> None:
    base, donor = _qconfig(2.0, 6), _qconfig(3.0, 6, donor=True)
    btext, dtext = json.dumps(base, indent=4).encode(), json.dumps(donor, indent=4).encode()
    replaced = {"model.layers.2.mlp.down_proj": "d", "model.layers.4.mlp.down_proj": "d"}
    rate = Fraction(9, 4)
    expected = metadata.expected_qconfig(base, {"d": donor}, replaced, rate)
    out = metadata.new_qconfig(btext, base, {"d": dtext}, expected, replaced)
    assert json.loads(out) == expected
    assert json.loads(out)["bits"] == 2.25
    assert out == json.dumps(expected, indent=4).encode()  # same layout as exllamav3 writes
    # the base's bytes before the first change are kept as they were
    assert out[: btext.index(b'"bits"')] == btext[: btext.index(b'"bits"')]


def test_qconfig_in_another_layout_is_written_anew() -> None:
    base, donor = _qconfig(2.0, 3), _qconfig(3.0, 3, donor=True)
    btext = json.dumps(base, separators=(",", ":")).encode()  # not indent=4: no spans to cut
    replaced = {"model.layers.1.mlp.down_proj": "d"}
    expected = metadata.expected_qconfig(base, {"d": donor}, replaced, Fraction(5, 2))
    out = metadata.new_qconfig(btext, base, {"d": json.dumps(donor).encode()}, expected, replaced)
    assert json.loads(out) == expected


def test_index_total_size_patched_in_place() -> None:
    idx = {"metadata": {"total_size": 123}, "weight_map": {"a": "x.safetensors", "b": "y.safetensors"}}
    text = json.dumps(idx, indent=2).encode()  # any layout: only the number changes
    out = metadata.new_index(text, idx, 98765)
    assert out == text.replace(b"123", b"98765")
    assert json.loads(out)["metadata"]["total_size"] == 98765


def test_config_only_bits_change() -> None:
    cfg = {"architectures": ["X"], "quantization_config": {"bits": 2.05, "head_bits": 6}, "hidden_size": 64}
    out = json.loads(metadata.new_config(cfg, Fraction(231, 100)))
    assert out == {**cfg, "quantization_config": {"bits": 2.31, "head_bits": 6}}


def test_a_repeated_key_inside_an_entry_is_refused_when_read_alone(ckpt_factory, copy_of) -> None:  # type: ignore[no-untyped-def]
    """A donor is opened for some modules only, their quantization_config.json entries cut out of the
    text: a key repeated inside such an entry is refused (naming it) as it is in a whole file."""
    import pytest

    from mosaic.checkpoint.folder import open_checkpoint
    from mosaic.errors import FormatError
    from mosaic.testing import demo_geometry

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
