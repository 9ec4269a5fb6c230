"""Audit of a GGUF mosaic (a folder whose PROVENANCE.json says ``format: gguf``), from its files alone.

Re-derives every claim without the build's code: the manifest's digests and no unlisted file; each
GGUF part strictly valid, the parts one model (``split.*`` keys in order, metadata in the first part
only, the part names ``llama-gguf-split`` gives); PROVENANCE.json against its schema, the folder's
files, the tensor infos (order, part, type, shape, size) and every tensor's SHA-256; the ``mosaic.*``
keys against the recipe; where each tensor came from against the recipe's rules; the card against a
re-rendering. With ``--sources``, the base's metadata against the mosaic's, every source file's
digest against PROVENANCE.json, and every tensor against its source tensor, byte for byte.
"""

from __future__ import annotations

import os
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

from mosaic._audit.report import AuditReport, NotAMosaic, check_manifest, sources_recipe, walk_folder
from mosaic._base.errors import MosaicError, RecipeError
from mosaic._base.hashing import digest_file, parallel_map
from mosaic._base.progress import SILENT, Reporter
from mosaic._checkpoint.folder import load_json
from mosaic._checkpoint.gguf_model import SPLIT_KEYS, GGUFModel, parse_name, split_name
from mosaic._formats.gguf_container import GGUFError, GGUFFile, TensorInfo, read_gguf, type_name
from mosaic._provenance.gguf_card import generated_block, render_gguf_card
from mosaic._provenance.records import (
    CARD_NAME,
    MANIFEST_NAME,
    PROVENANCE_NAME,
    RECIPE_NAME,
    validation_errors,
)
from mosaic._recipe.document import Recipe, parse_recipe
from mosaic._recipe.gguf_rules import SelectionProblem, assign
from mosaic._sources.gguf import open_gguf_source

MAX_PROVENANCE_BYTES = 1 << 30


def is_gguf_mosaic(folder: str | Path) -> bool:
    """A mosaic folder whose PROVENANCE.json declares ``format: gguf``."""
    p = Path(folder) / PROVENANCE_NAME
    try:
        if not p.is_file() or p.stat().st_size > MAX_PROVENANCE_BYTES:
            return False
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b'"format": "gguf"' in head


def _load_doc(rep: AuditReport, root: Path) -> dict | None:
    rep.ran.append("provenance")
    try:
        doc = load_json(root / PROVENANCE_NAME, "provenance")  # strict: duplicate keys, NaN, overflow refused
    except MosaicError as e:
        rep.fail("provenance", str(e), file=PROVENANCE_NAME)
        return None
    errs = validation_errors(doc)
    for e in errs[:20]:
        rep.fail("provenance", f"schema: {e}", file=PROVENANCE_NAME)
    if errs or not isinstance(doc, dict) or doc.get("format") != "gguf":
        if not errs:
            rep.fail("provenance", "format is not 'gguf'", file=PROVENANCE_NAME)
        return None
    failed = [c["name"] for c in doc["checks"] if not c["ok"]]
    if failed:
        rep.fail("provenance", f"the build recorded failed checks: {', '.join(failed)}", file=PROVENANCE_NAME)
    for key, what in (("files", "files"), ("tensors", "tensors")):
        seen: set[str] = set()
        for item in doc[key]:
            if item["name"] in seen:
                rep.fail("provenance", f"listed twice in {what}", file=item.get("file", item["name"]),
                         tensor=item["name"] if key == "tensors" else None)
            seen.add(item["name"])
    return doc


def _check_parts(rep: AuditReport, root: Path, parts: list[str], parsed: dict[str, GGUFFile], name: str) -> None:
    """The parts are one model: names, ``split.*`` keys, metadata only in the first part."""
    n = len(parts)
    total = sum(len(h.tensors) for h in parsed.values())
    for i, p in enumerate(parts):
        want = f"{name}.gguf" if n == 1 else split_name(name, i + 1, n)
        if p != want:
            rep.fail("gguf", f"part {i + 1} of {n} should be named {want}", file=p)
        h = parsed.get(p)
        if h is None:
            continue
        split = {k: h.value(k) for k in SPLIT_KEYS if k in h.kvs}
        if n == 1:
            if split:
                rep.fail("gguf", f"a single file carries split keys {sorted(split)}", file=p)
            continue
        if split != {"split.no": i, "split.count": n, "split.tensors.count": total}:
            rep.fail("gguf", f"split keys {split}, expected split.no={i}, split.count={n}, split.tensors.count={total}", file=p)
        if i and set(h.kvs) - set(SPLIT_KEYS):
            rep.fail("gguf", f"metadata outside the first part: {sorted(set(h.kvs) - set(SPLIT_KEYS))[:3]}", file=p)


