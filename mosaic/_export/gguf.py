"""``mosaic export gguf``: an EXL3 checkpoint (a mosaic or any EXL3 folder) as GGUF files for ranma.cpp.

Owns the mapping from safetensors names to GGUF names and keys, the exact layout of every output
file before any data is written, the streaming copy, the split into shards and ``manifest.json``.
Nothing is re-quantized: ranma.cpp (a llama.cpp fork) reads EXL3 trellis tiles as its own tensor
types, so each EXL3 linear becomes ``<name>.weight`` of type ``256 + 16 * codebook + code`` whose
bytes are the trellis tiles in another order, plus ``<name>.rot_in`` / ``.rot_out`` = suh / svh
(F16, bytes unchanged); routed experts are stacked per layer and projection in expert order; every
other tensor gets the type the fork's converter gives it (:func:`mosaic._export.tensors.gguf_dtype`: F32 for
norms, 1-D tensors, routers and convolutions, which widens BF16/F16 exactly; its source type otherwise).
The facts follow the fork's own converter (ranma.cpp ``conversion/exl3.py``, ``gguf-py/gguf/exl3.py``,
``gguf-py/gguf/constants.py``, ``docs/ranma/exl3.md``).

The two exceptions to "no value changes" are that widening to F32 and GLM-5.3's ``ssm_a = -exp(A_log)``
(float64, rounded once to F32); both are recorded per tensor in manifest.json (``layout``) and re-derived
independently by ``mosaic audit --sources`` (see :mod:`mosaic._export.tensors`).

Tile order. The trellis is int16 ``[K/16, N/16, 16*bits]``: a 16x16 tile is ``32*bits`` contiguous
bytes. GGUF wants ``[N/128][K/16][8 tiles]`` (``to_ggml`` in the fork's ``gguf-py/gguf/exl3.py``):
the 8 tiles of one 128-row group at one ``kt`` are already contiguous in the source (``seg =
8 * 32 * bits`` bytes at ``(kt * N/16 + 8 g) * 32 * bits``), so the re-tiling is the permutation
"segment (kt, g) -> position (g, kt)" of whole segments. It is streamed a few 128-row groups at a
time (a memory map, a strided gather of ``K/16`` segments per group), never a whole tensor.

Names and keys come from gguf-py's tables (``gguf.MODEL_ARCH_NAMES``, ``gguf.get_tensor_name_map``);
a tensor those tables cannot name is refused, never guessed. MTP layers (index >= num_hidden_layers)
and vision towers are left out (the fork's converter does not convert them either) and listed.
GLM-5.3-Flash (``Glm5NextForConditionalGeneration`` -> ``glm5-next``) is the exception: gguf-py does not
know it, so :mod:`mosaic._export.glm5_next` maps it with the fork's own cited name table, writes exactly the
tensor set the fork's loader creates, and keeps the MTP layer (the fork's release ranma_20261007 loads
it as ``blk.<num_hidden_layers>``).

The tokenizer metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``) comes from
:mod:`mosaic._export.vocab`; a checkpoint whose tokenizer it cannot convert exactly is refused, since
ranma.cpp does not load a file without one.

Memory is bounded by a few 8 MiB buffers whatever the size of a stacked tensor; the output is
written into a temporary sibling folder, read back once and checked, then renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import OutputError, VerificationError
from mosaic._base.hashing import digest_file
from mosaic._base.lock import output_lock
from mosaic._base.progress import SILENT, Reporter
from mosaic._base.version import __version__
from mosaic._checkpoint.census_exl3 import analyze
from mosaic._checkpoint.exl3 import Module, module_key
from mosaic._checkpoint.folder import open_checkpoint, text_config
from mosaic._export import glm5_next
from mosaic._export.tensors import (
    F16,
    GGUFExportError,
    OutTensor,
    SourceRef,
    copied_chunks,
    exl3_check,
    f32_chunks,
    mla_chunks,
    neg_exp_chunks,
    plain,
    retiled_chunks,
)
from mosaic._export.vocab import Vocab, convert_vocab
from mosaic._formats.gguf_container import (
    FLOAT32,
    INT32,
    KV,
    STRING,
    UINT16,
    UINT32,
    Layout,
    align,
    layout,
    type_name,
)

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = "mosaic.gguf-manifest/v1"

#: HF architecture -> gguf-py MODEL_ARCH member. Architectures that exllamav3 quantizes, that gguf-py
#: maps, and whose plain layout the fork converts through the upstream model class (docs/ranma/exl3.md
#: lists llama and qwen3moe as checked); and GLM-5.3-Flash, mapped by mosaic._export.glm5_next.
SUPPORTED: dict[str, str] = {
    "LlamaForCausalLM": "LLAMA",
    "Qwen3ForCausalLM": "QWEN3",
    "Qwen3MoeForCausalLM": "QWEN3MOE",
    glm5_next.HF_ARCH: "GLM5_NEXT",  # gguf-py has no glm5-next: mosaic._export.glm5_next, the fork's own names
}
#: Upstream's llama model class permutes Q/K rows for RoPE; EXL3 rows cannot be permuted inside 128,
#: so the fork's converter (conversion/exl3.py, ``adapt``) writes the unpermuted rows with
#: ``<arch>.rope.style = "neox"`` (the key is ``%s.rope.style`` in the fork's src/llama-arch.cpp).
ROPE_NEOX = frozenset({"LLAMA"})

_EXPERT_RE = re.compile(r"^(?P<head>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.vision_model.",
                    "vision_model.", "model.multi_modal_projector.", "multi_modal_projector.")
_SPLIT_RE = re.compile(r"^(\d+)([KMG]?)$")


def supported_architectures() -> list[str]:
    return sorted(SUPPORTED)


def parse_size(text: str) -> int:
    """``llama-gguf-split --split-max-size``: a number of bytes, or with K/M/G = 10^3/10^6/10^9."""
    m = _SPLIT_RE.match(text.strip())
    if not m or int(m.group(1)) <= 0:
        raise GGUFExportError(f"--split-max-size {text!r}: expected a positive number with an optional K, M or G")
    return int(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m.group(2)]


def shard_name(stem: str, i: int, n: int) -> str:
    return f"{stem}-{i:05d}-of-{n:05d}.gguf"


@dataclass
class ExportPlan:
    source: Path
    architecture: str
    kvs: list[KV]
    tensors: list[OutTensor]
    omitted: list[dict[str, str]]
    shards: list[list[OutTensor]] = field(default_factory=list)
    layouts: list[Layout] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    vocab: Vocab | None = None


# ---- mapping ------------------------------------------------------------------------------------------------


def _ref(ckpt, name: str) -> SourceRef:
    shard, a, b = ckpt.file_range(name)
    t = ckpt.tensor(name)
    return SourceRef(name, shard, a, b - a, t.shape, t.dtype)


def _metadata(arch_name: str, arch_key: str, config: dict, qc: dict, name: str) -> list[KV]:
    tc = text_config(config)

    def num(key: str, *alts: str) -> int | float | None:
        for k in (key, *alts):
            v = tc.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return v
        return None

    def need(key: str, *alts: str) -> int:
        v = num(key, *alts)
        if not isinstance(v, int):
            raise GGUFExportError(f"config.json: {key} is missing or not an integer; it is needed for {arch_name}")
        return v

    if tc.get("rope_scaling") not in (None, {}):
        raise GGUFExportError("config.json: rope_scaling is set; exporting RoPE scaling to GGUF is not supported yet")
    a = arch_name
    kvs = [KV("general.architecture", STRING, a), KV("general.name", STRING, name),
           KV("general.quantization_version", UINT32, 2)]

    def u32(key: str, v: int | float | None) -> None:
        if v is not None:
            kvs.append(KV(f"{a}.{key}", UINT32, int(v)))

    def f32(key: str, v: int | float | None) -> None:
        if v is not None:
            kvs.append(KV(f"{a}.{key}", FLOAT32, float(v)))

    hidden = need("hidden_size")
    heads = num("num_attention_heads")
    head_dim = num("head_dim")
    if arch_key == "LLAMA":
        u32("vocab_size", num("vocab_size"))
    u32("context_length", num("max_position_embeddings"))
    u32("embedding_length", hidden)
    u32("block_count", need("num_hidden_layers"))
    u32("feed_forward_length", num("intermediate_size"))
    if arch_key == "LLAMA":
        u32("rope.dimension_count", head_dim or (hidden // int(heads) if heads else None))
    u32("attention.head_count", heads)
    u32("attention.head_count_kv", num("num_key_value_heads"))
    f32("rope.freq_base", num("rope_theta"))
    f32("attention.layer_norm_rms_epsilon", num("rms_norm_eps"))
    if arch_key != "LLAMA" and head_dim is not None:
        u32("attention.key_length", head_dim)
        u32("attention.value_length", head_dim)
    if arch_key == "QWEN3MOE":
        u32("expert_count", need("num_experts", "n_routed_experts"))
        u32("expert_used_count", need("num_experts_per_tok"))
        u32("expert_feed_forward_length", num("moe_intermediate_size"))
    if arch_key in ROPE_NEOX:
        kvs.append(KV(f"{a}.rope.style", STRING, "neox"))
    return kvs + _exl3_kvs(qc)


def _exl3_kvs(qc: dict) -> list[KV]:
    """What the fork's converter writes (conversion/exl3.py, ``add_metadata``); it refuses EXL3 types
    without a non-empty version and a codebook."""
    kvs: list[KV] = []
    version = qc.get("version")
    if not isinstance(version, str) or not version:
        raise GGUFExportError("config.json: quantization_config.version is missing or empty; ranma.cpp needs it")
    kvs.append(KV("quantize.exl3.version", STRING, version))
    if isinstance(qc.get("bits"), (int, float)):
        kvs.append(KV("quantize.exl3.bits", FLOAT32, float(qc["bits"])))
    if isinstance(qc.get("head_bits"), (int, float)):
        kvs.append(KV("quantize.exl3.head_bits", FLOAT32, float(qc["head_bits"])))
    kvs.append(KV("quantize.exl3.codebook", STRING, str(qc.get("codebook", "3inst"))))
    if "out_scales" in qc:
        kvs.append(KV("quantize.exl3.out_scales", STRING, str(qc["out_scales"])))
    cal = qc.get("calibration") if isinstance(qc.get("calibration"), dict) else {}
    for k in ("rows", "cols"):
        if isinstance(cal.get(k), int):
            kvs.append(KV(f"quantize.exl3.calibration.{k}", UINT32, int(cal[k])))
    return kvs


def plan_export(src: str | os.PathLike[str], name: str | None = None) -> ExportPlan:
    """Map every tensor of the checkpoint at ``src`` to its GGUF tensor (or to the omitted list)."""
    import gguf  # gguf-py: the name and key tables of llama.cpp

    ckpt = open_checkpoint(src)
    if ckpt.config is None:
        raise GGUFExportError(f"{ckpt.root}: no config.json; the architecture is unknown")
    archs = ckpt.config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) else None
    if arch not in SUPPORTED:
        raise GGUFExportError(
            f"{ckpt.root / 'config.json'}: architecture {arch if arch else archs!r} cannot be exported to GGUF; "
            f"supported: {', '.join(supported_architectures())}"
        )
    qc = ckpt.config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "exl3":
        raise GGUFExportError(f"{ckpt.root / 'config.json'}: quantization_config.quant_method is not exl3")
    arch_key = SUPPORTED[arch]
    if arch_key == "GLM5_NEXT":
        return _plan_glm5_next(ckpt, qc, name)
    march = gguf.MODEL_ARCH[arch_key]
    arch_name = gguf.MODEL_ARCH_NAMES[march]
    nhl = ckpt.num_hidden_layers
    if nhl is None:
        raise GGUFExportError(f"{ckpt.root / 'config.json'}: num_hidden_layers is missing")
    tmap = gguf.get_tensor_name_map(march, nhl)
    a = analyze(ckpt)
    mods = a.modules

    out: list[OutTensor] = []
    omitted: list[dict[str, str]] = []
    stacks: dict[str, list[tuple[int, Module]]] = {}
    stack_slot: dict[str, int] = {}
    done: set[str] = set()

    def gname(key: str) -> str:
        g = tmap.get_name(key)
        if g is None:
            raise GGUFExportError(f"{key}: gguf-py has no {arch_name} tensor name for it; refusing to guess one")
        return g

    for tname in ckpt.tensor_names():
        key, _ = module_key(tname)
        if tname.startswith(_VISION_PREFIXES):
            omitted.append({"tensor": tname, "reason": "vision tower (not converted)"})
            continue
        lm = _LAYER_RE.search(tname)
        if lm and int(lm.group(1)) >= nhl:
            omitted.append({"tensor": tname, "reason": f"MTP layer {lm.group(1)} (layer >= num_hidden_layers {nhl})"})
            continue
        m = mods.get(key)
        if m is not None and m.is_exl3:
            if key in done:
                continue
            done.add(key)
            k, n, tid = exl3_check(m)
            em = _EXPERT_RE.match(key)
            if em:
                if "bias" in m.tensors:
                    raise GGUFExportError(f"{key}.bias: routed experts with biases are not supported")
                skey = f"{em.group('head')}.{em.group('proj')}"
                if skey not in stacks:
                    stacks[skey] = []
                    stack_slot[skey] = len(out)
                    out.append(None)  # type: ignore[arg-type]  # filled once every expert is seen
                stacks[skey].append((int(em.group("e")), m))
                continue
            base = gname(key)
            out.append(OutTensor(f"{base}.weight", (k, n), tid, _exl3_bytes(m), "exl3-retile",
                                 [_ref(ckpt, f"{key}.trellis")]))
            out.append(OutTensor(f"{base}.rot_in", (k,), F16, 2 * k, "copy", [_ref(ckpt, f"{key}.suh")]))
            out.append(OutTensor(f"{base}.rot_out", (n,), F16, 2 * n, "copy", [_ref(ckpt, f"{key}.svh")]))
            if "bias" in m.tensors:
                out.append(_plain(ckpt, f"{key}.bias", f"{base}.bias"))
            continue
        g = tmap.get_name(tname, try_suffixes=(".weight", ".bias"))
        if g is None:
            raise GGUFExportError(f"{tname}: gguf-py has no {arch_name} tensor name for it; refusing to guess one")
        out.append(_plain(ckpt, tname, g))

    for skey, members in stacks.items():
        members.sort(key=lambda x: x[0])
        ids = [e for e, _ in members]
        if ids != list(range(len(ids))):
            raise GGUFExportError(f"{skey}: experts {ids[:8]}... are not 0..{len(ids) - 1}; cannot stack them")
        kinds = {}
        for e, m in members:
            kinds.setdefault(exl3_check(m), []).append(e)
        if len(kinds) > 1:
            desc = "; ".join(f"{type_name(t)} K={k} N={n}: experts {es[:4]}{'...' if len(es) > 4 else ''}"
                             for (k, n, t), es in kinds.items())
            raise GGUFExportError(f"{skey}: the experts of one stack must share one type and shape, found {desc}")
        (k, n, tid), = kinds
        e_count = len(members)
        base = gname(skey)
        keys = [m.key for _, m in members]
        stack = [
            OutTensor(f"{base}.weight", (k, n, e_count), tid, sum(_exl3_bytes(m) for _, m in members), "exl3-retile",
                      [_ref(ckpt, f"{x}.trellis") for x in keys]),
            OutTensor(f"{base}.rot_in", (k, e_count), F16, 2 * k * e_count, "copy", [_ref(ckpt, f"{x}.suh") for x in keys]),
            OutTensor(f"{base}.rot_out", (n, e_count), F16, 2 * n * e_count, "copy", [_ref(ckpt, f"{x}.svh") for x in keys]),
        ]
        out[stack_slot[skey]] = stack  # type: ignore[call-overload]
    flat: list[OutTensor] = []
    for item in out:
        flat.extend(item if isinstance(item, list) else [item])
    seen: set[str] = set()
    for t in flat:
        if t.name in seen:
            raise GGUFExportError(f"{t.name}: two source tensors map to this GGUF name")
        seen.add(t.name)
    kvs = _metadata(arch_name, arch_key, ckpt.config, qc, name or ckpt.root.name)
    vocab = convert_vocab(ckpt.root, ckpt.config)
    kvs += vocab.kvs
    return ExportPlan(ckpt.root, arch_name, kvs, flat, omitted, vocab=vocab)


def _plan_glm5_next(ckpt, qc: dict, name: str | None) -> ExportPlan:
    tensors, omitted, dims = glm5_next.plan_tensors(ckpt, analyze(ckpt))
    kvs = [KV("general.architecture", STRING, glm5_next.rn.ARCH), KV("general.name", STRING, name or ckpt.root.name),
           KV("general.quantization_version", UINT32, 2)]
    kvs += glm5_next.metadata(ckpt.config or {}, dims)
    kvs += _exl3_kvs(qc)
    vocab = convert_vocab(ckpt.root, ckpt.config)
    kvs += vocab.kvs
    return ExportPlan(ckpt.root, glm5_next.rn.ARCH, kvs, tensors, omitted, vocab=vocab)


def _exl3_bytes(m: Module) -> int:
    return m.tensors["trellis"].nbytes


def _plain(ckpt, tname: str, gguf_name: str) -> OutTensor:
    shard, a, b = ckpt.file_range(tname)
    t = ckpt.tensor(tname)
    return plain(SourceRef(tname, shard, a, b - a, t.shape, t.dtype), gguf_name)


# ---- splitting -----------------------------------------------------------------------------------------------


def split_plan(plan: ExportPlan, stem: str, max_size: int | None, no_tensor_first_split: bool) -> None:
    """Shards as ``llama-gguf-split --split`` cuts them: a new shard when the aligned tensor bytes would
    pass ``max_size`` (a tensor larger than that gets a shard of its own, never split); all metadata in
    the first shard, which holds no tensor with ``no_tensor_first_split``."""
    shards: list[list[OutTensor]] = [[]] if no_tensor_first_split else []
    cur: list[OutTensor] = []
    size = 0
    for t in plan.tensors:
        sz = align(t.nbytes)
        if cur and max_size is not None and size + sz > max_size:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += sz
    if cur or not shards:
        shards.append(cur)
    n = len(shards)
    if n > 65535:
        raise GGUFExportError(f"{n} shards; split.count is a u16")
    total = len(plan.tensors)
    plan.shards = shards
    plan.names = [shard_name(stem, i + 1, n) for i in range(n)]
    plan.layouts = []
    for i, ts in enumerate(shards):
        kvs = list(plan.kvs) if i == 0 else []
        kvs += [KV("split.no", UINT16, i), KV("split.count", UINT16, n), KV("split.tensors.count", INT32, total)]
        plan.layouts.append(layout(kvs, [(t.name, t.ne, t.type_id, t.nbytes) for t in ts]))


# ---- streaming -----------------------------------------------------------------------------------------------


@dataclass
class ExportResult:
    out_dir: Path
    manifest: dict
    plan: ExportPlan


def _write_shard(plan: ExportPlan, i: int, path: Path, advance: Callable[[int], None]) -> tuple[str, dict[str, str]]:
    lay = plan.layouts[i]
    fh = hashlib.sha256()
    digests: dict[str, str] = {}
    fds: dict[str, int] = {}
    try:
        with open(path, "wb") as f:
            f.write(lay.header)
            fh.update(lay.header)
            pos = 0
            for t, info in zip(plan.shards[i], lay.tensors, strict=True):
                th = hashlib.sha256()
                written = 0
                for ref in t.sources:
                    src = plan.source / ref.file
                    chunks: Iterator[bytes | memoryview]
                    if t.layout == "exl3-retile":
                        chunks = retiled_chunks(src, ref)
                    elif t.layout == "f32":
                        chunks = f32_chunks(src, ref)
                    elif t.layout == "neg-exp-f32":
                        chunks = neg_exp_chunks(src, ref)
                    elif t.layout in ("mla-k-b", "mla-v-b"):
                        chunks = mla_chunks(src, ref, t.layout[4])
                    else:
                        fd = fds.get(ref.file)
                        if fd is None:
                            fd = fds[ref.file] = os.open(src, os.O_RDONLY)
                        chunks = copied_chunks(fd, ref)
                    for c in chunks:
                        f.write(c)
                        fh.update(c)
                        th.update(c)
                        written += len(c)
                        advance(len(c))
                if written != t.nbytes or pos != info.offset:
                    raise VerificationError(f"{path.name}: tensor {t.name!r}: wrote {written} bytes at {pos}, planned {t.nbytes} at {info.offset}")
                pad = align(written) - written
                f.write(b"\0" * pad)
                fh.update(b"\0" * pad)
                pos += written + pad
                digests[t.name] = th.hexdigest()
    finally:
        for fd in fds.values():
            os.close(fd)
    return fh.hexdigest(), digests


def _source_path_record(src: Path) -> str | None:
    """The source folder as the user named it, when that is a relative path (never an absolute one)."""
    s = os.fspath(src)
    return None if os.path.isabs(s) else Path(s).as_posix()


def export_gguf(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    split_max_size: int | None = 50 * 10**9,
    no_tensor_first_split: bool = True,
    name: str | None = None,
    progress: Reporter = SILENT,
) -> ExportResult:
    """Export the EXL3 checkpoint at ``src`` into the new folder ``out``.

    ``<out>.lock`` (beside the output) is held from before the output is looked at until the export has
    ended: a second export (or build) of the same output is refused, naming this one. An output inside the
    source is refused first, so that not even the lock is written into a source."""
    outp = Path(out)
    srcp = Path(src)
    if outp.resolve().is_relative_to(srcp.resolve()):
        raise OutputError(f"{outp}: inside the source folder {srcp}; sources are never written to")
    try:  # the lock lies beside the output, taken before the output is looked at
        outp.absolute().parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{outp.absolute().parent}: cannot create the output's parent folder: {e.strerror or e}") from None
    with output_lock(outp, "mosaic export gguf"):
        return _export(srcp, outp, split_max_size, no_tensor_first_split, name, progress)


def _export(srcp: Path, outp: Path, split_max_size: int | None, no_tensor_first_split: bool, name: str | None,
            progress: Reporter) -> ExportResult:
    if outp.exists() or outp.is_symlink():
        raise OutputError(f"{outp}: already exists; choose another --out or remove it")
    if not srcp.is_dir():
        raise GGUFExportError(f"{srcp}: not a folder")
    stem = name or srcp.resolve().name
    if not re.match(r"^[A-Za-z0-9._-]+$", stem):
        raise GGUFExportError(f"name {stem!r}: use letters, digits, '.', '_' and '-'")
    plan = plan_export(srcp, name=stem)
    split_plan(plan, stem, split_max_size, no_tensor_first_split)

    used = sorted({r.file for t in plan.tensors for r in t.sources})
    ranges: dict[str, list[SourceRef]] = {f: [] for f in used}
    seen_refs: set[tuple[str, str]] = set()
    for t in plan.tensors:
        for r in t.sources:
            if (r.file, r.tensor) not in seen_refs:  # a tensor split in parts is digested once, whole
                seen_refs.add((r.file, r.tensor))
                ranges[r.file].append(r)
    src_files = []
    src_digest: dict[tuple[str, str], str] = {}
    total = sum(ly.size for ly in plan.layouts)
    advance = progress.step("export gguf", total + sum(plan.source.joinpath(f).stat().st_size for f in used) + total)
    for f in used:
        refs = ranges[f]
        d = digest_file(plan.source / f, [(r.start, r.start + r.nbytes) for r in refs], on_bytes=advance)
        src_files.append({"name": f, "size": d.size, "sha256": d.sha256})
        for r, h in zip(refs, d.ranges, strict=True):
            src_digest[(f, r.tensor)] = h

    outp.parent.mkdir(parents=True, exist_ok=True)
    tmp = outp.parent / f".{outp.name}.mosaic-partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        files = []
        tensors = []
        for i, fname in enumerate(plan.names):
            path = tmp / fname
            sha, digests = _write_shard(plan, i, path, advance)
            lay = plan.layouts[i]
            if path.stat().st_size != lay.size:
                raise VerificationError(f"{fname}: {path.stat().st_size} bytes written, {lay.size} planned")
            back = digest_file(path, [(lay.data_start + x.offset, lay.data_start + x.offset + x.nbytes) for x in lay.tensors],
                               on_bytes=advance)
            if back.sha256 != sha:
                raise VerificationError(f"{fname}: the bytes read back differ from those written")
            for t, info, h in zip(plan.shards[i], lay.tensors, back.ranges, strict=True):
                if h != digests[t.name]:
                    raise VerificationError(f"{fname}: tensor {t.name!r}: the bytes read back differ from those written")
                tensors.append({
                    "name": t.name, "file": fname, "type": t.type_id, "type_name": type_name(t.type_id),
                    "ne": list(t.ne), "offset": lay.data_start + info.offset, "nbytes": t.nbytes, "sha256": h,
                    "layout": t.layout,
                    "sources": [{**r.record(), "sha256": src_digest[(r.file, r.tensor)]} for r in t.sources],
                })
            files.append({"name": fname, "size": back.size, "sha256": back.sha256})
        doc = {
            "schema": MANIFEST_SCHEMA,
            "tool": {"name": "mosaic", "version": __version__},
            "format": {"container": "gguf", "version": 3, "alignment": 32, "runtime": "ranma.cpp (EXL3 tensor types)"},
            "architecture": plan.architecture,
            "source": {"name": plan.source.name, "path": _source_path_record(srcp), "files": src_files},
            "tokenizer": plan.vocab.record() if plan.vocab else None,
            "split": {"max_size": split_max_size, "no_tensor_first_split": no_tensor_first_split,
                      "count": len(plan.names)},
            "files": files,
            "omitted": plan.omitted,
            "tensors": tensors,
        }
        (tmp / MANIFEST).write_bytes(_dumps(doc))
        os.replace(tmp, outp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(outp, doc, plan)


def _dumps(doc: dict) -> bytes:
    """Deterministic JSON, one list item a line (diff-friendly for thousands of tensors)."""
    parts = []
    for k, v in doc.items():
        if isinstance(v, list) and v:
            body = "[\n" + ",\n".join("    " + json.dumps(i, ensure_ascii=False) for i in v) + "\n  ]"
        else:
            body = json.dumps(v, ensure_ascii=False)
        parts.append(f"  {json.dumps(k)}: {body}")
    return ("{\n" + ",\n".join(parts) + "\n}\n").encode("utf-8")


def export_summary(res: ExportResult) -> dict[str, object]:
    doc = res.manifest
    reasons: dict[str, int] = {}
    for o in doc["omitted"]:
        r = "mtp" if o["reason"].startswith("MTP") else "vision"
        reasons[r] = reasons.get(r, 0) + 1
    return {
        "output": str(res.out_dir),
        "architecture": doc["architecture"],
        "files": [{"name": f["name"], "size": f["size"]} for f in doc["files"]],
        "size": sum(f["size"] for f in doc["files"]),
        "tensors": len(doc["tensors"]),
        "exl3_tensors": sum(1 for t in doc["tensors"] if t["layout"] == "exl3-retile"),
        "omitted": {"mtp_tensors": reasons.get("mtp", 0), "vision_tensors": reasons.get("vision", 0)},
        "tokenizer": {k: doc["tokenizer"][k] for k in ("model", "pre", "tokens")} if doc.get("tokenizer") else None,
        "manifest": MANIFEST,
    }
