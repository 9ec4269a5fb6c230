"""Resolving a recipe's sources to folders on this machine.

``path`` sources are relative to the recipe file's folder (or, for ``mosaic audit --sources`` without
a recipe file, to the current directory), or absolute. ``repo`` + ``revision`` sources come from the
local Hugging Face cache through huggingface_hub, offline; a source that is not there is a clear error
saying how to get it (`mosaic fetch`, or `--stream`), and an incomplete snapshot is an error naming
the missing files. Where the caller allows it (:func:`hub_folder`), a commit that is not cached is read
by ranges instead: its small files whole and every shard's header, nothing of its tensors. Sources are
only ever opened for reading.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mosaic._base.errors import SourceError
from mosaic._base.progress import SILENT, Reporter
from mosaic._recipe.document import SourceSpec

if TYPE_CHECKING:
    from mosaic._hub.partial import PartialSnapshot

#: What the strict checkpoint reader opens of a source read by ranges, besides every shard's header.
CHECKPOINT_FILES = ("config.json", "model.safetensors.index.json", "quantization_config.json")


def hub_snapshot(repo: str, revision: str) -> Path:
    """The cached snapshot folder of ``repo`` at ``revision``; never touches the network.

    Shared with ``mosaic fetch`` (:func:`mosaic._hub.snapshot.resolve_snapshot`): the revision must be a pinned
    commit, and a snapshot missing files of the hub's listing is an error naming them.
    """
    from mosaic._hub.snapshot import resolve_snapshot

    return resolve_snapshot(repo, revision)


def resolve_source(spec: SourceSpec, relative_to: Path) -> Path:
    """The folder a source names; refuses what does not exist."""
    if spec.repo is not None:
        return hub_snapshot(spec.repo, spec.revision or "")
    assert spec.path is not None
    p = Path(spec.path).expanduser()
    folder = p if p.is_absolute() else relative_to / p
    if not folder.is_dir():
        raise SourceError(f"source {spec.id!r}: {spec.path} ({folder}) is not a folder")
    return folder


def hub_folder(
    repo: str, revision: str, *, small: tuple[str, ...] | None = CHECKPOINT_FILES, jobs: int = 8, progress: Reporter = SILENT
) -> tuple[Path, PartialSnapshot | None]:
    """A folder to read ``repo@revision`` from: the complete local cache (no network), else a partial
    snapshot holding the ``small`` files (all non-shard files with None) and every shard's header."""
    try:
        return hub_snapshot(repo, revision), None
    except SourceError:
        pass
    from mosaic._hub.partial import PartialSnapshot

    snap = PartialSnapshot(repo, revision)
    snap.open_for_reading(small=small, jobs=jobs, progress=progress)
    return snap.folder, snap
