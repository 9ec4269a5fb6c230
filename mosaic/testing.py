"""Synthetic EXL3 checkpoints for tests, the demo and the benchmarks. Never downloads weights.

:func:`write_checkpoint` lays out a folder the way exllamav3's converter does: EXL3 linears as
``trellis``/``suh``/``svh``/marker groups, routed experts one module per expert, whole layers packed
greedily into ``model-0000K-of-0000N.safetensors`` shards with an index, a ``config.json`` carrying
``quantization_config``, ``quantization_config.json`` in exllamav3's exact shape, and the extra files
of a model repository (a small byte-level BPE ``tokenizer.json`` and ``tokenizer_config.json`` in the
style of the geometry's family, ``generation_config.json``, ``chat_template.jinja``). Tensor bytes are deterministic pseudo-random bytes (markers hold their real values).

Two header styles: ``"library"`` writes each shard through the ``safetensors`` library (padded,
sorted by dtype then name, ``__metadata__``), ``"exl3"`` mimics exllamav3's own writer (minified,
unpadded, insertion order, no metadata) and streams, so large benchmark checkpoints need little memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from mosaic.checkpoint.exl3 import MARKERS
from mosaic.formats.safetensors_reader import tensor_nbytes

_TORCH_DTYPES = {"BF16": "torch.bfloat16", "F16": "torch.float16", "F32": "torch.float32", "I16": "torch.int16", "I32": "torch.int32"}
_ST_LIB_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I16": "int16", "I32": "int32"}

_ARCHS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "llama": ("LlamaForCausalLM", "llama"),
    "glm": ("Glm4MoeForCausalLM", "glm4_moe"),
}


@dataclass(frozen=True)
class Geometry:
    """The shape of a synthetic model. Dimensions are kept multiples of 128 (EXL3 pads to that)."""

    arch: str = "qwen3_moe"
    layers: int = 4
    dense_layers: int = 1
    mtp_layers: int = 0
    experts: int = 4
    shared_experts: bool = True
    score_bias: bool = True  # routed-expert gate's e_score_correction_bias (GLM/DeepSeek style; Qwen3-MoE has none)
    hidden: int = 256
    kv_dim: int = 128
    intermediate: int = 512
    expert_intermediate: int = 128
    vocab: int = 1024
    bits: float = 2
    layer_bits: dict[int, float] = field(default_factory=dict)  # routed-expert bits per layer
    group_bits: dict[str, float] = field(default_factory=dict)  # bits per module group
    expert_bits: dict[tuple[int, int], float] = field(default_factory=dict)  # (layer, expert) -> bits
    group_codebooks: dict[str, str] = field(default_factory=dict)  # module group -> codebook
    head_bits: int = 6
    codebook: str = "mul1"
    prefix: str = "model.layers"
    vision_blocks: int = 0
    shard_size: int = 4 << 20
    style: str = "exl3"
    seed: int = 0
    extra_files: bool = True

    def with_(self, **kw: object) -> Geometry:
        return replace(self, **kw)  # type: ignore[arg-type]


def demo_geometry(**kw: object) -> Geometry:
    """The small MoE model of ``make demo``: a few MB, several shards, shaped as a real Qwen3-MoE is
    (every layer MoE, no shared experts, no router bias), so that the GGUF export takes it too."""
    base: dict[str, object] = dict(layers=6, dense_layers=0, experts=8, shared_experts=False, score_bias=False,
                                   shard_size=2 << 20)
    base.update(kw)
    return Geometry(**base)  # type: ignore[arg-type]


def every_group_geometry(**kw: object) -> Geometry:
    """A small MoE with every module group mosaic knows: a dense first layer, shared experts and a
    router bias beside the routed experts. No real Qwen3-MoE has that shape (the GGUF export refuses
    it), but build, census, plan and audit tests need every group in one model."""
    base: dict[str, object] = dict(layers=6, dense_layers=1, experts=8, shared_experts=True, score_bias=True,
                                   shard_size=2 << 20)
    base.update(kw)
    return Geometry(**base)  # type: ignore[arg-type]


def glm_geometry(**kw: object) -> Geometry:
    """GLM-5.3-Flash's layout at tiny dimensions: 45 layers + MTP layer 45, 288 experts, 12 shards."""
    base: dict[str, object] = dict(
        arch="glm",
        layers=45,
        dense_layers=3,
        mtp_layers=1,
        experts=288,
        hidden=128,
        kv_dim=128,
        intermediate=256,
        expert_intermediate=128,
        vocab=1024,
        bits=2,
        head_bits=5,
        prefix="model.language_model.layers",
        vision_blocks=2,
        shard_size=16 << 20,
    )
    base.update(kw)
    return Geometry(**base)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    marker: int | None = None

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


