"""The tokenizer of a GGUF export: ``tokenizer.ggml.*`` and ``tokenizer.chat_template`` from a checkpoint's files.

Owns the conversion of a Hugging Face tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja`` / ``chat_template.json``, ``config.json``) into the metadata that llama.cpp and
ranma.cpp need to load a model, without ``transformers``. A GGUF file without it does not load.

It reproduces what upstream's ``convert_hf_to_gguf.py`` writes for a byte-level BPE tokenizer
(``_set_vocab_gpt2``: ``get_vocab_base`` for tokens and types, ``gguf.SpecialVocab`` for merges, special
ids, ``add_*_token`` and the chat template), which ranma.cpp's converter runs unchanged for EXL3 sources:

* tokens in id order, including added tokens; ids up to ``vocab_size`` of config.json that no token has
  become ``[PAD{i}]`` of type UNUSED; a model-vocabulary token is NORMAL, an added token CONTROL when it is
  special or looks special (``does_token_look_special``), else USER_DEFINED with ``▁`` turned into a space;
* ``tokenizer.ggml.pre`` is not found by hashing encoded text (that needs ``transformers``) but from the
  ``pre_tokenizer`` definition itself: its regex, spelled as llama.cpp spells it, must be exactly the one
  llama.cpp's ``src/llama-vocab.cpp`` compiles for a name, with the BPE and decoding options that
  name implies there (:data:`PRE_TOKENIZERS`);
* merges, special ids and flags come from gguf-py's own ``SpecialVocab`` and ``GGUFWriter`` methods, so
  their keys and value types are gguf-py's.

Anything it cannot convert exactly (SentencePiece-style or non-BPE models, an unknown pre-tokenizer,
ambiguous ids) is refused with a :class:`VocabError` naming what was found; nothing is guessed.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import MosaicError
from mosaic._checkpoint.folder import load_json, text_config
from mosaic._formats.gguf_container import ARRAY, BOOL, FLOAT32, INT32, KV, STRING, UINT8, UINT32

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class VocabError(MosaicError):
    """The checkpoint's tokenizer cannot be converted to GGUF exactly."""


@dataclass(frozen=True)
class PreTokenizer:
    """What one ``tokenizer.ggml.pre`` name means in llama.cpp, and the tokenizer.json that matches it."""

    regex: str  # as src/llama-vocab.cpp compiles it for this name (``(?i:...)`` expanded)
    ignore_merges: bool  # llama.cpp sets ``ignore_merges`` for this name; tokenizer.json's model.ignore_merges
    clean_spaces: bool  # llama.cpp's ``clean_spaces`` for this name; tokenizer_config's clean_up_tokenization_spaces
    normalizers: tuple[str | None, ...]  # tokenizer.json normalizer types the name is chosen for


# From llama.cpp ``src/llama-vocab.cpp`` (ranma.cpp's fork keeps upstream's vocabulary code):
# ``llm_tokenizer_bpe`` gives each LLAMA_VOCAB_PRE_TYPE its regex_exprs, and ``llama_vocab::impl::load``
# maps the ``tokenizer.ggml.pre`` string to the type and its flags:
#   "llama-bpe" -> LLAMA_VOCAB_PRE_TYPE_LLAMA3, ignore_merges = true, add_bos = true (clean_spaces default true);
#   "qwen2"     -> LLAMA_VOCAB_PRE_TYPE_QWEN2, clean_spaces = false.
# The converter (convert_hf_to_gguf.py, get_vocab_base_pre) reaches these names by hashing the tokens of
# a test text for meta-llama/Meta-Llama-3-8B ("llama-bpe") and Qwen/Qwen1.5-7B ("qwen2"); Qwen2, 2.5 and 3
# share that tokenizer's pre-tokenizer (with an NFC normalizer, which llama.cpp does not apply for qwen2).
# Other names with the same regex (dbrx, smaug-bpe, stablelm2, ...) differ in flags or are chosen for other
# tokenizers and are not listed: a tokenizer matching none of these is refused.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "llama-bpe": PreTokenizer(
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ignore_merges=True, clean_spaces=True, normalizers=(None,)),
    "qwen2": PreTokenizer(
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ignore_merges=False, clean_spaces=False, normalizers=(None, "NFC")),
}

