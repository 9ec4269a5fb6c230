"""Writing a planned GGUF mosaic: source digests, streamed copies, read-back, PROVENANCE, card, manifest.

1. Every source file the mosaic uses is read once for its SHA-256 and the SHA-256 of each tensor taken
   from it. A file whose digest is already known — verified by ``mosaic fetch`` against the hub's, or
   computed by an earlier build and unchanged since (the digest cache) — is not hashed whole again:
   only the tensors taken from it are read (and every copy is still read back and compared).
2. Each output part is written from its planned layout: the header bytes, then every tensor's bytes
   copied from its source range (kernel copies where the filesystem allows), padding left as zeros;
   nothing is held in memory beyond a copy buffer.
3. Each written part is read back once: its header must be the planned bytes, and every tensor's
   digest must equal its source tensor's. Any difference is a :class:`VerificationError` (exit 1).
Sources are opened read-only.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from mosaic._base.version import __version__
from mosaic._build import digest_cache
from mosaic._build.gguf_plan import GGUFPlan, selection_summary
from mosaic._build.splice import Flusher, durable_files
from mosaic._base.errors import VerificationError
from mosaic._base.faults import point as fault_point
from mosaic._formats.gguf_container import read_gguf, type_bits, type_name
from mosaic._formats.safetensors_writer import copy_in_steps
from mosaic._provenance.gguf_card import render_gguf_card
from mosaic._base.hashing import digest_file, digest_ranges, parallel_map, scratch, sha256_bytes
from mosaic._base.progress import SILENT, Reporter
from mosaic._provenance.records import (
    CARD_NAME,
    MANIFEST_NAME,
    PROVENANCE_NAME,
    RECIPE_NAME,
    SCHEMA_ID,
    FileRecord,
    dumps,
    manifest,
    validation_errors,
)


@dataclass
class GGUFWriteResult:
    """What the build did: per-part copy methods, the source and output digests, the checks."""

    methods: dict[str, str]
    sources: dict[str, dict[str, FileRecord]]
    source_tensors: dict[str, str]
    files: dict[str, FileRecord]
    tensors: dict[str, str]
    checks: list[dict[str, object]]
    #: per streamed source, its files read only in part (their whole-file digest is the hub's claim)
    unverified: dict[str, set[str]] = field(default_factory=dict)


def _digest_sources(plan: GGUFPlan, jobs: int, progress: Reporter,
                    streamed: dict | None = None) -> tuple[dict[str, dict[str, FileRecord]], dict[str, str]]:
    """Step 1: every used source file's digest, and the digest of each tensor the mosaic takes from it.
    A file of a streamed source holds only the ranges read: its digest is the one its partial snapshot
    checked (read whole) or the hub's claim, and only the tensors taken from it are hashed."""
    need: dict[tuple[str, str], list] = {}
    for sid, files in plan.used_files().items():
        for f in files:
            need[(sid, f)] = []
    for t in plan.tensors:
        need[(t.source, t.src.file)].append(t)
    cached = {k: digest_cache.lookup(plan.models[k[0]].path(k[1])) for k in need}
    for sid, verified in _verified(plan).items():
        for k in need:
            if k[0] == sid and k[1] in verified:
                e = cached[k]
                have = e.tensors if e is not None and e.sha256 == verified[k[1]] else {}
                cached[k] = digest_cache.Entry(verified[k[1]], plan.models[sid].headers[k[1]].file_size, have)
    partial: set[tuple[str, str]] = set()
    for sid, snap in (streamed or {}).items():
        claimed = snap.claimed_digests()
        for k in need:
            if k[0] == sid:
                cached[k] = digest_cache.Entry(claimed.get(k[1], ""), plan.models[sid].headers[k[1]].file_size, {})
                partial.add(k)

    def missing(k: tuple[str, str]) -> list:
        e = cached[k]
        return [t for t in need[k] if e is None or t.name not in e.tensors]

    total = sum(plan.models[k[0]].headers[k[1]].file_size if cached[k] is None else sum(t.nbytes for t in missing(k))
                for k in need)
    advance = progress.step("hashing sources", total)

    def one(k: tuple[str, str]) -> tuple[tuple[str, str], FileRecord, dict[str, str]]:
        sid, f = k
        m = plan.models[sid]
        path = m.path(f)
        ts = sorted(need[k], key=lambda t: t.src.start)
        before = digest_cache.identity(path)
        entry = cached[k]
        if entry is not None and entry.size == m.headers[f].file_size:
            todo = missing(k)
            fresh = dict(zip((t.name for t in todo), digest_ranges(path, [(t.src.start, t.src.end) for t in todo], on_bytes=advance)))
            if fresh and k not in partial:
                digest_cache.store(path, entry.sha256, fresh, identity_before=before)
            return k, FileRecord(f, entry.size, entry.sha256), {t.name: fresh.get(t.name) or entry.tensors[t.name] for t in ts}
        d = digest_file(path, [(t.src.start, t.src.end) for t in ts], on_bytes=advance)
        if d.size != m.headers[f].file_size:
            raise VerificationError(f"source {sid!r}: {path} changed size while the build ran ({m.headers[f].file_size} -> {d.size})")
        digests = dict(zip((t.name for t in ts), d.ranges))
        digest_cache.store(path, d.sha256, digests, identity_before=before)
        fault_point("source")
        return k, FileRecord(f, d.size, d.sha256), digests

    records: dict[str, dict[str, FileRecord]] = {sid: {} for sid in plan.used_files()}
    tensors: dict[str, str] = {}
    for (sid, f), rec, digests in parallel_map(one, list(need), jobs):
        records[sid][f] = rec
        tensors.update(digests)
    return records, tensors


