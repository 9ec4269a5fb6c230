"""``mosaic audit`` of a GGUF export folder (``manifest.json`` + ``*.gguf``, no PROVENANCE.json).

Re-derives what ``manifest.json`` claims from the files alone, with the strict container reader
(:mod:`mosaic._formats.gguf_container`) and never the exporter's plan: every file's size and SHA-256 (and no
unlisted file, no link), every shard's structure, the split keys across shards, every tensor's info
and digest. With ``sources``, every tensor is rebuilt from the safetensors tensors it claims to come
from and compared by digest: the trellis re-tiling is recomputed here independently, whole source
tensor at a time, as the fork's ``to_ggml`` states it (``[K/16, N/16, w] -> [N/128, K/16, 8, w]``).
The tokenizer keys of the first shard must be complete and consistent whenever tokens are there;
with ``sources`` they must equal a fresh conversion of the source's tokenizer files
(:mod:`mosaic._export.vocab`), whose digests must equal those manifest.json records.
The report uses :mod:`mosaic._audit.report`'s classes so the CLI renders it like a mosaic audit.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import numpy as np

from mosaic._audit.report import AuditReport, walk_folder
from mosaic._base.errors import MosaicError
from mosaic._base.hashing import digest_file, parallel_map
from mosaic._base.progress import SILENT, Reporter
from mosaic._checkpoint.folder import check_relative_name, load_json, open_checkpoint
from mosaic._formats.gguf_container import (
    ARRAY,
    INT32,
    STRING,
    UINT32,
    GGUFError,
    GGUFFile,
    exl3_bits2,
    read_gguf,
)

MANIFEST = "manifest.json"
SCHEMA = "mosaic.gguf-manifest/v1"
CHECKS = ("folder", "manifest", "gguf", "split", "tokenizer", "tensors", "sources")
TOK = "tokenizer.ggml."
#: special token id keys (gguf-py Keys.Tokenizer) that must name a token when present
_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "seperator_token_id",
            "mask_token_id", "eot_token_id", "eom_token_id")
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def is_gguf_folder(root: str | os.PathLike[str]) -> bool:
    """A GGUF export: manifest.json and at least one .gguf file, and no PROVENANCE.json."""
    p = Path(root)
    return (
        (p / MANIFEST).is_file()
        and not (p / "PROVENANCE.json").exists()
        and any(c.suffix == ".gguf" for c in p.iterdir())
    )


def _split_checks(rep: AuditReport, files: dict[str, GGUFFile]) -> None:
    names = sorted(files)
    stems = {}
    for name in names:
        m = _SHARD_RE.match(name)
        if not m:
            rep.fail("split", "file name is not <name>-0000K-of-0000N.gguf", file=name)
            return
        stems[name] = (m.group("stem"), int(m.group("i")), int(m.group("n")))
    if len({(s, n) for s, _, n in stems.values()}) != 1:
        rep.fail("split", f"shards of different names or counts: {', '.join(names)}")
        return
    n = next(iter(stems.values()))[2]
    if sorted(i for _, i, _ in stems.values()) != list(range(1, n + 1)):
        rep.fail("split", f"expected shards 1..{n}, found {sorted(i for _, i, _ in stems.values())}")
    total = sum(len(g.tensors) for g in files.values())
    seen: dict[str, str] = {}
    for name in names:
        g = files[name]
        i = stems[name][1]
        want = {"split.no": (2, i - 1), "split.count": (2, n), "split.tensors.count": (5, total)}
        for key, (vtype, value) in want.items():
            kv = g.kvs.get(key)
            if kv is None:
                rep.fail("split", f"{key} is missing", file=name)
            elif kv.vtype != vtype or kv.value != value:
                rep.fail("split", f"{key} = {kv.value!r} (type {kv.vtype}), expected {value!r} (type {vtype})", file=name)
        if i == 1:
            arch = g.value("general.architecture")
            if not isinstance(arch, str) or not arch:
                rep.fail("split", "the first shard has no general.architecture", file=name)
            if any(exl3_bits2(t.type_id) for f in files.values() for t in f.tensors):
                for key in ("quantize.exl3.version", "quantize.exl3.codebook"):
                    v = g.value(key)
                    if not isinstance(v, str) or not v:
                        rep.fail("split", f"{key} is missing or empty; ranma.cpp refuses EXL3 types without it", file=name)
        else:
            extra = sorted(k for k in g.kvs if not k.startswith("split."))
            if extra:
                rep.fail("split", f"metadata outside the first shard: {', '.join(extra[:5])}", file=name)
        for t in g.tensors:
            if t.name in seen:
                rep.fail("split", f"tensor also in {seen[t.name]}", file=name, tensor=t.name)
            seen[t.name] = name


#: The converter's rule for plain tensors, restated here (not imported from the exporter): 1-D tensors,
#: ``*_norm.weight``, names not ending in ``.weight``, routers and convolutions are F32 in the file.
def _must_be_f32(name: str, n_dims: int) -> bool:
    leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
    return (n_dims <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or leaf in ("ffn_gate_inp", "ffn_gate_inp_shexp") or leaf.startswith("ssm_conv1d"))


def _widen(raw: np.ndarray, dtype: str) -> np.ndarray | None:
    """BF16 / F16 / F32 values as float32 (BF16 is the top half of an F32)."""
    if dtype == "BF16":
        return (raw.view("<u2").astype("<u4") << 16).view("<f4")
    if dtype == "F16":
        return raw.view("<f2").astype("<f4")
    if dtype == "F32":
        return raw.view("<f4")
    return None


def _rebuild(entry: dict, s: dict, info, raw: np.ndarray, rep: AuditReport) -> bytes | None:
    """One source's part of a GGUF tensor, made again from the whole source tensor with numpy."""
    layout, part = entry["layout"], s.get("part") or {}
    name, out = s["tensor"], entry["name"]
    rows = part.get("rows")
    if layout == "exl3-retile":
        kt, nt, w = info.shape if len(info.shape) == 3 else (0, 0, 0)
        if info.dtype != "I16" or not kt or nt % 8 or kt % 8:
            rep.fail("sources", f"{name}: {info.dtype} {list(info.shape)} is not a re-tileable trellis", tensor=out)
            return None
        t = raw.view("<i2").reshape(kt, nt // 8, 8, w)
        if rows is not None:
            t = t[:, rows[0] // 128 : rows[1] // 128]
        return np.ascontiguousarray(np.swapaxes(t, 0, 1)).tobytes()
    if layout in ("mla-k-b", "mla-v-b"):
        h, k, v = part.get("heads"), part.get("k"), part.get("v")
        want = [k, info.shape[1], h] if layout == "mla-k-b" else [info.shape[1], v, h]
        if len(info.shape) != 2 or not all(isinstance(x, int) for x in (h, k, v)) or info.shape[0] != h * (k + v) \
                or entry["ne"] != want:
            rep.fail("sources", f"{name}: {list(info.shape)} split as heads={h}, k={k}, v={v} does not give ne {entry['ne']}",
                     tensor=out)
            return None
        size = 2 if info.dtype in ("F16", "BF16") else 4
        t = raw.view(f"<u{size}").reshape(h, k + v, info.shape[1])
        t = np.swapaxes(t[:, :k, :], 1, 2) if layout == "mla-k-b" else t[:, k:, :]
        return np.ascontiguousarray(t).tobytes()
    if rows is not None:
        per_row = raw.size // (info.shape[0] if info.shape else 1)
        raw = raw[rows[0] * per_row : rows[1] * per_row]
    if layout == "copy":
        if not out.endswith((".rot_in", ".rot_out")) and _TYPE_NAMES.get(entry["type"]) != info.dtype:
            rep.fail("sources", f"type {entry['type']} but a byte copy of a {info.dtype} source", tensor=out)
            return None
        return raw.tobytes()
    vals = _widen(raw, info.dtype)
    if vals is None or entry["type"] != 0:
        rep.fail("sources", f"{layout} of a {info.dtype} source into GGUF type {entry['type']} is not a value-preserving "
                 "widening to F32", tensor=out)
        return None
    if layout == "f32":
        return vals.astype("<f4").tobytes()
    if layout == "neg-exp-f32":
        if not name.endswith(".A_log") or not out.endswith(".ssm_a"):
            rep.fail("sources", f"-exp() applies to a KDA A_log (as ssm_a) only, not {name} -> {out}", tensor=out)
            return None
        with np.errstate(over="ignore"):
            return (-np.exp(vals.astype("<f8"))).astype("<f4").tobytes()
    rep.fail("sources", f"unknown layout {layout!r}", tensor=out)
    return None


def _expected_digest(root: Path, entry: dict, ckpt, ckpt_digests: dict[str, str], rep: AuditReport) -> str | None:
    """Rebuild one GGUF tensor's bytes from its sources; the digest of what the GGUF should hold."""
    h = hashlib.sha256()
    for s in entry["sources"]:
        name = s["tensor"]
        if name not in ckpt.tensor_file:
            rep.fail("sources", f"source tensor {name!r} is not in the source checkpoint", tensor=entry["name"])
            return None
        if ckpt_digests.get(name) != s["sha256"]:
            rep.fail("sources", f"source tensor {name!r} has digest {ckpt_digests.get(name)}, the manifest says {s['sha256']}",
                     tensor=entry["name"])
        shard, a, b = ckpt.file_range(name)
        raw = np.fromfile(ckpt.root / shard, dtype=np.uint8, count=b - a, offset=a)
        data = _rebuild(entry, s, ckpt.tensor(name), raw, rep)
        if data is None:
            return None
        h.update(data)
    return h.hexdigest()


def _dtype_rule(rep: AuditReport, parsed: dict[str, GGUFFile]) -> None:
    """The tensors the converter writes as F32 are F32 (that the others keep their source's type is checked
    with ``--sources``, where a ``copy`` must have its source's type)."""
    for n, g in parsed.items():
        for t in g.tensors:
            if exl3_bits2(t.type_id) or t.name.endswith((".rot_in", ".rot_out")):
                continue
            if _must_be_f32(t.name, len(t.ne)) and t.type_id != 0:
                rep.fail("tensors", f"type {t.type_id}; ranma.cpp's converter writes this tensor as F32 (0)", file=n, tensor=t.name)


_TYPE_NAMES = {0: "F32", 1: "F16", 30: "BF16", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64"}


def audit_gguf(
    folder: str | os.PathLike[str],
    *,
    sources: bool | str | Path = False,
    jobs: int | None = None,
    progress: Reporter = SILENT,
) -> AuditReport:
    """Audit a GGUF export folder. ``sources``: True to use the manifest's recorded relative source
    path (relative to the current directory), or the source folder itself."""
    root = Path(folder)
    rep = AuditReport(root)
    rep.ran.extend(c for c in CHECKS if c != "sources" or sources)
    jobs = jobs or os.cpu_count() or 1
    names = walk_folder(root, rep)
    try:
        doc = load_json(root / MANIFEST, "manifest")
    except MosaicError as e:
        rep.fail("manifest", str(e), file=MANIFEST)
        return rep
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("files"), list) \
            or not isinstance(doc.get("tensors"), list):
        rep.fail("manifest", f"not a {SCHEMA} document (schema, files, tensors)", file=MANIFEST)
        return rep
    listed: dict[str, dict] = {}
    for f in doc["files"]:
        try:
            n = check_relative_name(f.get("name") if isinstance(f, dict) else None, "file name", MANIFEST)
        except MosaicError as e:
            rep.fail("manifest", str(e), file=MANIFEST)
            continue
        if n in listed:
            rep.fail("manifest", "listed twice", file=n)
        listed[n] = f
    for n in names:
        if n != MANIFEST and n not in listed:
            rep.fail("manifest", "file not listed in manifest.json", file=n)
    tensors_by_file: dict[str, list[dict]] = {}
    for t in doc["tensors"]:
        if not isinstance(t, dict) or not {"name", "file", "offset", "nbytes", "sha256", "type", "ne", "sources", "layout"} <= set(t):
            rep.fail("manifest", f"malformed tensor entry {str(t)[:80]}", file=MANIFEST)
            return rep
        tensors_by_file.setdefault(t["file"], []).append(t)

    present = [n for n in listed if n in names]
    for n in listed:
        if n not in names:
            rep.fail("manifest", "listed in manifest.json but missing", file=n)
    parsed: dict[str, GGUFFile] = {}
    for n in present:
        if n.endswith(".gguf"):
            try:
                parsed[n] = read_gguf(root / n)
            except GGUFError as e:
                rep.fail("gguf", str(e), file=n, tensor=e.tensor)

    def one(n: str) -> tuple[str, int, str, dict[str, str]]:
        g = parsed.get(n)
        ranges = [g.file_range(t) for t in g.tensors] if g else []
        d = digest_file(root / n, ranges)
        return n, d.size, d.sha256, {t.name: h for t, h in zip(g.tensors, d.ranges, strict=True)} if g else {}

    digests: dict[str, str] = {}
    total = 0
    for n, size, sha, tdig in parallel_map(one, present, jobs):
        total += size
        rep.digests[n] = sha
        f = listed[n]
        if f.get("size") != size:
            rep.fail("manifest", f"size {size}, manifest.json says {f.get('size')}", file=n)
        if f.get("sha256") != sha:
            rep.fail("manifest", f"SHA-256 {sha}, manifest.json says {f.get('sha256')}", file=n)
        digests.update({f"{n}\0{k}": v for k, v in tdig.items()})
    if parsed:
        _split_checks(rep, parsed)
        _tokenizer_checks(rep, parsed, doc)
        _dtype_rule(rep, parsed)

    for n, g in parsed.items():
        entries = {t["name"]: t for t in tensors_by_file.get(n, [])}
        for t in g.tensors:
            e = entries.pop(t.name, None)
            if e is None:
                rep.fail("tensors", "tensor not in manifest.json", file=n, tensor=t.name)
                continue
            a, _ = g.file_range(t)
            claims = {"type": t.type_id, "ne": list(t.ne), "offset": a, "nbytes": t.nbytes}
            for k, v in claims.items():
                if e.get(k) != v:
                    rep.fail("tensors", f"{k} is {v}, manifest.json says {e.get(k)}", file=n, tensor=t.name)
            h = digests.get(f"{n}\0{t.name}")
            if h != e["sha256"]:
                rep.fail("tensors", f"SHA-256 {h}, manifest.json says {e['sha256']}", file=n, tensor=t.name)
        for name in entries:
            rep.fail("tensors", "in manifest.json but not in the file", file=n, tensor=name)
    rep.counts = {"files": len(present), "shards": len(parsed), "tensors": sum(len(g.tensors) for g in parsed.values()),
                  "bytes": total}

    if sources:
        _audit_sources(rep, doc, sources, digests, jobs, parsed)
    return rep


def _first_shard(parsed: dict[str, GGUFFile]) -> tuple[str, GGUFFile] | None:
    for name in sorted(parsed):
        if parsed[name].value("split.no") == 0:
            return name, parsed[name]
    return None


def _tokenizer_checks(rep: AuditReport, parsed: dict[str, GGUFFile], doc: dict) -> None:
    """When the first shard has tokens: the keys llama.cpp needs with them, of the right types and sizes."""
    first = _first_shard(parsed)
    if first is None:
        return
    name, g = first
    rec = doc.get("tokenizer")
    tokens = g.kvs.get(TOK + "tokens")
    if tokens is None:
        if rec is not None or any(k.startswith(TOK) for k in g.kvs):
            rep.fail("tokenizer", "tokenizer keys or a manifest tokenizer record without tokenizer.ggml.tokens", file=name)
        return
    if tokens.vtype != ARRAY or tokens.item != STRING or not tokens.value:
        rep.fail("tokenizer", "tokenizer.ggml.tokens is not a non-empty array of strings", file=name)
        return
    n = len(tokens.value)  # type: ignore[arg-type]
    model = g.kvs.get(TOK + "model")
    if model is None or model.vtype != STRING or not model.value:
        rep.fail("tokenizer", "tokenizer.ggml.model is missing; llama.cpp cannot pick a tokenizer", file=name)
    needed = ["token_type"] + (["pre", "merges"] if model is not None and model.value == "gpt2" else [])
    for key in needed:
        if TOK + key not in g.kvs:
            rep.fail("tokenizer", f"{TOK}{key} is missing while the tokens are present", file=name)
    types = g.kvs.get(TOK + "token_type")
    if types is not None and (types.vtype != ARRAY or types.item != INT32 or len(types.value) != n  # type: ignore[arg-type]
                              or not all(1 <= t <= 6 for t in types.value)):  # type: ignore[union-attr]
        rep.fail("tokenizer", f"tokenizer.ggml.token_type is not {n} token types (i32, 1..6)", file=name)
    merges = g.kvs.get(TOK + "merges")
    if merges is not None and (merges.vtype != ARRAY or merges.item != STRING
                               or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges.value)):  # type: ignore[union-attr]
        rep.fail("tokenizer", "tokenizer.ggml.merges is not an array of 'left right' strings", file=name)
    for key in _ID_KEYS:
        kv = g.kvs.get(TOK + key)
        if kv is not None and (kv.vtype != UINT32 or not 0 <= kv.value < n):  # type: ignore[operator]
            rep.fail("tokenizer", f"{TOK}{key} = {kv.value!r} is not a u32 token id below {n}", file=name)
    if isinstance(rec, dict):
        for key, have in (("model", model.value if model else None), ("pre", g.value(TOK + "pre")), ("tokens", n)):
            if rec.get(key) != have:
                rep.fail("tokenizer", f"tokenizer {key}: the file has {have!r}, manifest.json says {rec.get(key)!r}",
                         file=name)


def _tokenizer_sources(rep: AuditReport, doc: dict, src: Path, config: dict | None, parsed: dict[str, GGUFFile]) -> None:
    """The tokenizer keys against a fresh conversion of the source's files, and those files' digests."""
    from mosaic._export.vocab import convert_vocab

    first = _first_shard(parsed)
    if first is None:
        return
    name, g = first
    rec = doc.get("tokenizer")
    if not isinstance(rec, dict):
        if any(k.startswith("tokenizer.") for k in g.kvs):
            rep.fail("sources", "the first shard has tokenizer keys but manifest.json records no tokenizer", file=name)
        return
    try:
        fresh = convert_vocab(src, config)
    except MosaicError as e:
        rep.fail("sources", f"the source tokenizer cannot be converted: {e}")
        return
    recorded = {f.get("name"): f for f in rec.get("files") or [] if isinstance(f, dict)}
    for f in fresh.files:
        r = recorded.pop(f["name"], None)
        if r is None:
            rep.fail("sources", "source tokenizer file not recorded in manifest.json", file=str(f["name"]))
        elif (r.get("size"), r.get("sha256")) != (f["size"], f["sha256"]):
            rep.fail("sources", f"source tokenizer file has SHA-256 {f['sha256']}, manifest.json says {r.get('sha256')}",
                     file=str(f["name"]))
    for n in recorded:
        rep.fail("sources", "manifest.json records a tokenizer file the conversion does not use", file=str(n))
    want = {kv.key: kv for kv in fresh.kvs}
    have = {k: kv for k, kv in g.kvs.items() if k.startswith("tokenizer.")}
    for key in sorted(set(want) | set(have)):
        w, h = want.get(key), have.get(key)
        if w is None:
            rep.fail("sources", f"{key} is in the file but not in a fresh conversion of the source tokenizer", file=name)
        elif h is None:
            rep.fail("sources", f"{key} is missing; a fresh conversion of the source tokenizer has it", file=name)
        elif (w.vtype, w.item, w.value) != (h.vtype, h.item, h.value):
            rep.fail("sources", f"{key} differs from a fresh conversion of the source tokenizer", file=name)


def _accounted(rep: AuditReport, doc: dict, ckpt) -> None:
    """Every source tensor is in the export or listed as left out, so none was dropped silently; the only
    exception is a codebook marker (``.mul1``/``.mcg``) of an exported module, which lives in the type id."""
    used = {s["tensor"] for t in doc["tensors"] for s in t.get("sources") or [] if isinstance(s, dict)}
    omitted = {o.get("tensor") for o in doc.get("omitted") or [] if isinstance(o, dict)}
    for name in sorted(omitted - set(ckpt.tensor_file)):
        rep.fail("sources", "manifest.json lists it as left out, but the source has no such tensor", tensor=str(name))
    for name in ckpt.tensor_names():
        if name in used or name in omitted:
            continue
        key, _, suffix = name.rpartition(".")
        if suffix in ("mul1", "mcg") and f"{key}.trellis" in used:
            continue
        rep.fail("sources", "source tensor neither exported nor listed as left out in manifest.json", tensor=name)


def _audit_sources(rep: AuditReport, doc: dict, sources: bool | str | Path, digests: dict[str, str], jobs: int,
                   parsed: dict[str, GGUFFile]) -> None:
    if sources is True:
        rec = (doc.get("source") or {}).get("path")
        if not isinstance(rec, str) or not rec or os.path.isabs(rec):
            rep.fail("sources", "manifest.json records no relative source path; pass the source folder to --sources")
            return
        src = Path(rec)
    else:
        src = Path(sources)
    try:
        ckpt = open_checkpoint(src)
    except MosaicError as e:
        rep.fail("sources", f"cannot open the source checkpoint: {e}")
        return
    _tokenizer_sources(rep, doc, src, ckpt.config, parsed)
    _accounted(rep, doc, ckpt)
    wanted: dict[str, list[str]] = {}
    for t in doc["tensors"]:
        for s in t["sources"]:
            if s["tensor"] in ckpt.tensor_file:
                wanted.setdefault(ckpt.tensor_file[s["tensor"]], []).append(s["tensor"])
    ckpt_digests: dict[str, str] = {}

    def one(item: tuple[str, list[str]]) -> dict[str, str]:
        shard, ns = item
        ns = sorted(set(ns))
        h = ckpt.headers[shard]
        d = digest_file(ckpt.root / shard, [h.file_range(x) for x in ns])
        return dict(zip(ns, d.ranges, strict=True))

    for part in parallel_map(one, list(wanted.items()), jobs):
        ckpt_digests.update(part)
    for t in doc["tensors"]:
        want = _expected_digest(ckpt.root, t, ckpt, ckpt_digests, rep)
        if want is not None and want != t["sha256"]:
            rep.fail("sources", "the bytes rebuilt from the sources differ from the manifest's digest",
                     file=t["file"], tensor=t["name"])
        got = digests.get(f"{t['file']}\0{t['name']}")
        if want is not None and got is not None and want != got:
            rep.fail("sources", "the GGUF bytes differ from the bytes rebuilt from the sources", file=t["file"], tensor=t["name"])
