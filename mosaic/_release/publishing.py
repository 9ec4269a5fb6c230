"""``mosaic publish``: audit first, upload in one commit, read the hub's digests back.

The branch ends up holding exactly the mosaic's files, and its signature (``model.sig``, from
``mosaic sign``) when it has one; after the commit, the hub's digests of every file are compared with
``sha256-manifest.txt`` (and the signature's with the file uploaded). A signature that no longer
matches the folder is refused before anything is uploaded: every consumer's verification would fail. This sits above both the audit and the hub client
(it needs both), so neither of them depends on the other.

It must never print or store the token, or touch the network with ``dry_run``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mosaic._audit.run import audit
from mosaic._base.errors import MosaicError, VerificationError
from mosaic._base.progress import SILENT, Reporter
from mosaic._base.version import __version__
from mosaic._hub.snapshot import REPO_RE, HubFile, digest_local, hub_progress, scrub_token
from mosaic._provenance.records import (
    MANIFEST_NAME,
    PROVENANCE_NAME,
    SIGNATURE_NAME,
    FileRecord,
    parse_manifest,
)
from mosaic._provenance.signature import MalformedSignature, stale_files

#: Files the hub keeps in every repository by itself; never uploaded, deleted or compared by publish.
HUB_OWN_FILES = frozenset({".gitattributes"})


class PublishError(MosaicError):
    """``mosaic publish`` refused (audit failed, bad repository name, the hub said no): exit 2."""


# --- publish ---------------------------------------------------------------------------------------


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

    @property
    def signature(self) -> str | None:
        """The signature file uploaded with the mosaic, if it has one."""
        return SIGNATURE_NAME if any(f.name == SIGNATURE_NAME for f in self.files) else None


def upload_plan(folder: str | Path, recipe_only: bool = False) -> tuple[list[UploadItem], str]:
    """What publish uploads (every manifest entry and the manifest itself, or with ``recipe_only`` all
    but the shards) and its commit message."""
    root = Path(folder)
    data = (root / MANIFEST_NAME).read_bytes()
    try:
        listed = parse_manifest(data, MANIFEST_NAME)
    except ValueError as e:
        raise PublishError(f"{root}: {e}") from None
    items = [UploadItem(n, (root / n).stat().st_size, sha) for n, sha in sorted(listed.items())
             if not (recipe_only and n.endswith((".safetensors", ".gguf")))]
    items.append(UploadItem(MANIFEST_NAME, len(data), hashlib.sha256(data).hexdigest()))
    sig = root / SIGNATURE_NAME
    if sig.is_file() and not sig.is_symlink():
        raw = sig.read_bytes()
        items.append(UploadItem(SIGNATURE_NAME, len(raw), hashlib.sha256(raw).hexdigest()))
    items.sort(key=lambda i: i.name)
    try:
        prov = json.loads((root / PROVENANCE_NAME).read_text(encoding="utf-8"))
        name, recipe_sha = str(prov["name"]), str(prov["recipe"]["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PublishError(f"{root / PROVENANCE_NAME}: cannot read name and recipe.sha256 ({e})") from None
    kind = " (recipe only: rebuild the shards with `mosaic rebuild`)" if recipe_only else ""
    return items, f"{name}: recipe sha256 {recipe_sha}, mosaic {__version__}{kind}"


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
    recipe_only: bool = False,
    jobs: int | None = None,
    progress: Reporter = SILENT,
    show_hub_progress: bool = False,
) -> PublishResult:
    """Audit ``folder``, upload it to ``repo`` in one commit, then compare the hub's digests with the manifest.

    The branch ends up holding exactly the mosaic's files (plus the hub's own ``.gitattributes``):
    files of an earlier upload that the mosaic does not have are deleted in the same commit.
    ``dry_run`` audits and lists, and makes no request at all.
    """
    root = Path(folder)
    if not REPO_RE.match(repo or ""):
        raise PublishError(f"--repo {repo!r}: not a hub repository name (expected ORG/NAME)")
    rep = audit(root, jobs=jobs, progress=progress)
    if not rep.ok:
        f = rep.failures[0]
        where = ": ".join(x for x in (f.file, f.tensor) if x)
        more = f" (and {len(rep.failures) - 1} more)" if len(rep.failures) > 1 else ""
        raise PublishError(
            f"{root}: refusing to publish: `mosaic audit` failed: {f.check}: {where + ': ' if where else ''}{f.detail}{more}"
        )
    if rep.signature is not None and rep.signature["present"]:
        try:
            stale = stale_files(root, rep.files, rep.digests)
        except MalformedSignature as e:
            raise PublishError(f"{root / SIGNATURE_NAME}: refusing to publish: {e}") from None
        if stale:
            (n, d), more = stale[0], (f" (and {len(stale) - 1} more)" if len(stale) > 1 else "")
            raise PublishError(
                f"{root / SIGNATURE_NAME}: refusing to publish a signature that no longer matches the folder: {n}: {d}{more}; "
                "sign again (mosaic sign --force) or remove it"
            )
    items, message = upload_plan(root, recipe_only=recipe_only)
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
        with hub_progress(show_hub_progress):
            info = api.create_commit(
                repo,
                operations=ops,
                commit_message=message,
                commit_description=f"Uploaded by `mosaic publish` ({len(items)} files). "
                "Verify a download with `sha256sum -c sha256-manifest.txt` and `mosaic audit`"
                + (f"; its signature ({SIGNATURE_NAME}) with `mosaic audit DIR --key PUBLIC_KEY`." if result.signature else "."),
                revision=target,
            )
        result.commit = str(info.oid)
        step = "reading back the hub's digests"
        remote = listing(result.commit)
    except Exception as e:  # the hub's and the transport's errors, and malformed answers: one line, no traceback
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PublishError(f"{repo}: {step} failed: {scrub_token(first)}") from None
    problems = compare_with_hub(root, items, remote)
    if problems:
        raise VerificationError(
            f"{repo}@{result.commit}: the hub's digests differ from {MANIFEST_NAME}: " + "; ".join(problems)
        )
    result.verified = True
    return result
