"""From the Hugging Face Hub and back: pinned, verified downloads, and one-commit publishing.

This module owns:

- ``mosaic fetch``: every ``repo`` + ``revision`` source of a recipe is downloaded by
  huggingface_hub (resumable per file, into the Hugging Face cache unless ``local_dir`` says
  otherwise) at exactly its pinned commit, then every file is checked against the hub's own
  digests: the LFS SHA-256 for LFS files, the git blob id (SHA-1 of ``blob <len>\\0`` + content)
  for the others. A file that does not match is removed from the cache and reported (exit 1).
- the verified-digest records: one small JSON per snapshot in mosaic's own cache folder,
  ``$HF_HOME/mosaic/verified/<org>/<name>/<revision>.json``, with each file's size, SHA-256, hub
  digest and on-disk identity, so that an unchanged file is never hashed twice
  (:func:`verified_digests`, for the build);
- resolving a cached snapshot offline, with a clear error naming missing files
  (:func:`resolve_snapshot`, used by :mod:`mosaic.sources`);
- ``mosaic publish``: audit first, upload in one commit, read the hub's digests back and compare
  them with ``sha256-manifest.txt``.

It must never: print, log or write the access token anywhere (huggingface_hub finds it in its
usual places: ``HF_TOKEN``, the token file); download anything that is not pinned to a full
40-hex commit; write into a snapshot, a source folder or a mosaic folder (records live only in
mosaic's own cache folder); touch the network with ``publish(dry_run=True)`` or in offline mode.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from .errors import MosaicError, SourceError, VerificationError
from .hashing import parallel_map
from .progress import SILENT, Reporter
from .records import MANIFEST_NAME, PROVENANCE_NAME, FileRecord, parse_manifest

RECORD_SCHEMA = "mosaic.verified/v1"
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_CHUNK = 8 << 20
#: Files the hub keeps in every repository by itself; never uploaded, deleted or compared by publish.
HUB_OWN_FILES = frozenset({".gitattributes"})


class PublishError(MosaicError):
    """``mosaic publish`` refused (audit failed, bad repository name, the hub said no): exit 2."""


# --- names and pins --------------------------------------------------------------------------------


def require_pinned(repo: str, revision: str | None) -> str:
    """The revision, if it is a full 40-hex commit; otherwise an error showing how to pin it."""
    if not _REPO_RE.match(repo or ""):
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


def _hub() -> Any:
    """huggingface_hub's constants module, read at call time (tests and users may set HF_* late)."""
    from huggingface_hub import constants

    return constants