#: Names chosen by the architecture, not by the regex: upstream's converter writes ``glm4`` for GLM's
#: byte-level BPE (``_set_vocab_glm``) although its regex is Llama-3's, so a regex match alone would give
#: ``llama-bpe``. llama.cpp's ``glm4`` (LLAMA_VOCAB_PRE_TYPE_CHATGLM4) compiles that same regex and sets no
#: ``ignore_merges``; its ``clean_spaces`` is not established from the sources, so it is not checked.
#: HF architecture prefix -> (name, the PRE_TOKENIZERS regex it must have, ``tokenizer.ggml.<kind>_token_id``
#: -> token text that upstream's GLM vocabulary sets).
BY_ARCHITECTURE: dict[str, tuple[str, str, dict[str, str]]] = {
    # upstream convert_hf_to_gguf.py ``_set_vocab_glm``: bos [gMASK], eot <|user|>, unk <|endoftext|>,
    # eom <|observation|> (set after SpecialVocab read tokenizer_config.json, so those it names win)
    "Glm5Next": ("glm4", "llama-bpe", {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>",
                                       "eom": "<|observation|>"}),
}


def _family(config: dict | None) -> tuple[str, str, dict[str, str]] | None:
    archs = (config or {}).get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    return next((v for k, v in BY_ARCHITECTURE.items() if arch.startswith(k)), None)

_CI_GROUP = re.compile(r"\(\?i:([A-Za-z'|]*)\)")


def llamacpp_regex(hf_regex: str) -> str:
    """A tokenizer.json regex as llama.cpp writes it: its engine has no ``(?i:...)`` groups, so a group of
    letters and apostrophes becomes ``(?:...)`` with each letter as ``[xX]`` (src/llama-vocab.cpp, "adapted"
    comments). Any other construct is kept as it is (and then matches no known name)."""

    def fold(m: re.Match[str]) -> str:
        return "(?:" + "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in m.group(1)) + ")"

    return _CI_GROUP.sub(fold, hf_regex)


