"""``mosaic rebuild ORG/NAME@REV``: a published mosaic (EXL3 or GGUF) rebuilt from its sources, byte for byte.

A mosaic is, by construction and by its own PROVENANCE.json, nothing but byte ranges of its sources.
So a user need not download its shards: ``rebuild`` reads only the published repository's small files
(recipe, PROVENANCE.json, manifest, card, configs, tokenizer; each checked against the hub's digest),
builds the shards from the sources — local folders given with ``--source ID=PATH``, the local cache,
or ranged hub reads for the rest — and checks every tensor against the published PROVENANCE.json and
every file against the published manifest. The published small files are copied verbatim (they are
not regenerated: a newer mosaic would write other bytes), which is what makes the folder identical.

Any mismatch names the tensor or file and its source, keeps nothing (the work happens in a hidden
sibling of the output, renamed only at the end) and exits 1. A GGUF mosaic's parts are written with the
published mosaic's own ``mosaic.*`` keys (its version included), so that a newer mosaic rebuilds an older
release byte for byte.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import OutputError, SourceError, VerificationError
from mosaic._base.lock import output_lock
from mosaic._base.progress import SILENT, Reporter
from mosaic._build.run import PARTIAL_TAG, build, clean_stale_partials
from mosaic._formats.safetensors_reader import strict_json_loadb
from mosaic._hub.partial import SHARD_SUFFIX, PartialSnapshot
from mosaic._provenance.records import (
    CARD_NAME,
    MANIFEST_NAME,
    PROVENANCE_NAME,
    RECIPE_NAME,
    SIGNATURE_NAME,
    parse_manifest,
)
from mosaic._recipe.document import Recipe, SourceSpec, parse_hub_ref, parse_recipe

#: Published files a newer or older mosaic may write differently (tool version, card wording); every
#: other file the rebuild writes must equal the published one before the published copy is kept.
VERSIONED = frozenset({CARD_NAME, PROVENANCE_NAME, MANIFEST_NAME, SIGNATURE_NAME})


@dataclass
class RebuildResult:
    out_dir: Path
    repo: str
    revision: str
    files: int
    tensors: int
    #: bytes read from the hub: the published repo's small files, and each streamed source's ranges
    hub_bytes: dict[str, int] = field(default_factory=dict)
    local_sources: dict[str, str] = field(default_factory=dict)


def parse_source_override(text: str) -> tuple[str, Path]:
    sid, sep, path = text.partition("=")
    if not sep or not sid or not path:
        raise SourceError(f"--source {text!r}: expected ID=PATH (a source id of the recipe and a folder)")
    return sid, Path(path).expanduser().absolute()


def source_override(sid: str, path: str) -> tuple[str, Path]:
    """A ``--source`` given as its id and folder, checked as ``--source ID=PATH`` is."""
    if not sid or "=" in sid or not path:
        raise SourceError(f"--source {sid}={path}: expected ID=PATH (a source id of the recipe and a folder)")
    return sid, Path(path).expanduser().absolute()


def _with_sources(recipe: Recipe, overrides: dict[str, Path]) -> Recipe:
    """The recipe with some sources read from local folders instead (the published files keep the
    recipe as written; only where the bytes are read from changes). For a GGUF source, a folder keeps
    the recipe's ``file`` (a name or glob inside it); a ``.gguf`` file is taken as it is."""
    unknown = sorted(set(overrides) - set(recipe.sources))
    if unknown:
        raise SourceError(f"--source {unknown[0]}: the recipe has no such source (it has {', '.join(recipe.sources)})")
    for sid, spec in recipe.sources.items():
        if spec.path is not None and sid not in overrides:
            raise SourceError(
                f"source {sid!r} is a local folder in the published recipe ({spec.path}); give your copy with "
                f"--source {sid}=PATH"
            )

    def swap(sid: str, spec: SourceSpec) -> SourceSpec:
        if sid not in overrides:
            return spec
        p = overrides[sid]
        keep = spec.file if spec.file is not None and not p.name.endswith(".gguf") else None
        return SourceSpec(sid, path=str(p), file=keep)

    return dataclasses.replace(
        recipe, base=swap("base", recipe.base), donors={d: swap(d, s) for d, s in recipe.donors.items()}
    )


def rebuild(
    ref: str,
    *,
    out: str | Path | None = None,
    sources: dict[str, Path] | None = None,
    jobs: int | None = None,
    progress: Reporter = SILENT,
) -> RebuildResult:
    parsed = parse_hub_ref(ref)
    if parsed is None:
        raise SourceError(f"{ref!r}: expected ORG/NAME@<40-hex commit> (a published mosaic, pinned)")
    repo, revision = parsed
    out_dir = Path(out).absolute() if out is not None else Path.cwd() / repo.split("/", 1)[1]
    try:  # the lock lies beside the output, taken before the output is looked at
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out_dir.parent}: cannot create the output's parent folder: {e.strerror or e}") from None
    with output_lock(out_dir, "mosaic rebuild"):
        return _rebuild(repo, revision, out_dir, sources, jobs, progress)


