"""What ``mosaic fetch`` reports of each pinned commit it made local: one small, frozen record.

Apart from :mod:`.download` so that the public API can hand the record out as it is (``mosaic.FetchedSource``)
without loading the hub client to name its type."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class FetchedSource:
    """One pinned hub commit on this machine, every file checked against the hub's own digest."""

    repo: str
    revision: str
    folder: Path
    files: int
    bytes: int
    #: files hashed now; the others were unchanged since an earlier fetch verified them
    hashed: int
    unchanged: int
    #: the record of the verified digests (a build reads it instead of hashing again)
    record: Path
    #: ``HF_HUB_OFFLINE=1``: the cache was checked, nothing downloaded
    offline: bool

    def as_dict(self) -> dict[str, object]:
        return {f.name: str(v) if isinstance(v := getattr(self, f.name), Path) else v for f in fields(self)}
