"""``mosaic measure --imatrix SRC``: the importance matrix that weights every weight error, found and checked.

``SRC`` is a local file or a pinned hub file ``ORG/NAME@COMMIT:FILE``, downloaded into the Hugging Face
cache when it is not there yet and checked against the hub's digest (``mosaic fetch``'s own path: an
unpinned revision is refused, a file that differs is removed). The file is read strictly in either of
llama.cpp's formats (:mod:`mosaic._formats.imatrix`) and checked against the base (every entry a tensor of
it, every row its input width, one per expert) before any weight error is computed, so that bad input is
one line and nothing is written. The document records it in ``settings.imatrix``: its SHA-256 (what
``--resume`` and ``--merge`` compare), its format, the datasets and chunk count it was made from, and the
tensors it weighted.

With ``--imatrix-cap`` each channel's importance is first held under a robust ceiling (:func:`capped`): the
square of an activation is a poor weight where one channel carries a massive activation (values thousands to
millions of times the others', the attention-sink channels many models have), because then that one channel's
error is all the weighted error sees. A version that quantizes it well and every other channel badly scores as
lossless, and a plan takes it for free. The ceiling is a fixed outlier rule of robust statistics, the same for
every model, not a setting to tune.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mosaic._base.errors import MosaicError
from mosaic._base.hashing import digest_file
from mosaic._base.progress import SILENT, Reporter
from mosaic._formats.imatrix import Imatrix, read_imatrix

#: ``--imatrix-cap``: the ceiling in robust standard deviations of a row's log importances above their median
#: (Iglewicz and Hoaglin's cut for an outlier's modified z-score); 1.4826 × MAD estimates one standard deviation.
CAP = 3.5
_MAD_TO_SD = 1.4826
#: Fewer positive channels than this in a row (or none spread apart) give no ceiling: the row is kept as it is.
_MIN_CHANNELS = 8

_HUB_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)@(?P<rev>[^:]+):(?P<file>.+)$")


@dataclass(frozen=True)
class Importance:
    """An importance matrix checked against the base, and the SHA-256 of its file."""

    imatrix: Imatrix
    sha256: str
    cap: float | None = None  # --imatrix-cap: the ceiling of :func:`capped`; None: the values as they are

    @property
    def key(self) -> str:
        """What a weighted sum is cached under: the matrix's SHA-256, and the ceiling where there is one."""
        return self.sha256 if self.cap is None else f"{self.sha256}+cap{self.cap:g}"

    def weights(self, name: str) -> np.ndarray:
        """``s`` of tensor ``name`` (mean 1, shape ``(experts, row)``), under the ceiling where there is one."""
        s = self.imatrix.weights(name)
        return s if self.cap is None else capped(s, self.cap)

    def record(self, weighted: tuple[str, ...] | list[str]) -> dict[str, object]:
        """``settings.imatrix``: what the document says of the matrix and of the tensors it weighted."""
        m = self.imatrix
        rec: dict[str, object] = {"sha256": self.sha256, "format": m.format, "datasets": list(m.datasets),
                                  "chunk_count": m.chunk_count, "weighted": sorted(weighted)}
        if self.cap is not None:
            rec["cap"] = self.cap
        return rec


def capped(s: np.ndarray, z: float = CAP) -> np.ndarray:
    """``s`` with every row (an expert's channels) held under ``exp(median + z × 1.4826 × MAD)`` of the row's
    positive log values, then over its mean again. On a log scale because importances spread by factors; per
    row because experts see different tokens. A row with fewer than 8 positive values, or whose values do not
    spread (MAD 0), has no ceiling and is kept."""
    out = np.array(s, dtype=np.float64, copy=True)
    for row in out.reshape(-1, out.shape[-1]):
        logs = np.log(row[row > 0])
        if logs.size < _MIN_CHANNELS:
            continue
        med = float(np.median(logs))
        mad = float(np.median(np.abs(logs - med)))
        if mad > 0:
            np.minimum(row, math.exp(med + z * _MAD_TO_SD * mad), out=row)
    mean = float(out.mean())
    return out / mean if mean > 0 else out


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


def load_importance(src: str, tensors: dict[str, tuple[int, ...]], progress: Reporter = SILENT,
                    cap: float | None = None) -> Importance:
    """Find, read and check the importance matrix ``src`` against the base's tensors (name → ggml ``ne``);
    ``cap``: the ceiling its values are held under (``--imatrix-cap``)."""
    path = local_path(src, progress)
    imatrix = read_imatrix(path).for_model(tensors)
    return Importance(imatrix, digest_file(path).sha256, cap)


def imatrix_name(rec: dict | None) -> str:
    """A document's ``settings.imatrix`` as a refusal names it: its SHA-256 (and its ceiling, ``--imatrix-cap``),
    or that there was none."""
    if not rec or not rec.get("sha256"):
        return "no importance matrix"
    return f"sha256 {rec['sha256']}" + (f" under --imatrix-cap {rec['cap']:g}" if rec.get("cap") is not None else "")