def _looks_special(text: str) -> bool:
    """``does_token_look_special`` of upstream's convert_hf_to_gguf.py: added tokens that some models mark
    as not special but that are control tokens."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``, applied by ``decode`` when clean_up_tokenization_spaces is true."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


@dataclass
class Vocab:
    """A converted tokenizer: the GGUF metadata and the files it was read from (name, size, SHA-256)."""

    model: str
    pre: str
    kvs: list[KV]
    files: list[dict[str, object]]
    notes: list[str] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return next(len(kv.value) for kv in self.kvs if kv.key == "tokenizer.ggml.tokens")  # type: ignore[arg-type]

    def record(self) -> dict[str, object]:
        """What manifest.json says about the tokenizer."""
        return {"model": self.model, "pre": self.pre, "tokens": self.n_tokens, "files": self.files, "notes": self.notes}


def _file_record(path: Path) -> dict[str, object]:
    data = path.read_bytes()
    return {"name": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _describe_pre(pre: object) -> str:
    if not isinstance(pre, dict):
        return repr(pre)
    if pre.get("type") == "Sequence":
        return "Sequence[" + ", ".join(_describe_pre(p) for p in pre.get("pretokenizers") or []) + "]"
    if pre.get("type") == "Split":
        pat = pre.get("pattern") or {}
        return f"Split({pat!r}, behavior={pre.get('behavior')!r}, invert={pre.get('invert')!r})"
    opts = ", ".join(f"{k}={v!r}" for k, v in pre.items() if k != "type")
    return f"{pre.get('type')}({opts})"


def _split_regex(tok: dict) -> str | None:
    pre = tok.get("pre_tokenizer")
    parts = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    if not (isinstance(parts, list) and parts and isinstance(parts[0], dict) and parts[0].get("type") == "Split"):
        return None
    pat = parts[0].get("pattern")
    regex = pat.get("Regex") if isinstance(pat, dict) else None
    return regex if isinstance(regex, str) else None


def pre_tokenizer_name(tok: dict, tok_config: dict | None, where: str = TOKENIZER_JSON) -> str:
    """The ``tokenizer.ggml.pre`` name whose llama.cpp pre-tokenizer is exactly this tokenizer.json's."""
    pre = tok.get("pre_tokenizer")
    parts = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    found = _describe_pre(pre)
    if not (isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], dict) and isinstance(parts[1], dict)
            and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel"):
        raise VocabError(f"{where}: pre_tokenizer {found} is not Sequence[Split(regex), ByteLevel]; "
                         f"no llama.cpp pre-tokenizer is known to match it (known: {', '.join(PRE_TOKENIZERS)})")
    split, byte_level = parts
    regex = (split.get("pattern") or {}).get("Regex") if isinstance(split.get("pattern"), dict) else None
    if not isinstance(regex, str) or split.get("behavior") != "Isolated" or split.get("invert") is not False \
            or byte_level.get("add_prefix_space") is not False or byte_level.get("use_regex") is not False:
        raise VocabError(f"{where}: pre_tokenizer {found}: expected an isolating, non-inverted Split with a regex and "
                         "a ByteLevel without prefix space or regex of its own")
    spelled = llamacpp_regex(regex)
    name = next((n for n, p in PRE_TOKENIZERS.items() if p.regex == spelled), None)
    if name is None:
        raise VocabError(f"{where}: pre-tokenizer regex {regex!r} is none of the regexes llama.cpp's "
                         f"src/llama-vocab.cpp compiles for {', '.join(PRE_TOKENIZERS)}; refusing to guess a "
                         "tokenizer.ggml.pre name")
    p = PRE_TOKENIZERS[name]
    model = tok.get("model") or {}
    if bool(model.get("ignore_merges", False)) != p.ignore_merges:
        raise VocabError(f"{where}: the pre-tokenizer is {name}'s, but model.ignore_merges is "
                         f"{model.get('ignore_merges')!r}; llama.cpp uses ignore_merges={str(p.ignore_merges).lower()} "
                         f"for {name}")
    norm = tok.get("normalizer")
    ntype = norm.get("type") if isinstance(norm, dict) else norm
    if ntype not in p.normalizers:
        raise VocabError(f"{where}: normalizer {norm!r} is not one llama.cpp's {name} pre-tokenizer is chosen for")
    clean = (tok_config or {}).get("clean_up_tokenization_spaces")
    if isinstance(clean, bool) and clean != p.clean_spaces:
        raise VocabError(f"{TOKENIZER_CONFIG}: clean_up_tokenization_spaces is {clean}, llama.cpp decodes {name} "
                         f"with clean_spaces={str(p.clean_spaces).lower()}")
    return name


def _check_bpe(tok: dict) -> dict:
    model = tok.get("model")
    if not isinstance(model, dict):
        raise VocabError(f"{TOKENIZER_JSON}: no model")
    mtype = model.get("type", "BPE" if "merges" in model else None)
    if mtype != "BPE":
        raise VocabError(f"{TOKENIZER_JSON}: model type {mtype!r}; only byte-level BPE tokenizers are converted "
                         "(tokenizer.ggml.model gpt2)")
    if model.get("byte_fallback"):
        raise VocabError(f"{TOKENIZER_JSON}: BPE with byte_fallback is a SentencePiece-style tokenizer "
                         "(tokenizer.ggml.model llama, scores from tokenizer.model); it is not converted")
    for k in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(k):
            raise VocabError(f"{TOKENIZER_JSON}: model.{k} = {model[k]!r}; llama.cpp's BPE has no such option")
    if model.get("dropout") not in (None, 0, 0.0):
        raise VocabError(f"{TOKENIZER_JSON}: model.dropout = {model['dropout']!r}; BPE dropout cannot be converted")
    dec = tok.get("decoder")
    if not (isinstance(dec, dict) and dec.get("type") == "ByteLevel"):
        raise VocabError(f"{TOKENIZER_JSON}: decoder {_describe_pre(dec)} is not ByteLevel; not a byte-level BPE")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        raise VocabError(f"{TOKENIZER_JSON}: model.vocab is missing or empty")
    return model


