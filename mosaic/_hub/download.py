"""``mosaic fetch``: pinned, verified downloads of a recipe's hub sources.

Every ``repo`` + ``revision`` source of a recipe is downloaded by huggingface_hub (resumable per
file, into the Hugging Face cache unless ``local_dir`` says otherwise) at exactly its pinned commit,
then every file is checked against the hub's own digests (:mod:`mosaic._hub.snapshot`). A file that
does not match is removed from the cache and reported (exit 1); the digests of the files that match
are recorded so that the build never hashes them again.

It must never download anything that is not pinned to a full 40-hex commit, nor print or store the token.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Any

from mosaic._base.errors import SourceError, VerificationError
from mosaic._base.hashing import parallel_map
from mosaic._base.progress import SILENT, Reporter
from mosaic._hub.fetched import FetchedSource
from mosaic._hub.snapshot import (
    RECORD_SCHEMA,
    LocalDigest,
    cache_snapshot_folder,
    cached_tree,
    digest_local,
    file_identity,
    hf_constants,
    hub_error,
    hub_listing,
    hub_progress,
    listing_from_record,
    load_record,
    matches_hub,
    missing_files_error,
    record_path,
    require_pinned,
    storage_folder,
    unchanged_since_record,
    write_record,
)


def _discard(path: Path, storage: Path | None) -> None:
    """Remove a corrupted download so the next fetch downloads it again (its blob too, in the cache)."""
    try:
        target = path.resolve()
        path.unlink()
        if storage is not None and target != path and storage.resolve() / "blobs" in target.parents:
            target.unlink(missing_ok=True)
    except OSError:
        pass


_SPLIT_RE = re.compile(r"^(?P<stem>.+)-\d{5}-of-(?P<count>\d{5})\.gguf$")


def select_files(names: list[str] | set[str], patterns: list[str]) -> set[str]:
    """The files of a repo that GGUF ``file`` patterns name: names matching a pattern (or inside a
    folder it names), and every part of a split set one of whose parts matches. A GGUF repository
    holds many quantizations; only the recipe's are downloaded."""
    names = set(names)
    out: set[str] = set()
    for pat in patterns:
        hit = {n for n in names if fnmatch.fnmatchcase(n, pat)}
        if not hit and not any(c in pat for c in "*?["):
            hit = {n for n in names if n.startswith(pat.rstrip("/") + "/")}
        out |= hit
    for n in list(out):
        m = _SPLIT_RE.match(n)
        if m:
            count = int(m["count"])
            out |= {f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)} & names
    return out


def fetch_snapshot(
    repo: str,
    revision: str,
    *,
    local_dir: str | Path | None = None,
    jobs: int | None = None,
    progress: Reporter = SILENT,
    show_hub_progress: bool = False,
    files: list[str] | None = None,
) -> FetchedSource:
    """Download ``repo`` at the pinned ``revision`` (or find it in the cache offline) and verify every file.

    Raises SourceError (exit 2) for an unpinned revision, an unreachable hub or an incomplete snapshot
    offline, and VerificationError (exit 1) when a file's bytes differ from the hub's digest (the file
    is removed, so that fetching again downloads it again). ``files``: GGUF ``file`` patterns; only
    the files they name are downloaded and verified (:func:`select_files`), and naming none is an error.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    require_pinned(repo, revision)
    ldir = Path(local_dir).absolute() if local_dir is not None else None
    offline = bool(hf_constants().is_offline_mode())
    rec_path = record_path(repo, revision, ldir)
    previous = load_record(rec_path, repo, revision)

    if offline:
        folder = ldir if ldir is not None else cache_snapshot_folder(repo, revision)
        listing = listing_from_record(previous) if previous else cached_tree(repo, revision, ldir)
        if listing is not None and files is not None:
            listing = _only(listing, files, repo, revision)
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
        if files is not None:
            listing = _only(listing, files, repo, revision)
        try:
            with hub_progress(show_hub_progress):
                got = snapshot_download(repo_id=repo, revision=revision, local_dir=ldir,
                                        allow_patterns=sorted(listing) if files is not None else None)
        except IncompleteSnapshotError as e:
            raise SourceError(f"{repo}@{revision}: {e}") from None
        except LocalEntryNotFoundError as e:
            raise hub_error(repo, revision, e) from None
        except (HfHubHTTPError, OSError, ValueError) as e:
            raise hub_error(repo, revision, e) from None
        except Exception as e:  # httpx2 transport errors and the like
            if type(e).__module__.startswith(("httpx", "huggingface_hub")):
                raise hub_error(repo, revision, e) from None
            raise
        folder = Path(got)

    missing = [n for n in sorted(listing) if not (folder / n).is_file()]
    if missing:
        raise missing_files_error(repo, revision, folder, missing)

    old_files = previous["files"] if previous else {}
    old_hub = listing_from_record(previous) if previous else {}
    reuse = {n for n, h in listing.items() if old_hub.get(n) == h and unchanged_since_record(folder, n, old_files.get(n))}
    todo = [n for n in sorted(listing) if n not in reuse]
    advance = progress.step(f"verifying {repo}", sum(listing[n].size for n in todo))

    def one(name: str) -> tuple[str, LocalDigest, dict[str, int]]:
        p = folder / name
        ident = file_identity(p)
        return name, digest_local(p, advance), ident

    results = parallel_map(one, todo, jobs or os.cpu_count() or 1)
    files: dict[str, Any] = {n: old_files[n] for n in reuse}
    bad: list[str] = []
    for name, d, ident in results:
        hub = listing[name]
        if matches_hub(hub, d):
            files[name] = {"size": d.size, "sha256": d.sha256, "hub": hub.digest, "identity": ident}
        else:
            got_digest = f"sha256:{d.sha256}" if hub.lfs_sha256 else f"git-sha1:{d.git_sha1}"
            bad.append(f"{name} (hub: {hub.size} bytes, {hub.digest}; downloaded: {d.size} bytes, {got_digest})")
            _discard(folder / name, None if ldir is not None else storage_folder(repo))
    write_record(
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
    return FetchedSource(
        repo, revision, folder, len(listing), sum(h.size for h in listing.values()), len(todo), len(reuse), rec_path, offline
    )


def _only(listing: dict[str, Any], patterns: list[str], repo: str, revision: str) -> dict[str, Any]:
    for pat in patterns:
        if not select_files(set(listing), [pat]):
            raise SourceError(f"{repo}@{revision}: file {pat!r} names no file of the repository")
    keep = select_files(set(listing), patterns)
    return {n: h for n, h in listing.items() if n in keep}


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
) -> list[FetchedSource]:
    """Fetch and verify every ``repo`` + ``revision`` source of a recipe (each pinned commit once)."""
    from mosaic._recipe.document import load_recipe

    recipe = load_recipe(recipe_path)
    # per pinned commit: the GGUF file patterns it is named with, or None when any source takes it whole
    seen: dict[tuple[str, str], list[str] | None] = {}
    for spec in (recipe.base, *recipe.donors.values()):
        if spec.repo is not None:
            key = (spec.repo, require_pinned(spec.repo, spec.revision))
            if spec.file is None:
                seen[key] = None
            elif key not in seen or seen[key] is not None:
                seen[key] = [*(seen.get(key) or []), spec.file]
    out = []
    for (repo, rev), patterns in seen.items():
        target = fetch_dir_for(local_dir, repo, rev) if local_dir is not None else None
        out.append(
            fetch_snapshot(repo, rev, local_dir=target, jobs=jobs, progress=progress, show_hub_progress=show_hub_progress,
                           files=patterns)
        )
    return out


