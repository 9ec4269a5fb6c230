"""A recipe's GGUF sources: which format a recipe is in, and each source's model, offline.

A GGUF source is a ``path`` (a ``.gguf`` file, the first file of a split set, or a folder holding one
model) or a ``repo`` + ``revision``, either narrowed by ``file`` (a name or glob inside the folder or
repo: GGUF repositories hold many quantizations). A repo source comes from the local Hugging Face
cache: only the files of the named quantization need to be there (``mosaic fetch`` downloads only
those); a missing part is named. Nothing here touches the network or writes anything.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from mosaic._base.errors import MosaicError, RecipeError, SourceError
from mosaic._checkpoint.gguf_model import GGUFModel, is_gguf_location, open_gguf_model
from mosaic._formats.gguf_container import GGUFFile
from mosaic._recipe.document import _REV_RE, REPO_RE, Recipe, SourceSpec

if TYPE_CHECKING:
    from mosaic._hub.partial import PartialSnapshot


def _location(spec: SourceSpec, relative_to: Path) -> Path:
    if spec.repo is not None:
        from mosaic._hub.snapshot import cache_snapshot_folder, require_pinned

        require_pinned(spec.repo, spec.revision)
        return cache_snapshot_folder(spec.repo, spec.revision or "")
    assert spec.path is not None
    p = Path(spec.path).expanduser()
    return p if p.is_absolute() else relative_to / p


def is_gguf_source(spec: SourceSpec, relative_to: Path) -> bool:
    """Does this source name a GGUF model (a ``file``, a ``.gguf`` path, a folder of ``.gguf`` files)?"""
    if spec.file is not None:
        return True
    if spec.repo is not None:
        folder = _location(spec, relative_to)
        return folder.is_dir() and is_gguf_location(folder)
    return is_gguf_location(_location(spec, relative_to))


def is_gguf_recipe(recipe: Recipe, relative_to: Path | None = None) -> bool:
    """Is this a GGUF recipe? Decided by the base; every donor must then be GGUF too, and the reverse.

    GGUF-only fields (``file``, ``output.split_max_size``) in an EXL3 recipe, and EXL3-only ones
    (``output.exclude``) in a GGUF recipe, are refused naming the field."""
    rel = recipe.folder if relative_to is None else relative_to
    kinds = {sid: is_gguf_source(spec, rel) for sid, spec in recipe.sources.items()}
    gguf = kinds["base"]
    for sid, k in kinds.items():
        if k != gguf:
            field = "base" if sid == "base" else f"donors.{sid}"
            what = "a GGUF model" if k else "an EXL3 folder"
            base_what = "a GGUF model" if gguf else "an EXL3 folder"
            raise RecipeError(f"{recipe.file}: {field}: is {what}, but the base is {base_what}; a mosaic has one format")
    if not gguf and recipe.split_max_size is not None:
        raise RecipeError(f"{recipe.file}: output.split_max_size: applies to GGUF mosaics only")
    if gguf and recipe.exclude:
        raise RecipeError(f"{recipe.file}: output.exclude: a GGUF mosaic carries only its GGUF files; remove it")
    return gguf


def open_gguf_hub(spec: SourceSpec) -> tuple[GGUFModel, PartialSnapshot]:
    """A hub source not in the local cache, opened from its headers read by HTTP ranges (nothing of its
    tensors): only the files of the quantization ``file`` names (a whole split set) are touched."""
    from mosaic._hub.download import select_files
    from mosaic._hub.partial import PartialSnapshot

    assert spec.repo is not None and spec.revision is not None
    snap = PartialSnapshot(spec.repo, spec.revision)
    ggufs = [n for n in snap.listing if n.endswith(".gguf")]
    names = sorted(select_files(ggufs, [spec.file]) if spec.file is not None else ggufs)
    if not names:
        raise SourceError(f"source {spec.id!r} ({spec.describe()}): no .gguf file of the commit matches {spec.file!r}")
    snap.prepare(names)

    def read(path: Path) -> GGUFFile:
        return snap.read_gguf(path.relative_to(snap.folder).as_posix())

    try:
        return open_gguf_model(snap.folder, spec.file, read=read), snap
    except SourceError as e:
        raise SourceError(f"source {spec.id!r} ({spec.describe()}): {e}") from None


def open_gguf_source(spec: SourceSpec, relative_to: Path, *, ranges: dict[str, PartialSnapshot] | None = None) -> GGUFModel:
    """The model a GGUF source names. A hub source missing from the cache is read by ranges when the
    caller gives ``ranges`` (its partial snapshot is put there, under the source's id); otherwise the
    error says how to get it."""
    where = _location(spec, relative_to)
    if spec.repo is not None and not where.is_dir() and ranges is not None:
        model, snap = open_gguf_hub(spec)
        ranges[spec.id] = snap
        return model
    if spec.repo is not None and not where.is_dir():
        raise SourceError(
            f"source {spec.id!r}: {spec.repo}@{spec.revision} is not in the local Hugging Face cache; "
            "download it first with `mosaic fetch RECIPE`"
        )
    try:
        return open_gguf_model(where, spec.file)
    except SourceError as e:
        raise SourceError(f"source {spec.id!r} ({spec.describe()}): {e}") from None


_HUB_RE = re.compile(r"^(?P<repo>[^@]+)@(?P<rev>[0-9a-f]{40}):(?P<file>.+)$")


def is_gguf_src(text: str) -> bool:
    """A GGUF ``--base``/``--donor``: a .gguf file, a folder of GGUF files, or ``org/name@<commit>:<file>``."""
    if _HUB_RE.match(text) and not Path(text).exists():
        return True
    return is_gguf_location(Path(text))


def gguf_source(text: str, what: str, sid: str) -> SourceSpec:
    m = _HUB_RE.match(text)
    if m and not Path(text).exists():
        if not REPO_RE.match(m["repo"]) or not _REV_RE.match(m["rev"]):
            raise MosaicError(f"{what}: {text!r} is not org/name@<40-hex commit>:<file or glob>")
        return SourceSpec(sid, repo=m["repo"], revision=m["rev"], file=m["file"])
    return SourceSpec(sid, path=text)
