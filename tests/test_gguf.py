"""GGUF export for ranma.cpp: bytes, names, keys, shards, refusals and the audit of an export."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mosaic._audit.gguf_folder import audit_gguf
from mosaic._export.gguf import SourceRef, export_gguf, retiled_chunks
from mosaic._formats.gguf_container import read_gguf
from mosaic.cli.commands import main
from mosaic.testing.exl3 import Geometry, glm_geometry, write_checkpoint

LLAMA = Geometry(arch="llama", experts=0, layers=2, vocab=512)
QWEN = Geometry(arch="qwen3_moe", layers=3, dense_layers=0, experts=4, shared_experts=False, score_bias=False,
                mtp_layers=1, vision_blocks=1, vocab=512, seed=3)


# ---- an independent view of the sources: raw safetensors headers, numpy only ----------------------------------


def source_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, e in header.items():
            a, b = e["data_offsets"]
            out[name] = (e["dtype"], e["shape"], raw[8 + n + a : 8 + n + b])
    return out


def retile(trellis: bytes, shape: list[int]) -> bytes:
    """The fork's tile order: [K/16, N/16, w] int16 -> [N/128, K/16, 8, w]."""
    kt, nt, w = shape
    t = np.frombuffer(trellis, dtype="<i2").reshape(kt, nt // 8, 8, w)
    return np.ascontiguousarray(t.transpose(1, 0, 2, 3)).tobytes()


def widen(data: bytes, dtype: str) -> bytes:
    """BF16 / F16 -> F32, the converter's one value change for norms and routers (exact)."""
    if dtype == "BF16":
        return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).tobytes()
    if dtype == "F16":
        return np.frombuffer(data, dtype="<f2").astype("<f4").tobytes()
    return data


def gguf_tensors(out: Path) -> dict[str, tuple[int, list[int], bytes, str]]:
    """name -> (type, ne, bytes, file), with our strict reader."""
    res = {}
    for f in sorted(out.glob("*.gguf")):
        g = read_gguf(f)
        raw = f.read_bytes()
        for t in g.tensors:
            a, b = g.file_range(t)
            res[t.name] = (t.type_id, list(t.ne), raw[a:b], f.name)
    return res


@pytest.fixture
def exl3_gguf_reader(monkeypatch):
    """gguf-py's GGUFReader, taught the fork's EXL3 type sizes (block 128 values, 16*bits bytes)."""
    import gguf.constants
    import gguf.gguf_reader
    import gguf.quants

    sizes = dict(gguf.constants.GGML_QUANT_SIZES)
    for cb in range(3):
        for code in range(11 if cb == 0 else 8):
            bits2 = 2 * (code + 1) if code < 8 else 2 * (code - 7) + 1
            sizes[256 + 16 * cb + code] = (128, 8 * bits2)
    real = gguf.constants.GGMLQuantizationType

    class Types:
        def __call__(self, v: int):
            try:
                return real(v)
            except ValueError:
                return int(v)

        def __getattr__(self, name: str):
            return getattr(real, name)

    monkeypatch.setattr(gguf.gguf_reader, "GGMLQuantizationType", Types())
    monkeypatch.setattr(gguf.gguf_reader, "GGML_QUANT_SIZES", sizes)
    monkeypatch.setattr(gguf.quants, "GGML_QUANT_SIZES", sizes)
    return gguf.gguf_reader.GGUFReader


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("l") / "llama-tiny", LLAMA)


@pytest.fixture(scope="module")
def qwen_src(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("q") / "qwen-tiny", QWEN)


