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

from mosaic._checkpoint.exl3 import MARKERS
from mosaic._formats.safetensors_reader import tensor_nbytes

_TORCH_DTYPES = {"BF16": "torch.bfloat16", "F16": "torch.float16", "F32": "torch.float32", "I16": "torch.int16", "I32": "torch.int32"}
_ST_LIB_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I16": "int16", "I32": "int32"}

_ARCHS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "llama": ("LlamaForCausalLM", "llama"),
    "glm": ("Glm4MoeForCausalLM", "glm4_moe"),
    "glm5_next": ("Glm5NextForConditionalGeneration", "glm5_next"),
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
    # GLM-5.3-Flash (arch "glm5_next") only: attention heads (KDA and MLA share one count, as in the model),
    # KDA head dim, MLA ranks and head dims, DSA indexer, conv kernel, the MTP and vision quantization rates
    heads: int = 2
    head_dim: int = 128
    q_lora: int = 128
    kv_lora: int = 128
    index_heads: int = 2
    index_dim: int = 128
    kpool: int = 4
    conv_kernel: int = 4
    mla_every: int = 4  # layers i with i % mla_every == mla_every - 1 are MLA + DSA, the others KDA
    mtp_bits: float = 4
    vision_bits: float = 4

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
    """A simplified GLM-like MoE (``Glm4MoeForCausalLM``, plain q/k/v/o attention) with GLM-5.3-Flash's layer
    and expert counts: 45 layers + MTP layer 45, 288 experts. Kept for tests of generic behaviour; the real
    GLM-5.3-Flash layout is :func:`glm53_geometry`."""
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