def _rebuild(repo: str, revision: str, out_dir: Path, sources: dict[str, Path] | None, jobs: int | None,
             progress: Reporter) -> RebuildResult:
    if out_dir.exists():
        raise OutputError(f"{out_dir}: already exists; choose another --out or remove it")

    published = PartialSnapshot(repo, revision)
    small = sorted(n for n in published.listing
                   if not n.endswith((SHARD_SUFFIX, ".gguf")) and not any(p.startswith(".") for p in n.split("/")))
    for need in (RECIPE_NAME, PROVENANCE_NAME, MANIFEST_NAME):
        if need not in small:
            raise SourceError(f"{repo}@{revision}: no {need}; not a mosaic published by mosaic")
    published.read_whole(small, progress=progress)
    folder = published.folder
    try:
        listed = parse_manifest((folder / MANIFEST_NAME).read_bytes(), MANIFEST_NAME)
        prov = strict_json_loadb((folder / PROVENANCE_NAME).read_bytes())
        want_tensors = {t["name"]: t for t in prov["tensors"]}  # type: ignore[index]
        if len(want_tensors) != len(prov["tensors"]):  # type: ignore[index]
            raise ValueError("a tensor is listed twice")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise VerificationError(f"{repo}@{revision}: {MANIFEST_NAME} or {PROVENANCE_NAME} unreadable: {e}") from None
    recipe = _with_sources(parse_recipe((folder / RECIPE_NAME).read_bytes(), folder / RECIPE_NAME), sources or {})
    gguf = isinstance(prov, dict) and prov.get("format") == "gguf"
    keys = None
    if gguf:
        keys = (prov.get("gguf") or {}).get("mosaic_keys")  # type: ignore[union-attr]
        if not isinstance(keys, dict) or not keys or not all(
                isinstance(k, str) and k.startswith("mosaic.") and (isinstance(v, str) or (
                    isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 32)) for k, v in keys.items()):
            raise VerificationError(f"{repo}@{revision}: {PROVENANCE_NAME}: gguf.mosaic_keys is not a set of mosaic.* keys "
                                    "with string or u32 values")

    # named like a build's temporary folder, so a later build or rebuild removes it if this process dies
    work = out_dir.parent / f".{out_dir.name}{PARTIAL_TAG}{os.getpid()}-{os.urandom(4).hex()}"
    clean_stale_partials(out_dir)
    try:
        res = build(recipe, out=work, jobs=jobs, stream=True, progress=progress, gguf_keys=keys, lock=False)
        try:
            _check_tensors(res.provenance, want_tensors, repo, revision)
        except _TensorMismatch as e:
            _discard_partial(recipe, e.source)  # the range cache never keeps a byte that failed a check
            raise
        # the published small files, verbatim; then every file against the published manifest
        for name in small:
            dst = work / name
            if name not in VERSIONED and dst.is_file() and dst.read_bytes() != (folder / name).read_bytes():
                raise VerificationError(f"{repo}@{revision}: {name}: the published file differs from the one its "
                                        "sources and recipe give")
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.unlink(missing_ok=True)
            shutil.copyfile(folder / name, dst)
        digests = {n: r.sha256 for n, r in res.splice.files.items() if n.endswith((SHARD_SUFFIX, ".gguf"))}
        _check_files(work, listed, digests, repo, revision)
        os.rename(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    local = {sid: str(p) for sid, p in (sources or {}).items()}
    hub = {"published": published.reader.bytes_read, **res.streamed}
    return RebuildResult(out_dir, repo, revision, len(listed) + 1, len(want_tensors), hub, local)


class _TensorMismatch(VerificationError):
    def __init__(self, message: str, source: object) -> None:
        super().__init__(message)
        self.source = source


def _discard_partial(recipe: Recipe, source: object) -> None:
    """Forget what was read in part of a hub source whose bytes failed a check (read again next time)."""
    spec = recipe.sources.get(source) if isinstance(source, str) else None
    if spec is None or spec.repo is None or spec.revision is None:
        return
    snap = PartialSnapshot(spec.repo, spec.revision)
    if snap.root.exists():
        for name in snap.unverified():
            snap.discard(name)


def _check_tensors(built: dict, want: dict[str, dict], repo: str, revision: str) -> None:
    got = {t["name"]: t for t in built["tensors"]}
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            raise VerificationError(f"{repo}@{revision}: tensor {name!r}: in PROVENANCE.json, not in the rebuilt mosaic")
        for key in ("file", "dtype", "shape", "nbytes", "sha256", "source"):
            if g.get(key) != w.get(key):
                raise _TensorMismatch(
                    f"{repo}@{revision}: tensor {name!r} from source {w.get('source')!r}: {key} {g.get(key)!r} rebuilt, "
                    f"{w.get(key)!r} published", w.get("source")
                )
    extra = sorted(set(got) - set(want))
    if extra:
        raise VerificationError(f"{repo}@{revision}: tensor {extra[0]!r}: rebuilt but not in the published PROVENANCE.json")


def _check_files(work: Path, listed: dict[str, str], shard_digests: dict[str, str], repo: str, revision: str) -> None:
    present = sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file())
    # a signature (``mosaic sign``) is the one published file the manifest does not list; it is copied
    # verbatim like the others, and ``mosaic audit --key`` verifies it against the rebuilt folder
    signed = [SIGNATURE_NAME] if (work / SIGNATURE_NAME).is_file() else []
    expected = sorted([*listed, MANIFEST_NAME, *signed])
    if present != expected:
        extra = sorted(set(present) - set(expected))
        missing = sorted(set(expected) - set(present))
        raise VerificationError(
            f"{repo}@{revision}: the rebuilt folder differs from the published manifest "
            f"(extra: {', '.join(extra) or '-'}; missing: {', '.join(missing) or '-'})"
        )
    for name, want in listed.items():
        have = shard_digests.get(name) or _sha256(work / name)
        if have != want:
            raise VerificationError(f"{repo}@{revision}: {name}: sha256 {have} rebuilt, {want} in {MANIFEST_NAME}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()