def gguf_wanted_ranges(plan: GGUFPlan, sid: str) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of each file of source ``sid`` the output is made of: its header and the tensors it
    gives, runs split only by the alignment padding between them merged into one."""
    out: dict[str, list[tuple[int, int]]] = {}
    m = plan.models[sid]
    for t in sorted((t for t in plan.tensors if t.source == sid), key=lambda t: (t.src.file, t.src.start)):
        ranges = out.setdefault(t.src.file, [(0, m.headers[t.src.file].data_start)])
        a, b = t.src.start, t.src.end
        if a - ranges[-1][1] < m.alignment:
            ranges[-1] = (ranges[-1][0], max(b, ranges[-1][1]))
        else:
            ranges.append((a, b))
    return out


def read_gguf_ranges(plan: GGUFPlan, streamed: dict, *, jobs: int = 8, progress: Reporter = SILENT) -> dict[str, int]:
    """``--stream``: make every range the plan reads from a hub source present locally; bytes read per source."""
    return {sid: snap.ensure(gguf_wanted_ranges(plan, sid), jobs=jobs, progress=progress) for sid, snap in streamed.items()}


def _verified(plan: GGUFPlan) -> dict[str, dict[str, str]]:
    """Digests of hub source files that ``mosaic fetch`` verified and that are unchanged since."""
    from mosaic._hub.snapshot import verified_digests

    out: dict[str, dict[str, str]] = {}
    for sid, spec in plan.recipe.sources.items():
        if spec.repo is not None and spec.revision is not None:
            d = verified_digests(spec.repo, spec.revision)
            if d:
                out[sid] = d
    return out


def _write_part(plan: GGUFPlan, index: int, dst_path: Path, on_bytes: object, durable: Flusher) -> str:
    """Step 2 for one part: header, then each tensor's source range, handed to ``durable`` to be
    fsynced while it is read back; returns the copy methods used."""
    fname, lay = plan.files[index]
    buf = scratch("copy")[0]
    methods: set[str] = set()
    fds: dict[Path, int] = {}
    dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.pwrite(dst, lay.header, 0)
        for t in plan.tensors:
            if t.file != fname:
                continue
            src_path = plan.models[t.source].path(t.src.file)
            if src_path not in fds:
                fds[src_path] = os.open(src_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            methods |= copy_in_steps(fds[src_path], dst, t.nbytes, t.src.start, t.offset, buf=buf, on_bytes=on_bytes)  # type: ignore[arg-type]
        os.ftruncate(dst, lay.size)
        durable.take(os.dup(dst))
    finally:
        os.close(dst)
        for fd in fds.values():
            os.close(fd)
    return "+".join(sorted(methods)) or "header only"


def _verify_part(plan: GGUFPlan, index: int, path: Path, source_tensors: dict[str, str], on_bytes: object) -> tuple[FileRecord, dict[str, str], list[str]]:
    """Step 3 for one part: read back once; header as planned, size as planned, every tensor as its source."""
    fname, lay = plan.files[index]
    problems: list[str] = []
    ts = [t for t in plan.tensors if t.file == fname]
    d = digest_file(path, [(t.offset, t.offset + t.nbytes) for t in ts], on_bytes=on_bytes)  # type: ignore[arg-type]
    if d.size != lay.size:
        problems.append(f"{fname}: {d.size} bytes written, {lay.size} planned")
    with open(path, "rb") as f:
        if f.read(len(lay.header)) != lay.header:
            problems.append(f"{fname}: header differs from the planned bytes")
    try:
        read_gguf(path)
    except Exception as e:  # the strict reader's verdict on what was written
        problems.append(f"{fname}: not a valid GGUF file: {e}")
    digests = {}
    for t, got in zip(ts, d.ranges):
        digests[t.name] = got
        if got != source_tensors[t.name]:
            problems.append(f"{fname}: tensor {t.name}: bytes differ from its source ({t.source})")
    return FileRecord(fname, d.size, d.sha256), digests, problems


def _rate(r: Fraction | None) -> float | None:
    return None if r is None else round(float(r), 6)


def gguf_provenance(plan: GGUFPlan, res: GGUFWriteResult) -> dict:
    """The PROVENANCE document (``format: gguf``): tensors with their ggml type name and id, ``shape``
    in ggml order (``ne``, innermost first, as llama.cpp prints it)."""
    recipe = plan.recipe
    rates = plan.rates()
    exact = rates["exact"]
    sources: dict[str, dict] = {}
    for sid, spec in recipe.sources.items():
        recs = res.sources.get(sid, {})
        m = plan.models[sid]
        sources[sid] = {**spec.as_record(), "rate": _rate(rates["base"] if sid == "base" else rates["donors"][sid]),  # type: ignore[index]
                        "files": [{**recs[f].as_dict(), **({"sha256_verified": False} if f in res.unverified.get(sid, ()) else {})}
                                  for f in m.files if f in recs]}
    base = plan.models["base"]
    return {
        "schema": SCHEMA_ID,
        "tool": {"name": "mosaic", "version": __version__},
        "name": recipe.name,
        "format": "gguf",
        "recipe": {"file": RECIPE_NAME, "sha256": recipe.sha256},
        "sources": sources,
        "gguf": {
            "architecture": base.architecture,
            "alignment": base.alignment,
            "file_type": base.first.value("general.file_type"),
            "split_max_size": recipe.split_max_size,
            "parts": [f for f, _ in plan.files],
            "mosaic_keys": {kv.key: kv.value for kv in plan.kvs if kv.key.startswith("mosaic.")},
        },
        "selection": selection_summary(plan),
        "size": {"shards": plan.size, "tensors": plan.tensor_bytes, "base_shards": base.size},
        "rate": {
            "exact": _rate(exact),  # type: ignore[arg-type]
            "exact_fraction": f"{exact.numerator}/{exact.denominator}" if isinstance(exact, Fraction) else None,
            "config_bits": None,
            "by_bytes": _rate(rates["by_bytes"]),  # type: ignore[arg-type]
            "by_layer_mass": _rate(rates["by_layer_mass"]),  # type: ignore[arg-type]
            "base": _rate(rates["base"]),  # type: ignore[arg-type]
            "base_by_bytes": _rate(rates["base_by_bytes"]),  # type: ignore[arg-type]
            "base_layer_mass": _rate(rates["base_layer_mass"]),  # type: ignore[arg-type]
            "donors": {sid: _rate(r) for sid, r in rates["donors"].items()},  # type: ignore[union-attr]
        },
        "files": [],
        "tensors": [
            {"name": t.name, "file": t.file, "dtype": type_name(t.type_id), "shape": list(t.ne), "nbytes": t.nbytes,
             "sha256": res.tensors[t.name], "source": t.source, "type_id": t.type_id,
             "bits": round(type_bits(t.type_id), 6)}
            for t in plan.tensors
        ],
        "checks": res.checks,
    }


def write_gguf(plan: GGUFPlan, tmp: Path, *, jobs: int = 1, progress: Reporter = SILENT,
               durable: Flusher | None = None, streamed: dict | None = None) -> tuple[GGUFWriteResult, dict]:
    """Steps 1-3 into the new, empty folder ``tmp``, then the recipe, card, PROVENANCE.json and manifest,
    every file handed to ``durable`` to be fsynced (the caller waits for it before the rename; without
    one, this waits before returning)."""
    with durable_files(durable) as flusher:
        return _write_gguf(plan, tmp, jobs, progress, flusher, streamed or {})


def _write_gguf(plan: GGUFPlan, tmp: Path, jobs: int, progress: Reporter, durable: Flusher,
                streamed: dict) -> tuple[GGUFWriteResult, dict]:
    sources, source_tensors = _digest_sources(plan, jobs, progress, streamed)
    adv_write = progress.step("writing", plan.size)
    adv_verify = progress.step("verifying", plan.size)
    methods: dict[str, str] = {}
    lock = threading.Lock()

    def one(i: int) -> tuple[FileRecord, dict[str, str], list[str]]:
        fname, lay = plan.files[i]
        m = _write_part(plan, i, tmp / fname, adv_write, durable)
        adv_write(len(lay.header))
        with lock:
            methods[fname] = m
        fault_point("written")
        out = _verify_part(plan, i, tmp / fname, source_tensors, adv_verify)
        fault_point("verified")
        return out

    results = parallel_map(one, range(len(plan.files)), jobs)
    files: dict[str, FileRecord] = {}
    tensors: dict[str, str] = {}
    problems: list[str] = []
    for rec, digests, probs in results:
        files[rec.name] = rec
        tensors.update(digests)
        problems += probs
    if problems:
        raise VerificationError("build verification failed: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    n_donor = len(plan.assignment)
    checks = [
        {"name": "sizes_as_planned", "ok": True,
         "detail": f"{len(plan.files)} GGUF file(s), {plan.size} bytes as laid out before writing"},
        {"name": "tensors_equal_sources", "ok": True,
         "detail": f"{len(plan.tensors)} tensors read back from the written files; digest of each equals the digest of its "
                   f"source range ({n_donor} from donors, {len(plan.tensors) - n_donor} from the base)"},
        {"name": "gguf_valid", "ok": True,
         "detail": "every written file parsed by the strict GGUF reader; headers equal the planned bytes"},
        {"name": "same_model", "ok": True,
         "detail": "donors match the base: architecture, graph and tokenizer metadata, tensor names and shapes"},
    ]
    res = GGUFWriteResult(methods, sources, source_tensors, files, tensors, checks,
                          {sid: set(snap.unverified()) for sid, snap in streamed.items()})
    recipe_bytes = plan.recipe.raw
    durable.write(tmp / RECIPE_NAME, (recipe_bytes,))
    res.files[RECIPE_NAME] = FileRecord(RECIPE_NAME, len(recipe_bytes), sha256_bytes(recipe_bytes))
    doc = gguf_provenance(plan, res)
    card = render_gguf_card(doc)
    durable.write(tmp / CARD_NAME, (card,))
    fault_point("card")
    res.files[CARD_NAME] = FileRecord(CARD_NAME, len(card), sha256_bytes(card))
    doc["files"] = [r.as_dict() for r in sorted(res.files.values(), key=lambda r: r.name)]
    errs = validation_errors(doc)
    if errs:
        raise VerificationError("PROVENANCE.json does not match its schema: " + "; ".join(errs[:3]))
    data = dumps(doc)
    durable.write(tmp / PROVENANCE_NAME, (data,))
    fault_point("provenance")
    records = [*res.files.values(), FileRecord(PROVENANCE_NAME, len(data), sha256_bytes(data))]
    durable.write(tmp / MANIFEST_NAME, (manifest(records),))
    fault_point("manifest")
    return res, doc
