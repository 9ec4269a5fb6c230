"""Resolving a recipe's sources to folders on this machine, without network.

``path`` sources are relative to the recipe file's folder (or, for ``mosaic audit --sources`` without
a recipe file, to the current directory). ``repo`` + ``revision`` sources come from the local
Hugging Face cache through huggingface_hub, offline; a source that is not there is a clear error
saying how to get it. Sources are only ever opened for reading.
"""

from __future__ import annotations

from pathlib import Path

from .errors import SourceError
from .recipe import SourceSpec


def hub_snapshot(repo: str, revision: str) -> Path:
    """The cached snapshot folder of ``repo`` at ``revision``; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id=repo, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as e:
        raise SourceError(
            f"{repo}@{revision}: not in the local Hugging Face cache ({type(e).__name__}); "
            f"download it first with `mosaic fetch RECIPE`"
        ) from None
    return Path(folder)


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
