"""Census of clean and deliberately broken synthetic checkpoints, in both header styles."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from mosaic._base.errors import CheckpointError, SafetensorsError
from mosaic._checkpoint.census_exl3 import analyze, census_report
from mosaic._checkpoint.folder import open_checkpoint
from mosaic.cli.commands import main
from mosaic.testing.exl3 import every_group_geometry, glm_geometry, rewrite_shard

STYLES = ["exl3", "library"]


def census(path: Path) -> dict:
    return census_report(analyze(open_checkpoint(path)))


@pytest.mark.parametrize("style", STYLES)
def test_clean_checkpoint(ckpt_factory, style: str) -> None:
    g = every_group_geometry(style=style, layer_bits={2: 3, 4: 4})
    rep = census(ckpt_factory(g))
    assert rep["problems"] == []
    assert rep["codebooks"] == {"mul1": rep["exl3_modules"]}
    layers = {r["layer"]: r for r in rep["layers"]}
    assert layers[2]["groups"]["routed_experts"]["bits"] == [3]
    assert layers[4]["groups"]["routed_experts"]["bits"] == [4]
    assert layers[1]["groups"]["routed_experts"]["bits"] == [2]
    assert layers[0]["groups"]["dense_mlp"]["bits"] == [2]
    assert rep["head_bits"] == [6]
    assert rep["shards"] > 1
    # exact rate by hand: per MoE layer, experts 8 × 3 × 256×128 weights; everything else at 2 bits
    h, ei, inter, kv = 256, 128, 512, 128
    attn = 2 * h * h + 2 * h * kv
    dense = 3 * h * inter
    experts = 8 * 3 * h * ei
    shared = 3 * h * ei
    weights = 6 * attn + dense + 5 * (experts + shared)
    bits = 2 * weights + experts * (1 + 2)
    assert rep["rate"]["exact"] == pytest.approx(bits / weights)
    assert rep["rate"]["exact_fraction"] is not None


def test_same_tensors_in_both_styles(ckpt_factory) -> None:
    a = open_checkpoint(ckpt_factory(every_group_geometry(style="exl3")))
    b = open_checkpoint(ckpt_factory(every_group_geometry(style="library")))
    assert set(a.tensor_file) == set(b.tensor_file)
    h0 = a.headers[a.shards[0]]
    assert (h0.header_len % 8 != 0) or h0.metadata is None
    assert all(h.header_len % 8 == 0 and h.metadata == {"format": "pt"} for h in b.headers.values())


def test_glm_geometry(ckpt_factory) -> None:
    rep = census(ckpt_factory(glm_geometry()))
    assert rep["problems"] == []
    assert rep["tensors"] > 150_000
    assert rep["shards"] >= 9
    assert [r["layer"] for r in rep["layers"]] == list(range(46))
    assert rep["layers"][45]["mtp"] is True and rep["layers"][44]["mtp"] is False
    assert rep["layers"][10]["groups"]["routed_experts"]["modules"] == 288 * 3


def test_per_expert_bit_mix_is_a_problem(ckpt_factory) -> None:
    rep = census(ckpt_factory(every_group_geometry(expert_bits={(3, 5): 3})))
    assert any("layer 3" in p and "cannot fuse" in p for p in rep["problems"])


def test_mixed_codebooks_is_a_problem(ckpt_factory) -> None:
    rep = census(ckpt_factory(every_group_geometry(group_codebooks={"attention": "mcg"})))
    assert any(p.startswith("mixed codebooks") for p in rep["problems"])


def _first_shard_with(ck, name: str) -> Path:
    return ck.root / ck.tensor_file[name]


def test_wrong_marker_value(demo_base: Path, copy_of) -> None:
    d = copy_of(demo_base)
    ck = open_checkpoint(d)
    name = "model.layers.2.mlp.experts.1.up_proj.mul1"
    rewrite_shard(_first_shard_with(ck, name), patch={name: struct.pack("<I", 0x12345678)})
    rep = census(d)
    assert any(name in p and "marker value" in p for p in rep["problems"])
    assert any("mul1_multiplier" in p for p in rep["problems"])


def test_missing_part_of_a_tensor_group(demo_base: Path, copy_of) -> None:
    d = copy_of(demo_base)
    ck = open_checkpoint(d)
    name = "model.layers.1.self_attn.k_proj.svh"
    rewrite_shard(_first_shard_with(ck, name), drop={name})
    rep = census(d)
    assert any("model.layers.1.self_attn.k_proj: missing svh" in p for p in rep["problems"])
    assert any(name in p and "index" in p for p in rep["problems"])


def test_index_mismatches(demo_base: Path, copy_of) -> None:
    d = copy_of(demo_base)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    other = next(s for s in set(idx["weight_map"].values()) if s != idx["weight_map"][name])
    idx["weight_map"][name] = other
    idx["metadata"]["total_size"] += 1
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    rep = census(d)
    assert any(f"{name!r} is mapped to {other}" in p for p in rep["problems"])
    assert any("total_size" in p for p in rep["problems"])


def test_qconfig_mismatches(demo_base: Path, copy_of) -> None:
    d = copy_of(demo_base)
    q = json.loads((d / "quantization_config.json").read_text())
    key = "model.layers.3.mlp.experts.0.down_proj"
    q["tensor_storage"][key]["bits_per_weight"] = 3
    st = q["tensor_storage"][key]["stored_tensors"]
    st[f"{key}.trellis"]["n_bytes"] += 2
    st[f"{key}.suh"]["dtype"] = "torch.bfloat16"
    st[f"{key}.svh"]["shape"] = [1]
    (d / "quantization_config.json").write_text(json.dumps(q, indent=4))
    probs = census(d)["problems"]
    for needle in ("bits_per_weight 3", "n_bytes", "dtype 'torch.bfloat16'", "shape [1]"):
        assert any(needle in p and key in p for p in probs), needle


def test_stray_shard_is_a_problem(demo_base: Path, copy_of) -> None:
    d = copy_of(demo_base)
    (d / "model-00099-of-00099.safetensors").write_bytes((d / "model-00001-of-00002.safetensors").read_bytes())
    assert any("not in the index" in p for p in census(d)["problems"])


def test_unreadable_shard_raises(demo_base: Path, copy_of) -> None:
    d = copy_of(demo_base)
    p = d / "model-00002-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(SafetensorsError) as ei:
        open_checkpoint(d)
    assert ei.value.rule == "TruncatedFile"


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x.safetensors", "a/../../b"])
def test_unsafe_index_names_refused(demo_base: Path, copy_of, bad: str) -> None:
    d = copy_of(demo_base)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"][next(iter(idx["weight_map"]))] = bad
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="refused"):
        open_checkpoint(d)


def test_symlinked_source_is_followed(demo_base: Path, tmp_path: Path) -> None:
    d = tmp_path / "linked"
    d.mkdir()
    for f in demo_base.iterdir():
        (d / f.name).symlink_to(f)
    rep = census(d)
    assert rep["problems"] == [] and rep["tensors"] == census(demo_base)["tensors"]


def test_cli_exit_codes_and_json(demo_base: Path, ckpt_factory, tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["census", str(demo_base), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["problems"] == [] and doc["tensors"] > 0
    bad = ckpt_factory(every_group_geometry(expert_bits={(3, 5): 3}))
    r = CliRunner().invoke(main, ["census", str(bad)])
    assert r.exit_code == 1 and "cannot fuse" in r.output
    r = CliRunner().invoke(main, ["census", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "mosaic: error:" in r.stderr