def _storage_folder(repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return Path(_hub().HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")


def cache_snapshot_folder(repo: str, revision: str) -> Path:
    """Where the Hugging Face cache keeps ``repo`` at ``revision`` (whether it exists or not)."""
    return _storage_folder(repo) / "snapshots" / revision


def records_root() -> Path:
    """mosaic's own cache folder for verified digests: ``$HF_HOME/mosaic/verified``."""
    return Path(_hub().HF_HOME) / "mosaic" / "verified"


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


def _matches(hub: HubFile, local: LocalDigest) -> bool:
    if local.size != hub.size:
        return False
    if hub.lfs_sha256:
        return local.sha256 == hub.lfs_sha256
    return local.git_sha1 == hub.blob_id


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()  # follows links: the cache's snapshot entries point at blobs
    return {"size": st.st_size, "dev": st.st_dev, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}


# --- records ---------------------------------------------------------------------------------------


def _load_record(path: Path, repo: str, revision: str) -> dict[str, Any] | None:
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


def _write_record(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _hub_from_record(doc: dict[str, Any]) -> dict[str, HubFile]:
    return {
        n: HubFile(n, int(e["size"]), str(e["blob_id"]), e.get("lfs_sha256"))
        for n, e in doc["hub"].items()
        if isinstance(e, dict)
    }


def _unchanged(folder: Path, name: str, entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("identity"), dict):
        return False
    try:
        return _identity(folder / name) == entry["identity"]
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
    if not _COMMIT_RE.match(revision or "") or not _REPO_RE.match(repo or ""):
        return None
    doc = _load_record(record_path(repo, revision, local_dir), repo, revision)
    if doc is None:
        return None
    folder = Path(local_dir) if local_dir is not None else cache_snapshot_folder(repo, revision)
    return {
        name: str(entry["sha256"])
        for name, entry in sorted(doc["files"].items())
        if _unchanged(folder, name, entry)
    }


# --- hub listing and download ----------------------------------------------------------------------


def _hub_error(repo: str, revision: str, e: BaseException) -> SourceError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, RevisionNotFoundError):
        return SourceError(f"{repo}@{revision}: the hub has no such commit in this repository")
    if isinstance(e, GatedRepoError):
        return SourceError(f"{repo}: gated repository; accept its terms on the hub and log in (`hf auth login`)")
    if isinstance(e, RepositoryNotFoundError):
        return SourceError(f"{repo}: repository not found on the hub (or private: log in with `hf auth login`)")
    return SourceError(f"{repo}@{revision}: cannot download from the hub: {_scrub(str(e).splitlines()[0] if str(e) else type(e).__name__)}")


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
        raise _hub_error(repo, revision, e) from None
    out: dict[str, HubFile] = {}
    for f in entries:
        if isinstance(f, RepoFile):
            out[f.path] = HubFile(f.path, int(f.size), f.blob_id, f.lfs.sha256 if f.lfs is not None else None)
    return out


def _cached_tree(repo: str, revision: str, local_dir: Path | None) -> dict[str, HubFile] | None:
    """The tree listing huggingface_hub cached beside the snapshot (``trees/<commit>.json``), if any."""
    base = local_dir / ".cache" / "huggingface" if local_dir is not None else _storage_folder(repo)
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
def _hub_progress(show: bool) -> Iterator[None]:
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


def _missing_error(repo: str, revision: str, folder: Path, missing: list[str]) -> SourceError:
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return SourceError(
        f"{repo}@{revision}: the snapshot in {folder} is incomplete: {len(missing)} file(s) missing: {shown}; "
        f"run `mosaic fetch RECIPE` with network access to complete it"
    )


@dataclass
class FetchedSnapshot:
    repo: str
    revision: str
    folder: Path
    files: int
    bytes: int
    hashed: int
    unchanged: int
    record: Path
    offline: bool

    def as_dict(self) -> dict[str, object]:
        return {
            "repo": self.repo,
            "revision": self.revision,
            "folder": str(self.folder),
            "files": self.files,
            "bytes": self.bytes,
            "hashed": self.hashed,
            "unchanged": self.unchanged,
            "record": str(self.record),
            "offline": self.offline,
        }


def _discard(path: Path, storage: Path | None) -> None:
    """Remove a corrupted download so the next fetch downloads it again (its blob too, in the cache)."""
    try:
        target = path.resolve()
        path.unlink()
        if storage is not None and target != path and storage.resolve() / "blobs" in target.parents:
            target.unlink(missing_ok=True)
    except OSError:
        pass


def fetch_snapshot(
    repo: str,
    revision: str,
    *,
    local_dir: str | Path | None = None,
    jobs: int | None = None,
    progress: Reporter = SILENT,
    show_hub_progress: bool = False,
) -> FetchedSnapshot:
    """Download ``repo`` at the pinned ``revision`` (or find it in the cache offline) and verify every file.

    Raises SourceError (exit 2) for an unpinned revision, an unreachable hub or an incomplete snapshot
    offline, and VerificationError (exit 1) when a file's bytes differ from the hub's digest (the file
    is removed, so that fetching again downloads it again).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    require_pinned(repo, revision)
    ldir = Path(local_dir).absolute() if local_dir is not None else None
    offline = bool(_hub().is_offline_mode())
    rec_path = record_path(repo, revision, ldir)
    previous = _load_record(rec_path, repo, revision)

    if offline:
        folder = ldir if ldir is not None else cache_snapshot_folder(repo, revision)
        listing = _hub_from_record(previous) if previous else _cached_tree(repo, revision, ldir)
        if not folder.is_dir():
            raise SourceError(
                f"{repo}@{revision}: not in {'the folder ' + str(folder) if ldir else 'the Hugging Face cache'} "
                f"and HF_HUB_OFFLINE is set; run `mosaic fetch` with network access first"
            )
        if listing is None:
            raise SourceError(
                f"{repo}@{revision}: no record of the hub's digests for {folder}, so it cannot be verified "
                f"offline; run `mosaic fetch` once with network access"
            )
    else:
        listing = hub_listing(repo, revision)
        try:
            with _hub_progress(show_hub_progress):
                got = snapshot_download(repo_id=repo, revision=revision, local_dir=ldir)
        except IncompleteSnapshotError as e:
            raise SourceError(f"{repo}@{revision}: {e}") from None
        except LocalEntryNotFoundError as e:
            raise _hub_error(repo, revision, e) from None
        except (HfHubHTTPError, OSError, ValueError) as e:
            raise _hub_error(repo, revision, e) from None
        except Exception as e:  # httpx2 transport errors and the like
            if type(e).__module__.startswith(("httpx", "huggingface_hub")):
                raise _hub_error(repo, revision, e) from None
            raise
        folder = Path(got)

    missing = [n for n in sorted(listing) if not (folder / n).is_file()]
    if missing:
        raise _missing_error(repo, revision, folder, missing)

    old_files = previous["files"] if previous else {}
    old_hub = _hub_from_record(previous) if previous else {}
    reuse = {n for n, h in listing.items() if old_hub.get(n) == h and _unchanged(folder, n, old_files.get(n))}
    todo = [n for n in sorted(listing) if n not in reuse]
    advance = progress.step(f"verifying {repo}", sum(listing[n].size for n in todo))

    def one(name: str) -> tuple[str, LocalDigest, dict[str, int]]:
        p = folder / name
        ident = _identity(p)
        return name, digest_local(p, advance), ident

    results = parallel_map(one, todo, jobs or os.cpu_count() or 1)
    files: dict[str, Any] = {n: old_files[n] for n in reuse}
    bad: list[str] = []
    for name, d, ident in results:
        hub = listing[name]
        if _matches(hub, d):
            files[name] = {"size": d.size, "sha256": d.sha256, "hub": hub.digest, "identity": ident}
        else:
            got_digest = f"sha256:{d.sha256}" if hub.lfs_sha256 else f"git-sha1:{d.git_sha1}"
            bad.append(f"{name} (hub: {hub.size} bytes, {hub.digest}; downloaded: {d.size} bytes, {got_digest})")
            _discard(folder / name, None if ldir is not None else _storage_folder(repo))
    _write_record(
        rec_path,
        {
            "schema": RECORD_SCHEMA,
            "repo": repo,
            "revision": revision,
            "folder": str(folder),
            "hub": {n: h.as_json() for n, h in sorted(listing.items())},
            "files": dict(sorted(files.items())),
        },
    )
    if bad:
        raise VerificationError(
            f"{repo}@{revision}: {len(bad)} file(s) differ from the hub's digests and were removed: "
            + "; ".join(bad)
            + "; run `mosaic fetch` again to download them again"
        )
    return FetchedSnapshot(
        repo, revision, folder, len(listing), sum(h.size for h in listing.values()), len(todo), len(reuse), rec_path, offline
    )


def fetch_dir_for(local_dir: str | Path, repo: str, revision: str) -> Path:
    """Where ``mosaic fetch --local-dir DIR`` puts one source: ``DIR/<org>/<name>@<revision>``."""
    org, name = repo.split("/", 1)
    return Path(local_dir) / org / f"{name}@{revision}"


def fetch(
    recipe_path: str | Path,
    *,
    local_dir: str | Path | None = None,
    jobs: int | None = None,
    progress: Reporter = SILENT,
    show_hub_progress: bool = False,
) -> list[FetchedSnapshot]:
    """Fetch and verify every ``repo`` + ``revision`` source of a recipe (each pinned commit once)."""
    from .recipe import load_recipe

    recipe = load_recipe(recipe_path)
    seen: dict[tuple[str, str], None] = {}
    for spec in (recipe.base, *recipe.donors.values()):
        if spec.repo is not None:
            seen[(spec.repo, require_pinned(spec.repo, spec.revision))] = None
    out = []
    for repo, rev in seen:
        target = fetch_dir_for(local_dir, repo, rev) if local_dir is not None else None
        out.append(
            fetch_snapshot(repo, rev, local_dir=target, jobs=jobs, progress=progress, show_hub_progress=show_hub_progress)
        )
    return out


def resolve_snapshot(repo: str, revision: str) -> Path:
    """The cached, complete snapshot folder of ``repo@revision``; never touches the network.

    Complete means: every file of the hub's listing (mosaic's record of the fetch, or the listing
    huggingface_hub cached beside the snapshot) is there; otherwise the error names the missing files.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    require_pinned(repo, revision)
    folder = cache_snapshot_folder(repo, revision)
    previous = _load_record(record_path(repo, revision), repo, revision)
    listing = _hub_from_record(previous) if previous else _cached_tree(repo, revision, None)
    try:
        got = Path(snapshot_download(repo_id=repo, revision=revision, local_files_only=True))
    except IncompleteSnapshotError:
        got = folder  # named precisely below
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as e:
        raise SourceError(
            f"{repo}@{revision}: not in the local Hugging Face cache ({type(e).__name__}); "
            f"download it first with `mosaic fetch RECIPE`"
        ) from None
    if listing is not None:
        missing = [n for n in sorted(listing) if not (got / n).is_file()]
        if missing:
            raise _missing_error(repo, revision, got, missing)
    return got


# --- publish ---------------------------------------------------------------------------------------


def _scrub(text: str) -> str:
    """Remove the token from a message, should a server ever echo it back."""
    try:
        from huggingface_hub import get_token

        token = get_token()
    except Exception:
        token = None
    return text.replace(token, "***") if token else text


#: A file to upload: name, size and SHA-256, as the manifest lists it.
UploadItem = FileRecord


@dataclass
class PublishResult:
    repo: str
    branch: str
    commit_message: str
    files: list[UploadItem]
    dry_run: bool
    commit: str | None = None
    deleted: list[str] = field(default_factory=list)
    verified: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "repo": self.repo,
            "branch": self.branch,
            "dry_run": self.dry_run,
            "commit": self.commit,
            "commit_message": self.commit_message,
            "files": [f.as_dict() for f in self.files],
            "bytes": sum(f.size for f in self.files),
            "deleted": self.deleted,
            "verified": self.verified,
        }


