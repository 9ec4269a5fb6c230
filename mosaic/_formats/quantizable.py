"""Which tensors of a GGUF model llama.cpp's quantizer quantizes: its own rule (``tensor_allows_quantization`` in
``llama-quant.cpp``, the parts that do not depend on the architecture). A ladder's rungs hold every other tensor as
the source has it, and the read-back holds the tool to that; the tests' stand-in for the tool applies the same rule.
"""

from __future__ import annotations

#: Parts of a name llama.cpp never quantizes (``tensor_allows_quantization`` in its ``llama-quant.cpp``, the
#: architecture-free rules): norms, expert routers, the small tables of some architectures.
_KEPT_PARTS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
               "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight")
#: Whole names it never quantizes (positional embeddings and token types).
_KEPT_NAMES = ("position_embd.weight", "token_types.weight")


def _dims(ne: tuple[int, ...]) -> int:
    """ggml's ``ggml_n_dims``: the dimensions up to the last that is not 1."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def quantizable(name: str, ne: tuple[int, ...]) -> bool:
    """Does llama-quantize quantize this tensor? Its own rule: a weight of two or more dimensions, but for the
    parts :data:`_KEPT_PARTS` and :data:`_KEPT_NAMES` name. Any other tensor keeps its type and bytes in every rung."""
    return (_dims(tuple(ne)) >= 2 and name.endswith("weight") and name not in _KEPT_NAMES
            and not any(part in name for part in _KEPT_PARTS))
