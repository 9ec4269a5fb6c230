"""GLM-5.3-Flash (``Glm5NextForConditionalGeneration``) -> ranma.cpp's ``glm5-next``: tensors and keys.

ranma.cpp's loader (``src/models/glm5-next.cpp``, ``load_arch_tensors``) throws on a missing tensor and
on any tensor it does not create, so this module writes exactly its set, checks every ``ne`` against the
loader's, and refuses (naming the tensor) anything else. Names come from the fork's own table
(:mod:`mosaic._export.ranma_names`). The HF -> GGUF steps follow the upstream-lineage converter
(``conversion/glm.py``) and the fork's changelog: the fused KDA ``qkv_proj`` is split by output rows
into ``attn_q``/``attn_k``/``attn_v`` (whole 128-row groups: tiles re-laid, ``rot_out`` sliced, ``rot_in``
copied), the fused ``conv1d`` in thirds, the MLA ``kv_b_proj`` into ``attn_k_b`` (per head transposed)
and ``attn_v_b``, ``A_log`` into ``ssm_a = -exp(A_log)``; the MTP layer stays as ``blk.<num_hidden_layers>``
with its ``nextn.*`` tensors; the vision tower is left out (listed in manifest.json).

The metadata is every key upstream's converter writes for the architecture (``Glm5NextModel`` in the
upstream-lineage ``conversion/glm.py``, ``set_gguf_parameters``), not only those the loader refuses to load
without: ``leading_dense_block_count`` (without it layers 0-2 are taken for MoE),
``kda.gate_lower_bound``, ``expert_weights_scale``/``_norm``, ``expert_gating_func`` change what it
computes. ``attention.head_count_kv`` is per layer (0 = KDA, recurrent; 1 = MLA and MTP, upstream's MLA
convention, with ``key_length``/``value_length`` = the latent sizes and the per-head sizes in ``*_mla``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mosaic._checkpoint.census_exl3 import Analysis
from mosaic._checkpoint.exl3 import Module
from mosaic._checkpoint.folder import Checkpoint, text_config
from mosaic._export import ranma_names as rn
from mosaic._export.tensors import F16, GGUFExportError, OutTensor, SourceRef, exl3_check, plain
from mosaic._formats.gguf_container import ARRAY, BOOL, FLOAT32, GGML_TYPE_OF_DTYPE, KV, UINT32

HF_ARCH = "Glm5NextForConditionalGeneration"
TEXT = "model.language_model."
VISION_PREFIXES = ("model.visual.",)
KDA, MLA = "linear_attention", "deepseek_sparse_attention"


@dataclass(frozen=True)
class Dims:
    """The sizes the loader reads from the metadata, taken from config.json's text_config."""

    n_layer: int
    n_mtp: int
    embd: int
    vocab: int
    heads: int
    kda_dim: int
    conv: int
    q_lora: int
    kv_lora: int
    k_mla: int
    v_mla: int
    rope: int
    idx_heads: int
    idx_dim: int
    kpool: int
    top_k: int
    experts: int
    used: int
    shared: int
    ff_exp: int
    ff: int
    dense_lead: int
    hc: int
    types: tuple[str, ...]

    @property
    def d_inner(self) -> int:
        return self.kda_dim * self.heads

    def is_kda(self, layer: int) -> bool:
        return layer < self.n_layer and self.types[layer] == KDA