@pytest.fixture(scope="module")
def qwen_out(qwen_src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qo") / "gguf"
    export_gguf(qwen_src, out, split_max_size=300_000)
    return out


# ---- bytes ------------------------------------------------------------------------------------------------------


def test_llama_every_tensor_is_its_relaid_source(llama_src, tmp_path, exl3_gguf_reader):
    out = tmp_path / "g"
    export_gguf(llama_src, out)
    src = source_tensors(llama_src)
    got = gguf_tensors(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(got) == len(manifest["tensors"]) > 0
    # names from llama.cpp's tables, checked here by hand rather than through gguf-py
    expect = {
        "token_embd.weight": ("model.embed_tokens.weight", "copy"),
        "output.weight": ("lm_head.trellis", "exl3"),
        "output.rot_in": ("lm_head.suh", "copy"),
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.trellis", "exl3"),
        "blk.1.attn_output.rot_out": ("model.layers.1.self_attn.o_proj.svh", "copy"),
        "blk.1.ffn_down.weight": ("model.layers.1.mlp.down_proj.trellis", "exl3"),
        "output_norm.weight": ("model.norm.weight", "f32"),
        "blk.0.attn_norm.weight": ("model.layers.0.input_layernorm.weight", "f32"),
        "blk.0.ffn_norm.weight": ("model.layers.0.post_attention_layernorm.weight", "f32"),
    }
    for name, (sname, how) in expect.items():
        dtype, shape, data = src[sname]
        want = retile(data, shape) if how == "exl3" else widen(data, dtype) if how == "f32" else data
        assert got[name][2] == want, name
    # norms are F32 as the fork's converter writes them (1-D, *_norm.weight), from BF16 sources
    assert got["blk.0.attn_norm.weight"][0] == 0 and src["model.layers.0.input_layernorm.weight"][0] == "BF16"
    # 2-bit mul1 = 257, 6-bit mul1 head = 261; ne = [K, N]
    assert got["blk.0.attn_q.weight"][:2] == (257, [256, 256])
    assert got["blk.0.attn_k.weight"][:2] == (257, [256, 128])
    assert got["output.weight"][:2] == (261, [256, 512])
    assert got["token_embd.weight"][:2] == (30, [256, 512])  # BF16 kept
    # every tensor against the sources its manifest entry names, re-laid here
    for t in manifest["tensors"]:
        parts = [src[s["tensor"]] for s in t["sources"]]
        want = b"".join(retile(d, sh) if t["layout"] == "exl3-retile" else widen(d, dt) if t["layout"] == "f32" else d
                        for dt, sh, d in parts)
        assert got[t["name"]][2] == want, t["name"]
    # gguf-py agrees on names, types, shapes and bytes
    seen = 0
    for f in sorted(out.glob("*.gguf")):
        r = exl3_gguf_reader(f)
        for t in r.tensors:
            typ, ne, data, _ = got[t.name]
            assert int(t.tensor_type) == typ and [int(x) for x in t.shape] == ne
            assert t.data.tobytes() == data
            seen += 1
    assert seen == len(got)


def test_retiling_moves_whole_tiles_to_row_groups(llama_src, tmp_path):
    """Element-wise: GGUF group g, k-tile kt, slot j holds source tile (kt, 8g + j), unchanged."""
    out = tmp_path / "g"
    export_gguf(llama_src, out)
    _, shape, data = source_tensors(llama_src)["lm_head.trellis"]
    kt, nt, w = shape
    tr = np.frombuffer(data, dtype="<i2").reshape(kt, nt, w)
    g = np.frombuffer(gguf_tensors(out)["output.weight"][2], dtype="<i2").reshape(nt // 8, kt, 8, w)
    for grp in range(nt // 8):
        for k in range(kt):
            for j in range(8):
                assert np.array_equal(g[grp, k, j], tr[k, 8 * grp + j])
    # a GGUF row of the head (128-row strips) is K*bits/8 bytes: the tensor is N rows of them
    assert len(gguf_tensors(out)["output.weight"][2]) == (nt * 16) * (kt * 16) * 6 // 8


def test_streamed_retiling_in_small_blocks_equals_whole_tensor(llama_src):
    from mosaic._checkpoint.folder import open_checkpoint

    ck = open_checkpoint(llama_src)
    name = "model.layers.0.mlp.down_proj.trellis"
    shard, a, b = ck.file_range(name)
    ref = SourceRef(name, shard, a, b - a, ck.tensor(name).shape)
    chunks = [bytes(c) for c in retiled_chunks(llama_src / shard, ref, chunk=1)]
    assert len(chunks) == ref.shape[1] // 8 > 1  # one 128-row group per block
    _, shape, data = source_tensors(llama_src)[name]
    assert b"".join(chunks) == retile(data, shape)


def test_qwen3moe_experts_stacked_in_expert_order(qwen_src, qwen_out, exl3_gguf_reader):
    src = source_tensors(qwen_src)
    got = gguf_tensors(qwen_out)
    for layer in range(3):
        for proj, gg in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            keys = [f"model.layers.{layer}.mlp.experts.{e}.{proj}" for e in range(4)]
            typ, ne, data, _ = got[f"blk.{layer}.ffn_{gg}_exps.weight"]
            kt, nt, _ = src[keys[0] + ".trellis"][1]
            assert (typ, ne) == (257, [kt * 16, nt * 16, 4])
            assert data == b"".join(retile(src[k + ".trellis"][2], src[k + ".trellis"][1]) for k in keys)
            assert got[f"blk.{layer}.ffn_{gg}_exps.rot_in"][:2] == (1, [kt * 16, 4])
            assert got[f"blk.{layer}.ffn_{gg}_exps.rot_in"][2] == b"".join(src[k + ".suh"][2] for k in keys)
            assert got[f"blk.{layer}.ffn_{gg}_exps.rot_out"][2] == b"".join(src[k + ".svh"][2] for k in keys)
        # the router is F32, as the converter writes routers
        dt, _, data = src[f"model.layers.{layer}.mlp.gate.weight"]
        assert got[f"blk.{layer}.ffn_gate_inp.weight"][:3:2] == (0, widen(data, dt))
    # gguf-py reads every shard and sees the same stacks
    names = set()
    for f in sorted(qwen_out.glob("*.gguf")):
        for t in exl3_gguf_reader(f).tensors:
            names.add(t.name)
            assert t.data.tobytes() == got[t.name][2]
    assert names == set(got)


def test_mtp_and_vision_left_out_and_said_so(qwen_out):
    got = gguf_tensors(qwen_out)
    assert not any(n.startswith("blk.3.") for n in got)  # layer 3 is the MTP layer
    m = json.loads((qwen_out / "manifest.json").read_text())
    reasons = {o["tensor"]: o["reason"] for o in m["omitted"]}
    assert "model.layers.3.mlp.experts.0.up_proj.trellis" in reasons
    assert reasons["model.layers.3.eh_proj.trellis"].startswith("MTP layer 3")
    assert reasons["model.visual.blocks.0.attn.qkv.weight"].startswith("vision")
    assert all(not o["tensor"].startswith("model.layers.2.") for o in m["omitted"])


def test_every_source_tensor_is_accounted_for(qwen_src, qwen_out):
    m = json.loads((qwen_out / "manifest.json").read_text())
    used = {s["tensor"] for t in m["tensors"] for s in t["sources"]}
    omitted = {o["tensor"] for o in m["omitted"]}
    rest = set(source_tensors(qwen_src)) - used - omitted
    assert rest and all(n.endswith(".mul1") for n in rest)  # codebook markers live in the type id
    assert not used & omitted


# ---- container, split and keys --------------------------------------------------------------------------------


def test_split_shards_metadata_first_no_tensor_spans(qwen_out):
    files = sorted(qwen_out.glob("*.gguf"))
    n = len(files)
    assert n >= 4
    assert [f.name for f in files] == [f"qwen-tiny-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    parsed = [read_gguf(f) for f in files]
    total = sum(len(g.tensors) for g in parsed)
    assert len(parsed[0].tensors) == 0 and "general.architecture" in parsed[0].kvs
    names = [t.name for g in parsed for t in g.tensors]
    assert len(names) == len(set(names)) == total
    for i, g in enumerate(parsed):
        assert (g.kvs["split.no"].vtype, g.value("split.no")) == (2, i)  # u16, 0-based as llama.cpp counts
        assert (g.kvs["split.count"].vtype, g.value("split.count")) == (2, n)
        assert (g.kvs["split.tensors.count"].vtype, g.value("split.tensors.count")) == (5, total)
        if i:
            assert set(g.kvs) == {"split.no", "split.count", "split.tensors.count"}
            data = sum((t.nbytes + 31) // 32 * 32 for t in g.tensors)
            assert data <= 300_000 or len(g.tensors) == 1
            # llama-gguf-split would have put the next tensor here only if it fit
            if i + 1 < n:
                first_next = parsed[i + 1].tensors[0]
                assert data + (first_next.nbytes + 31) // 32 * 32 > 300_000
        assert g.data_start % 32 == 0 and all(t.offset % 32 == 0 for t in g.tensors)
        assert g.file_size == (files[i].stat().st_size)
    m = json.loads((qwen_out / "manifest.json").read_text())
    assert [f["name"] for f in m["files"]] == [f.name for f in files]
    assert all(f["size"] == (qwen_out / f["name"]).stat().st_size for f in m["files"])


def test_tensor_first_split_option_and_sizes(llama_src, tmp_path):
    res = CliRunner().invoke(main, ["export", "gguf", str(llama_src), "--out", str(tmp_path / "a"), "--tensor-first-split",
                                    "--split-max-size", "1M", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    first = read_gguf(tmp_path / "a" / doc["files"][0]["name"])
    assert len(first.tensors) > 0  # tensors allowed in the first shard
    assert doc["tensors"] == sum(len(read_gguf(tmp_path / "a" / f["name"]).tensors) for f in doc["files"])
    bad = CliRunner().invoke(main, ["export", "gguf", str(llama_src), "--out", str(tmp_path / "b"), "--split-max-size", "5X"])
    assert bad.exit_code == 2 and "split-max-size" in bad.stderr


def test_metadata_keys(llama_src, qwen_out, tmp_path):
    export_gguf(llama_src, tmp_path / "l")
    lg = read_gguf(sorted((tmp_path / "l").glob("*.gguf"))[0])
    assert lg.value("general.architecture") == "llama"
    assert lg.value("llama.rope.style") == "neox"  # unpermuted Q/K rows, as the fork's converter writes them
    assert lg.value("llama.block_count") == 2 and lg.value("llama.embedding_length") == 256
    assert lg.value("quantize.exl3.version") == "1.6.5"
    assert lg.value("quantize.exl3.codebook") == "mul1"
    assert lg.kvs["quantize.exl3.bits"].vtype == 6 and lg.value("quantize.exl3.bits") == pytest.approx(2.0)
    assert lg.value("quantize.exl3.head_bits") == pytest.approx(6.0)
    assert lg.value("quantize.exl3.out_scales") == "auto"
    assert (lg.value("quantize.exl3.calibration.rows"), lg.value("quantize.exl3.calibration.cols")) == (250, 2048)
    assert "general.alignment" not in lg.kvs
    qg = read_gguf(sorted(qwen_out.glob("*.gguf"))[0])
    assert qg.value("general.architecture") == "qwen3moe"
    assert qg.value("qwen3moe.expert_count") == 4 and qg.value("qwen3moe.expert_used_count") == 4
    assert qg.value("qwen3moe.block_count") == 3
    assert "qwen3moe.rope.style" not in qg.kvs


# ---- refusals ---------------------------------------------------------------------------------------------------


def _cli(*args: str):
    return CliRunner().invoke(main, ["export", "gguf", *args])


def test_refuses_glm_and_unknown_architectures(tmp_path):
    glm = write_checkpoint(tmp_path / "glm", glm_geometry(layers=2, dense_layers=1, experts=4, vision_blocks=0, shard_size=1 << 30))
    res = _cli(str(glm), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert "Glm4MoeForCausalLM" in res.stderr and "LlamaForCausalLM" in res.stderr and "Qwen3MoeForCausalLM" in res.stderr
    assert res.stderr.startswith("mosaic: error:") and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()
    other = write_checkpoint(tmp_path / "other", LLAMA)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (other / "config.json").write_text(json.dumps(cfg))
    res = _cli(str(other), "--out", str(tmp_path / "o2"))
    assert res.exit_code == 2 and "FooForCausalLM" in res.stderr and "supported:" in res.stderr


def test_refuses_dims_not_multiple_of_128(tmp_path):
    src = write_checkpoint(tmp_path / "s", LLAMA.with_(kv_dim=64))
    res = _cli(str(src), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "k_proj" in res.stderr and "multiples of 128" in res.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def test_refuses_mixed_types_in_one_expert_stack(tmp_path):
    src = write_checkpoint(tmp_path / "s", QWEN.with_(expert_bits={(1, 2): 3}, mtp_layers=0, vision_blocks=0))
    res = _cli(str(src), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert "model.layers.1.mlp.experts" in res.stderr and "one type" in res.stderr
    assert not (tmp_path / "o").exists()


def test_refuses_existing_output(llama_src, tmp_path):
    (tmp_path / "o").mkdir()
    res = _cli(str(llama_src), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "already exists" in res.stderr


# ---- audit ------------------------------------------------------------------------------------------------------


def test_audit_passes_untouched_export_with_sources(qwen_src, qwen_out):
    rep = audit_gguf(qwen_out, sources=qwen_src)
    assert rep.ok, [f.as_dict() for f in rep.failures]
    assert "sources" in rep.ran and rep.counts["tensors"] > 0
    res = CliRunner().invoke(main, ["audit", str(qwen_out), "--sources", str(qwen_src), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ok"] is True


def test_audit_names_file_and_tensor_of_a_flipped_byte(qwen_out, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(qwen_out, out)
    m = json.loads((out / "manifest.json").read_text())
    victim = next(t for t in m["tensors"] if t["name"] == "blk.1.ffn_down_exps.weight")
    path = out / victim["file"]
    raw = bytearray(path.read_bytes())
    raw[victim["offset"] + victim["nbytes"] // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    rep = audit_gguf(out)
    assert not rep.ok
    where = {(f.check, f.file, f.tensor) for f in rep.failures}
    assert ("manifest", victim["file"], None) in where
    assert ("tensors", victim["file"], "blk.1.ffn_down_exps.weight") in where
    res = CliRunner().invoke(main, ["audit", str(out), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["ok"] is False


def test_audit_sources_detects_a_changed_source(qwen_src, qwen_out, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(qwen_src, src)
    m = json.loads((qwen_out / "manifest.json").read_text())
    t = next(x for x in m["tensors"] if x["name"] == "blk.0.attn_q.weight")
    s = t["sources"][0]
    from mosaic._checkpoint.folder import open_checkpoint

    shard, a, _b = open_checkpoint(src).file_range(s["tensor"])
    raw = bytearray((src / shard).read_bytes())
    raw[a + 7] ^= 0x80
    (src / shard).write_bytes(bytes(raw))
    rep = audit_gguf(qwen_out, sources=src)
    assert not rep.ok
    assert any(f.check == "sources" and f.tensor == "blk.0.attn_q.weight" for f in rep.failures)


def test_audit_structure_errors_are_failures_not_crashes(qwen_out, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(qwen_out, out)
    first = sorted(out.glob("*.gguf"))[0]
    raw = bytearray(first.read_bytes())
    raw[4:8] = struct.pack("<I", 2)  # GGUF version 2
    first.write_bytes(bytes(raw))
    (out / "stray.gguf").write_bytes(b"GGUF")
    rep = audit_gguf(out)
    checks = {(f.check, f.file) for f in rep.failures}
    assert ("gguf", first.name) in checks
    assert ("manifest", "stray.gguf") in checks
