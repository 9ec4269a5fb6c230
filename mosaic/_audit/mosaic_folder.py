"""``mosaic audit``: prove what a mosaic's PROVENANCE.json claims, from the files alone.

The audit shares the strict format readers, the EXL3 rules and the recipe's selection semantics with
the builder, but never its plan: it re-derives everything from the folder. Every byte is read once
(files in parallel): one pass gives each file's digest (for the manifest and PROVENANCE ``files``)
and each tensor's digest (for PROVENANCE ``tensors``). Each failure names its check, the file and,
where there is one, the tensor. With ``sources``, every tensor is also compared with the tensor of
the source it claims to come from.

This module must not import anything of :mod:`mosaic._build` (tests/test_layering.py holds it to that).
"""

from __future__ import annotations

import os
from collections import defaultdict
from fractions import Fraction
from operator import attrgetter, itemgetter
from pathlib import Path

from mosaic._audit.report import AuditReport, NotAMosaic, check_manifest, sources_recipe, walk_folder
from mosaic._base.errors import FormatError, MosaicError, RecipeError, SafetensorsError
from mosaic._base.hashing import digest_file, parallel_map
from mosaic._base.progress import SILENT, Reporter
from mosaic._checkpoint.census_exl3 import analyze
from mosaic._checkpoint.exl3 import parse_key, part_rates
from mosaic._checkpoint.folder import (
    CONFIG_NAME,
    INDEX_NAME,
    QCONFIG_NAME,
    bulk,
    load_json,
    open_checkpoint,
)
from mosaic._formats.safetensors_reader import ShardHeader, read_header, tensor_shards
from mosaic._provenance.card import extract_block, render_block
from mosaic._provenance.records import (
    CARD_NAME,
    MANIFEST_NAME,
    PROVENANCE_NAME,
    RECIPE_NAME,
    SCHEMA_ID,
    TensorColumns,
    as_columns,
    column,
    validation_errors,
)
from mosaic._recipe.document import Recipe, parse_recipe

CHECKS = (
    "folder",
    "manifest",
    "safetensors",
    "index",
    "provenance",
    "tensors",
    "configs",
    "exl3_loadable",
    "recipe",
    "card",
    "sources",
)


def _expected_source(recipe: Recipe, name: str) -> tuple[str, int | None]:
    """Which source the recipe's rules give a tensor (the base when no rule takes it)."""
    key, _, _ = name.rpartition(".")
    info = parse_key(key)
    for rule in recipe.rules:
        if rule.selects_key(name) or rule.selects_module(info.layer, info.path):
            return rule.donor, rule.index
    return "base", None


def _expected_sources(recipe: Recipe, names: list[str]) -> list[str]:
    """:func:`_expected_source` of many tensors. Without key rules the answer depends only on the
    module key, so it is worked out once per module (52,000) rather than per tensor (151,000)."""
    if any(rule.keys is not None for rule in recipe.rules):
        return [_expected_source(recipe, n)[0] for n in names]
    by_key: dict[str, str] = {}
    out = []
    for n in names:
        key = n.rpartition(".")[0]
        src = by_key.get(key)
        if src is None:
            src = by_key[key] = _expected_source(recipe, n)[0]
        out.append(src)
    return out


@bulk()
def _differs(recorded: object, derived: Fraction) -> bool:
    """A recorded rate against the one derived from the headers, exactly, to 5e-7; a value that is
    not a finite number (the schema lets any number through) differs."""
    try:
        return abs(Fraction(recorded) - derived) > Fraction(5, 10**7)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return True


def _col(records: list[dict] | TensorColumns, key: str) -> list:
    """One field of every record: the column itself, or taken from the dicts a column at a time."""
    return getattr(records, key) if isinstance(records, TensorColumns) else list(map(itemgetter(key), records))


