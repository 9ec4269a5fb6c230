"""The names ranma.cpp gives GLM-5.3-Flash's tensors and metadata keys: the fork's own table, cited.

PyPI's ``gguf`` has no ``glm5-next`` architecture and no hyper-connection (``hc_*``), KDA (``ssm_f_a``...)
or k-pool indexer names, so :mod:`mosaic._export.glm5_next` cannot take them from gguf-py as the other
architectures do. These strings are copied from the fork's own list, not guessed:

* tensor names: ``TENSOR_NAMES`` in ``gguf-py/gguf/constants.py`` of saturnsky/ranma.cpp @ 254cc1ca
  (the ``MODEL_TENSOR`` member is given with each);
* keys: ``Keys.LLM`` / ``Keys.Attention`` (and its ``Indexer``) / ``Keys.HyperConnection`` / ``Keys.SSM`` /
  ``Keys.KDA`` / ``Keys.Rope`` of the same file;
* which of them the loader reads, and with which shapes: ``src/models/glm5-next.cpp``
  (``load_arch_hparams``, ``load_arch_tensors``) and ``src/llama-arch.cpp`` (``LLM_ARCH_GLM5_NEXT ->
  "glm5-next"``).

Where the fork's table and the loader disagree, the loader decides (it throws on a missing or extra
tensor). ``SSM_A_NOSCAN`` is the one tensor the loader creates without a ``.weight`` suffix (``ssm_a``).
"""

from __future__ import annotations

#: ``LLM_ARCH_GLM5_NEXT`` in src/llama-arch.cpp (with a hyphen; ``glm5next`` is not loaded by the fork).
ARCH = "glm5-next"

#: MODEL_TENSOR member -> name (``{bid}`` = block index), from the fork's TENSOR_NAMES.
TENSOR_NAMES: dict[str, str] = {
    "TOKEN_EMBD": "token_embd",
    "OUTPUT_NORM": "output_norm",
    "OUTPUT": "output",
    "ATTN_NORM": "blk.{bid}.attn_norm",
    "FFN_NORM": "blk.{bid}.ffn_norm",
    "HC_ATTN_FN": "blk.{bid}.hc_attn_fn",
    "HC_ATTN_BASE": "blk.{bid}.hc_attn_base",
    "HC_ATTN_SCALE": "blk.{bid}.hc_attn_scale",
    "HC_FFN_FN": "blk.{bid}.hc_ffn_fn",
    "HC_FFN_BASE": "blk.{bid}.hc_ffn_base",
    "HC_FFN_SCALE": "blk.{bid}.hc_ffn_scale",
    # KDA (the fork marks these "Kimi Linear")
    "ATTN_Q": "blk.{bid}.attn_q",
    "ATTN_K": "blk.{bid}.attn_k",
    "ATTN_V": "blk.{bid}.attn_v",
    "ATTN_OUT": "blk.{bid}.attn_output",
    "SSM_CONV1D_Q": "blk.{bid}.ssm_conv1d_q",
    "SSM_CONV1D_K": "blk.{bid}.ssm_conv1d_k",
    "SSM_CONV1D_V": "blk.{bid}.ssm_conv1d_v",
    "SSM_F_A": "blk.{bid}.ssm_f_a",
    "SSM_F_B": "blk.{bid}.ssm_f_b",
    "SSM_G_A": "blk.{bid}.ssm_g_a",
    "SSM_G_B": "blk.{bid}.ssm_g_b",
    "SSM_BETA": "blk.{bid}.ssm_beta",
    "SSM_A": "blk.{bid}.ssm_a",  # created as LLM_TENSOR_SSM_A_NOSCAN: no suffix
    "SSM_DT": "blk.{bid}.ssm_dt",
    "SSM_NORM": "blk.{bid}.ssm_norm",
    # MLA + DSA indexer (k-pool)
    "ATTN_Q_A": "blk.{bid}.attn_q_a",
    "ATTN_Q_B": "blk.{bid}.attn_q_b",
    "ATTN_KV_A_MQA": "blk.{bid}.attn_kv_a_mqa",
    "ATTN_K_B": "blk.{bid}.attn_k_b",
    "ATTN_V_B": "blk.{bid}.attn_v_b",
    "ATTN_Q_A_NORM": "blk.{bid}.attn_q_a_norm",
    "ATTN_KV_A_NORM": "blk.{bid}.attn_kv_a_norm",
    "INDEXER_K_NORM": "blk.{bid}.indexer.k_norm",
    "INDEXER_PROJ": "blk.{bid}.indexer.proj",
    "INDEXER_ATTN_K": "blk.{bid}.indexer.attn_k",
    "INDEXER_ATTN_Q_B": "blk.{bid}.indexer.attn_q_b",
    "INDEXER_KPOOL_GATE": "blk.{bid}.indexer_compressor_gate",
    "INDEXER_KPOOL_APE": "blk.{bid}.indexer_compressor_ape",
    # MLP and MoE
    "FFN_GATE": "blk.{bid}.ffn_gate",
    "FFN_UP": "blk.{bid}.ffn_up",
    "FFN_DOWN": "blk.{bid}.ffn_down",
    "FFN_GATE_INP": "blk.{bid}.ffn_gate_inp",
    "FFN_EXP_PROBS_B": "blk.{bid}.exp_probs_b",
    "FFN_GATE_EXP": "blk.{bid}.ffn_gate_exps",
    "FFN_UP_EXP": "blk.{bid}.ffn_up_exps",
    "FFN_DOWN_EXP": "blk.{bid}.ffn_down_exps",
    "FFN_GATE_SHEXP": "blk.{bid}.ffn_gate_shexp",
    "FFN_UP_SHEXP": "blk.{bid}.ffn_up_shexp",
    "FFN_DOWN_SHEXP": "blk.{bid}.ffn_down_shexp",
    # MTP (NextN) block
    "NEXTN_EH_PROJ": "blk.{bid}.nextn.eh_proj",
    "NEXTN_ENORM": "blk.{bid}.nextn.enorm",
    "NEXTN_HNORM": "blk.{bid}.nextn.hnorm",
    "NEXTN_SHARED_HEAD_NORM": "blk.{bid}.nextn.shared_head_norm",
}


