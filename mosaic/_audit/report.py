"""What every audit returns, and the walk of a folder that every audit starts with.

Neutral ground shared by the audit of an EXL3 mosaic (:mod:`mosaic._audit.mosaic_folder`) and of a
GGUF export (:mod:`mosaic._audit.gguf_folder`): a report is a list of named checks and failures, each
failure naming its check, the file and, where there is one, the tensor, so that every renderer and
``--json`` show both kinds of folder alike.
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import CheckpointError, MosaicError, RecipeError
from mosaic._checkpoint.folder import check_relative_name
from mosaic._provenance.records import (
    HUB_ARTEFACTS,
    MANIFEST_NAME,
    RECIPE_NAME,
    SIGNATURE_NAME,
    parse_manifest,
)
from mosaic._recipe.document import Recipe, load_recipe


@dataclass
class Failure:
    check: str
    detail: str
    file: str | None = None
    tensor: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"check": self.check, "file": self.file, "tensor": self.tensor, "detail": self.detail}


@dataclass
class AuditReport:
    path: Path
    ran: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    #: every file the walk found (relative names; the signature file and the hub's artefacts left out)
    files: list[str] = field(default_factory=list)
    #: the SHA-256 of each file the audit read, so that checking a signature need not read them again
    digests: dict[str, str] = field(default_factory=dict)
    #: what is known of the folder's signature (``model.sig``): present, verified, by what
    signature: dict[str, object] | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, check: str, detail: str, file: str | None = None, tensor: str | None = None) -> None:
        self.failures.append(Failure(check, detail, file, tensor))

    def as_dict(self) -> dict[str, object]:
        by_check: dict[str, list[dict]] = defaultdict(list)
        for f in self.failures:
            by_check[f.check].append(f.as_dict())
        doc: dict[str, object] = {
            "path": str(self.path),
            "ok": self.ok,
            "counts": self.counts,
            "checks": [{"name": c, "ok": not by_check.get(c), "failures": by_check.get(c, [])} for c in self.ran],
        }
        if self.signature is not None:
            doc["signature"] = self.signature
        return doc


class NotAMosaic(MosaicError):
    """The folder holds no PROVENANCE.json: exit 2."""


def walk_folder(root: Path, rep: AuditReport) -> list[str]:
    """Every regular file below ``root`` as a relative name; links and odd files are failures.

    The signature file (``model.sig``, written after the manifest) is not among them: it is checked
    on its own (:mod:`mosaic._provenance.signature`)."""
    names: list[str] = []
    ignored = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        for entry in sorted(dirnames + filenames):
            p = d / entry
            rel = p.relative_to(root).as_posix()
            if rel in HUB_ARTEFACTS and not p.is_symlink():
                ignored += sum(len(f) for _, _, f in os.walk(p)) if p.is_dir() else 1
                if entry in dirnames:
                    dirnames.remove(entry)
                continue
            st = os.lstat(p)
            if rel == SIGNATURE_NAME and stat.S_ISREG(st.st_mode):
                continue
            if stat.S_ISLNK(st.st_mode):
                rep.fail("folder", "symbolic link in a mosaic folder (mosaic never writes one)", file=rel)
                if entry in dirnames:
                    dirnames.remove(entry)
            elif stat.S_ISREG(st.st_mode):
                names.append(rel)
            elif not stat.S_ISDIR(st.st_mode):
                rep.fail("folder", "not a regular file", file=rel)
    if ignored:
        rep.counts["hub_files_ignored"] = ignored
    rep.files = sorted(names)
    return sorted(names)


def check_manifest(rep: AuditReport, root: Path, files: list[str]) -> dict[str, str]:
    """The manifest against the folder, for every kind of mosaic: strictly parsed, every name a safe
    relative name, every other file listed and every listed file present. Returns name -> SHA-256."""
    rep.ran.append("manifest")
    manifest: dict[str, str] = {}
    fileset = set(files)
    if MANIFEST_NAME not in fileset:
        rep.fail("manifest", "missing", file=MANIFEST_NAME)
        return manifest
    try:
        manifest = parse_manifest((root / MANIFEST_NAME).read_bytes(), MANIFEST_NAME)
    except ValueError as e:
        rep.fail("manifest", str(e), file=MANIFEST_NAME)
    for name in list(manifest):
        try:
            check_relative_name(name, "name", MANIFEST_NAME)
        except CheckpointError as e:
            rep.fail("manifest", str(e), file=MANIFEST_NAME)
            del manifest[name]
    for name in files:
        if name != MANIFEST_NAME and name not in manifest:
            rep.fail("manifest", "file in the folder is not listed in the manifest", file=name)
    for name in manifest:
        if name not in fileset:
            rep.fail("manifest", "listed in the manifest but missing from the folder", file=name)
    return manifest


def sources_recipe(rep: AuditReport, recipe: Recipe | None, sources: bool | str | Path) -> tuple[Recipe | None, Path] | None:
    """The recipe ``--sources`` resolves sources from, and the folder its paths are relative to.

    ``sources`` is True (the mosaic's own recipe, paths relative to the current folder) or the recipe
    file the build used, which must be the mosaic's own byte for byte. None, with the failure
    recorded, when that file cannot be used."""
    if sources is True:
        return recipe, Path.cwd()
    try:
        given = load_recipe(sources)  # type: ignore[arg-type]
    except RecipeError as e:
        rep.fail("sources", str(e))
        return None
    if recipe is not None and given.raw != recipe.raw:
        rep.fail("sources", f"{sources} differs from the mosaic's {RECIPE_NAME}")
        return None
    return given, given.folder