def _records_agree(records: list[dict] | TensorColumns, where_tensor: dict[str, str], headers: dict[str, ShardHeader],
                   tensor_digest: dict[str, str]) -> bool:
    """Whether every PROVENANCE tensor record agrees with the headers and the digests read, each
    shard tensor listed exactly once: the record-by-record check below would report nothing. Checked
    a column at a time (151,000 records at GLM-5.3's size); False sends every record through it."""
    try:
        names = _col(records, "name")
        if len(names) != len(where_tensor) or len(set(names)) != len(names) or not all(map(where_tensor.__contains__, names)):
            return False
        shards = list(map(where_tensor.__getitem__, names))
        infos = [headers[s][n] for s, n in zip(shards, names)]
        shapes = _col(records, "shape") if isinstance(records, TensorColumns) else list(map(tuple, _col(records, "shape")))
        return (
            _col(records, "file") == shards
            and _col(records, "dtype") == list(map(attrgetter("dtype"), infos))
            and shapes == list(map(attrgetter("shape"), infos))
            and _col(records, "nbytes") == [i.end - i.begin for i in infos]
            and _col(records, "sha256") == list(map(tensor_digest.get, names))
        )
    except (KeyError, TypeError):
        return False


def audit_mosaic(
    folder: str | Path,
    *,
    sources: bool | str | Path = False,
    jobs: int | None = None,
    progress: Reporter = SILENT,
) -> AuditReport:
    """Audit one mosaic folder. ``sources``: True to resolve sources from ``mosaic-recipe.yaml``
    (paths relative to the current directory), or the recipe file the build used."""
    root = Path(folder)
    if not root.is_dir():
        raise NotAMosaic(f"{root}: not a folder")
    if not (root / PROVENANCE_NAME).is_file() and not (root / PROVENANCE_NAME).is_symlink():
        raise NotAMosaic(f"{root}: no {PROVENANCE_NAME}; not a mosaic folder")
    rep = AuditReport(root)
    jobs = jobs or os.cpu_count() or 1
    rep.ran.append("folder")
    files = walk_folder(root, rep)
    fileset = set(files)

    manifest = check_manifest(rep, root, files)

    # --- headers of every shard (exllamav3 loads every *.safetensors in the folder) --------------
    rep.ran.append("safetensors")
    headers: dict[str, ShardHeader] = {}
    for name in files:
        if name.endswith(".safetensors") and "/" not in name:
            try:
                headers[name] = read_header(root / name)
            except SafetensorsError as e:
                rep.fail("safetensors", f"{e.rule}: {e}", file=name, tensor=e.key)
    shards_of = tensor_shards(headers)
    where_tensor: dict[str, str] = shards_of if shards_of is not None else {}
    if shards_of is None:  # a tensor in two shards: name each
        for name, h in headers.items():
            for t in h.tensors:
                if t.name in where_tensor:
                    rep.fail("safetensors", f"tensor also in {where_tensor[t.name]}", file=name, tensor=t.name)
                else:
                    where_tensor[t.name] = name
    rep.counts["shards"] = len(headers)
    rep.counts["tensors"] = len(where_tensor)

    # --- one read of every byte: file digests and tensor digests --------------------------------
    total = sum((root / n).stat().st_size for n in files)
    advance = progress.step(f"auditing {root.name}", total)

    def one(name: str) -> tuple[str, int, str, dict[str, str]]:
        h = headers.get(name)
        ts = [t.name for t in h.tensors] if h else []
        d = digest_file(root / name, [h.file_range(t) for t in ts] if h else [], on_bytes=advance)
        return name, d.size, d.sha256, dict(zip(ts, d.ranges))

    actual: dict[str, tuple[int, str]] = {}
    tensor_digest: dict[str, str] = {}
    twice = any(f.check == "safetensors" and f.tensor for f in rep.failures)
    for name, size, sha, tds in parallel_map(one, files, jobs):
        actual[name] = (size, sha)
        rep.digests[name] = sha
        if not twice:
            tensor_digest.update(tds)  # every tensor is in one shard only: its digest is this one
            continue
        for t, dg in tds.items():
            if where_tensor.get(t) == name:
                tensor_digest[t] = dg
    rep.counts["files"] = len(files)
    rep.counts["bytes"] = total
    for name, want in manifest.items():
        if name in actual and actual[name][1] != want:
            rep.fail("manifest", "SHA-256 differs from the manifest", file=name)

    rep.ran.append("index")
    # --- PROVENANCE.json ------------------------------------------------------------------------
    rep.ran.append("provenance")
    rep.ran.append("tensors")
    doc: dict | None = None
    try:
        loaded = load_json(root / PROVENANCE_NAME, "provenance")
        columns = as_columns(loaded.get("tensors")) if isinstance(loaded, dict) else None
        if columns is not None:  # checked a column at a time; the 151,000 record dicts go
            loaded["tensors"] = columns
        errors = validation_errors(loaded)
        for e in errors[:20]:
            rep.fail("provenance", f"schema: {e}", file=PROVENANCE_NAME)
        if not errors and isinstance(loaded, dict):
            doc = loaded
    except FormatError as e:
        rep.fail("provenance", str(e), file=PROVENANCE_NAME)
    if doc is not None:
        listed = {}
        for f in doc["files"]:
            if f["name"] in listed:
                rep.fail("provenance", "listed twice in files", file=f["name"])
            listed[f["name"]] = f
        for name in files:
            if name in (PROVENANCE_NAME, MANIFEST_NAME):
                continue
            f = listed.get(name)
            if f is None:
                rep.fail("provenance", "file in the folder is not in PROVENANCE.json files", file=name)
            elif (f["size"], f["sha256"]) != actual[name]:
                rep.fail("provenance", "size or SHA-256 differs from PROVENANCE.json files", file=name)
        for name in listed:
            if name not in fileset:
                rep.fail("provenance", "in PROVENANCE.json files but missing from the folder", file=name)
        seen: set[str] = set()
        agree = _records_agree(doc["tensors"], where_tensor, headers, tensor_digest)
        records = [] if agree else doc["tensors"]
        if agree:
            seen = set(where_tensor)  # every record agrees: each shard tensor is listed once
        for t in records:
            n = t["name"]
            if n in seen:
                rep.fail("tensors", "listed twice in PROVENANCE.json", file=t["file"], tensor=n)
                continue
            seen.add(n)
            shard = where_tensor.get(n)
            if shard is None:
                rep.fail("tensors", "in PROVENANCE.json but in no shard", file=t["file"], tensor=n)
                continue
            info = headers[shard][n]
            if (t["file"], t["dtype"], tuple(t["shape"]), t["nbytes"]) != (shard, info.dtype, info.shape, info.nbytes):
                rep.fail("tensors", "file, dtype, shape or nbytes differ from the header", file=shard, tensor=n)
            if tensor_digest.get(n) != t["sha256"]:
                rep.fail("tensors", "bytes do not match the SHA-256 in PROVENANCE.json", file=shard, tensor=n)
        for n, shard in where_tensor.items():
            if n not in seen:
                rep.fail("tensors", "tensor in a shard is not in PROVENANCE.json", file=shard, tensor=n)
        if doc["schema"] != SCHEMA_ID:
            rep.fail("provenance", f"schema {doc['schema']!r}", file=PROVENANCE_NAME)
        failed_checks = [c["name"] for c in doc["checks"] if not c["ok"]]
        if failed_checks:
            rep.fail("provenance", f"the build recorded failed checks: {', '.join(failed_checks)}", file=PROVENANCE_NAME)

    # --- index ↔ headers (read after PROVENANCE.json: the two largest parses never overlap) -----------------------------------------------------------------------
    idx: object = None
    wm: object = None
    if INDEX_NAME in fileset:
        try:
            idx = load_json(root / INDEX_NAME, "index")
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict):
                raise FormatError(f"{INDEX_NAME}: no weight_map object")
            for key, shard in wm.items() if wm != where_tensor else ():  # equal: nothing to report
                if where_tensor.get(key) != shard:
                    rep.fail("index", f"maps to {shard!r} but it is in {where_tensor.get(key)!r}", file=INDEX_NAME, tensor=key)
            for key, shard in where_tensor.items() if wm.keys() != where_tensor.keys() else ():
                if key not in wm:
                    rep.fail("index", "tensor in a shard is missing from weight_map", file=shard, tensor=key)
            total_size = (idx.get("metadata") or {}).get("total_size")
            tensor_bytes = sum(h.data_size for h in headers.values())
            if total_size != tensor_bytes:
                rep.fail("index", f"metadata.total_size is {total_size}, the shards hold {tensor_bytes} tensor bytes", file=INDEX_NAME)
        except (FormatError, AttributeError) as e:
            rep.fail("index", str(e), file=INDEX_NAME)
    elif len(headers) > 1:
        rep.fail("index", "several shards but no index", file=INDEX_NAME)

    # --- configs and EXL3 loadability (only when the shards themselves are readable) ------------
    rep.ran.append("configs")
    rep.ran.append("exl3_loadable")
    analysis = None
    if not any(f.check == "safetensors" for f in rep.failures):
        try:
            analysis = analyze(open_checkpoint(root, headers=headers, index=idx))
        except (MosaicError, OSError) as e:
            rep.fail("configs", str(e))
    idx = wm = None  # the weight map (151,000 entries) has been checked: let it go
    if analysis is not None:
        for p in analysis.problems:
            check = "configs" if p.startswith(("quantization_config.json", "config.json")) else "index" if p.startswith(("index", "shard file")) else "exl3_loadable"
            if check == "index" and any(f.check == "index" for f in rep.failures):
                continue  # already reported, with the tensor named
            rep.fail(check, p)
        rate = analysis.rate
        cfg = analysis.ckpt.config or {}
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if rate is not None and isinstance(qc, dict) and qc.get("bits") != round(float(rate), 2):
            rep.fail("configs", f"quantization_config.bits is {qc.get('bits')}, the headers give {float(rate):.4f}", file=CONFIG_NAME)
        q = analysis.ckpt.qconfig
        if rate is not None and isinstance(q, dict) and q.get("bits") != round(float(rate), 2):
            rep.fail("configs", f"bits is {q.get('bits')}, the headers give {float(rate):.4f}", file=QCONFIG_NAME)
        # Compared as fractions: the schema lets rate.exact be any number, 10**400 included, which
        # float() cannot hold; size is optional in the schema.
        exact = doc["rate"]["exact"] if doc is not None else None
        if rate is not None and exact is not None and _differs(exact, rate):
            rep.fail("provenance", f"rate.exact is {str(exact)[:40]}, the headers give {float(rate):.6f}", file=PROVENANCE_NAME)
        if doc is not None and not analysis.ckpt.partial:
            parts = {k: v for k, v in part_rates(analysis.modules.values(), analysis.num_hidden_layers).items() if k != "decoder"}
            claimed = doc["rate"].get("outside") or {}
            for part in sorted(set(parts) | set(claimed)):
                have, want = claimed.get(part), parts.get(part)
                if have is None or want is None or _differs(have, want):
                    rep.fail("provenance", f"rate.outside.{part} is {have}, the headers give "
                             f"{float(want) if want is not None else None}", file=PROVENANCE_NAME)
        size = doc.get("size") if doc is not None else None
        shards = size.get("shards") if isinstance(size, dict) else None
        if doc is not None and shards != sum(h.file_size for h in headers.values()):
            rep.fail("provenance", f"size.shards is {str(shards)[:40]}, the shards' total size differs", file=PROVENANCE_NAME)

    # --- recipe ↔ where each tensor came from ---------------------------------------------------
    rep.ran.append("recipe")
    recipe: Recipe | None = None
    if RECIPE_NAME not in fileset:
        rep.fail("recipe", "missing", file=RECIPE_NAME)
    else:
        raw = (root / RECIPE_NAME).read_bytes()
        try:
            recipe = parse_recipe(raw, root / RECIPE_NAME)
        except RecipeError as e:
            rep.fail("recipe", str(e), file=RECIPE_NAME)
        if doc is not None and recipe is not None:
            if recipe.sha256 != doc["recipe"]["sha256"]:
                rep.fail("recipe", "SHA-256 differs from PROVENANCE.json recipe.sha256", file=RECIPE_NAME)
            if recipe.name != doc["name"]:
                rep.fail("recipe", f"name {recipe.name!r} but PROVENANCE.json says {doc['name']!r}", file=RECIPE_NAME)
            ids = {"base", *recipe.donors}
            if set(doc["sources"]) != ids:
                rep.fail("recipe", f"sources {sorted(doc['sources'])} but the recipe names {sorted(ids)}", file=PROVENANCE_NAME)
            for sid, spec in {"base": recipe.base, **recipe.donors}.items():
                s = doc["sources"].get(sid)
                if s is not None and {k: s.get(k) for k in ("path", "repo", "revision") if k in s} != spec.as_record():
                    rep.fail("recipe", f"source {sid!r} is recorded as {s}, the recipe says {spec.as_record()}", file=PROVENANCE_NAME)
            expected_sources = _expected_sources(recipe, column(doc["tensors"], "name"))
            for t, want in zip(doc["tensors"], expected_sources) if column(doc["tensors"], "source") != expected_sources else ():
                if t["source"] != want:
                    rep.fail("recipe", f"source is {t['source']!r} but the recipe gives it to {want!r}", file=t["file"], tensor=t["name"])

    # --- the model card's numbers ↔ PROVENANCE.json ----------------------------------------------
    rep.ran.append("card")
    if CARD_NAME not in fileset:
        rep.fail("card", "missing", file=CARD_NAME)
    elif doc is not None:
        try:
            block = extract_block((root / CARD_NAME).read_text("utf-8"))
        except UnicodeDecodeError:
            block = None
        try:
            # The card is rendered from fields the schema does not all require (size, selection,
            # config_bits, ...): a PROVENANCE.json without them is a failure, not a crash.
            expected: str | None = render_block(doc)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            expected = None
            rep.fail("card", f"PROVENANCE.json lacks what the card is made from: {type(e).__name__}: {str(e)[:100]}", file=PROVENANCE_NAME)
        if block is None:
            rep.fail("card", "no generated block (mosaic markers) in the model card", file=CARD_NAME)
        elif expected is not None and block != expected:
            rep.fail("card", "the card's generated block does not match PROVENANCE.json", file=CARD_NAME)

    if sources:
        rep.ran.append("sources")
        _audit_sources(rep, root, doc, recipe, sources, tensor_digest, where_tensor, jobs, progress)
    return rep