def upload_plan(folder: str | Path) -> tuple[list[UploadItem], str]:
    """What publish uploads (every manifest entry and the manifest itself) and its commit message."""
    root = Path(folder)
    data = (root / MANIFEST_NAME).read_bytes()
    try:
        listed = parse_manifest(data, MANIFEST_NAME)
    except ValueError as e:
        raise PublishError(f"{root}: {e}") from None
    items = [UploadItem(n, (root / n).stat().st_size, sha) for n, sha in sorted(listed.items())]
    items.append(UploadItem(MANIFEST_NAME, len(data), hashlib.sha256(data).hexdigest()))
    items.sort(key=lambda i: i.name)
    try:
        prov = json.loads((root / PROVENANCE_NAME).read_text(encoding="utf-8"))
        name, recipe_sha = str(prov["name"]), str(prov["recipe"]["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PublishError(f"{root / PROVENANCE_NAME}: cannot read name and recipe.sha256 ({e})") from None
    return items, f"{name}: recipe sha256 {recipe_sha}, mosaic {__version__}"


def compare_with_hub(root: Path, items: list[UploadItem], remote: dict[str, HubFile]) -> list[str]:
    """Every difference between the uploaded files (manifest digests) and the hub's digests of a commit."""
    problems = []
    for it in items:
        hub = remote.get(it.name)
        if hub is None:
            problems.append(f"{it.name}: missing on the hub")
        elif hub.size != it.size:
            problems.append(f"{it.name}: {hub.size} bytes on the hub, {it.size} here")
        elif hub.lfs_sha256 is not None:
            if hub.lfs_sha256 != it.sha256:
                problems.append(f"{it.name}: hub sha256 {hub.lfs_sha256}, manifest {it.sha256}")
        else:
            local = digest_local(root / it.name)
            if local.sha256 != it.sha256:
                problems.append(f"{it.name}: changed here during the upload (sha256 {local.sha256}, manifest {it.sha256})")
            elif local.git_sha1 != hub.blob_id:
                problems.append(f"{it.name}: hub git blob {hub.blob_id}, this file's {local.git_sha1}")
    names = {it.name for it in items}
    problems += [f"{n}: on the hub but not in the mosaic" for n in sorted(remote) if n not in names and n not in HUB_OWN_FILES]
    return problems


def publish(
    folder: str | Path,
    repo: str,
    *,
    branch: str | None = None,
    private: bool = False,
    dry_run: bool = False,
    jobs: int | None = None,
    progress: Reporter = SILENT,
    show_hub_progress: bool = False,
) -> PublishResult:
    """Audit ``folder``, upload it to ``repo`` in one commit, then compare the hub's digests with the manifest.

    The branch ends up holding exactly the mosaic's files (plus the hub's own ``.gitattributes``):
    files of an earlier upload that the mosaic does not have are deleted in the same commit.
    ``dry_run`` audits and lists, and makes no request at all.
    """
    from .audit import audit

    root = Path(folder)
    if not _REPO_RE.match(repo or ""):
        raise PublishError(f"--repo {repo!r}: not a hub repository name (expected ORG/NAME)")
    rep = audit(root, jobs=jobs, progress=progress)
    if not rep.ok:
        f = rep.failures[0]
        where = ": ".join(x for x in (f.file, f.tensor) if x)
        more = f" (and {len(rep.failures) - 1} more)" if len(rep.failures) > 1 else ""
        raise PublishError(
            f"{root}: refusing to publish: `mosaic audit` failed: {f.check}: {where + ': ' if where else ''}{f.detail}{more}"
        )
    items, message = upload_plan(root)
    target = branch or "main"
    result = PublishResult(repo, target, message, items, dry_run)
    if dry_run:
        return result

    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi()

    def listing(rev: str) -> dict[str, HubFile]:
        return {
            f.path: HubFile(f.path, int(f.size), f.blob_id, f.lfs.sha256 if f.lfs is not None else None)
            for f in api.list_repo_tree(repo, revision=rev, recursive=True)
            if isinstance(f, RepoFile)
        }

    step = "creating the repository"
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        if branch is not None:
            step = f"creating branch {branch}"
            api.create_branch(repo, branch=branch, exist_ok=True)
        step = "listing the branch"
        names = {i.name for i in items}
        result.deleted = sorted(n for n in listing(target) if n not in names and n not in HUB_OWN_FILES)
        ops: list[Any] = [CommitOperationAdd(path_in_repo=i.name, path_or_fileobj=str(root / i.name)) for i in items]
        ops += [CommitOperationDelete(path_in_repo=n) for n in result.deleted]
        step = "uploading"
        with _hub_progress(show_hub_progress):
            info = api.create_commit(
                repo,
                operations=ops,
                commit_message=message,
                commit_description=f"Uploaded by `mosaic publish` ({len(items)} files). "
                "Verify a download with `sha256sum -c sha256-manifest.txt` and `mosaic audit`.",
                revision=target,
            )
        result.commit = str(info.oid)
        step = "reading back the hub's digests"
        remote = listing(result.commit)
    except Exception as e:  # the hub's and the transport's errors, and malformed answers: one line, no traceback
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PublishError(f"{repo}: {step} failed: {_scrub(first)}") from None
    problems = compare_with_hub(root, items, remote)
    if problems:
        raise VerificationError(
            f"{repo}@{result.commit}: the hub's digests differ from {MANIFEST_NAME}: " + "; ".join(problems)
        )
    result.verified = True
    return result