def _linear(key: str, n_in: int, n_out: int, bits: float, codebook: str) -> list[_Tensor]:
    out = [
        _Tensor(f"{key}.suh", "F16", (n_in,)),
        _Tensor(f"{key}.svh", "F16", (n_out,)),
        _Tensor(f"{key}.trellis", "I16", (n_in // 16, n_out // 16, int(16 * bits))),
    ]
    if codebook in MARKERS:
        out.append(_Tensor(f"{key}.{codebook}", "I32", (), MARKERS[codebook]))
    return out


def _root(g: Geometry) -> str:
    return g.prefix[: -len(".layers")] if g.prefix.endswith(".layers") else "model"


def _units(g: Geometry) -> Iterator[list[_Tensor]]:
    """Top-level units in model order: embeddings, each layer, final norm + head, vision tower."""
    h, cb = g.hidden, g.codebook
    root = _root(g)

    def bits(group: str) -> float:
        return g.group_bits.get(group, g.bits)

    def book(group: str) -> str:
        return g.group_codebooks.get(group, cb)

    yield [_Tensor(f"{root}.embed_tokens.weight", "BF16", (g.vocab, h))]
    for layer in range(g.layers + g.mtp_layers):
        p = f"{g.prefix}.{layer}"
        ts = [_Tensor(f"{p}.input_layernorm.weight", "BF16", (h,))]
        ab, ac = bits("attention"), book("attention")
        ts += _linear(f"{p}.self_attn.q_proj", h, h, ab, ac)
        ts += _linear(f"{p}.self_attn.k_proj", h, g.kv_dim, ab, ac)
        ts += _linear(f"{p}.self_attn.v_proj", h, g.kv_dim, ab, ac)
        ts += _linear(f"{p}.self_attn.o_proj", h, h, ab, ac)
        ts.append(_Tensor(f"{p}.post_attention_layernorm.weight", "BF16", (h,)))
        if layer < g.dense_layers or g.experts == 0:
            mb, mc = bits("dense_mlp"), book("dense_mlp")
            ts += _linear(f"{p}.mlp.gate_proj", h, g.intermediate, mb, mc)
            ts += _linear(f"{p}.mlp.up_proj", h, g.intermediate, mb, mc)
            ts += _linear(f"{p}.mlp.down_proj", g.intermediate, h, mb, mc)
        else:
            ts.append(_Tensor(f"{p}.mlp.gate.weight", "BF16", (g.experts, h)))
            if g.score_bias:
                ts.append(_Tensor(f"{p}.mlp.gate.e_score_correction_bias", "F32", (g.experts,)))
            lb = g.layer_bits.get(layer, bits("routed_experts"))
            ei, ec = g.expert_intermediate, book("routed_experts")
            for e in range(g.experts):
                eb = g.expert_bits.get((layer, e), lb)
                ts += _linear(f"{p}.mlp.experts.{e}.gate_proj", h, ei, eb, ec)
                ts += _linear(f"{p}.mlp.experts.{e}.up_proj", h, ei, eb, ec)
                ts += _linear(f"{p}.mlp.experts.{e}.down_proj", ei, h, eb, ec)
            if g.shared_experts:
                sb, sc = bits("shared_experts"), book("shared_experts")
                ts += _linear(f"{p}.mlp.shared_experts.gate_proj", h, ei, sb, sc)
                ts += _linear(f"{p}.mlp.shared_experts.up_proj", h, ei, sb, sc)
                ts += _linear(f"{p}.mlp.shared_experts.down_proj", ei, h, sb, sc)
        if layer >= g.layers:  # multi-token-prediction layer extras
            ts += _linear(f"{p}.eh_proj", 2 * h, h, bits("attention"), cb)
            ts += [_Tensor(f"{p}.enorm.weight", "BF16", (h,)), _Tensor(f"{p}.hnorm.weight", "BF16", (h,))]
            ts.append(_Tensor(f"{p}.shared_head.norm.weight", "BF16", (h,)))
        yield ts
    yield [_Tensor(f"{root}.norm.weight", "BF16", (h,)), *_linear("lm_head", h, g.vocab, g.head_bits, cb)]
    for b in range(g.vision_blocks):
        q = f"model.visual.blocks.{b}"
        yield [
            _Tensor(f"{q}.norm1.weight", "F32", (h,)),
            _Tensor(f"{q}.attn.qkv.weight", "BF16", (3 * h, h)),
            _Tensor(f"{q}.attn.qkv.bias", "BF16", (3 * h,)),
            _Tensor(f"{q}.mlp.fc1.weight", "BF16", (h, h)),
        ]


def _pack(g: Geometry) -> list[list[_Tensor]]:
    shards: list[list[_Tensor]] = []
    cur: list[_Tensor] = []
    size = 0
    for unit in _units(g):
        usize = sum(t.nbytes for t in unit)
        if cur and size + usize > g.shard_size:
            shards.append(cur)
            cur, size = [], 0
        cur += unit
        size += usize
    if cur:
        shards.append(cur)
    return shards


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


class _Bytes:
    """Deterministic pseudo-random tensor bytes, drawn in model order."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def draw(self, t: _Tensor) -> bytes:
        if t.marker is not None:
            return struct.pack("<I", t.marker)
        return self.rng.bytes(t.nbytes)


def _write_exl3_style(path: Path, tensors: list[_Tensor], data: _Bytes) -> None:
    header: dict[str, object] = {}
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for t in tensors:
            f.write(data.draw(t))


def _write_library_style(path: Path, tensors: list[_Tensor], data: _Bytes) -> None:
    from safetensors import TensorSpec, serialize_file

    keep = []
    specs = {}
    for t in tensors:
        arr = np.frombuffer(data.draw(t), dtype=np.uint8)
        keep.append(arr)
        specs[t.name] = TensorSpec(
            dtype=_ST_LIB_DTYPES[t.dtype], shape=list(t.shape), data_ptr=arr.ctypes.data, data_len=arr.nbytes
        )
    serialize_file(specs, str(path), metadata={"format": "pt"})
    del keep


def _storage_entry(key: str, tensors: list[_Tensor]) -> dict[str, object]:
    entry: dict[str, object] = {
        "stored_tensors": {
            t.name: {"shape": list(t.shape), "n_bytes": t.nbytes, "dtype": _TORCH_DTYPES[t.dtype]} for t in tensors
        }
    }
    trellis = next((t for t in tensors if t.name.endswith(".trellis")), None)
    if trellis is not None:
        bpw = trellis.shape[-1] / 16
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = int(bpw) if bpw.is_integer() else bpw
        for t in tensors:
            if t.marker is not None:
                entry[f"{t.name.rsplit('.', 1)[1]}_multiplier"] = t.marker
    return entry


def _rate(shards: list[list[_Tensor]], g: Geometry) -> float:
    num = den = 0.0
    for ts in shards:
        for t in ts:
            if t.name.endswith(".trellis") and ".layers." in t.name:
                layer = int(t.name.split(".layers.", 1)[1].split(".", 1)[0])
                if layer < g.layers:
                    w = t.shape[0] * t.shape[1] * 256
                    num += w * t.shape[2] / 16
                    den += w
    return round(num / den, 2) if den else 0.0


#: The pre-tokenizer regexes of Llama-3 and Qwen2/Qwen3 as their tokenizer.json files spell them.
LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
#: (left, right) merges of the toy tokenizers, in rank order; every result is a vocabulary entry.
TOY_MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"))


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, the 256 base tokens of a byte-level BPE vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_files(g: Geometry) -> tuple[dict, dict]:
    """A small but real byte-level BPE ``tokenizer.json`` and its ``tokenizer_config.json``: the 256 byte
    tokens, :data:`TOY_MERGES` and their results, then the added tokens. Llama geometries get Llama-3's
    regex, string merges and a BOS template; the others Qwen2/Qwen3's regex, NFC, pair merges and
    ``<think>`` as a non-special added token. Every id is below ``g.vocab`` (config.json pads to it)."""
    llama = g.arch == "llama"
    vocab = {c: i for i, c in enumerate(byte_level_alphabet())}
    for a, b in TOY_MERGES:
        vocab.setdefault(a + b, len(vocab))
    if llama:
        names = [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
                 ("<|end_header_id|>", True), ("<|eot_id|>", True)]
    else:
        names = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False),
                 ("</think>", False)]
    added = [{"id": len(vocab) + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": sp} for i, (c, sp) in enumerate(names)]
    if added[-1]["id"] >= g.vocab:
        raise ValueError(f"vocab {g.vocab} is too small for the toy tokenizer ({added[-1]['id'] + 1} tokens)")
    split = {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX if llama else QWEN2_REGEX},
             "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": llama, "use_regex": False}
    tok: dict[str, object] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None if llama else {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": llama,
                  "vocab": vocab,
                  "merges": [f"{a} {b}" for a, b in TOY_MERGES] if llama else [[a, b] for a, b in TOY_MERGES]},
    }
    decoder = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
               for t in added}
    if llama:
        bos = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
        tok["post_processor"] = {"type": "Sequence", "processors": [
            tok["post_processor"],
            {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [added[0]["id"]],
                                                      "tokens": ["<|begin_of_text|>"]}}},
        ]}
        config = {"added_tokens_decoder": decoder, "bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": True,
                  "eos_token": "<|eot_id|>", "model_max_length": 32768, "tokenizer_class": "PreTrainedTokenizerFast",
                  "chat_template": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
                                   "\n\n{{ m.content }}<|eot_id|>{% endfor %}"}
    else:
        config = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder, "bos_token": None,
                  "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
                  "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
                  "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    return tok, config


def write_checkpoint(out: str | Path, g: Geometry) -> Path:
    """Write a synthetic EXL3 checkpoint of geometry ``g`` into the new folder ``out``."""
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=False)
    shards = _pack(g)
    names = shard_names(len(shards))
    data = _Bytes(g.seed)
    writer = _write_library_style if g.style == "library" else _write_exl3_style
    weight_map: dict[str, str] = {}
    total = 0
    for name, ts in zip(names, shards, strict=False):
        writer(outp / name, ts, data)
        for t in ts:
            weight_map[t.name] = name
            total += t.nbytes
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (outp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))

    arch, model_type = _ARCHS[g.arch]
    qcfg: dict[str, object] = {
        "quant_method": "exl3",
        "version": "1.6.5",
        "bits": _rate(shards, g),
        "head_bits": g.head_bits,
        "calibration": {"rows": 250, "cols": 2048},
        "out_scales": "auto",
        "codebook": g.codebook,
    }
    text: dict[str, object] = {
        "hidden_size": g.hidden,
        "intermediate_size": g.intermediate,
        "moe_intermediate_size": g.expert_intermediate,
        "num_hidden_layers": g.layers,
        "num_attention_heads": max(1, g.hidden // 64),
        "num_key_value_heads": max(1, g.kv_dim // 64),
        "head_dim": 64,
        "vocab_size": g.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
    }
    if g.experts:
        text.update({"n_routed_experts": g.experts, "num_experts": g.experts, "num_experts_per_tok": min(8, g.experts),
                     "first_k_dense_replace": g.dense_layers, "n_shared_experts": int(g.shared_experts)})
    if g.mtp_layers:
        text["num_nextn_predict_layers"] = g.mtp_layers
    config: dict[str, object] = {"architectures": [arch], "model_type": model_type, "torch_dtype": "bfloat16"}
    if g.prefix.startswith("model.language_model."):
        config["text_config"] = text
    else:
        config.update(text)
    config["quantization_config"] = qcfg
    (outp / "config.json").write_text(json.dumps(config, indent=4))

    storage: dict[str, object] = {}
    groups: dict[str, list[_Tensor]] = {}
    for ts in shards:
        for t in ts:
            groups.setdefault(t.name.rsplit(".", 1)[0], []).append(t)
    for key, ts in groups.items():
        storage[key] = _storage_entry(key, ts)
    (outp / "quantization_config.json").write_text(json.dumps({**qcfg, "tensor_storage": storage}, indent=4))

    if g.extra_files:
        tok, tok_config = tokenizer_files(g)
        (outp / "tokenizer.json").write_text(json.dumps(tok, indent=2, ensure_ascii=False))
        (outp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
        (outp / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}, indent=2))
        (outp / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}\n")
    return outp


def rewrite_shard(path: str | Path, drop: set[str] = frozenset(), patch: dict[str, bytes] | None = None) -> None:  # type: ignore[assignment]
    """Rewrite one shard in place without some tensors, or with some tensors' bytes replaced (tests only)."""
    import os
    import tempfile

    from mosaic.formats.safetensors_reader import read_header
    from mosaic.formats.safetensors_writer import OutTensor, layout_shard, write_shard

    p = Path(path)
    h = read_header(p)
    patch = patch or {}
    tmpdir = Path(tempfile.mkdtemp(dir=p.parent))
    try:
        tensors = []
        for t in h.tensors:
            if t.name in drop:
                continue
            if t.name in patch:
                src = tmpdir / f"patch{len(tensors)}"
                src.write_bytes(patch[t.name])
                tensors.append(OutTensor(t.name, t.dtype, t.shape, t.nbytes, str(src), 0))
            else:
                tensors.append(OutTensor(t.name, t.dtype, t.shape, t.nbytes, str(p), h.data_start + t.begin))
        tmp = tmpdir / "new.safetensors"
        write_shard(layout_shard(tensors, h.metadata), tmp)
        os.replace(tmp, p)
    finally:
        for f in tmpdir.iterdir():
            f.unlink()
        tmpdir.rmdir()