def audit_gguf_mosaic(
    folder: str | Path,
    *,
    sources: bool | str | Path = False,
    jobs: int | None = None,
    progress: Reporter = SILENT,
) -> AuditReport:
    """Audit one GGUF mosaic folder; ``sources`` as for :func:`mosaic._audit.mosaic_folder.audit_mosaic`."""
    root = Path(folder)
    if not (root / PROVENANCE_NAME).is_file():
        raise NotAMosaic(f"{root}: no {PROVENANCE_NAME}; not a mosaic folder")
    rep = AuditReport(root)
    jobs = jobs or os.cpu_count() or 1
    rep.ran.append("folder")
    files = walk_folder(root, rep)
    fileset = set(files)

    manifest = check_manifest(rep, root, files)

    doc = _load_doc(rep, root)
    parts: list[str] = list(doc["gguf"]["parts"]) if doc else sorted(n for n in files if n.endswith(".gguf"))
    rep.ran.append("gguf")
    parsed: dict[str, GGUFFile] = {}
    for p in sorted(set(parts) | {n for n in files if n.endswith(".gguf")}):
        if p not in parts:
            rep.fail("gguf", "GGUF file not among the mosaic's parts", file=p)
            continue
        if p not in fileset:
            rep.fail("gguf", "part missing from the folder", file=p)
            continue
        try:
            parsed[p] = read_gguf(root / p)
        except GGUFError as e:
            rep.fail("gguf", f"{e.rule}: {e}", file=p, tensor=e.tensor)
    if doc:
        _check_parts(rep, root, parts, parsed, doc["name"])
    rep.counts["shards"] = len(parsed)

    # one read of every file: file digests, and tensor digests for the parts
    total = sum((root / n).stat().st_size for n in files)
    advance = progress.step(f"auditing {root.name}", total)
    rep.counts["files"] = len(files)
    rep.counts["bytes"] = total

    def one(name: str) -> tuple[str, int, str, dict[str, str]]:
        h = parsed.get(name)
        ranges = [h.file_range(t) for t in h.tensors] if h else []
        d = digest_file(root / name, ranges, on_bytes=advance)
        return name, d.size, d.sha256, dict(zip((t.name for t in h.tensors), d.ranges)) if h else {}

    digests: dict[str, tuple[int, str]] = {}
    tensor_digest: dict[str, str] = {}
    part_of: dict[str, str] = {}
    for name, size, sha, td in parallel_map(one, files, jobs):
        digests[name] = (size, sha)
        rep.digests[name] = sha  # a signature is checked against these, not read again
        for t, dg in td.items():
            if t in part_of:  # each part's reader refuses repeats within it; across parts, here
                rep.fail("gguf", f"tensor also in {part_of[t]}: one model holds each tensor once", file=name, tensor=t)
                continue
            part_of[t] = name
            tensor_digest[t] = dg
    for n, sha in manifest.items():
        if n in digests and digests[n][1] != sha:
            rep.fail("manifest", "SHA-256 differs from the manifest", file=n)
    if doc is None:
        return rep

    # PROVENANCE files and tensors
    listed = {f["name"]: f for f in doc["files"]}
    for n in files:
        if n in (PROVENANCE_NAME, MANIFEST_NAME):
            continue
        f = listed.get(n)
        if f is None:
            rep.fail("provenance", "file not listed in PROVENANCE.json files", file=n)
        elif (f["size"], f["sha256"]) != digests[n]:
            rep.fail("provenance", "size or SHA-256 differs from PROVENANCE.json", file=n)
    for n in listed:
        if n not in fileset:
            rep.fail("provenance", "listed in PROVENANCE.json but missing from the folder", file=n)
    infos = [(p, t) for p in parts if p in parsed for t in parsed[p].tensors]
    rep.counts["tensors"] = len(infos)
    if len(infos) != len(doc["tensors"]) and len(parsed) == len(parts):
        rep.fail("provenance", f"{len(doc['tensors'])} tensors recorded, the parts hold {len(infos)}", file=PROVENANCE_NAME)
    for (p, t), rec in zip(infos, doc["tensors"]):
        if rec["name"] != t.name:
            rep.fail("provenance", f"tensor order differs: recorded {rec['name']!r} here", file=p, tensor=t.name)
            break
        want = {"file": p, "dtype": type_name(t.type_id), "shape": list(t.ne), "nbytes": t.nbytes}
        got = {k: rec[k] for k in want}
        if got != want or rec.get("type_id", t.type_id) != t.type_id:
            rep.fail("provenance", f"tensor info {want} differs from the record {got}", file=p, tensor=t.name)
        if tensor_digest.get(t.name) != rec["sha256"]:
            rep.fail("tensors", "SHA-256 of the tensor's bytes differs from PROVENANCE.json", file=p, tensor=t.name)
    rep.ran.append("tensors")
    size_parts = sum(digests[p][0] for p in parts if p in digests)
    if doc["size"]["shards"] != size_parts or doc["size"]["tensors"] != sum(t.nbytes for _, t in infos):
        rep.fail("provenance", f"size {doc['size']} differs from the parts ({size_parts} bytes)", file=PROVENANCE_NAME)
    if len(parsed) == len(parts):
        _check_rates(rep, doc["rate"], [t for _, t in infos], size_parts)

    recipe = _recipe_checks(rep, root, doc, parsed.get(parts[0]) if parts else None, fileset)

    rep.ran.append("card")
    if CARD_NAME not in fileset:
        rep.fail("card", "missing", file=CARD_NAME)
    else:
        block = generated_block((root / CARD_NAME).read_bytes())
        if block is None:
            rep.fail("card", "no generated block (mosaic markers) in the model card", file=CARD_NAME)
        elif block != generated_block(render_gguf_card(doc)):
            rep.fail("card", "the card's generated block does not match PROVENANCE.json", file=CARD_NAME)

    if sources:
        rep.ran.append("sources")
        _audit_sources(rep, doc, recipe, sources, tensor_digest, parsed.get(parts[0]) if parts else None, jobs, progress)
    return rep


