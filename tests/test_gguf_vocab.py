"""Tokenizer metadata of the GGUF export: keys read back with gguf-py, merges forms, padding, refusals, audit."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mosaic._audit.gguf_folder import audit_gguf
from mosaic._export.gguf import export_gguf
from mosaic._export.vocab import PRE_TOKENIZERS, VocabError, convert_vocab, llamacpp_regex
from mosaic._formats.gguf_container import KV, layout, read_gguf
from mosaic.cli.commands import main
from mosaic.testing.exl3 import LLAMA3_REGEX, QWEN2_REGEX, Geometry, write_checkpoint

LLAMA = Geometry(arch="llama", experts=0, layers=1, vocab=512)
QWEN = Geometry(arch="qwen3_moe", layers=1, dense_layers=0, experts=2, shared_experts=False, score_bias=False,
                vocab=512, seed=5)

# The synthetic tokenizers, spelled out here rather than taken from mosaic.testing.exl3.
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
MERGED = ["Ġt", "he", "Ġthe", "in", "Ġa", "er", "on", "Ġs"]  # ids 256..263
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def byte_tokens() -> list[str]:
    import gguf.vocab

    table = gguf.vocab.bytes_to_unicode()  # gguf-py's own copy of GPT-2's byte table
    return [table[b] for b in range(256)]


def expected(arch: str) -> tuple[list[str], list[int]]:
    if arch == "llama":
        added = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        added_types = [CONTROL] * 5
    else:
        added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        added_types = [CONTROL, CONTROL, CONTROL, USER_DEFINED, USER_DEFINED]
    tokens = byte_tokens() + MERGED + added + [f"[PAD{i}]" for i in range(269, 512)]
    types = [NORMAL] * 264 + added_types + [UNUSED] * (512 - 269)
    return tokens, types


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("vl") / "llama-tok", LLAMA)


@pytest.fixture(scope="module")
def qwen_src(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("vq") / "qwen-tok", QWEN)


@pytest.fixture(scope="module")
def llama_out(llama_src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vlo") / "gguf"
    export_gguf(llama_src, out)
    return out


@pytest.fixture(scope="module")
def qwen_out(qwen_src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vqo") / "gguf"
    export_gguf(qwen_src, out)
    return out


def first_shard(out: Path) -> Path:
    return sorted(out.glob("*-00001-of-*.gguf"))[0]


def reader_values(path: Path) -> dict[str, object]:
    import gguf

    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


# ---- the keys ---------------------------------------------------------------------------------------------------


def test_llama_first_shard_tokenizer_keys(llama_out):
    got = reader_values(first_shard(llama_out))
    tokens, types = expected("llama")
    assert got["tokenizer.ggml.model"] == "gpt2"
    assert got["tokenizer.ggml.pre"] == "llama-bpe"
    assert got["tokenizer.ggml.tokens"] == tokens
    assert got["tokenizer.ggml.token_type"] == types
    assert got["tokenizer.ggml.merges"] == MERGES  # string form in the source
    assert got["tokenizer.ggml.bos_token_id"] == 264
    assert got["tokenizer.ggml.eos_token_id"] == 268
    assert got["tokenizer.ggml.add_bos_token"] is True  # from the TemplateProcessing post-processor
    assert got["tokenizer.chat_template"].startswith("{{ bos_token }}{% for m in messages %}")
    assert "tokenizer.ggml.padding_token_id" not in got and "tokenizer.ggml.unknown_token_id" not in got
    # our strict reader agrees, with gguf-py's value types
    g = read_gguf(first_shard(llama_out))
    assert (g.kvs["tokenizer.ggml.token_type"].vtype, g.kvs["tokenizer.ggml.token_type"].item) == (9, 5)  # i32
    assert g.kvs["tokenizer.ggml.bos_token_id"].vtype == 4  # u32
    assert g.kvs["tokenizer.ggml.add_bos_token"].vtype == 7  # bool
    for f in sorted(llama_out.glob("*.gguf"))[1:]:
        assert not any(k.startswith("tokenizer.") for k in read_gguf(f).kvs)


def test_qwen_first_shard_tokenizer_keys(qwen_src, qwen_out):
    got = reader_values(first_shard(qwen_out))
    tokens, types = expected("qwen")
    assert got["tokenizer.ggml.pre"] == "qwen2"
    assert got["tokenizer.ggml.tokens"] == tokens
    assert got["tokenizer.ggml.token_type"] == types  # <think> is added but not special: USER_DEFINED
    assert got["tokenizer.ggml.merges"] == MERGES  # pair form in the source, same key
    assert got["tokenizer.ggml.eos_token_id"] == 266
    assert got["tokenizer.ggml.padding_token_id"] == 264
    assert got["tokenizer.ggml.add_bos_token"] is False
    assert "tokenizer.ggml.bos_token_id" not in got  # bos_token is null
    assert got["tokenizer.chat_template"] == (qwen_src / "chat_template.jinja").read_text()
    m = json.loads((qwen_out / "manifest.json").read_text())
    rec = m["tokenizer"]
    assert (rec["model"], rec["pre"], rec["tokens"]) == ("gpt2", "qwen2", 512)
    names = [f["name"] for f in rec["files"]]
    assert names == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"]
    for f in rec["files"]:
        data = (qwen_src / f["name"]).read_bytes()
        assert (f["size"], f["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())


def _copy_with(src: Path, dst: Path, tok=None, cfg=None, config=None) -> Path:
    shutil.copytree(src, dst)
    for name, fn in (("tokenizer.json", tok), ("tokenizer_config.json", cfg), ("config.json", config)):
        if fn is not None:
            doc = json.loads((dst / name).read_text())
            fn(doc)
            (dst / name).write_text(json.dumps(doc, ensure_ascii=False))
    return dst


def _merges(folder: Path) -> list[str]:
    v = convert_vocab(folder, json.loads((folder / "config.json").read_text()))
    return next(kv.value for kv in v.kvs if kv.key == "tokenizer.ggml.merges")  # type: ignore[return-value]


def test_string_and_pair_merges_give_the_same_key(qwen_src, tmp_path):
    pairs = _merges(qwen_src)
    as_strings = _copy_with(qwen_src, tmp_path / "s", tok=lambda t: t["model"].update(
        merges=[f"{a} {b}" for a, b in t["model"]["merges"]]))
    assert pairs == _merges(as_strings) == MERGES
    # a space inside a pair part is written as U+0120, the way gguf-py's SpecialVocab encodes it
    spaced = _copy_with(qwen_src, tmp_path / "p", tok=lambda t: t["model"].update(merges=[["a b", "c"]]))
    assert _merges(spaced) == ["a\u0120b c"]


def test_padding_follows_config_vocab_size(qwen_src, tmp_path):
    def drop(c: dict) -> None:
        del c["vocab_size"]

    unpadded = _copy_with(qwen_src, tmp_path / "u", config=drop)
    v = convert_vocab(unpadded, json.loads((unpadded / "config.json").read_text()))
    assert v.n_tokens == 269 and expected("qwen")[0][:269] == next(kv.value for kv in v.kvs if kv.key == "tokenizer.ggml.tokens")
    small = _copy_with(qwen_src, tmp_path / "s", config=lambda c: c.update(vocab_size=268))
    with pytest.raises(VocabError, match=r"id 268 .*not below vocab_size 268"):
        convert_vocab(small, json.loads((small / "config.json").read_text()))


def test_added_token_types_follow_the_converter(qwen_src, tmp_path):
    """Added tokens: special -> CONTROL; not special but looking special (<|...|>) -> CONTROL; other -> USER_DEFINED
    with U+2581 written as a space (convert_hf_to_gguf.py get_vocab_base / does_token_look_special)."""
    def edit(t: dict) -> None:
        t["added_tokens"] += [
            {"id": 300, "content": "<|tool|>", "special": False, "normalized": False},
            {"id": 301, "content": "\u2581foo", "special": False, "normalized": True},
        ]

    def edit_cfg(c: dict) -> None:
        c.pop("added_tokens_decoder")

    src = _copy_with(qwen_src, tmp_path / "a", tok=edit, cfg=edit_cfg)
    kvs = {kv.key: kv.value for kv in convert_vocab(src, json.loads((src / "config.json").read_text())).kvs}
    toks, types = kvs["tokenizer.ggml.tokens"], kvs["tokenizer.ggml.token_type"]
    assert (toks[300], types[300]) == ("<|tool|>", CONTROL)
    assert (toks[301], types[301]) == (" foo", USER_DEFINED)
    assert (toks[299], types[299]) == ("[PAD299]", UNUSED)


def test_regexes_fold_to_llama_cpp_spelling():
    assert llamacpp_regex(LLAMA3_REGEX) == PRE_TOKENIZERS["llama-bpe"].regex
    assert llamacpp_regex(QWEN2_REGEX) == PRE_TOKENIZERS["qwen2"].regex
    assert PRE_TOKENIZERS["llama-bpe"].regex.startswith("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|")
    assert llamacpp_regex("(?i:\\p{L})") == "(?i:\\p{L})"  # not a letters-only group: left alone, so unknown


# ---- refusals ---------------------------------------------------------------------------------------------------


def _export_fails(src: Path, tmp_path: Path, *needles: str) -> None:
    res = CliRunner().invoke(main, ["export", "gguf", str(src), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("mosaic: error:") and "Traceback" not in res.output
    for n in needles:
        assert n in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()


def test_cli_reports_the_tokenizer(llama_src, tmp_path):
    res = CliRunner().invoke(main, ["export", "gguf", str(llama_src), "--out", str(tmp_path / "j"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tokenizer"] == {"model": "gpt2", "pre": "llama-bpe", "tokens": 512}
    res = CliRunner().invoke(main, ["export", "gguf", str(llama_src), "--out", str(tmp_path / "h")])
    assert res.exit_code == 0 and "tokenizer: gpt2 (llama-bpe pre-tokenizer), 512 tokens" in res.stdout


def test_refuses_unknown_pre_tokenizer_regex(llama_src, tmp_path):
    bad = LLAMA3_REGEX.replace("\\p{N}{1,3}", "\\p{N}{1,4}")

    def edit(t: dict) -> None:
        t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = bad

    src = _copy_with(llama_src, tmp_path / "s", tok=edit)
    _export_fails(src, tmp_path, "\\\\p{N}{1,4}", "refusing to guess", "llama-bpe")


def test_refuses_other_pre_tokenizer_shapes(llama_src, tmp_path):
    src = _copy_with(llama_src, tmp_path / "s", tok=lambda t: t.update(pre_tokenizer={"type": "ByteLevel",
                                                                                     "add_prefix_space": False,
                                                                                     "use_regex": True}))
    with pytest.raises(VocabError, match=r"pre_tokenizer ByteLevel\(add_prefix_space=False, use_regex=True\)"):
        convert_vocab(src)
    # llama.cpp ignores merges for llama-bpe; a tokenizer that does not would tokenize differently
    src2 = _copy_with(llama_src, tmp_path / "m", tok=lambda t: t["model"].update(ignore_merges=False))
    with pytest.raises(VocabError, match="ignore_merges"):
        convert_vocab(src2)


def test_refuses_non_bpe_and_sentencepiece_models(qwen_src, tmp_path):
    uni = _copy_with(qwen_src, tmp_path / "u", tok=lambda t: t.update(model={"type": "Unigram", "vocab": [["a", 0.0]]}))
    _export_fails(uni, tmp_path, "model type 'Unigram'", "byte-level BPE")
    spm = _copy_with(qwen_src, tmp_path / "b", tok=lambda t: t["model"].update(byte_fallback=True))
    with pytest.raises(VocabError, match="SentencePiece"):
        convert_vocab(spm)
    gone = tmp_path / "g"
    shutil.copytree(qwen_src, gone)
    (gone / "tokenizer.json").unlink()
    (gone / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(VocabError, match=r"tokenizer\.json: missing .*SentencePiece tokenizer\.model"):
        convert_vocab(gone)


def test_refuses_ambiguous_ids(qwen_src, tmp_path):
    def clash(t: dict) -> None:
        t["added_tokens"][0]["id"] = 5  # id of a byte token with other text

    src = _copy_with(qwen_src, tmp_path / "c", tok=clash)
    with pytest.raises(VocabError, match="clashes"):
        convert_vocab(src)
    src2 = _copy_with(qwen_src, tmp_path / "d", cfg=lambda c: c["added_tokens_decoder"]["267"].update(special=True))
    with pytest.raises(VocabError, match=r"added_tokens_decoder\[267\]"):
        convert_vocab(src2)


# ---- audit ------------------------------------------------------------------------------------------------------


def _rewrite_first(out: Path, edit) -> None:
    """Rewrite the (tensor-less) first shard with edited keys and make manifest.json's digests match, so only
    the tokenizer checks can notice."""
    path = first_shard(out)
    g = read_gguf(path)
    assert not g.tensors
    kvs = edit(dict(g.kvs))
    data = layout(list(kvs.values()), []).header
    path.write_bytes(data)
    m = json.loads((out / "manifest.json").read_text())
    for f in m["files"]:
        if f["name"] == path.name:
            f["size"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (out / "manifest.json").write_text(json.dumps(m))


def test_audit_passes_and_checks_tokenizer(qwen_src, qwen_out):
    rep = audit_gguf(qwen_out, sources=qwen_src)
    assert rep.ok, [f.as_dict() for f in rep.failures]
    assert "tokenizer" in rep.ran


def test_audit_detects_a_tampered_token_with_sources(qwen_src, qwen_out, tmp_path):
    out = tmp_path / "t"
    shutil.copytree(qwen_out, out)

    def edit(kvs: dict) -> dict:
        kv = kvs["tokenizer.ggml.tokens"]
        toks = list(kv.value)
        toks[267] = "<thinking>"
        kvs[kv.key] = KV(kv.key, kv.vtype, toks, kv.item)
        return kvs

    _rewrite_first(out, edit)
    assert audit_gguf(out).ok  # still a complete, consistent tokenizer: only the sources can tell
    rep = audit_gguf(out, sources=qwen_src)
    assert [(f.check, f.detail) for f in rep.failures] == [
        ("sources", "tokenizer.ggml.tokens differs from a fresh conversion of the source tokenizer")]
    res = CliRunner().invoke(main, ["audit", str(out), "--sources", str(qwen_src), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["ok"] is False


def test_audit_detects_missing_and_broken_tokenizer_keys(qwen_out, tmp_path):
    out = tmp_path / "t"
    shutil.copytree(qwen_out, out)

    def edit(kvs: dict) -> dict:
        del kvs["tokenizer.ggml.merges"]
        kvs["tokenizer.ggml.eos_token_id"] = KV("tokenizer.ggml.eos_token_id", 4, 9999)
        return kvs

    _rewrite_first(out, edit)
    rep = audit_gguf(out)
    details = sorted(f.detail for f in rep.failures if f.check == "tokenizer")
    assert details == ["tokenizer.ggml.eos_token_id = 9999 is not a u32 token id below 512",
                       "tokenizer.ggml.merges is missing while the tokens are present"]


def test_audit_sources_detects_a_changed_tokenizer_file(qwen_src, qwen_out, tmp_path):
    src = _copy_with(qwen_src, tmp_path / "s", cfg=lambda c: c.update(eos_token="<|endoftext|>"))
    rep = audit_gguf(qwen_out, sources=src)
    where = {(f.check, f.file) for f in rep.failures}
    assert ("sources", "tokenizer_config.json") in where
    assert any("tokenizer.ggml.eos_token_id differs" in f.detail for f in rep.failures)
