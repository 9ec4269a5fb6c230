"""The tests' stand-in for llama-quantize follows the real tool's own rules where a ladder depends on them: which
tensors it quantizes, the precedence of its flags, ``--tensor-type`` patterns lower-cased and the first match taken,
the row-width fallback after a named type, a tensor named at its own type copied. ``mosaic ladder`` holds every rung
to the types it asked for, so a tool that writes another type is refused in one line. Where llama.cpp's own
llama-quantize is built (``make llama-tools``), the stand-in's choice of type for each tensor is held to it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import mosaic
from mosaic._formats.quantizable import quantizable
from mosaic._measure.rungs import made_tool
from mosaic.testing.gguf import Geometry, write_llama_gguf
from mosaic.testing.quantize_tool import fallback, target_types, tensor_type_option, write_tool
from tests.conftest import needs_runtime

#: SmolLM2's widths: 576-wide rows, which no 256-wide block divides, and a 1536-wide ffn_down, which one does
NARROW = Geometry(n_layer=1, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3)


def _types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def test_llama_cpps_own_rules_for_which_tensor_takes_which_type() -> None:
    assert quantizable("blk.0.attn_q.weight", (576, 576)) and quantizable("token_embd.weight", (576, 49152))
    assert not quantizable("blk.0.attn_norm.weight", (576,)) and not quantizable("blk.0.attn_q.bias", (576,))
    assert not quantizable("blk.0.ffn_gate_inp.weight", (576, 8))  # a router: never quantized
    assert not quantizable("blk.0.x.weight", (576, 1))  # ggml_n_dims: a trailing 1 is no dimension
    assert fallback("Q4_K", 576) == "Q5_0" and fallback("Q6_K", 576) == "Q8_0" and fallback("IQ3_S", 576) == "IQ4_NL"
    assert fallback("Q2_K", 576) == "Q4_0" and fallback("Q4_K", 1536) == "Q4_K" and fallback("Q4_K", 40) == "F16"
    assert tensor_type_option("BLK\\.0\\.ATTN_Q=q8_0") == ("blk\\.0\\.attn_q", "Q8_0")  # the pattern lower-cased
    widths = {"token_embd.weight": 576, "blk.0.attn_q.weight": 576, "blk.0.ffn_down.weight": 1536}
    overrides = [tensor_type_option("attn=q4_k"), tensor_type_option("blk\\.0\\.attn_q=q8_0"), tensor_type_option("ffn=iq4_xs")]
    got = target_types(widths, "Q6_K", pure=True, token_embd="q8_0", output=None, overrides=overrides)
    assert got == {"token_embd.weight": "Q8_0",  # its own flag first
                   "blk.0.attn_q.weight": "Q5_0",  # the first pattern that matches (attn=q4_k), then its fallback
                   "blk.0.ffn_down.weight": "IQ4_XS"}
    assert target_types(widths, "Q6_K", pure=False, token_embd=None, output=None, overrides=[])["blk.0.attn_q.weight"] is None
    assert target_types(widths, "Q6_K", pure=True, token_embd=None, output=None, overrides=[])["blk.0.attn_q.weight"] == "Q8_0"


def test_named_types_are_written_and_a_tensor_at_its_own_type_is_copied(tmp_path: Path) -> None:
    needs_runtime()
    src = write_llama_gguf(tmp_path / "F16.gguf", qtype="F16", seed=3, geometry=NARROW)[0]
    q8 = tmp_path / "Q8_0.gguf"
    tool = write_tool(tmp_path / "q")
    subprocess.run([str(tool), str(src), str(q8), "Q8_0"], check=True, capture_output=True)
    (tmp_path / "types.txt").write_text("^blk\\.0\\.ffn_down\\.weight$=q4_k\n^blk\\.0\\.attn_q\\.weight$=q8_0 attn=q5_1\n")
    out = tmp_path / "out.gguf"
    r = subprocess.run([str(tool), "--allow-requantize", "--tensor-type-file", str(tmp_path / "types.txt"), "--pure",
                        str(q8), str(out), "Q4_0"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got, own = _types(out), _types(q8)
    assert got["blk.0.ffn_down.weight"] == "Q4_K" and got["blk.0.attn_q.weight"] == "Q8_0"
    assert got["blk.0.attn_k.weight"] == "Q5_1" and got["blk.0.ffn_up.weight"] == "Q4_0"  # the pattern; --pure's type
    assert got["blk.0.attn_norm.weight"] == own["blk.0.attn_norm.weight"] == "F32"
    from gguf import GGUFReader

    a = {t.name: bytes(t.data) for t in GGUFReader(str(out)).tensors}
    b = {t.name: bytes(t.data) for t in GGUFReader(str(q8)).tensors}
    assert a["blk.0.attn_q.weight"] == b["blk.0.attn_q.weight"]  # named at its own type: the source's bytes
    r = subprocess.run([str(tool), "--allow-requantize", "--tensor-type", "attn=q5_1", str(q8), str(out), "Q4_0"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "cannot pass --tensor-type to llama.cpp's own mix" in r.stderr  # refused, not guessed


def test_a_rung_not_at_the_types_asked_is_refused(tmp_path: Path) -> None:
    """A tool that ignores ``--tensor-type`` (an older llama.cpp, another build) writes the rung's type where a lean
    rung asked for the source's own: the read-back refuses it, naming the tensor, and keeps no file."""
    needs_runtime()
    src = write_llama_gguf(tmp_path / "F16.gguf", qtype="F16", seed=3, geometry=Geometry(n_layer=1, n_embd=256, n_ff=256))[0]
    tool = write_tool(tmp_path / "q")
    q4km = tmp_path / "Q4_K_M.gguf"
    subprocess.run([str(tool), str(src), str(q4km), "Q4_K_M"], check=True, capture_output=True)
    deaf = tmp_path / "deaf"
    deaf.write_text("#!/bin/sh\n# drops every --tensor-type and its value, quantizes --pure\n"
                    "args=''; skip=0; for a in \"$@\"; do if [ $skip = 1 ]; then skip=0; continue; fi; "
                    "if [ \"$a\" = --tensor-type ]; then skip=1; continue; fi; args=\"$args '$a'\"; done\n"
                    f"eval exec '{tool}' --pure $args\n")
    deaf.chmod(0o755)
    with pytest.raises(mosaic.MosaicError, match=r"the Q5_K rung llama-quantize wrote holds blk\.0\.\w+\.weight at Q5_K, "
                                                 r"not at Q4_K, the type it was asked for"):
        mosaic.ladder(q4km, out=tmp_path / "rungs", types="Q4_K,Q5_K,Q6_K", llama_quantize=deaf, lean=True)
    assert not list((tmp_path / "rungs").glob("*Q5_K*"))


@pytest.mark.skipif(not made_tool().is_file(), reason="llama.cpp's own llama-quantize is not built here (make llama-tools)")
@pytest.mark.parametrize("args", [["--pure"], ["--pure", "--token-embedding-type", "q8_0"],
                                  ["--tensor-type", "attn=q4_k", "--tensor-type", "ffn_down=iq4_nl", "--pure"]],
                         ids=["pure", "embedding-flag", "named"])
def test_the_stand_in_gives_each_tensor_the_type_llama_quantize_gives_it(tmp_path: Path, args: list[str]) -> None:
    needs_runtime()
    src = write_llama_gguf(tmp_path / "F16.gguf", qtype="F16", seed=3, geometry=NARROW)[0]
    got = {}
    for name, tool in (("real", str(made_tool())), ("stand-in", str(write_tool(tmp_path / "q")))):
        out = tmp_path / f"{name}.gguf"
        r = subprocess.run([tool, *args, str(src), str(out), "Q4_K_M", "2"], capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert r.returncode == 0, r.stdout + r.stderr
        got[name] = _types(out)
    assert got["stand-in"] == got["real"]
    assert got["real"]["blk.0.attn_q.weight"] == "Q5_0"  # 576 wide: Q4_K falls back, named or not