def _check_rates(rep: AuditReport, rate: dict, tensors: list[TensorInfo], size: int) -> None:
    """The mosaic's own rates derived again from its tensor infos (the base's need the base: ``--sources``)."""
    weights = sum(_elements(t) for t in tensors)
    layers = [t for t in tensors if parse_name(t.name)[0] is not None]
    derived = {
        "exact": Fraction(8 * sum(t.nbytes for t in tensors), weights) if weights else None,
        "by_bytes": Fraction(8 * size, weights) if weights else None,
        "by_layer_mass": Fraction(8 * sum(t.nbytes for t in layers), sum(_elements(t) for t in layers)) if layers else None,
    }
    for key, want in derived.items():
        got = rate.get(key)
        if (want is None) != (got is None) or (want is not None and _rate_differs(got, want)):
            shown = "none" if want is None else f"{float(want):.6f}"
            rep.fail("provenance", f"rate.{key} is {got}, the tensor infos give {shown}", file=PROVENANCE_NAME)


def _check_base_rates(rep: AuditReport, rate: dict, base: GGUFModel) -> None:
    """The base's rates as recorded (``base_by_bytes`` and ``base_layer_mass`` only in newer records)."""
    weights = sum(t.elements for t in base.tensors)
    layers = [t for t in base.tensors if t.layer is not None]
    derived = {
        "base": Fraction(8 * sum(t.nbytes for t in base.tensors), weights) if weights else None,
        "base_by_bytes": Fraction(8 * base.size, weights) if weights else None,
        "base_layer_mass": Fraction(8 * sum(t.nbytes for t in layers), sum(t.elements for t in layers)) if layers else None,
    }
    for key, want in derived.items():
        if key not in rate:
            continue
        got = rate[key]
        if (want is None) != (got is None) or (want is not None and _rate_differs(got, want)):
            shown = "none" if want is None else f"{float(want):.6f}"
            rep.fail("sources", f"rate.{key} is {got}, the base's tensor infos give {shown}", file=PROVENANCE_NAME)


def _elements(t: TensorInfo) -> int:
    n = 1
    for d in t.ne:
        n *= d
    return n


def _rate_differs(recorded: object, derived: Fraction) -> bool:
    try:
        return abs(Fraction(recorded) - derived) > Fraction(5, 10**7)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return True


