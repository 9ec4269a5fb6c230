"""``mosaic measure --imatrix SRC``: the importance matrix that weights every weight error, found and checked.

``SRC`` is a local file or a pinned hub file ``ORG/NAME@COMMIT:FILE``, downloaded into the Hugging Face
cache when it is not there yet and checked against the hub's digest (``mosaic fetch``'s own path: an
unpinned revision is refused, a file that differs is removed). The file is read strictly in either of
llama.cpp's formats (:mod:`mosaic._formats.imatrix`) and checked against the base (every entry a tensor of
it, every row its input width, one per expert) before any weight error is computed, so that bad input is
one line and nothing is written. The document records it in ``settings.imatrix``: its SHA-256 (what
``--resume`` and ``--merge`` compare), its format, the datasets and chunk count it was made from, and the
tensors it weighted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mosaic._base.errors import MosaicError
from mosaic._base.hashing import digest_file
from mosaic._base.progress import SILENT, Reporter
from mosaic._formats.imatrix import Imatrix, read_imatrix

_HUB_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)@(?P<rev>[^:]+):(?P<file>.+)$")


@dataclass(frozen=True)
class Importance:
    """An importance matrix checked against the base, and the SHA-256 of its file."""

    imatrix: Imatrix
    sha256: str

    def record(self, weighted: tuple[str, ...] | list[str]) -> dict[str, object]:
        """``settings.imatrix``: what the document says of the matrix and of the tensors it weighted."""
        m = self.imatrix
        return {"sha256": self.sha256, "format": m.format, "datasets": list(m.datasets), "chunk_count": m.chunk_count,
                "weighted": sorted(weighted)}


def local_path(src: str, progress: Reporter) -> Path:
    """The file ``src`` names: itself, or a pinned hub file fetched and verified into the cache."""
    p = Path(src)
    m = _HUB_RE.match(src)
    if p.exists() or m is None:
        if not p.is_file():
            raise MosaicError(f"--imatrix {src}: no such file (a local file, or ORG/NAME@<40-hex commit>:FILE on the hub)")
        return p
    repo, rev, name = m["repo"], m["rev"], m["file"]
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        raise MosaicError(f"--imatrix {src}: the revision must be a full 40-hex commit (pinned), not {rev!r}")
    if any(c in name for c in "*?[") or name.startswith("/") or ".." in name.split("/"):
        raise MosaicError(f"--imatrix {src}: name one file of the repository, not a glob or a path outside it")
    from mosaic._hub.download import fetch_snapshot

    fetched = fetch_snapshot(repo, rev, files=[name], progress=progress)
    path = fetched.folder / name
    if not path.is_file():
        raise MosaicError(f"--imatrix {src}: {name} is not a file of {repo}@{rev}")
    return path


def load_importance(src: str, tensors: dict[str, tuple[int, ...]], progress: Reporter = SILENT) -> Importance:
    """Find, read and check the importance matrix ``src`` against the base's tensors (name → ggml ``ne``)."""
    path = local_path(src, progress)
    imatrix = read_imatrix(path).for_model(tensors)
    return Importance(imatrix, digest_file(path).sha256)


def imatrix_name(rec: dict | None) -> str:
    """A document's ``settings.imatrix`` as a refusal names it: its SHA-256, or that there was none."""
    return f"sha256 {rec['sha256']}" if rec and rec.get("sha256") else "no importance matrix"
