"""A plan that stock llama-quantize replays, and pins a plan honours: the tensor-type file is read back by the
tool's own rules (entries split on white space, each pattern lower-cased and searched anywhere in a name, the
first match deciding) and names every tensor the tool quantizes at its planned type and nothing else; pins hold
their tensors, or the plan is refused in one line."""

from __future__ import annotations

import pytest

from mosaic._base.errors import MosaicError
from mosaic._plan.pins import parse_pins, pin_of
from mosaic._plan.replay import entry, tensor_type_lines, types_of


def _tid(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name])


def test_each_entry_names_its_tensor_alone_as_the_tool_reads_it() -> None:
    names = ["blk.1.attn_q.weight", "blk.11.attn_q.weight", "blk.1.attn_q_norm.weight", "blk.1.attn_q.bias",
             "token_embd.weight", "output.weight", "blk.1.ffn_down.weight"]
    tensors = [("blk.1.attn_q.weight", (64, 64), _tid("Q4_K")), ("blk.11.attn_q.weight", (64, 64), _tid("IQ3_S")),
               ("blk.1.attn_q_norm.weight", (64,), _tid("F32")), ("blk.1.attn_q.bias", (64,), _tid("F32")),
               ("token_embd.weight", (64, 1000), _tid("Q2_K")), ("output.weight", (64, 1000), _tid("Q6_K")),
               ("blk.1.ffn_down.weight", (256, 64), _tid("IQ4_NL"))]
    lines = tensor_type_lines(tensors)
    assert lines[0] == "^blk\\.1\\.attn_q\\.weight$=q4_k"
    assert len(lines) == 5  # the norm and the bias are not quantized: not named
    got = types_of(lines, names)
    assert got == {"blk.1.attn_q.weight": "Q4_K", "blk.11.attn_q.weight": "IQ3_S", "token_embd.weight": "Q2_K",
                   "output.weight": "Q6_K", "blk.1.ffn_down.weight": "IQ4_NL"}
    # unescaped and unanchored, layer 1's entry would take layer 11's tensor too ('.' matches the second '1'):
    # the escapes and the anchors are what keep them apart
    assert types_of(["blk.1.=q4_k", "blk.11.=iq3_s"], ["blk.11.attn_q.weight"]) == {"blk.11.attn_q.weight": "Q4_K"}
    with pytest.raises(MosaicError, match="no entry can name this tensor"):
        entry("blk.0.Attn.weight", "q4_k")  # the tool lower-cases its patterns: an upper-case name is out of reach
    with pytest.raises(MosaicError, match="no entry can name this tensor"):
        entry("a b.weight", "q4_k")


def test_pins_read_as_the_tool_reads_its_entries() -> None:
    pins = parse_pins(["ATTN_V=Q8_0", "blk\\.0\\..*=q4_k", "attn=q6_k"])
    assert [p.type for p in pins] == ["Q8_0", "Q4_K", "Q6_K"]
    assert pin_of(pins, "blk.0.attn_v.weight").text == "ATTN_V=Q8_0"  # lower-cased, the first match deciding
    assert pin_of(pins, "blk.0.attn_q.weight").text == "blk\\.0\\..*=q4_k"
    assert pin_of(pins, "blk.3.attn_q.weight").text == "attn=q6_k" and pin_of(pins, "output.weight") is None
    for bad, says in (("attn_v", "expected PATTERN=TYPE"), ("attn_v=q9_9", "not a ggml type"), ("([=q4_k", "not a regular expression")):
        with pytest.raises(MosaicError, match=says):
            parse_pins([bad])