def _tokens(tok: dict, tok_config: dict | None, model: dict, vocab_size: int | None) -> tuple[list[str], list[int]]:
    """``get_vocab_base``: the token list and types, with the ids as transformers would give them."""
    import gguf

    by_id: dict[int, str] = {}
    ids: dict[str, int] = {}
    for text, i in model["vocab"].items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise VocabError(f"{TOKENIZER_JSON}: token {text!r} has id {i!r}")
        if i in by_id:
            raise VocabError(f"{TOKENIZER_JSON}: id {i} is both {by_id[i]!r} and {text!r}")
        by_id[i] = text
        ids[text] = i
    added: dict[int, dict] = {}
    for a in tok.get("added_tokens") or []:
        if not isinstance(a, dict) or not isinstance(a.get("content"), str) or not isinstance(a.get("id"), int) or a["id"] < 0:
            raise VocabError(f"{TOKENIZER_JSON}: malformed added token {str(a)[:80]}")
        i, text = a["id"], a["content"]
        if i in added or (i in by_id and by_id[i] != text) or (text in ids and ids[text] != i):
            raise VocabError(f"{TOKENIZER_JSON}: added token {text!r} (id {i}) clashes with another token of that "
                             "id or text; the id transformers would give it is ambiguous")
        added[i] = a
        by_id[i] = text
        ids[text] = i
    decoder = (tok_config or {}).get("added_tokens_decoder") or {}
    for key, d in decoder.items():
        a = added.get(int(key)) if str(key).isdigit() else None
        if a is None or not isinstance(d, dict) or d.get("content") != a["content"] \
                or bool(d.get("special", False)) != bool(a.get("special", False)):
            raise VocabError(f"{TOKENIZER_CONFIG}: added_tokens_decoder[{key}] = {str(d)[:80]} disagrees with "
                             f"{TOKENIZER_JSON}'s added_tokens")
    for kind in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
        entry = (tok_config or {}).get(f"{kind}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(text, str) and text not in ids:
            raise VocabError(f"{TOKENIZER_CONFIG}: {kind}_token {text!r} is not in the vocabulary; transformers would "
                             "add it with a new id")
    n = vocab_size if vocab_size is not None else len(ids)
    top = max(by_id)
    if top >= n:
        what = f"vocab_size {vocab_size} in config.json" if vocab_size is not None else f"{n} tokens"
        raise VocabError(f"{TOKENIZER_JSON}: token id {top} ({by_id[top]!r}) is not below {what}")
    clean = (tok_config or {}).get("clean_up_tokenization_spaces")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        a = added.get(i)
        if a is None:
            types.append(gguf.TokenType.NORMAL)
        else:
            special = bool(a.get("special", False))
            if not a.get("normalized", not special):
                # the converter replaces it by decode(encode(text)); for a byte-level BPE that is the text
                # itself unless decoding cleans up spaces around punctuation
                cleaned = _clean_up_tokenization(text)
                if cleaned != text:
                    if not isinstance(clean, bool):
                        raise VocabError(f"{TOKENIZER_CONFIG}: added token {text!r} would change if decoding cleaned "
                                         "up spaces, and clean_up_tokenization_spaces is not set")
                    text = cleaned if clean else text
            if special or _looks_special(text):
                types.append(gguf.TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")  # pre-normalize user-defined spaces, as the converter does
                types.append(gguf.TokenType.USER_DEFINED)
        tokens.append(text)
    return tokens, [int(t) for t in types]


class _Notes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _writer_kvs(values: dict) -> list[KV]:
    """gguf-py GGUFWriter key/values as ours, with the value types its writer would give them."""
    import gguf

    out = []
    for key, v in values.items():
        vtype = int(v.type)
        if vtype == ARRAY:
            items = list(v.value)
            item = int(v.sub_type if v.sub_type is not None else gguf.GGUFValueType.get_type(items[0]))
            conv = {STRING: str, INT32: int, UINT32: int, UINT8: int, BOOL: bool, FLOAT32: float}[item]
            out.append(KV(key, ARRAY, [conv(x) for x in items], item))
        else:
            conv2 = {STRING: str, UINT32: int, INT32: int, BOOL: bool, FLOAT32: float}[vtype]
            out.append(KV(key, vtype, conv2(v.value)))
    return out


def convert_vocab(folder: str | Path, config: dict | None = None) -> Vocab:
    """Convert the tokenizer of the checkpoint at ``folder`` (``config``: its config.json, for vocab_size)."""
    import gguf

    root = Path(folder)
    tj = root / TOKENIZER_JSON
    if not tj.is_file():
        what = " (only a SentencePiece tokenizer.model, which is not converted)" if (root / "tokenizer.model").is_file() else ""
        raise VocabError(f"{tj}: missing{what}; a GGUF file without a tokenizer does not load in ranma.cpp")
    tok = load_json(tj, "tokenizer")
    if not isinstance(tok, dict):
        raise VocabError(f"{tj}: not a JSON object")
    tcp = root / TOKENIZER_CONFIG
    tok_config = load_json(tcp, "tokenizer config") if tcp.is_file() else None
    if tok_config is not None and not isinstance(tok_config, dict):
        raise VocabError(f"{tcp}: not a JSON object")
    model = _check_bpe(tok)
    family = _family(config)
    special_ids: dict[str, int] = {}
    if family is None:
        pre = pre_tokenizer_name(tok, tok_config)
    else:
        pre, like, specials = family
        regex = _split_regex(tok)
        if regex is None or llamacpp_regex(regex) != PRE_TOKENIZERS[like].regex:
            raise VocabError(f"{tj}: pre-tokenizer {_describe_pre(tok.get('pre_tokenizer'))} is not the one llama.cpp's "
                             f"{pre!r} compiles ({like}'s regex); refusing to guess a tokenizer.ggml.pre name")
        ids = {a.get("content"): a.get("id") for a in tok.get("added_tokens") or [] if isinstance(a, dict)}
        for kind, text in specials.items():
            if not isinstance(ids.get(text), int):
                raise VocabError(f"{tj}: added token {text!r} is missing; the {pre} vocabulary uses it as the {kind} token")
            special_ids[kind] = ids[text]
    vs = text_config(config or {}).get("vocab_size")
    if vs is not None and (not isinstance(vs, int) or isinstance(vs, bool) or vs <= 0):
        raise VocabError(f"config.json: vocab_size {vs!r} is not a positive integer")
    tokens, types = _tokens(tok, tok_config, model, vs)

    used = [TOKENIZER_JSON]
    if tok_config is not None:
        used.append(TOKENIZER_CONFIG)
        if "chat_template" not in tok_config:
            # SpecialVocab's fallbacks, in its order (it reads them only beside a tokenizer_config.json)
            if (root / "chat_template.jinja").is_file():
                used.append("chat_template.jinja")
                if (root / "additional_chat_templates").is_dir():
                    raise VocabError(f"{root / 'additional_chat_templates'}: named chat templates are not exported")
            elif (root / "chat_template.json").is_file():
                used.append("chat_template.json")
    if not model.get("merges"):
        raise VocabError(f"{tj}: model.merges is missing or empty; a gpt2 tokenizer needs its merges")
    if (root / "config.json").is_file():
        used.append("config.json")  # SpecialVocab reads <kind>_token_id from it

    handler = _Notes()
    log = logging.getLogger("gguf")
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False
    try:
        gw = gguf.GGUFWriter(None, "llama")
        gw.kv_data[0].clear()  # drop general.architecture: only the tokenizer's keys are wanted here
        gw.add_tokenizer_model("gpt2")
        gw.add_tokenizer_pre(pre)
        gw.add_token_list(tokens)
        gw.add_token_types(types)
        special = gguf.SpecialVocab(root, load_merges=True)
        for kind, tid in special_ids.items():
            special._set_special_token(kind, tid)
        special.add_to_gguf(gw, quiet=True)
    except (ValueError, TypeError, KeyError) as e:
        raise VocabError(f"{root}: gguf-py's SpecialVocab refused the tokenizer files: {e}") from None
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
    if isinstance(special.chat_template, list):
        raise VocabError(f"{root}: named chat templates (a list) are not exported")
    kvs = _writer_kvs(gw.kv_data[0])
    files = [_file_record(root / n) for n in used]
    # gguf-py's warnings go into manifest.json: never with the source's absolute path (outputs are deterministic)
    notes = [m.replace(str(root.resolve()), ".").replace(str(root), ".") for m in handler.messages if m.strip()]
    return Vocab("gpt2", pre, kvs, files, notes)
