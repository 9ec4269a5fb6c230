"""``mosaic audit``'s entry: which audit a folder gets, and which folders below a path are mosaics.

An EXL3 mosaic (a folder with PROVENANCE.json) gets :func:`mosaic._audit.mosaic_folder.audit_mosaic`;
a GGUF mosaic (PROVENANCE.json with ``format: gguf``) gets :func:`mosaic._audit.gguf_mosaic.audit_gguf_mosaic`;
a GGUF export (a folder with a GGUF ``manifest.json``) gets :func:`mosaic._audit.gguf_folder.audit_gguf`.
Both return an :class:`mosaic._audit.report.AuditReport`. Either is then told what is known of its
signature (``model.sig``): verified against the digests the audit read when a public key or a Sigstore
identity is given, else only present or absent (an unsigned folder is valid).
"""

from __future__ import annotations

import os
from pathlib import Path

from mosaic._audit.gguf_folder import audit_gguf, is_gguf_folder
from mosaic._audit.gguf_mosaic import audit_gguf_mosaic, is_gguf_mosaic
from mosaic._audit.mosaic_folder import audit_mosaic
from mosaic._audit.report import AuditReport, NotAMosaic
from mosaic._base.progress import SILENT, Reporter
from mosaic._provenance.records import PROVENANCE_NAME, SIGNATURE_NAME
from mosaic._provenance.signature import Trust, check_signature


def audit(
    folder: str | Path,
    *,
    sources: bool | str | Path = False,
    jobs: int | None = None,
    progress: Reporter = SILENT,
    trust: Trust | None = None,
    require_signature: bool = False,
) -> AuditReport:
    """Audit one mosaic folder or GGUF export. ``sources``: True to resolve sources from the folder's own
    recipe (paths relative to the current directory), or the recipe file the build used. ``trust``: the
    public key or Sigstore identity the signature must verify with (a ``signature`` check);
    ``require_signature``: an absent or unverified signature is a failure."""
    root = Path(folder)
    if not root.is_dir():
        raise NotAMosaic(f"{root}: not a folder")
    if is_gguf_mosaic(root):
        rep = audit_gguf_mosaic(root, sources=sources, jobs=jobs, progress=progress)
    elif is_gguf_folder(root):
        rep = audit_gguf(root, sources=sources, jobs=jobs, progress=progress)
    else:
        rep = audit_mosaic(root, sources=sources, jobs=jobs, progress=progress)
    _signature(rep, root, trust, require_signature)
    return rep


def _signature(rep: AuditReport, root: Path, trust: Trust | None, require: bool) -> None:
    chk = check_signature(root, rep.files, rep.digests, trust)
    rep.signature = chk.as_dict()
    if trust is None and not require:
        return
    rep.ran.append("signature")
    for file, detail in chk.failures:
        rep.fail("signature", detail, file=file)
    if not chk.present:
        rep.fail("signature", "the folder is not signed (no model.sig)", file=SIGNATURE_NAME)
    elif trust is None and not chk.failures:
        rep.fail("signature", "present but not verified: give --key PUBLIC_KEY, or --identity and --issuer",
                 file=SIGNATURE_NAME)


def find_mosaics(folder: str | Path) -> list[Path]:
    """The folder itself if it is a mosaic (or a GGUF export), else every such folder below it."""
    root = Path(folder)
    if (root / PROVENANCE_NAME).exists() or is_gguf_folder(root):
        return [root]
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if PROVENANCE_NAME in filenames or is_gguf_folder(dirpath):
            found.append(Path(dirpath))
            dirnames[:] = []
    return found
