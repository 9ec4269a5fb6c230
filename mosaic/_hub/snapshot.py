"""What a pinned hub snapshot is, on the hub and in the local cache: pins, listings, verified digests.

This module owns the ground that ``mosaic fetch`` (:mod:`mosaic._hub.download`), the build's source
resolution (:mod:`mosaic._sources.resolve`) and ``mosaic publish`` (:mod:`mosaic._release.publishing`) stand on:

- pins: a source is a repository name and a full 40-hex commit, never a branch;
- the hub's own digests of a file: the LFS SHA-256 for LFS files, the git blob id (SHA-1 of
  ``blob <len>\\0`` + content) for the others, and the same two computed from a local file;
- the verified-digest records: one small JSON per snapshot in mosaic's own cache folder,
  ``$HF_HOME/mosaic/verified/<org>/<name>/<revision>.json``, with each file's size, SHA-256, hub
  digest and on-disk identity, so that an unchanged file is never hashed twice
  (:func:`verified_digests`, for the build);
- resolving a cached snapshot offline, with a clear error naming missing files
  (:func:`resolve_snapshot`).

It must never: print, log or write the access token anywhere (huggingface_hub finds it in its
usual places: ``HF_TOKEN``, the token file); write into a snapshot, a source folder or a mosaic
folder (records live only in mosaic's own cache folder); touch the network in offline resolution.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mosaic._base.errors import SourceError, VerificationError
from mosaic._recipe.document import REPO_RE

RECORD_SCHEMA = "mosaic.verified/v1"
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_CHUNK = 8 << 20


# --- names and pins --------------------------------------------------------------------------------


def require_pinned(repo: str, revision: str | None) -> str:
    """The revision, if it is a full 40-hex commit; otherwise an error showing how to pin it."""
    if not REPO_RE.match(repo or ""):
        raise SourceError(f"{repo!r}: not a hub repository name (expected ORG/NAME)")
    if revision is None or not _COMMIT_RE.match(revision):
        shown = "(none)" if not revision else repr(revision)
        raise SourceError(
            f"{repo}: revision {shown} is not a full 40-hex commit hash; branches and tags move, so mosaic "
            f"downloads only pinned commits. Pin it: find the commit with "
            f"`git ls-remote https://huggingface.co/{repo} {revision or 'main'}` and write "
            f"`repo: {repo}` + `revision: <40-hex commit>` in the recipe"
        )
    return revision


def hf_constants() -> Any:
    """huggingface_hub's constants module, read at call time (tests and users may set HF_* late)."""
    from huggingface_hub import constants

    return constants