def _recipe_checks(rep: AuditReport, root: Path, doc: dict, first: GGUFFile | None, fileset: set[str]) -> Recipe | None:
    """The recipe file, the ``mosaic.*`` keys and where each tensor came from, against the rules."""
    rep.ran.append("recipe")
    if RECIPE_NAME not in fileset:
        rep.fail("recipe", "missing", file=RECIPE_NAME)
        return None
    raw = (root / RECIPE_NAME).read_bytes()
    try:
        recipe = parse_recipe(raw, root / RECIPE_NAME)
    except RecipeError as e:
        rep.fail("recipe", str(e), file=RECIPE_NAME)
        return None
    if recipe.sha256 != doc["recipe"]["sha256"]:
        rep.fail("recipe", "SHA-256 differs from PROVENANCE.json recipe.sha256", file=RECIPE_NAME)
    for sid, spec in recipe.sources.items():
        rec = {k: v for k, v in doc["sources"].get(sid, {}).items() if k in ("path", "repo", "revision", "file")}
        if rec != spec.as_record():
            rep.fail("recipe", f"source {sid!r} recorded as {rec}, the recipe says {spec.as_record()}", file=PROVENANCE_NAME)
    if first is not None:
        want = {"mosaic.version": doc["tool"]["version"], "mosaic.recipe.name": recipe.name,
                "mosaic.recipe.sha256": recipe.sha256,
                "mosaic.tensors.from_donors": sum(1 for t in doc["tensors"] if t["source"] != "base")}
        got = {k: first.value(k) for k in want}
        if got != want:
            rep.fail("recipe", f"mosaic.* keys {got} differ from the recipe and provenance {want}", file=doc["gguf"]["parts"][0])
        if doc["gguf"].get("mosaic_keys") != {k: kv.value for k, kv in first.kvs.items() if k.startswith("mosaic.")}:
            rep.fail("recipe", "PROVENANCE.json gguf.mosaic_keys differ from the file's mosaic.* keys", file=doc["gguf"]["parts"][0])
    try:
        assigned = assign(recipe, [t["name"] for t in doc["tensors"]])
    except SelectionProblem as e:
        rep.fail("recipe", f"the recipe does not apply to this mosaic: {e}", file=RECIPE_NAME)
        return recipe
    for t in doc["tensors"]:
        want_src = assigned.get(t["name"], ("base", -1))[0]
        if t["source"] != want_src:
            rep.fail("recipe", f"recorded from {t['source']!r}, the recipe takes it from {want_src!r}", file=t["file"], tensor=t["name"])
    return recipe


def _audit_sources(rep: AuditReport, doc: dict, recipe: Recipe | None, sources: bool | str | Path,
                   tensor_digest: dict[str, str], first: GGUFFile | None, jobs: int, progress: Reporter) -> None:
    """Every output tensor against its source tensor; source files and base metadata against the record."""
    resolved = sources_recipe(rep, recipe, sources)
    if resolved is None:
        return
    recipe, base_dir = resolved
    if recipe is None:
        rep.fail("sources", "no valid recipe to resolve sources from")
        return
    models: dict[str, GGUFModel] = {}
    for sid, spec in recipe.sources.items():
        try:
            models[sid] = open_gguf_source(spec, base_dir)
        except MosaicError as e:
            rep.fail("sources", str(e))
    if len(models) != len(recipe.sources):
        return
    if first is not None:
        mine = {k: kv for k, kv in first.kvs.items() if not k.startswith(("mosaic.", "split."))}
        theirs = {k: kv for k, kv in models["base"].metadata.items() if not k.startswith("mosaic.")}
        if mine != theirs:
            diff = sorted(set(mine) ^ set(theirs)) or sorted(k for k in mine if mine[k] != theirs[k])
            rep.fail("sources", f"metadata differs from the base's: {diff[:3]}", file=doc["gguf"]["parts"][0])
    _check_base_rates(rep, doc["rate"], models["base"])
    wanted: dict[tuple[str, str], list] = defaultdict(list)
    for sid, m in models.items():
        for f in m.files:
            wanted[(sid, f)]  # every source file is hashed, to compare with the record
    by_name = {sid: m.by_name() for sid, m in models.items()}
    for t in doc["tensors"]:
        src = by_name.get(t["source"], {}).get(t["name"])
        if src is None:
            rep.fail("sources", f"source {t['source']!r} has no such tensor", file=t["file"], tensor=t["name"])
            continue
        wanted[(t["source"], src.file)].append(src)
    recorded = {(sid, f["name"]): (f["size"], f["sha256"]) for sid, s in doc["sources"].items() for f in s["files"]}
    items = [k for k in wanted if k in recorded or wanted[k]]
    total = sum(models[s].headers[f].file_size for s, f in items)
    advance = progress.step("reading sources", total)

    def one(k: tuple[str, str]) -> tuple[tuple[str, str], int, str, list[tuple[str, str]]]:
        sid, f = k
        ts = sorted(wanted[k], key=lambda t: t.start)
        d = digest_file(models[sid].path(f), [(t.start, t.end) for t in ts], on_bytes=advance)
        return k, d.size, d.sha256, list(zip((t.name for t in ts), d.ranges))

    for (sid, f), size, sha, pairs in parallel_map(one, items, jobs):
        if (sid, f) in recorded and recorded[(sid, f)] != (size, sha):
            rep.fail("sources", f"source {sid!r}: file differs from PROVENANCE.json's record", file=f)
        for n, dg in pairs:
            if tensor_digest.get(n) != dg:
                where = next((t["file"] for t in doc["tensors"] if t["name"] == n), None)
                rep.fail("sources", f"bytes differ from the tensor of source {sid!r}", file=where, tensor=n)
    rep.counts["source_tensors"] = sum(len(v) for v in wanted.values())
