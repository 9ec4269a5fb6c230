"""``mosaic export gguf`` of GLM-5.3-Flash -> ranma.cpp's ``glm5-next``: exactly the loader's tensors, by value."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mosaic._audit.gguf_folder import audit_gguf
from mosaic._build.run import build
from mosaic._export.gguf import export_gguf
from mosaic._formats.gguf_container import read_gguf
from mosaic.cli.commands import main
from mosaic.testing.exl3 import glm53_geometry, rewrite_shard, write_checkpoint

from .test_build import recipe_doc, write_recipe
from .test_gguf import gguf_tensors, retile, source_tensors, widen

G = glm53_geometry(layers=8, dense_layers=3, experts=4, vision_blocks=1, shard_size=1 << 20, seed=5)
T = "model.language_model.layers"


def loader_set(cfg: dict) -> dict[str, list[int]]:
    """The tensors ranma.cpp's ``llama_model_glm5_next::load_arch_tensors`` creates (with ne), restated here
    from the loader's source for a config; EXL3 linears add ``rot_in``/``rot_out`` ([K(,E)], [N(,E)])."""
    tc = cfg["text_config"]
    e, v, h = tc["hidden_size"], tc["vocab_size"], tc["num_attention_heads"]
    dk, cv = tc["linear_attn_config"]["head_dim"], tc["linear_attn_config"]["short_conv_kernel_size"]
    di = dk * h
    ql, kl, km, vm = tc["q_lora_rank"], tc["kv_lora_rank"], tc["qk_nope_head_dim"], tc["v_head_dim"]
    ih, idim, p = tc["index_n_heads"], tc["index_head_dim"], tc["index_kpool"]
    x, f, fd = tc["n_routed_experts"], tc["moe_intermediate_size"], tc["intermediate_size"]
    n, mtp = tc["num_hidden_layers"], tc["num_nextn_predict_layers"]
    out: dict[str, list[int]] = {}

    def lin(name: str, k: int, nn: int, experts: int = 0) -> None:
        extra = [experts] if experts else []
        out[f"{name}.weight"] = [k, nn, *extra]
        out[f"{name}.rot_in"] = [k, *extra]
        out[f"{name}.rot_out"] = [nn, *extra]

    out["token_embd.weight"] = [e, v]
    out["output_norm.weight"] = [e]
    lin("output", e, v)
    for i in range(n + mtp):
        b = f"blk.{i}"
        out[f"{b}.attn_norm.weight"] = out[f"{b}.ffn_norm.weight"] = [e]
        if i < n:
            for s in ("attn", "ffn"):
                out[f"{b}.hc_{s}_fn.weight"] = [4 * e, 24]
                out[f"{b}.hc_{s}_base.weight"] = [24]
                out[f"{b}.hc_{s}_scale.weight"] = [3]
        if i < n and tc["layer_types"][i] == "linear_attention":
            for q in "qkv":
                out[f"{b}.ssm_conv1d_{q}.weight"] = [cv, 1, di, 1]  # the 4-D form, which the loader tries first
                lin(f"{b}.attn_{q}", e, di)
            out[f"{b}.ssm_f_a.weight"] = out[f"{b}.ssm_g_a.weight"] = [e, dk]
            out[f"{b}.ssm_f_b.weight"] = out[f"{b}.ssm_g_b.weight"] = [dk, di]
            out[f"{b}.ssm_beta.weight"] = [e, h]
            out[f"{b}.ssm_a"] = [h]
            out[f"{b}.ssm_dt.bias"] = [di]
            out[f"{b}.ssm_norm.weight"] = [dk]
            lin(f"{b}.attn_output", di, e)
        else:
            out[f"{b}.attn_q_a_norm.weight"] = [ql]
            out[f"{b}.attn_kv_a_norm.weight"] = [kl]
            lin(f"{b}.attn_q_a", e, ql)
            lin(f"{b}.attn_q_b", ql, h * km)
            lin(f"{b}.attn_kv_a_mqa", e, kl)
            out[f"{b}.attn_k_b.weight"] = [km, kl, h]
            out[f"{b}.attn_v_b.weight"] = [kl, vm, h]
            lin(f"{b}.attn_output", h * vm, e)
            out[f"{b}.indexer.k_norm.weight"] = out[f"{b}.indexer.k_norm.bias"] = [idim]
            out[f"{b}.indexer.proj.weight"] = [e, ih]
            out[f"{b}.indexer.attn_k.weight"] = [e, idim]
            lin(f"{b}.indexer.attn_q_b", ql, ih * idim)
            out[f"{b}.indexer_compressor_gate.weight"] = [e, idim]
            out[f"{b}.indexer_compressor_ape.weight"] = [idim, p]
        if i < tc["first_k_dense_replace"]:
            lin(f"{b}.ffn_gate", e, fd)
            lin(f"{b}.ffn_up", e, fd)
            lin(f"{b}.ffn_down", fd, e)
        else:
            out[f"{b}.ffn_gate_inp.weight"] = [e, x]
            out[f"{b}.exp_probs_b.bias"] = [x]
            lin(f"{b}.ffn_gate_exps", e, f, x)
            lin(f"{b}.ffn_up_exps", e, f, x)
            lin(f"{b}.ffn_down_exps", f, e, x)
            lin(f"{b}.ffn_gate_shexp", e, f)
            lin(f"{b}.ffn_up_shexp", e, f)
            lin(f"{b}.ffn_down_shexp", f, e)
        if i >= n:
            lin(f"{b}.nextn.eh_proj", 2 * e, e)
            for m in ("enorm", "hnorm", "shared_head_norm"):
                out[f"{b}.nextn.{m}.weight"] = [e]
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("g5") / "glm53-tiny", G)