def tensor_name(member: str, bid: int | None = None, suffix: str | None = "weight") -> str:
    """``<name>.<suffix>`` of a MODEL_TENSOR member (``suffix=None``: no suffix, as for ``ssm_a``)."""
    base = TENSOR_NAMES[member].format(bid=bid)
    return base if suffix is None else f"{base}.{suffix}"


#: Metadata keys (``{arch}`` = ARCH), from the fork's Keys classes.
KEYS: dict[str, str] = {
    "VOCAB_SIZE": "{arch}.vocab_size",
    "LAYERNORM_EPS": "{arch}.attention.layer_norm_epsilon",
    "CONTEXT_LENGTH": "{arch}.context_length",
    "EMBEDDING_LENGTH": "{arch}.embedding_length",
    "BLOCK_COUNT": "{arch}.block_count",
    "LEADING_DENSE_BLOCK_COUNT": "{arch}.leading_dense_block_count",
    "FEED_FORWARD_LENGTH": "{arch}.feed_forward_length",
    "EXPERT_FEED_FORWARD_LENGTH": "{arch}.expert_feed_forward_length",
    "EXPERT_COUNT": "{arch}.expert_count",
    "EXPERT_USED_COUNT": "{arch}.expert_used_count",
    "EXPERT_SHARED_COUNT": "{arch}.expert_shared_count",
    "EXPERT_WEIGHTS_SCALE": "{arch}.expert_weights_scale",
    "EXPERT_WEIGHTS_NORM": "{arch}.expert_weights_norm",
    "EXPERT_GATING_FUNC": "{arch}.expert_gating_func",
    "NEXTN_PREDICT_LAYERS": "{arch}.nextn_predict_layers",
    "SWIGLU_CLAMP_EXP": "{arch}.swiglu_clamp_exp",
    "SWIGLU_CLAMP_SHEXP": "{arch}.swiglu_clamp_shexp",
    "HEAD_COUNT": "{arch}.attention.head_count",
    "HEAD_COUNT_KV": "{arch}.attention.head_count_kv",
    "KEY_LENGTH": "{arch}.attention.key_length",
    "VALUE_LENGTH": "{arch}.attention.value_length",
    "LAYERNORM_RMS_EPS": "{arch}.attention.layer_norm_rms_epsilon",
    "Q_LORA_RANK": "{arch}.attention.q_lora_rank",
    "KV_LORA_RANK": "{arch}.attention.kv_lora_rank",
    "KEY_LENGTH_MLA": "{arch}.attention.key_length_mla",
    "VALUE_LENGTH_MLA": "{arch}.attention.value_length_mla",
    "INDEXER_HEAD_COUNT": "{arch}.attention.indexer.head_count",
    "INDEXER_KEY_LENGTH": "{arch}.attention.indexer.key_length",
    "INDEXER_TOP_K": "{arch}.attention.indexer.top_k",
    "INDEXER_TYPES": "{arch}.attention.indexer.types",
    "INDEXER_KPOOL": "{arch}.attention.indexer.kpool",
    "INDEXER_KPOOL_SELECT_TAIL": "{arch}.attention.indexer.kpool_select_tail",
    "HC_COUNT": "{arch}.hyper_connection.count",
    "HC_SINKHORN_ITERATIONS": "{arch}.hyper_connection.sinkhorn_iterations",
    "HC_EPSILON": "{arch}.hyper_connection.epsilon",
    "SSM_CONV_KERNEL": "{arch}.ssm.conv_kernel",
    "KDA_HEAD_DIM": "{arch}.kda.head_dim",
    "KDA_GATE_LOWER_BOUND": "{arch}.kda.gate_lower_bound",
    "ROPE_DIMENSION_COUNT": "{arch}.rope.dimension_count",
    "ROPE_FREQ_BASE": "{arch}.rope.freq_base",
}

#: gguf-py's ExpertGatingFuncType (LLAMA_EXPERT_GATING_FUNC_TYPE_*): softmax 1, sigmoid 2.
GATING_FUNC = {"softmax": 1, "sigmoid": 2}


def key(member: str) -> str:
    return KEYS[member].format(arch=ARCH)