def _audit_sources(
    rep: AuditReport,
    root: Path,
    doc: dict | None,
    recipe: Recipe | None,
    sources: bool | str | Path,
    tensor_digest: dict[str, str],
    where_tensor: dict[str, str],
    jobs: int,
    progress: Reporter,
) -> None:
    """Compare every output tensor with the tensor of the source it claims (true equality)."""
    from mosaic._sources.resolve import resolve_source

    resolved = sources_recipe(rep, recipe, sources)
    if resolved is None:
        return
    recipe, base_dir = resolved
    if recipe is None or doc is None:
        rep.fail("sources", "no valid recipe and provenance to resolve sources from")
        return
    folders: dict[str, Path] = {}
    for sid, spec in {"base": recipe.base, **recipe.donors}.items():
        try:
            folders[sid] = resolve_source(spec, base_dir)
        except MosaicError as e:
            rep.fail("sources", str(e))
    if len(folders) != 1 + len(recipe.donors):
        return
    ckpts = {}
    for sid, folder in folders.items():
        try:
            ckpts[sid] = open_checkpoint(folder)
        except MosaicError as e:
            rep.fail("sources", str(e))
            return
    wanted: dict[tuple[str, str], list[str]] = defaultdict(list)
    for t in doc["tensors"]:
        sid = t["source"]
        ck = ckpts.get(sid)
        if ck is None or t["name"] not in ck.tensor_file:
            rep.fail("sources", f"source {sid!r} has no such tensor", file=t["file"], tensor=t["name"])
            continue
        wanted[(sid, ck.tensor_file[t["name"]])].append(t["name"])
    total = sum(ckpts[s].tensor(n).nbytes for (s, _), ns in wanted.items() for n in ns)
    advance = progress.step("reading sources", total)

    def one(item: tuple[tuple[str, str], list[str]]) -> list[tuple[str, str]]:
        (sid, shard), names = item
        ck = ckpts[sid]
        h = ck.headers[shard]
        d = digest_file(ck.root / shard, [h.file_range(n) for n in names], on_bytes=advance)
        return list(zip(names, d.ranges))

    for pairs in parallel_map(one, list(wanted.items()), jobs):
        for n, dg in pairs:
            if tensor_digest.get(n) != dg:
                rep.fail("sources", "bytes differ from the source tensor", file=where_tensor.get(n), tensor=n)
    rep.counts["source_tensors"] = sum(len(v) for v in wanted.values())


