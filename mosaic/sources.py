"""Resolving a recipe's sources to folders on this machine, without network.

``path`` sources are relative to the recipe file's folder (or, for ``mosaic audit --sources`` without
a recipe file, to the current directory). ``repo`` + ``revision`` sources come from the local
Hugging Face cache through huggingface_hub, offline; a source that is not there is a clear error
saying how to get it (`mosaic fetch`), and an incomplete snapshot is an error naming the missing
files. Sources are only ever opened for reading.
"""

from __future__ import annotations

from pathlib import Path

from mosaic.errors import SourceError
from mosaic.recipe import SourceSpec


def hub_snapshot(repo: str, revision: str) -> Path:
    """The cached snapshot folder of ``repo`` at ``revision``; never touches the network.

    Shared with ``mosaic fetch`` (:func:`mosaic.hub.snapshot.resolve_snapshot`): the revision must be a pinned
    commit, and a snapshot missing files of the hub's listing is an error naming them.
    """
    from mosaic.hub.snapshot import resolve_snapshot

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