def storage_folder(repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return Path(hf_constants().HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")


def cache_snapshot_folder(repo: str, revision: str) -> Path:
    """Where the Hugging Face cache keeps ``repo`` at ``revision`` (whether it exists or not)."""
    return storage_folder(repo) / "snapshots" / revision


def records_root() -> Path:
    """mosaic's own cache folder for verified digests: ``$HF_HOME/mosaic/verified``."""
    return Path(hf_constants().HF_HOME) / "mosaic" / "verified"


def record_path(repo: str, revision: str, local_dir: str | Path | None = None) -> Path:
    """The record of ``repo@revision``: one per snapshot in the cache, one per ``local_dir`` folder."""
    org, name = repo.split("/", 1)
    folder = records_root() / org / name
    if local_dir is None:
        return folder / f"{revision}.json"
    tag = hashlib.sha256(str(Path(local_dir).resolve()).encode()).hexdigest()[:16]
    return folder / f"{revision}.local-{tag}.json"


# --- digests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubFile:
    """One file of a hub commit as the hub describes it."""

    name: str
    size: int
    blob_id: str
    lfs_sha256: str | None = None

    @property
    def digest(self) -> str:
        """The hub's own digest: ``sha256:<hex>`` for LFS files, ``git-sha1:<hex>`` otherwise."""
        return f"sha256:{self.lfs_sha256}" if self.lfs_sha256 else f"git-sha1:{self.blob_id}"

    def as_json(self) -> dict[str, object]:
        return {"size": self.size, "blob_id": self.blob_id, "lfs_sha256": self.lfs_sha256}


@dataclass(frozen=True)
class LocalDigest:
    size: int
    sha256: str
    git_sha1: str


def digest_local(path: Path, on_bytes: Any = None) -> LocalDigest:
    """One read of ``path``: its SHA-256 and its git blob id (SHA-1 of ``blob <len>\\0`` + content)."""
    size = path.stat().st_size
    sha = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode())
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            git.update(chunk)
            n += len(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    if n != size:
        raise VerificationError(f"{path}: changed while being read ({size} bytes at start, {n} read)")
    return LocalDigest(n, sha.hexdigest(), git.hexdigest())


def matches_hub(hub: HubFile, local: LocalDigest) -> bool:
    if local.size != hub.size:
        return False
    if hub.lfs_sha256:
        return local.sha256 == hub.lfs_sha256
    return local.git_sha1 == hub.blob_id


def file_identity(path: Path) -> dict[str, int]:
    st = path.stat()  # follows links: the cache's snapshot entries point at blobs
    return {"size": st.st_size, "dev": st.st_dev, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}


# --- records ---------------------------------------------------------------------------------------


def load_record(path: Path, repo: str, revision: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (
        isinstance(doc, dict)
        and doc.get("schema") == RECORD_SCHEMA
        and doc.get("repo") == repo
        and doc.get("revision") == revision
        and isinstance(doc.get("files"), dict)
        and isinstance(doc.get("hub"), dict)
    ):
        return None
    return doc


def write_record(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def listing_from_record(doc: dict[str, Any]) -> dict[str, HubFile]:
    return {
        n: HubFile(n, int(e["size"]), str(e["blob_id"]), e.get("lfs_sha256"))
        for n, e in doc["hub"].items()
        if isinstance(e, dict)
    }


def unchanged_since_record(folder: Path, name: str, entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("identity"), dict):
        return False
    try:
        return file_identity(folder / name) == entry["identity"]
    except OSError:
        return False


def verified_digests(repo: str, revision: str, *, local_dir: str | Path | None = None) -> dict[str, str] | None:
    """SHA-256 of every file of ``repo@revision`` that ``mosaic fetch`` verified and that is unchanged since.

    Returns ``{file name: sha256 hex}`` for the files whose size, device, inode and modification time
    still equal what they were when verified (a file replaced, rewritten or missing is left out, so the
    caller hashes it itself), or ``None`` when the snapshot was never verified. Looks at the Hugging
    Face cache's snapshot, or at ``local_dir`` when the files were fetched there. Never touches the
    network and never hashes anything.
    """
    if not _COMMIT_RE.match(revision or "") or not REPO_RE.match(repo or ""):
        return None
    doc = load_record(record_path(repo, revision, local_dir), repo, revision)
    if doc is None:
        return None
    folder = Path(local_dir) if local_dir is not None else cache_snapshot_folder(repo, revision)
    return {
        name: str(entry["sha256"])
        for name, entry in sorted(doc["files"].items())
        if unchanged_since_record(folder, name, entry)
    }


def scrub_token(text: str) -> str:
    """Remove the token from a message, should a server ever echo it back."""
    try:
        from huggingface_hub import get_token

        token = get_token()
    except Exception:
        token = None
    return text.replace(token, "***") if token else text


# --- hub listing and download ----------------------------------------------------------------------


def hub_error(repo: str, revision: str, e: BaseException) -> SourceError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, RevisionNotFoundError):
        return SourceError(f"{repo}@{revision}: the hub has no such commit in this repository")
    if isinstance(e, GatedRepoError):
        return SourceError(f"{repo}: gated repository; accept its terms on the hub and log in (`hf auth login`)")
    if isinstance(e, RepositoryNotFoundError):
        return SourceError(f"{repo}: repository not found on the hub (or private: log in with `hf auth login`)")
    return SourceError(f"{repo}@{revision}: cannot download from the hub: {scrub_token(str(e).splitlines()[0] if str(e) else type(e).__name__)}")


def hub_listing(repo: str, revision: str) -> dict[str, HubFile]:
    """Every file of ``repo`` at the pinned commit with the hub's size and digests (one tree listing)."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.hf_api import RepoFile

    require_pinned(repo, revision)
    try:
        entries = list(HfApi().list_repo_tree(repo, revision=revision, recursive=True))
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
        raise hub_error(repo, revision, e) from None
    out: dict[str, HubFile] = {}
    for f in entries:
        if isinstance(f, RepoFile):
            out[f.path] = HubFile(f.path, int(f.size), f.blob_id, f.lfs.sha256 if f.lfs is not None else None)
    return out


def cached_tree(repo: str, revision: str, local_dir: Path | None) -> dict[str, HubFile] | None:
    """The tree listing huggingface_hub cached beside the snapshot (``trees/<commit>.json``), if any."""
    base = local_dir / ".cache" / "huggingface" if local_dir is not None else storage_folder(repo)
    try:
        doc = json.loads((base / "trees" / f"{revision}.json").read_text(encoding="utf-8"))
        files = doc["files"]
        return {
            n: HubFile(n, int(e["size"]), str(e["blob_id"]), e.get("lfs_sha256"))
            for n, e in files.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@contextmanager
def hub_progress(show: bool) -> Iterator[None]:
    """huggingface_hub's own download bars on a terminal; none with --json or without a TTY."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not show:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was_disabled:
            enable_progress_bars()


def missing_files_error(repo: str, revision: str, folder: Path, missing: list[str]) -> SourceError:
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return SourceError(
        f"{repo}@{revision}: the snapshot in {folder} is incomplete: {len(missing)} file(s) missing: {shown}; "
        f"run `mosaic fetch RECIPE` with network access to complete it"
    )


def resolve_snapshot(repo: str, revision: str) -> Path:
    """The cached, complete snapshot folder of ``repo@revision``; never touches the network.

    Complete means: every file of the hub's listing (mosaic's record of the fetch, or the listing
    huggingface_hub cached beside the snapshot) is there; otherwise the error names the missing files.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    require_pinned(repo, revision)
    folder = cache_snapshot_folder(repo, revision)
    previous = load_record(record_path(repo, revision), repo, revision)
    listing = listing_from_record(previous) if previous else cached_tree(repo, revision, None)
    try:
        got = Path(snapshot_download(repo_id=repo, revision=revision, local_files_only=True))
    except IncompleteSnapshotError:
        got = folder  # named precisely below
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as e:
        raise SourceError(
            f"{repo}@{revision}: not in the local Hugging Face cache ({type(e).__name__}); "
            f"download it first with `mosaic fetch RECIPE`, or build with `--stream` to read only the bytes the mosaic takes"
        ) from None
    if listing is not None:
        missing = [n for n in sorted(listing) if not (got / n).is_file()]
        if missing:
            raise missing_files_error(repo, revision, got, missing)
    return got