def glm53_geometry(**kw: object) -> Geometry:
    """GLM-5.3-Flash as exllamav3 stores it (``Glm5NextForConditionalGeneration``), at tiny dimensions.

    Every tensor kind of the real checkpoint is here (see shared/reference/glm53-spark.md and
    docs/glm53.md): 45 trunk layers, 34 of them KDA linear attention (fused EXL3 ``qkv_proj``, fused
    ``conv1d``, F16 gate projections, ``A_log``, ``dt_bias``, ``o_norm``) and 11 MLA + DSA (layers 3, 7, ...,
    43: EXL3 ``q_a/q_b/kv_a/o_proj``, F16 unquantized ``kv_b_proj``, an indexer with EXL3 ``wq_b`` and F16
    ``wk``/``weights_proj``/k-pool tensors); mHC tensors on every trunk layer; 3 dense layers then MoE with
    288 experts; the MTP layer 45 (MLA + DSA, MoE, ``eh_proj`` at ``mtp_bits``); a vision tower at
    ``vision_bits``; the text config nested under ``text_config``. The tensor count equals the real
    model's text part (150,547); only the widths are small (every EXL3 dimension a multiple of 128).
    """
    base: dict[str, object] = dict(
        arch="glm5_next",
        layers=45,
        dense_layers=3,
        mtp_layers=1,
        experts=288,
        hidden=128,
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


def is_mla_layer(g: Geometry, layer: int) -> bool:
    """GLM-5.3's ``layer_types``: MLA + DSA every ``mla_every``-th layer (3, 7, ..., 43), KDA elsewhere; the
    MTP layer is MLA + DSA."""
    return layer >= g.layers or layer % g.mla_every == g.mla_every - 1


def layer_types(g: Geometry) -> list[str]:
    return ["deepseek_sparse_attention" if is_mla_layer(g, i) else "linear_attention" for i in range(g.layers)]


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


def _glm5_next_units(g: Geometry) -> Iterator[list[_Tensor]]:
    """GLM-5.3-Flash's tensors in model order (see :func:`glm53_geometry`); names, dtypes and shapes as
    exllamav3 writes them."""
    h, cb = g.hidden, g.codebook
    heads, dk = g.heads, g.head_dim
    di = heads * dk
    km = vm = dk  # MLA qk_nope_head_dim / v_head_dim (rope dim 0)
    hc_mix = (2 + 4) * 4  # hc_mult 4

    def bits(group: str, layer: int | None = None) -> float:
        if layer is not None and layer >= g.layers:
            return g.mtp_bits
        return g.group_bits.get(group, g.bits)

    def book(group: str) -> str:
        return g.group_codebooks.get(group, cb)

    yield [_Tensor("model.language_model.embed_tokens.weight", "BF16", (g.vocab, h))]
    for layer in range(g.layers + g.mtp_layers):
        p = f"{g.prefix}.{layer}"
        a = f"{p}.self_attn"
        ab, ac = bits("attention", layer), book("attention")
        ts = [_Tensor(f"{p}.input_layernorm.weight", "BF16", (h,))]
        if layer < g.layers:
            for site in ("attn", "ffn"):
                ts += [_Tensor(f"{p}.hc_{site}_fn", "F32", (hc_mix, 4 * h)), _Tensor(f"{p}.hc_{site}_base", "F32", (hc_mix,)),
                       _Tensor(f"{p}.hc_{site}_scale", "F32", (3,))]
        if not is_mla_layer(g, layer):
            ts += _linear(f"{a}.qkv_proj", h, 3 * di, ab, ac)
            ts.append(_Tensor(f"{a}.conv1d.weight", "BF16", (3 * di, 1, g.conv_kernel)))
            ts += [_Tensor(f"{a}.f_a_proj.weight", "F16", (dk, h)), _Tensor(f"{a}.f_b_proj.weight", "F16", (di, dk)),
                   _Tensor(f"{a}.g_a_proj.weight", "F16", (dk, h)), _Tensor(f"{a}.g_b_proj.weight", "F16", (di, dk)),
                   _Tensor(f"{a}.b_proj.weight", "F16", (heads, h)), _Tensor(f"{a}.dt_bias", "BF16", (di,)),
                   _Tensor(f"{a}.A_log", "F32", (heads,)), _Tensor(f"{a}.o_norm.weight", "BF16", (dk,))]
            ts += _linear(f"{a}.o_proj", di, h, ab, ac)
        else:
            ts += _linear(f"{a}.q_a_proj", h, g.q_lora, ab, ac)
            ts.append(_Tensor(f"{a}.q_a_layernorm.weight", "BF16", (g.q_lora,)))
            ts += _linear(f"{a}.q_b_proj", g.q_lora, heads * km, ab, ac)
            ts += _linear(f"{a}.kv_a_proj_with_mqa", h, g.kv_lora, ab, ac)
            ts.append(_Tensor(f"{a}.kv_a_layernorm.weight", "BF16", (g.kv_lora,)))
            ts.append(_Tensor(f"{a}.kv_b_proj.weight", "F16", (heads * (km + vm), g.kv_lora)))
            ts += _linear(f"{a}.o_proj", heads * vm, h, ab, ac)
            ix = f"{a}.indexer"
            ts += _linear(f"{ix}.wq_b", g.q_lora, g.index_heads * g.index_dim, ab, ac)
            ts += [_Tensor(f"{ix}.wk.weight", "F16", (g.index_dim, h)),
                   _Tensor(f"{ix}.k_norm.weight", "F16", (g.index_dim,)), _Tensor(f"{ix}.k_norm.bias", "F16", (g.index_dim,)),
                   _Tensor(f"{ix}.weights_proj.weight", "F16", (g.index_heads, h)),
                   _Tensor(f"{ix}.index_kpool_compress_ape", "F32", (g.kpool, g.index_dim)),
                   _Tensor(f"{ix}.index_kpool_compress_gate", "F16", (g.index_dim, h))]
        ts.append(_Tensor(f"{p}.post_attention_layernorm.weight", "BF16", (h,)))
        if layer < g.dense_layers:
            mb, mc = bits("dense_mlp", layer), book("dense_mlp")
            ts += _linear(f"{p}.mlp.gate_proj", h, g.intermediate, mb, mc)
            ts += _linear(f"{p}.mlp.up_proj", h, g.intermediate, mb, mc)
            ts += _linear(f"{p}.mlp.down_proj", g.intermediate, h, mb, mc)
        else:
            ts += [_Tensor(f"{p}.mlp.gate.weight", "F16", (g.experts, h)),
                   _Tensor(f"{p}.mlp.gate.e_score_correction_bias", "F32", (g.experts,))]
            sb, sc = bits("shared_experts", layer), book("shared_experts")
            ei = g.expert_intermediate
            ts += _linear(f"{p}.mlp.shared_experts.gate_proj", h, ei, sb, sc)
            ts += _linear(f"{p}.mlp.shared_experts.up_proj", h, ei, sb, sc)
            ts += _linear(f"{p}.mlp.shared_experts.down_proj", ei, h, sb, sc)
            lb = g.mtp_bits if layer >= g.layers else g.layer_bits.get(layer, bits("routed_experts"))
            ec = book("routed_experts")
            for e in range(g.experts):
                eb = g.expert_bits.get((layer, e), lb)
                ts += _linear(f"{p}.mlp.experts.{e}.gate_proj", h, ei, eb, ec)
                ts += _linear(f"{p}.mlp.experts.{e}.up_proj", h, ei, eb, ec)
                ts += _linear(f"{p}.mlp.experts.{e}.down_proj", ei, h, eb, ec)
        if layer >= g.layers:
            ts += _linear(f"{p}.eh_proj", 2 * h, h, g.mtp_bits, cb)
            ts += [_Tensor(f"{p}.enorm.weight", "BF16", (h,)), _Tensor(f"{p}.hnorm.weight", "BF16", (h,)),
                   _Tensor(f"{p}.shared_head.norm.weight", "BF16", (h,))]
        yield ts
    yield [_Tensor("model.language_model.norm.weight", "BF16", (h,)), *_linear("lm_head", h, g.vocab, g.head_bits, cb)]
    # The vision tower: its exact tensor list is not established from the sources (docs/glm53.md); this is a
    # ViT of the usual shape, quantized at vision_bits, so that selection, loadability and export treat it.
    vb = g.vision_bits
    for b in range(g.vision_blocks):
        q = f"model.visual.blocks.{b}"
        yield [
            _Tensor(f"{q}.norm1.weight", "BF16", (h,)),
            *_linear(f"{q}.attn.qkv", h, 3 * h, vb, cb),
            *_linear(f"{q}.attn.proj", h, h, vb, cb),
            _Tensor(f"{q}.norm2.weight", "BF16", (h,)),
            *_linear(f"{q}.mlp.gate_proj", h, g.intermediate, vb, cb),
            *_linear(f"{q}.mlp.up_proj", h, g.intermediate, vb, cb),
            *_linear(f"{q}.mlp.down_proj", g.intermediate, h, vb, cb),
        ]
    if g.vision_blocks:
        yield [_Tensor("model.visual.patch_embed.proj.weight", "BF16", (h, 3, 2, 14, 14)),
               _Tensor("model.visual.post_layernorm.weight", "BF16", (h,)),
               *_linear("model.visual.merger.proj", h, h, vb, cb)]


def _units(g: Geometry) -> Iterator[list[_Tensor]]:
    """Top-level units in model order: embeddings, each layer, final norm + head, vision tower."""
    if g.arch == "glm5_next":
        yield from _glm5_next_units(g)
        return
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
        if t.name.endswith(".A_log"):  # a decay rate's log: small floats, as a trained model has
            return self.rng.uniform(-1.0, 3.0, t.nbytes // 4).astype("<f4").tobytes()
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
    glm = g.arch == "glm5_next"
    vocab = {c: i for i, c in enumerate(byte_level_alphabet())}
    for a, b in TOY_MERGES:
        vocab.setdefault(a + b, len(vocab))
    if glm:
        names = [("<|endoftext|>", True), ("[MASK]", True), ("[gMASK]", True), ("<sop>", True), ("<eop>", True),
                 ("<|system|>", True), ("<|user|>", True), ("<|assistant|>", True), ("<|observation|>", True)]
    elif llama:
        names = [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
                 ("<|end_header_id|>", True), ("<|eot_id|>", True)]
    else:
        names = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False),
                 ("</think>", False)]
    added = [{"id": len(vocab) + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": sp} for i, (c, sp) in enumerate(names)]
    if added[-1]["id"] >= g.vocab:
        raise ValueError(f"vocab {g.vocab} is too small for the toy tokenizer ({added[-1]['id'] + 1} tokens)")
    split = {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX if llama or glm else QWEN2_REGEX},
             "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": llama, "use_regex": False}
    tok: dict[str, object] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None if llama or glm else {"type": "NFC"},
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
    elif glm:
        config = {"added_tokens_decoder": decoder, "clean_up_tokenization_spaces": False, "do_lower_case": False,
                  "eos_token": "<|endoftext|>", "model_max_length": 1048576, "pad_token": "<|endoftext|>",
                  "padding_side": "left", "remove_space": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        config = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder, "bos_token": None,
                  "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
                  "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
                  "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    return tok, config


def glm5_next_text_config(g: Geometry) -> dict[str, object]:
    """``text_config`` of GLM-5.3-Flash's config.json, with this geometry's widths (field names and the
    real model's values are in shared/reference/glm53-spark.md)."""
    return {
        "model_type": "glm5_next_text",
        "hidden_size": g.hidden,
        "num_hidden_layers": g.layers,
        "first_k_dense_replace": g.dense_layers,
        "layer_types": layer_types(g),
        "linear_attn_config": {"num_heads": g.heads, "head_dim": g.head_dim, "short_conv_kernel_size": g.conv_kernel,
                               "gate_lower_bound": -5.0},
        "num_attention_heads": g.heads,
        "q_lora_rank": g.q_lora,
        "kv_lora_rank": g.kv_lora,
        "qk_nope_head_dim": g.head_dim,
        "qk_rope_head_dim": 0,
        "v_head_dim": g.head_dim,
        "index_n_heads": g.index_heads,
        "index_head_dim": g.index_dim,
        "index_topk": 8 * g.kpool,
        "index_kpool": g.kpool,
        "index_kpool_always_select_tail": True,
        "indexer_types": ["full"] * g.layers,
        "mla_use_nope": True,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "n_routed_experts": g.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": min(8, g.experts),
        "moe_intermediate_size": g.expert_intermediate,
        "intermediate_size": g.intermediate,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "vocab_size": g.vocab,
        "num_nextn_predict_layers": g.mtp_layers,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
    }


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
    if g.arch == "glm5_next":
        text = glm5_next_text_config(g)
        qcfg["mtp_bits"] = g.mtp_bits
        qcfg["vision_bits"] = g.vision_bits
    config: dict[str, object] = {"architectures": [arch], "model_type": model_type, "torch_dtype": "bfloat16"}
    if g.prefix.startswith("model.language_model."):
        config["text_config"] = text
        if g.arch == "glm5_next":
            config["vision_config"] = {"model_type": "glm5_next_vision", "hidden_size": g.hidden, "depth": g.vision_blocks}
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

    from mosaic._formats.safetensors_reader import read_header
    from mosaic._formats.safetensors_writer import OutTensor, layout_shard, write_shard

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


#: The example recipe :func:`write_example` writes: two layers' routed experts and the head from the donor.
EXAMPLE_RECIPE = """\
name: example-mosaic
base:
  path: base
donors:
  q3:
    path: donor
replace:
  - from: q3
    layers: [1, 4]
    modules: [mlp.experts]
  - from: q3
    keys: ["lm_head.*"]
output:
  dir: {out}
"""


def write_example(folder: str | Path) -> Path:
    """A small EXL3 base (2 bpw) and donor (3 bpw) of one synthetic Qwen3-MoE-shaped model in ``folder/base`` and
    ``folder/donor``, and a recipe splicing the two: returns ``folder/recipe.yaml`` (output: ``folder/out/...``)."""
    root = Path(folder)
    write_checkpoint(root / "base", demo_geometry(bits=2, seed=1))
    write_checkpoint(root / "donor", demo_geometry(bits=3, head_bits=8, seed=2, style="library"))
    recipe = root / "recipe.yaml"
    recipe.write_text(EXAMPLE_RECIPE.format(out=json.dumps(str(root.absolute() / "out" / "example-mosaic"))))
    return recipe
