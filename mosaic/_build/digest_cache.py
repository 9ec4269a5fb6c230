"""Digests of source files kept between builds, so that building again from the same sources (a
recipe tried twice, a second mosaic of the same base) does not hash 100 GB again.

Only shards are cached. An entry is keyed by the file's real path and valid only while the file's
identity is unchanged: device, inode, size and modification time (ns), the same quick check rsync
and make rely on. It holds the file's SHA-256 and the SHA-256 of each tensor computed so far. A
stale entry cannot let a wrong byte into a mosaic: every copied tensor and every shard copied whole
is read back from the output and compared with these digests, so a source changed under an
unchanged identity fails the build. What an entry alone vouches for is the file digest recorded in
PROVENANCE.json for a source shard that is not copied whole.

Entries live in ``$MOSAIC_CACHE_DIR`` (default ``$XDG_CACHE_HOME/mosaic/digests``, else
``~/.cache/mosaic/digests``), never beside a source; ``MOSAIC_NO_DIGEST_CACHE=1`` turns the cache off (and
the weight errors kept under ``weights/`` in the same folder).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mosaic._base.errors import VerificationError
from mosaic._base.hashing import digest_file
from mosaic._base.progress import SILENT, Reporter

if TYPE_CHECKING:
    from mosaic._checkpoint.gguf_model import GGUFModel
    from mosaic._recipe.document import SourceSpec

_VERSION = 1


def cache_root() -> Path | None:
    """mosaic's cache folder (``None`` when turned off): the digests, and beside them what else is derived
    from files by their digests alone (the weight errors of ``mosaic measure``)."""
    if os.environ.get("MOSAIC_NO_DIGEST_CACHE"):
        return None
    explicit = os.environ.get("MOSAIC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mosaic" / "digests"


def _identity(path: Path) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _entry_path(root: Path, real: str) -> Path:
    return root / (hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest() + ".json")


@dataclass
class Entry:
    sha256: str
    size: int
    tensors: dict[str, str]


def lookup(path: str | os.PathLike[str]) -> Entry | None:
    """The cached digests of ``path`` if its identity is what it was when they were computed."""
    root = cache_root()
    if root is None:
        return None
    real = os.path.realpath(path)
    ident = _identity(Path(real))
    try:
        doc = json.loads(_entry_path(root, real).read_bytes())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(doc, dict)
        or doc.get("version") != _VERSION
        or doc.get("path") != real
        or doc.get("identity") != ident
        or not isinstance(doc.get("sha256"), str)
        or not isinstance(doc.get("tensors"), dict)
    ):
        return None
    return Entry(doc["sha256"], ident[2] if ident else 0, {str(k): str(v) for k, v in doc["tensors"].items()})


def store(path: str | os.PathLike[str], sha256: str, tensors: dict[str, str], *, identity_before: list[int] | None) -> None:
    """Remember digests computed from ``path``; skipped if the file changed while it was read."""
    root = cache_root()
    if root is None:
        return
    real = os.path.realpath(path)
    ident = _identity(Path(real))
    if ident is None or ident != identity_before:
        return
    old = lookup(real)
    merged = {**(old.tensors if old is not None and old.sha256 == sha256 else {}), **tensors}
    doc = {"version": _VERSION, "path": real, "identity": ident, "sha256": sha256, "tensors": merged}
    try:
        root.mkdir(parents=True, exist_ok=True)
        target = _entry_path(root, real)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        os.replace(tmp, target)
    except OSError:
        return  # a cache that cannot be written only costs time


def identity(path: str | os.PathLike[str]) -> list[int] | None:
    return _identity(Path(os.path.realpath(path)))


def file_records(model: GGUFModel, spec: SourceSpec, progress: Reporter = SILENT) -> list[dict]:
    """``[{name, size, sha256}]`` of a model's files: the hub's digests ``mosaic fetch`` verified, else the
    digest cache, else hashed once (and cached)."""
    verified: dict[str, str] = {}
    if spec.repo is not None and spec.revision is not None:
        from mosaic._hub.snapshot import verified_digests

        verified = verified_digests(spec.repo, spec.revision) or {}
    out = []
    for f in model.files:
        path = model.path(f)
        size = model.headers[f].file_size
        sha = verified.get(f)
        if sha is None:
            e = lookup(path)
            if e is not None and e.size == size:
                sha = e.sha256
        if sha is None:
            before = identity(path)
            d = digest_file(path, on_bytes=progress.step(f"hashing {f}", size))
            if d.size != size:
                raise VerificationError(f"{path}: changed size while it was read")
            store(path, d.sha256, {}, identity_before=before)
            sha = d.sha256
        out.append({"name": f, "size": size, "sha256": sha})
    return out


def folder_records(analysis: object, progress: Reporter = SILENT) -> list[dict]:
    """``[{name, size, sha256}]`` of an EXL3 folder's shards (the digest cache's, else hashed once)."""
    ck = analysis.ckpt  # type: ignore[attr-defined]
    out = []
    for name in ck.shards:
        path = ck.root / name
        e = lookup(path)
        size = path.stat().st_size
        if e is not None and e.size == size:
            out.append({"name": name, "size": size, "sha256": e.sha256})
            continue
        before = identity(path)
        d = digest_file(path, on_bytes=progress.step(f"hashing {name}", size))
        store(path, d.sha256, {}, identity_before=before)
        out.append({"name": name, "size": d.size, "sha256": d.sha256})
    return out
