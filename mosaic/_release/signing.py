"""``mosaic sign``: audit a folder, then sign the very digests the audit read.

Signing vouches for a folder, so it signs only one that passes ``mosaic audit`` (with ``sources``, the
audit against the sources too). The audit reads every byte once; the signature is made from the
digests of that read (:mod:`mosaic._provenance.signature`), so a 96 GB mosaic is read once for both, not once
more by the signing library. This sits above the audit and the signature format, like ``publish``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mosaic._audit.report import AuditReport, NotAMosaic
from mosaic._audit.run import audit
from mosaic._base.errors import VerificationError
from mosaic._base.lock import lock_path, output_lock
from mosaic._base.progress import SILENT, Reporter
from mosaic._provenance.records import SIGNATURE_NAME
from mosaic._provenance.signature import Signed, Signer, SigningError, prepare_signer, sign_digests


@dataclass
class SignResult:
    report: AuditReport
    signed: Signed


def sign(
    folder: str | Path,
    signer: Signer,
    *,
    sources: bool | str | Path = False,
    force: bool = False,
    jobs: int | None = None,
    progress: Reporter = SILENT,
) -> SignResult:
    """Audit ``folder`` (a mosaic or a GGUF export) and, if every check passes, write ``model.sig``.

    Refuses (exit 2) a folder that is already signed unless ``force``; refuses (exit 1) a folder whose
    audit fails, naming the first failure. The signer is made before the audit reads anything, so a
    refused key or an unreachable Sigstore stops it first. An existing signature is replaced only once
    the new one is complete.

    ``DIR.lock`` beside the folder (never inside it: the folder's manifest and signature must not see it) is
    held from before the folder is looked at until the signature is written, so that a second ``sign`` (or a
    build replacing the folder) is refused, naming this one."""
    root = Path(folder)
    if not lock_path(root).parent.is_dir():  # the folder's parent: where its lock would lie
        raise NotAMosaic(f"{root}: not a folder")
    with output_lock(root, "mosaic sign"):
        return _sign(root, signer, sources=sources, force=force, jobs=jobs, progress=progress)


def _sign(root: Path, signer: Signer, *, sources: bool | str | Path, force: bool, jobs: int | None,
          progress: Reporter) -> SignResult:
    if not root.is_dir():
        raise NotAMosaic(f"{root}: not a folder")
    sig = root / SIGNATURE_NAME
    if (sig.exists() or sig.is_symlink()) and not force:
        raise SigningError(f"{sig}: the folder is already signed; --force replaces the signature")
    prepared = prepare_signer(signer)
    rep = audit(root, sources=sources, jobs=jobs, progress=progress)
    if not rep.ok:
        f = rep.failures[0]
        where = ": ".join(x for x in (f.file, f.tensor) if x)
        more = f" (and {len(rep.failures) - 1} more)" if len(rep.failures) > 1 else ""
        raise VerificationError(
            f"{root}: refusing to sign: `mosaic audit` failed: {f.check}: {where + ': ' if where else ''}{f.detail}{more}"
        )
    return SignResult(rep, sign_digests(root, rep.files, rep.digests, prepared))