def read_dims(config: dict, where: str) -> Dims:
    tc = text_config(config)
    lac = tc.get("linear_attn_config") if isinstance(tc.get("linear_attn_config"), dict) else {}

    def need(d: dict, key: str, label: str | None = None) -> int:
        v = d.get(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise GGUFExportError(f"{where}: text_config.{label or key} is missing or not an integer; glm5-next needs it")
        return v

    n_layer = need(tc, "num_hidden_layers")
    types = tc.get("layer_types")
    if not isinstance(types, list) or len(types) != n_layer or not all(t in (KDA, MLA) for t in types):
        raise GGUFExportError(f"{where}: text_config.layer_types must list {n_layer} entries of "
                              f"{KDA!r} / {MLA!r}")
    heads = need(tc, "num_attention_heads")
    if need(lac, "num_heads", "linear_attn_config.num_heads") != heads:
        raise GGUFExportError(f"{where}: linear_attn_config.num_heads differs from num_attention_heads; ranma.cpp's "
                              "glm5-next uses one head count for both attention kinds")
    rope = need(tc, "qk_rope_head_dim")
    if rope != 0:
        raise GGUFExportError(f"{where}: qk_rope_head_dim is {rope}; the glm5-next loader's MLA is NoPE (0)")
    d = Dims(
        n_layer=n_layer, n_mtp=tc.get("num_nextn_predict_layers") or 0, embd=need(tc, "hidden_size"),
        vocab=need(tc, "vocab_size"), heads=heads, kda_dim=need(lac, "head_dim", "linear_attn_config.head_dim"),
        conv=need(lac, "short_conv_kernel_size", "linear_attn_config.short_conv_kernel_size"),
        q_lora=need(tc, "q_lora_rank"), kv_lora=need(tc, "kv_lora_rank"),
        k_mla=need(tc, "qk_nope_head_dim") + rope, v_mla=need(tc, "v_head_dim"), rope=rope,
        idx_heads=need(tc, "index_n_heads"), idx_dim=need(tc, "index_head_dim"), kpool=need(tc, "index_kpool"),
        top_k=need(tc, "index_topk"), experts=need(tc, "n_routed_experts"), used=need(tc, "num_experts_per_tok"),
        shared=need(tc, "n_shared_experts"), ff_exp=need(tc, "moe_intermediate_size"), ff=need(tc, "intermediate_size"),
        dense_lead=need(tc, "first_k_dense_replace"), hc=need(tc, "hc_mult"), types=tuple(types),
    )
    if d.hc != 4:
        raise GGUFExportError(f"{where}: hc_mult is {d.hc}; ranma.cpp's glm5-next supports mHC with 4 streams only")
    if d.kpool <= 1 or d.top_k % d.kpool:
        raise GGUFExportError(f"{where}: index_kpool {d.kpool} must be > 1 and divide index_topk {d.top_k}")
    return d


def loader_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Every tensor ``load_arch_tensors`` creates, with its ne (the checkpoint has no optional ones)."""
    tn = rn.tensor_name
    out: dict[str, tuple[int, ...]] = {tn("TOKEN_EMBD"): (d.embd, d.vocab), tn("OUTPUT_NORM"): (d.embd,),
                                        tn("OUTPUT"): (d.embd, d.vocab)}
    mix = (2 + d.hc) * d.hc
    di = d.d_inner
    for i in range(d.n_layer + d.n_mtp):
        L = {tn("ATTN_NORM", i): (d.embd,), tn("FFN_NORM", i): (d.embd,)}
        if i < d.n_layer:
            for site in ("ATTN", "FFN"):
                L[tn(f"HC_{site}_FN", i)] = (d.hc * d.embd, mix)
                L[tn(f"HC_{site}_BASE", i)] = (mix,)
                L[tn(f"HC_{site}_SCALE", i)] = (3,)
        if d.is_kda(i):
            for x in "QKV":  # the loader tries [Cv, 1, Di, 1] first (what the converter writes), then [Cv, 1, Di]
                L[tn(f"SSM_CONV1D_{x}", i)] = (d.conv, 1, di, 1)
                L[tn(f"ATTN_{x}", i)] = (d.embd, di)
            L[tn("SSM_F_A", i)] = L[tn("SSM_G_A", i)] = (d.embd, d.kda_dim)
            L[tn("SSM_F_B", i)] = L[tn("SSM_G_B", i)] = (d.kda_dim, di)
            L[tn("SSM_BETA", i)] = (d.embd, d.heads)
            L[tn("SSM_A", i, None)] = (d.heads,)
            L[tn("SSM_DT", i, "bias")] = (di,)
            L[tn("SSM_NORM", i)] = (d.kda_dim,)
            L[tn("ATTN_OUT", i)] = (di, d.embd)
        else:
            L[tn("ATTN_Q_A_NORM", i)] = (d.q_lora,)
            L[tn("ATTN_KV_A_NORM", i)] = (d.kv_lora,)
            L[tn("ATTN_Q_A", i)] = (d.embd, d.q_lora)
            L[tn("ATTN_Q_B", i)] = (d.q_lora, d.heads * d.k_mla)
            L[tn("ATTN_KV_A_MQA", i)] = (d.embd, d.kv_lora + d.rope)
            L[tn("ATTN_K_B", i)] = (d.k_mla - d.rope, d.kv_lora, d.heads)
            L[tn("ATTN_V_B", i)] = (d.kv_lora, d.v_mla, d.heads)
            L[tn("ATTN_OUT", i)] = (d.heads * d.v_mla, d.embd)
            L[tn("INDEXER_K_NORM", i)] = L[tn("INDEXER_K_NORM", i, "bias")] = (d.idx_dim,)
            L[tn("INDEXER_PROJ", i)] = (d.embd, d.idx_heads)
            L[tn("INDEXER_ATTN_K", i)] = (d.embd, d.idx_dim)
            L[tn("INDEXER_ATTN_Q_B", i)] = (d.q_lora, d.idx_heads * d.idx_dim)
            L[tn("INDEXER_KPOOL_GATE", i)] = (d.embd, d.idx_dim)
            L[tn("INDEXER_KPOOL_APE", i)] = (d.idx_dim, d.kpool)
        if i < d.dense_lead:
            L[tn("FFN_GATE", i)] = L[tn("FFN_UP", i)] = (d.embd, d.ff)
            L[tn("FFN_DOWN", i)] = (d.ff, d.embd)
        else:
            L[tn("FFN_GATE_INP", i)] = (d.embd, d.experts)
            L[tn("FFN_EXP_PROBS_B", i, "bias")] = (d.experts,)
            L[tn("FFN_GATE_EXP", i)] = L[tn("FFN_UP_EXP", i)] = (d.embd, d.ff_exp, d.experts)
            L[tn("FFN_DOWN_EXP", i)] = (d.ff_exp, d.embd, d.experts)
            L[tn("FFN_GATE_SHEXP", i)] = L[tn("FFN_UP_SHEXP", i)] = (d.embd, d.ff_exp * d.shared)
            L[tn("FFN_DOWN_SHEXP", i)] = (d.ff_exp * d.shared, d.embd)
        if i >= d.n_layer:
            L[tn("NEXTN_EH_PROJ", i)] = (2 * d.embd, d.embd)
            for m in ("NEXTN_ENORM", "NEXTN_HNORM", "NEXTN_SHARED_HEAD_NORM"):
                L[tn(m, i)] = (d.embd,)
        out.update(L)
    return out


class _Mapper:
    """Consumes the checkpoint's tensors as the mapping names them; whatever is left is refused."""

    def __init__(self, ckpt: Checkpoint, a: Analysis) -> None:
        self.ckpt, self.mods = ckpt, a.modules
        self.left = {n for n in ckpt.tensor_names() if not n.startswith(VISION_PREFIXES)}
        self.out: list[OutTensor | list[OutTensor]] = []

    def ref(self, name: str, part: dict[str, object] | None = None) -> SourceRef:
        if name not in self.ckpt.tensor_file:
            raise GGUFExportError(f"{name}: missing; ranma.cpp's glm5-next loader needs the tensor made from it")
        self.left.discard(name)
        shard, a, b = self.ckpt.file_range(name)
        t = self.ckpt.tensor(name)
        return SourceRef(name, shard, a, b - a, t.shape, t.dtype, part)

    def module(self, key: str) -> Module:
        m = self.mods.get(key)
        if m is None or not m.is_exl3:
            raise GGUFExportError(f"{key}: missing or not an EXL3 linear; ranma.cpp's glm5-next loader needs it")
        return m

    def linear(self, key: str, gguf: str) -> None:
        m = self.module(key)
        k, n, tid = exl3_check(m)
        self._take_marker(m)
        if "bias" in m.tensors:
            raise GGUFExportError(f"{key}.bias: the glm5-next loader creates no bias for {gguf}")
        self.out += [OutTensor(f"{gguf}.weight", (k, n), tid, m.tensors["trellis"].nbytes, "exl3-retile",
                               [self.ref(f"{key}.trellis")]),
                     OutTensor(f"{gguf}.rot_in", (k,), F16, 2 * k, "copy", [self.ref(f"{key}.suh")]),
                     OutTensor(f"{gguf}.rot_out", (n,), F16, 2 * n, "copy", [self.ref(f"{key}.svh")])]

    def split_linear(self, key: str, ggufs: list[str]) -> None:
        """A fused projection split by output rows into equal parts (whole 128-row groups each)."""
        m = self.module(key)
        k, n, tid = exl3_check(m)
        self._take_marker(m)
        part = n // len(ggufs)
        if part % 128 or part * len(ggufs) != n:
            raise GGUFExportError(f"{key}: {n} output rows do not split into {len(ggufs)} parts of whole 128-row groups")
        row_bytes = m.tensors["trellis"].nbytes // n
        for j, g in enumerate(ggufs):
            rows = {"rows": [j * part, (j + 1) * part]}
            self.out += [OutTensor(f"{g}.weight", (k, part), tid, row_bytes * part, "exl3-retile",
                                   [self.ref(f"{key}.trellis", rows)]),
                         OutTensor(f"{g}.rot_in", (k,), F16, 2 * k, "copy", [self.ref(f"{key}.suh")]),
                         OutTensor(f"{g}.rot_out", (part,), F16, 2 * part, "copy", [self.ref(f"{key}.svh", rows)])]

    def _take_marker(self, m: Module) -> None:
        if m.marker_suffix:
            self.left.discard(f"{m.key}.{m.marker_suffix}")  # the codebook lives in the type id

    def plain(self, name: str, gguf: str, part: dict[str, object] | None = None,
              ne: tuple[int, ...] | None = None) -> None:
        self.out.append(plain(self.ref(name, part), gguf, ne))

    def experts(self, layer_key: str, bid: int, count: int) -> None:
        for proj, member in (("gate_proj", "FFN_GATE_EXP"), ("up_proj", "FFN_UP_EXP"), ("down_proj", "FFN_DOWN_EXP")):
            ms = [self.module(f"{layer_key}.mlp.experts.{e}.{proj}") for e in range(count)]
            kinds: dict[tuple[int, int, int], list[int]] = {}
            for e, m in enumerate(ms):
                kinds.setdefault(exl3_check(m), []).append(e)
                self._take_marker(m)
                if "bias" in m.tensors:
                    raise GGUFExportError(f"{m.key}.bias: routed experts with biases are not supported")
            if len(kinds) > 1:
                desc = "; ".join(f"type {t} K={k} N={n}: experts {es[:4]}" for (k, n, t), es in kinds.items())
                raise GGUFExportError(f"{layer_key}.mlp.experts.*.{proj}: the experts of one stack must share one type "
                                      f"and shape, found {desc}")
            (k, n, tid), = kinds
            base = rn.tensor_name(member, bid, None)
            self.out.append([
                OutTensor(f"{base}.weight", (k, n, count), tid, sum(m.tensors["trellis"].nbytes for m in ms),
                          "exl3-retile", [self.ref(f"{m.key}.trellis") for m in ms]),
                OutTensor(f"{base}.rot_in", (k, count), F16, 2 * k * count, "copy", [self.ref(f"{m.key}.suh") for m in ms]),
                OutTensor(f"{base}.rot_out", (n, count), F16, 2 * n * count, "copy", [self.ref(f"{m.key}.svh") for m in ms]),
            ])


def plan_tensors(ckpt: Checkpoint, a: Analysis) -> tuple[list[OutTensor], list[dict[str, str]], Dims]:
    """The loader's tensor set from the checkpoint, in model order; vision tensors omitted and listed."""
    where = str(ckpt.root / "config.json")
    d = read_dims(ckpt.config or {}, where)
    tn = rn.tensor_name
    mp = _Mapper(ckpt, a)
    mp.plain(f"{TEXT}embed_tokens.weight", tn("TOKEN_EMBD"))
    for i in range(d.n_layer + d.n_mtp):
        p = f"{TEXT}layers.{i}"
        s = f"{p}.self_attn"
        mp.plain(f"{p}.input_layernorm.weight", tn("ATTN_NORM", i))
        mp.plain(f"{p}.post_attention_layernorm.weight", tn("FFN_NORM", i))
        if i < d.n_layer:
            for site in ("attn", "ffn"):
                for what in ("fn", "base", "scale"):
                    mp.plain(f"{p}.hc_{site}_{what}", tn(f"HC_{site.upper()}_{what.upper()}", i))
        if d.is_kda(i):
            mp.split_linear(f"{s}.qkv_proj", [tn(f"ATTN_{x}", i, None) for x in "QKV"])
            di = d.d_inner
            for j, x in enumerate("QKV"):
                # upstream reshapes each [Di, 1, Cv] conv to [1, Di, 1, Cv]: ne [Cv, 1, Di, 1]
                mp.plain(f"{s}.conv1d.weight", tn(f"SSM_CONV1D_{x}", i), {"rows": [j * di, (j + 1) * di]},
                         ne=(d.conv, 1, di, 1))
            for hf, member in (("f_a_proj", "SSM_F_A"), ("f_b_proj", "SSM_F_B"), ("g_a_proj", "SSM_G_A"),
                               ("g_b_proj", "SSM_G_B"), ("b_proj", "SSM_BETA"), ("o_norm", "SSM_NORM")):
                mp.plain(f"{s}.{hf}.weight", tn(member, i))
            mp.plain(f"{s}.dt_bias", tn("SSM_DT", i, "bias"))
            ref = mp.ref(f"{s}.A_log")
            if ref.dtype not in ("F32", "F16", "BF16") or len(ref.shape) != 1:
                raise GGUFExportError(f"{s}.A_log: {ref.dtype} {list(ref.shape)}; expected a 1-D float tensor")
            mp.out.append(OutTensor(tn("SSM_A", i, None), ref.shape, 0, 4 * ref.shape[0], "neg-exp-f32", [ref]))
            mp.linear(f"{s}.o_proj", tn("ATTN_OUT", i, None))
        else:
            mp.linear(f"{s}.q_a_proj", tn("ATTN_Q_A", i, None))
            mp.plain(f"{s}.q_a_layernorm.weight", tn("ATTN_Q_A_NORM", i))
            mp.linear(f"{s}.q_b_proj", tn("ATTN_Q_B", i, None))
            mp.linear(f"{s}.kv_a_proj_with_mqa", tn("ATTN_KV_A_MQA", i, None))
            mp.plain(f"{s}.kv_a_layernorm.weight", tn("ATTN_KV_A_NORM", i))
            kvb = f"{s}.kv_b_proj.weight"
            km, vm = d.k_mla - d.rope, d.v_mla
            ref = mp.ref(kvb, {"heads": d.heads, "k": km, "v": vm})
            if ref.shape != (d.heads * (km + vm), d.kv_lora) or ref.dtype not in ("F16", "BF16", "F32"):
                raise GGUFExportError(f"{kvb}: {ref.dtype} {list(ref.shape)}, expected an unquantized "
                                      f"[{d.heads * (km + vm)}, {d.kv_lora}] (heads × (k + v), kv_lora_rank)")
            tid = GGML_TYPE_OF_DTYPE[ref.dtype]  # 3-D ``.weight``: the converter keeps the source type
            size = ref.nbytes // (km + vm)
            mp.out.append(OutTensor(tn("ATTN_K_B", i), (km, d.kv_lora, d.heads), tid, size * km, "mla-k-b", [ref]))
            mp.out.append(OutTensor(tn("ATTN_V_B", i), (d.kv_lora, vm, d.heads), tid, size * vm, "mla-v-b", [ref]))
            mp.linear(f"{s}.o_proj", tn("ATTN_OUT", i, None))
            ix = f"{s}.indexer"
            mp.linear(f"{ix}.wq_b", tn("INDEXER_ATTN_Q_B", i, None))
            mp.plain(f"{ix}.wk.weight", tn("INDEXER_ATTN_K", i))
            mp.plain(f"{ix}.k_norm.weight", tn("INDEXER_K_NORM", i))
            mp.plain(f"{ix}.k_norm.bias", tn("INDEXER_K_NORM", i, "bias"))
            mp.plain(f"{ix}.weights_proj.weight", tn("INDEXER_PROJ", i))
            mp.plain(f"{ix}.index_kpool_compress_gate", tn("INDEXER_KPOOL_GATE", i))
            mp.plain(f"{ix}.index_kpool_compress_ape", tn("INDEXER_KPOOL_APE", i))
        if i < d.dense_lead:
            for proj, member in (("gate_proj", "FFN_GATE"), ("up_proj", "FFN_UP"), ("down_proj", "FFN_DOWN")):
                mp.linear(f"{p}.mlp.{proj}", tn(member, i, None))
        else:
            mp.plain(f"{p}.mlp.gate.weight", tn("FFN_GATE_INP", i))
            mp.plain(f"{p}.mlp.gate.e_score_correction_bias", tn("FFN_EXP_PROBS_B", i, "bias"))
            mp.experts(p, i, d.experts)
            for proj, member in (("gate_proj", "FFN_GATE_SHEXP"), ("up_proj", "FFN_UP_SHEXP"), ("down_proj", "FFN_DOWN_SHEXP")):
                mp.linear(f"{p}.mlp.shared_experts.{proj}", tn(member, i, None))
        if i >= d.n_layer:
            mp.linear(f"{p}.eh_proj", tn("NEXTN_EH_PROJ", i, None))
            mp.plain(f"{p}.enorm.weight", tn("NEXTN_ENORM", i))
            mp.plain(f"{p}.hnorm.weight", tn("NEXTN_HNORM", i))
            mp.plain(f"{p}.shared_head.norm.weight", tn("NEXTN_SHARED_HEAD_NORM", i))
    mp.plain(f"{TEXT}norm.weight", tn("OUTPUT_NORM"))
    mp.linear("lm_head", tn("OUTPUT", None, None))
    if mp.left:
        first = sorted(mp.left)[0]
        raise GGUFExportError(f"{first}: ranma.cpp's glm5-next loader has no tensor for it (and {len(mp.left) - 1} "
                              "more); it throws on extra tensors, so the export is refused")
    flat: list[OutTensor] = []
    for item in mp.out:
        flat.extend(item if isinstance(item, list) else [item])
    want = loader_shapes(d)
    for t in flat:
        if t.name.endswith((".rot_in", ".rot_out")):
            continue
        ne = want.get(t.name)
        if ne is None:
            raise GGUFExportError(f"{t.name}: ranma.cpp's glm5-next loader does not create this tensor")
        if tuple(t.ne) != ne:
            raise GGUFExportError(f"{t.name} (from {t.sources[0].tensor}): ne {list(t.ne)}, the loader expects {list(ne)}")
    omitted = [{"tensor": n, "reason": "vision tower (not converted: ranma.cpp loads vision as a separate mmproj)"}
               for n in ckpt.tensor_names() if n.startswith(VISION_PREFIXES)]
    return flat, omitted, d


def metadata(config: dict, d: Dims) -> list[KV]:
    """The ``glm5-next.*`` keys upstream's converter writes for this model (values from text_config)."""
    tc = text_config(config)
    lac = tc.get("linear_attn_config") or {}
    k = rn.key
    kvs: list[KV] = []

    def u32(name: str, v: object) -> None:
        kvs.append(KV(k(name), UINT32, int(v)))  # type: ignore[call-overload]

    def f32(name: str, v: object) -> None:
        kvs.append(KV(k(name), FLOAT32, float(v)))  # type: ignore[arg-type]

    u32("VOCAB_SIZE", d.vocab)
    if isinstance(tc.get("max_position_embeddings"), int):
        u32("CONTEXT_LENGTH", tc["max_position_embeddings"])
    u32("EMBEDDING_LENGTH", d.embd)
    u32("BLOCK_COUNT", d.n_layer + d.n_mtp)
    u32("LEADING_DENSE_BLOCK_COUNT", d.dense_lead)
    u32("FEED_FORWARD_LENGTH", d.ff)
    u32("EXPERT_FEED_FORWARD_LENGTH", d.ff_exp)
    u32("EXPERT_COUNT", d.experts)
    u32("EXPERT_USED_COUNT", d.used)
    u32("EXPERT_SHARED_COUNT", d.shared)
    if tc.get("routed_scaling_factor") is not None:
        f32("EXPERT_WEIGHTS_SCALE", tc["routed_scaling_factor"])
    kvs.append(KV(k("EXPERT_WEIGHTS_NORM"), BOOL, bool(tc.get("norm_topk_prob", True))))
    gating = tc.get("scoring_func", "sigmoid")
    if gating not in rn.GATING_FUNC:
        raise GGUFExportError(f"config.json: text_config.scoring_func {gating!r} is not softmax or sigmoid")
    u32("EXPERT_GATING_FUNC", rn.GATING_FUNC[gating])
    if tc.get("swiglu_limit") is not None:  # one entry per block, as upstream writes it
        for name in ("SWIGLU_CLAMP_EXP", "SWIGLU_CLAMP_SHEXP"):
            kvs.append(KV(k(name), ARRAY, [float(tc["swiglu_limit"])] * (d.n_layer + d.n_mtp), FLOAT32))
    u32("NEXTN_PREDICT_LAYERS", d.n_mtp)
    u32("HEAD_COUNT", d.heads)
    kvs.append(KV(k("HEAD_COUNT_KV"), ARRAY, [0 if d.is_kda(i) else 1 for i in range(d.n_layer + d.n_mtp)], UINT32))
    u32("KEY_LENGTH", d.kv_lora + d.rope)
    u32("VALUE_LENGTH", d.kv_lora)
    u32("KEY_LENGTH_MLA", d.k_mla)
    u32("VALUE_LENGTH_MLA", d.v_mla)
    u32("Q_LORA_RANK", d.q_lora)
    u32("KV_LORA_RANK", d.kv_lora)
    f32("LAYERNORM_RMS_EPS", tc.get("rms_norm_eps", 1e-5))
    f32("LAYERNORM_EPS", 1e-6)  # upstream writes this constant for glm5-next
    u32("ROPE_DIMENSION_COUNT", d.rope)
    if tc.get("rope_theta") is not None:
        f32("ROPE_FREQ_BASE", tc["rope_theta"])
    u32("INDEXER_HEAD_COUNT", d.idx_heads)
    u32("INDEXER_KEY_LENGTH", d.idx_dim)
    u32("INDEXER_TOP_K", d.top_k)
    u32("INDEXER_KPOOL", d.kpool)
    kvs.append(KV(k("INDEXER_KPOOL_SELECT_TAIL"), BOOL, bool(tc.get("index_kpool_always_select_tail", True))))
    types = tc.get("indexer_types")
    if types is not None:  # the trunk's entries, "full" -> true (without the key the loader takes all as full)
        if not isinstance(types, list) or len(types) < d.n_layer or not all(isinstance(t, str) for t in types):
            raise GGUFExportError(f"config.json: text_config.indexer_types must list at least {d.n_layer} strings")
        kvs.append(KV(k("INDEXER_TYPES"), ARRAY, [t == "full" for t in types[: d.n_layer]], BOOL))
    u32("HC_COUNT", d.hc)
    u32("HC_SINKHORN_ITERATIONS", tc.get("hc_sinkhorn_iters", 20))
    f32("HC_EPSILON", tc.get("hc_eps", 1e-6))
    u32("SSM_CONV_KERNEL", d.conv)
    u32("KDA_HEAD_DIM", d.kda_dim)
    if lac.get("gate_lower_bound") is not None:
        f32("KDA_GATE_LOWER_BOUND", lac["gate_lower_bound"])
    return kvs