@pytest.fixture(scope="module")
def out(src, tmp_path_factory) -> Path:
    o = tmp_path_factory.mktemp("g5o") / "gguf"
    export_gguf(src, o, split_max_size=1_000_000)
    return o


def test_tensor_set_is_exactly_the_loaders(src, out) -> None:
    cfg = json.loads((src / "config.json").read_text())
    got = gguf_tensors(out)
    want = loader_set(cfg)
    assert set(got) == set(want)
    assert {n: ne for n, (_t, ne, _d, _f) in got.items()} == want
    assert not any(n.startswith("v.") or ".attn_kv_b." in n or ".attn_qkv." in n for n in got)


def test_every_exl3_tensor_is_its_source_trellis_retiled(src, out) -> None:
    s = source_tensors(src)
    got = gguf_tensors(out)
    # the fused KDA qkv_proj split by output rows: whole 128-row groups of the source, in order
    _dtype, shape, data = s[f"{T}.0.self_attn.qkv_proj.trellis"]
    kt, nt, w = shape
    full = np.frombuffer(retile(data, shape), dtype="<i2").reshape(nt // 8, kt, 8, w)
    third = nt // 8 // 3
    for j, q in enumerate("qkv"):
        typ, ne, d, _ = got[f"blk.0.attn_{q}.weight"]
        assert (typ, ne) == (257, [kt * 16, nt * 16 // 3])
        assert d == full[j * third : (j + 1) * third].tobytes()
        assert got[f"blk.0.attn_{q}.rot_in"][2] == s[f"{T}.0.self_attn.qkv_proj.suh"][2]
        svh = s[f"{T}.0.self_attn.qkv_proj.svh"][2]
        assert got[f"blk.0.attn_{q}.rot_out"][2] == svh[j * len(svh) // 3 : (j + 1) * len(svh) // 3]
    # every other EXL3 tensor: the manifest's sources re-laid here
    m = json.loads((out / "manifest.json").read_text())
    checked = 0
    for t in m["tensors"]:
        if t["layout"] != "exl3-retile" or any("part" in x for x in t["sources"]):
            continue
        assert got[t["name"]][2] == b"".join(retile(s[x["tensor"]][2], s[x["tensor"]][1]) for x in t["sources"]), t["name"]
        checked += 1
    assert checked > 20
    # the MTP layer is blk.8 here (num_hidden_layers 8), its experts stacked at mtp_bits (4 -> mul1 4-bit 259)
    assert got["blk.8.ffn_up_exps.weight"][0] == 259 and got["blk.8.nextn.eh_proj.weight"][0] == 259


def test_splits_transposes_and_value_changes_by_value(src, out) -> None:
    s = source_tensors(src)
    got = gguf_tensors(out)
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    h, km, vm, kl = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    # conv1d [3Di, 1, Cv] BF16 -> thirds, F32 (a convolution)
    _, shape, data = s[f"{T}.1.self_attn.conv1d.weight"]
    conv = np.frombuffer(widen(data, "BF16"), dtype="<f4").reshape(shape)
    for j, q in enumerate("qkv"):
        typ, _ne, d, _ = got[f"blk.1.ssm_conv1d_{q}.weight"]
        assert typ == 0 and d == conv[j * shape[0] // 3 : (j + 1) * shape[0] // 3].tobytes()
    # kv_b_proj F16 [H(Km+Vm), Kl]: k_b[h][l][j] = kv[h(Km+Vm) + j][l]; v_b[h][i][l] = kv[h(Km+Vm) + Km + i][l]
    kv = np.frombuffer(s[f"{T}.3.self_attn.kv_b_proj.weight"][2], dtype="<f2").reshape(h * (km + vm), kl)
    kb = np.frombuffer(got["blk.3.attn_k_b.weight"][2], dtype="<f2").reshape(h, kl, km)
    vb = np.frombuffer(got["blk.3.attn_v_b.weight"][2], dtype="<f2").reshape(h, vm, kl)
    assert got["blk.3.attn_k_b.weight"][0] == got["blk.3.attn_v_b.weight"][0] == 1  # F16 kept
    for head in range(h):
        for j in (0, km - 1):
            for lat in (0, 5, kl - 1):
                assert kb[head, lat, j].tobytes() == kv[head * (km + vm) + j, lat].tobytes()
        assert np.array_equal(vb[head].view("<u2"), kv[head * (km + vm) + km : (head + 1) * (km + vm)].view("<u2"))
    # ssm_a = -exp(A_log): float64, rounded once to F32
    a_log = np.frombuffer(s[f"{T}.0.self_attn.A_log"][2], dtype="<f4")
    ssm_a = np.frombuffer(got["blk.0.ssm_a"][2], dtype="<f4")
    assert got["blk.0.ssm_a"][0] == 0 and np.array_equal(ssm_a, (-np.exp(a_log.astype("<f8"))).astype("<f4"))
    assert np.all(ssm_a < 0)
    # norms, 1-D tensors, routers -> F32 (exact widening); 2-D F16 gates and F32 hc keep their type and bytes
    for gname, sname, typ in (("blk.0.attn_norm.weight", f"{T}.0.input_layernorm.weight", 0),
                              ("blk.0.ssm_dt.bias", f"{T}.0.self_attn.dt_bias", 0),
                              ("blk.3.indexer.k_norm.bias", f"{T}.3.self_attn.indexer.k_norm.bias", 0),
                              ("blk.4.ffn_gate_inp.weight", f"{T}.4.mlp.gate.weight", 0),
                              ("blk.4.exp_probs_b.bias", f"{T}.4.mlp.gate.e_score_correction_bias", 0),
                              ("blk.0.ssm_f_a.weight", f"{T}.0.self_attn.f_a_proj.weight", 1),
                              ("blk.0.hc_attn_fn.weight", f"{T}.0.hc_attn_fn", 0),
                              ("blk.3.indexer_compressor_ape.weight", f"{T}.3.self_attn.indexer.index_kpool_compress_ape", 0),
                              ("token_embd.weight", "model.language_model.embed_tokens.weight", 30)):
        dtype, _, data = s[sname]
        assert got[gname][0] == typ, gname
        assert got[gname][2] == (widen(data, dtype) if typ == 0 else data), gname


def test_metadata_keys(out, src) -> None:
    g = read_gguf(sorted(out.glob("*.gguf"))[0])
    a = "glm5-next"
    assert g.value("general.architecture") == a
    kinds = json.loads((src / "config.json").read_text())["text_config"]["layer_types"]
    want = {
        "block_count": 9, "nextn_predict_layers": 1, "leading_dense_block_count": 3, "expert_count": 4,
        "expert_used_count": 4, "expert_shared_count": 1, "expert_feed_forward_length": 128, "feed_forward_length": 256,
        "expert_gating_func": 2, "expert_weights_norm": True, "attention.head_count": 2, "attention.key_length": 128,
        "attention.value_length": 128, "attention.key_length_mla": 128, "attention.value_length_mla": 128,
        "attention.q_lora_rank": 128, "attention.kv_lora_rank": 128, "rope.dimension_count": 0, "ssm.conv_kernel": 4,
        "kda.head_dim": 128, "attention.indexer.head_count": 2, "attention.indexer.key_length": 128,
        "attention.indexer.top_k": 32, "attention.indexer.kpool": 4, "hyper_connection.count": 4,
        "hyper_connection.sinkhorn_iterations": 20,
    }
    for k, v in want.items():
        assert g.value(f"{a}.{k}") == v, k
    assert g.value(f"{a}.expert_weights_scale") == pytest.approx(2.5)
    assert g.value(f"{a}.kda.gate_lower_bound") == pytest.approx(-5.0)
    assert g.value(f"{a}.hyper_connection.epsilon") == pytest.approx(1e-6)
    hkv = g.value(f"{a}.attention.head_count_kv")
    assert hkv == [0 if t == "linear_attention" else 1 for t in kinds] + [1]  # 0 = KDA (recurrent), MTP is MLA
    assert g.value(f"{a}.attention.indexer.types") == [True] * 8  # the config's indexer_types, "full" -> true
    assert g.value(f"{a}.attention.indexer.kpool_select_tail") is True
    assert g.value(f"{a}.vocab_size") == 1024
    assert g.value(f"{a}.attention.layer_norm_epsilon") == pytest.approx(1e-6)
    assert g.value("quantize.exl3.codebook") == "mul1" and g.value("quantize.exl3.version") == "1.6.5"
    # the tokenizer as upstream writes GLM's: pre glm4 (not llama-bpe, although the regex is Llama-3's)
    assert g.value("tokenizer.ggml.pre") == "glm4"
    tokens = g.value("tokenizer.ggml.tokens")
    assert tokens[g.value("tokenizer.ggml.eot_token_id")] == "<|user|>"
    assert tokens[g.value("tokenizer.ggml.eom_token_id")] == "<|observation|>"
    assert tokens[g.value("tokenizer.ggml.bos_token_id")] == "[gMASK]"
    assert tokens[g.value("tokenizer.ggml.unknown_token_id")] == "<|endoftext|>"
    assert tokens[g.value("tokenizer.ggml.eos_token_id")] == "<|endoftext|>"  # from tokenizer_config.json


def test_vision_left_out_and_listed_mtp_kept(out, src) -> None:
    m = json.loads((out / "manifest.json").read_text())
    omitted = {o["tensor"] for o in m["omitted"]}
    vision = {n for n in source_tensors(src) if n.startswith("model.visual.")}
    assert omitted == vision and vision
    used = {x["tensor"] for t in m["tensors"] for x in t["sources"]}
    rest = set(source_tensors(src)) - used - omitted
    assert rest and all(n.endswith(".mul1") for n in rest)
    assert any(n.startswith(f"{T}.8.") for n in used)


def test_audit_with_sources_passes_and_rederives_value_changes(src, out, tmp_path) -> None:
    rep = audit_gguf(out, sources=src)
    assert rep.ok, [f.as_dict() for f in rep.failures]
    # an ssm_a whose file and manifest agree but whose values are not -exp(A_log): caught only by re-deriving
    copy = tmp_path / "o"
    shutil.copytree(out, copy)
    m = json.loads((copy / "manifest.json").read_text())
    t = next(x for x in m["tensors"] if x["name"] == "blk.0.ssm_a")
    path = copy / t["file"]
    raw = bytearray(path.read_bytes())
    vals = np.frombuffer(bytes(raw[t["offset"] : t["offset"] + t["nbytes"]]), dtype="<f4").copy()
    vals[0] = np.nextafter(vals[0], np.float32(0))  # one ulp: what a float32 computation could give
    raw[t["offset"] : t["offset"] + t["nbytes"]] = vals.tobytes()
    path.write_bytes(bytes(raw))
    t["sha256"] = hashlib.sha256(vals.tobytes()).hexdigest()
    f = next(x for x in m["files"] if x["name"] == t["file"])
    f["sha256"] = hashlib.sha256(bytes(raw)).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(m))
    assert audit_gguf(copy).ok  # self-consistent
    rep = audit_gguf(copy, sources=src)
    assert not rep.ok and any(x.check == "sources" and x.tensor == "blk.0.ssm_a" for x in rep.failures)


def test_audit_catches_a_norm_left_in_bf16(out, tmp_path) -> None:
    """The F32 rule is checked from the file alone: a norm written as BF16 fails, naming it."""
    from mosaic._audit.gguf_folder import _dtype_rule
    from mosaic._audit.report import AuditReport

    parsed = {p.name: read_gguf(p) for p in sorted(out.glob("*.gguf"))}
    name, g = next((n, g) for n, g in parsed.items() if any(t.name == "blk.0.attn_norm.weight" for t in g.tensors))
    t = next(t for t in g.tensors if t.name == "blk.0.attn_norm.weight")
    object.__setattr__(t, "type_id", 30)
    rep = AuditReport(out)
    _dtype_rule(rep, parsed)
    assert [(f.check, f.file, f.tensor) for f in rep.failures] == [("tensors", name, "blk.0.attn_norm.weight")]


def test_refuses_what_the_loader_cannot_load(tmp_path) -> None:
    base = write_checkpoint(tmp_path / "s", G.with_(vision_blocks=0))
    shard = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"][f"{T}.0.self_attn.A_log"]
    rewrite_shard(base / shard, drop={f"{T}.0.self_attn.A_log"})
    res = CliRunner().invoke(main, ["export", "gguf", str(base), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and f"{T}.0.self_attn.A_log" in res.stderr and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()
    # an extra tensor the loader would not create: refused by name
    other = write_checkpoint(tmp_path / "s2", G.with_(vision_blocks=0))
    idx = json.loads((other / "model.safetensors.index.json").read_text())["weight_map"]
    victim = f"{T}.0.self_attn.o_norm.weight"
    from mosaic._formats.safetensors_reader import read_header
    from mosaic._formats.safetensors_writer import OutTensor, layout_shard, write_shard

    h = read_header(other / idx[victim])
    ts = [OutTensor(t.name, t.dtype, t.shape, t.nbytes, str(other / idx[victim]), h.data_start + t.begin) for t in h.tensors]
    extra = next(t for t in h.tensors if t.name == victim)
    ts.append(OutTensor(f"{T}.0.self_attn.o_norm.bias", extra.dtype, extra.shape, extra.nbytes, str(other / idx[victim]),
                        h.data_start + extra.begin))
    write_shard(layout_shard(ts, h.metadata), tmp_path / "new.safetensors")
    (tmp_path / "new.safetensors").replace(other / idx[victim])
    res = CliRunner().invoke(main, ["export", "gguf", str(other), "--out", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "o_norm.bias" in res.stderr and "no tensor for it" in res.stderr


def test_spark_style_mosaic_exported_audited_and_a_flipped_byte_caught(tmp_path) -> None:
    g = G.with_(layers=12, experts=4, vision_blocks=1)
    base = write_checkpoint(tmp_path / "base", g.with_(seed=1))
    donor = write_checkpoint(tmp_path / "q305", g.with_(seed=2, bits=3))
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [3, "9-11"], "modules": ["mlp.experts"]}],
                                               at=tmp_path))
    spark = build(recipe, out=tmp_path / "spark").out_dir
    res = CliRunner().invoke(main, ["export", "gguf", str(spark), "--out", str(tmp_path / "gguf"), "--split-max-size", "2M",
                                    "--json"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "gguf"
    got = gguf_tensors(out)
    assert got["blk.3.ffn_down_exps.weight"][0] == 258 and got["blk.4.ffn_down_exps.weight"][0] == 257  # 3 / 2 bits
    assert audit_gguf(out, sources=spark).ok
    m = json.loads((out / "manifest.json").read_text())
    victim = next(t for t in m["tensors"] if t["name"] == "blk.10.ffn_up_exps.weight")
    path = out / victim["file"]
    raw = bytearray(path.read_bytes())
    raw[victim["offset"] + 17] ^= 0x40
    path.write_bytes(bytes(raw))
    res = CliRunner().invoke(main, ["audit", str(out), "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    fails = {(c["name"], f["tensor"]) for r in doc.get("mosaics", [doc]) for c in r["checks"] for f in c["failures"]}
    assert ("tensors", "blk.10.ffn_up_exps.weight") in fails


def test_swiglu_clamp_and_missing_indexer_types_follow_upstream(src) -> None:
    """``swiglu_limit`` becomes one clamp per block for routed and shared experts; without ``indexer_types``
    the key is not written (the loader then takes every indexer as full)."""
    from mosaic._export.glm5_next import metadata, read_dims
    from mosaic._formats.gguf_container import ARRAY, FLOAT32

    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["swiglu_limit"] = 7.0
    del cfg["text_config"]["indexer_types"]
    kvs = {kv.key: kv for kv in metadata(cfg, read_dims(cfg, "config.json"))}
    for k in ("glm5-next.swiglu_clamp_exp", "glm5-next.swiglu_clamp_shexp"):
        assert (kvs[k].vtype, kvs[k].item, kvs[k].value) == (ARRAY, FLOAT32, [7.0] * 9)
    assert "glm5-next.attention.indexer.types" not in kvs
    cfg["text_config"]["linear_attn_config"]["num_heads"] = 3
    with pytest.raises(Exception, match="one head count"):
        read_dims(cfg, "config.json")


def test_audit_sources_finds_a_source_tensor_dropped_silently(src, out, tmp_path) -> None:
    copy = tmp_path / "o"
    shutil.copytree(out, copy)
    m = json.loads((copy / "manifest.json").read_text())
    dropped = m["omitted"].pop(0)["tensor"]
    m["omitted"].append({"tensor": "model.visual.no_such_tensor", "reason": "vision tower"})
    (copy / "manifest.json").write_text(json.dumps(m))
    rep = audit_gguf(copy, sources=src)
    fails = {(f.check, f.tensor) for f in rep.failures}
    assert ("sources", dropped) in fails and ("sources", "model.visual.no_such_tensor") in fails
