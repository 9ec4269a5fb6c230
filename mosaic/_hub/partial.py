"""A hub snapshot read in part: the commit's files at full size, holding only the byte ranges read.

``mosaic plan`` needs a checkpoint's headers and configs, not its 100 GB of tensors; a build needs
the tensors it takes, not the donor's other layers. This module keeps what was read of a pinned
commit in mosaic's cache beside huggingface_hub's, ``$HF_HOME/mosaic/ranges/<org>/<name>/<commit>/``:

- ``files/<name>``: each file at its full size, sparse, with only the ranges read written in; the
  folder reads like a snapshot, so the strict readers and the build use it unchanged;
- ``ranges/<name>.json``: the ranges present, each with the SHA-256 of its bytes, recorded only after
  the range is on disk (fsync), so an interrupted read leaves nothing half-recorded and a re-run
  reads only what is missing; ranges reused are hashed again and compared before anyone uses them;
- ``listing.json``: the hub's listing of the commit (sizes, LFS SHA-256, git blob ids).

Small files (configs, index, tokenizer) are read whole and checked against the hub's own digest. A
shard read whole is checked against its LFS SHA-256 and marked verified. A shard read in part cannot
be checked against anything the hub publishes: :meth:`PartialSnapshot.unverified` names those files,
and PROVENANCE.json says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mosaic._base.errors import VerificationError
from mosaic._base.hashing import parallel_map
from mosaic._base.progress import SILENT, Reporter
from mosaic._formats.gguf_container import GGUFError, GGUFFile, parse_gguf_header
from mosaic._formats.safetensors_reader import MAX_HEADER_SIZE
from mosaic._hub.ranges import RangeReader
from mosaic._hub.snapshot import HubFile, digest_local, hf_constants, hub_listing, matches_hub, require_pinned

#: A range is fetched and recorded in pieces of at most this size: the unit of resume and of parallelism.
PIECE = 64 << 20
#: The first read of a safetensors shard; almost every header fits (the rest is read when it does not).
HEADER_PROBE = 100_000
#: The first read of a GGUF header (the rest is read as the parse asks for it).
GGUF_FIRST_READ = 1 << 20
SHARD_SUFFIX = ".safetensors"


def ranges_root() -> Path:
    return Path(hf_constants().HF_HOME) / "mosaic" / "ranges"


@dataclass(frozen=True)
class Piece:
    start: int
    end: int
    sha256: str


def _subtract(wanted: list[tuple[int, int]], have: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``wanted`` not covered by ``have`` (both half-open), merged and sorted."""
    out: list[tuple[int, int]] = []
    covered = sorted(have)
    for a, b in sorted(wanted):
        pos = a
        for c, d in covered:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
            if pos >= b:
                break
        if pos < b:
            out.append((pos, b))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(out):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _pieces(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(s, min(s + PIECE, b)) for a, b in ranges for s in range(a, b, PIECE)]


class PartialSnapshot:
    """What has been read of ``repo@revision``, and the means to read more."""

    def __init__(self, repo: str, revision: str, *, reader: RangeReader | None = None, root: Path | None = None) -> None:
        self.repo = repo
        self.revision = require_pinned(repo, revision)
        org, name = repo.split("/", 1)
        self.root = (root or ranges_root()) / org / name / revision
        self.folder = self.root / "files"
        self.reader = reader or RangeReader(repo, revision)
        self._lock = threading.Lock()
        self._listing: dict[str, HubFile] | None = None

    # --- the hub's listing --------------------------------------------------------------------------
    @property
    def listing(self) -> dict[str, HubFile]:
        """The commit's files; read from the hub once, then from the cache (a commit never changes)."""
        if self._listing is None:
            path = self.root / "listing.json"
            try:
                doc = json.loads(path.read_text())
                self._listing = {n: HubFile(n, int(e["size"]), str(e["blob_id"]), e.get("lfs_sha256")) for n, e in doc.items()}
            except (OSError, ValueError, KeyError, TypeError):
                self._listing = hub_listing(self.repo, self.revision)
                self.root.mkdir(parents=True, exist_ok=True)
                atomic_write(path, json.dumps({n: f.as_json() for n, f in sorted(self._listing.items())}, indent=1).encode())
        return self._listing

    def file(self, name: str) -> HubFile:
        f = self.listing.get(name)
        if f is None:
            raise VerificationError(f"{self.repo}@{self.revision}: {name}: not in the commit's listing")
        return f

    # --- the record of what is present -------------------------------------------------------------
    def _record_path(self, name: str) -> Path:
        return self.root / "ranges" / f"{name}.json"

    def _record(self, name: str) -> dict:
        f = self.file(name)
        try:
            doc = json.loads(self._record_path(name).read_text())
            if doc.get("size") == f.size and (self.folder / name).stat().st_size == f.size:
                return doc
        except (OSError, ValueError, AttributeError):
            pass
        return {"size": f.size, "pieces": [], "verified": None}

    def _save(self, name: str, doc: dict) -> None:
        path = self._record_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(doc, sort_keys=True).encode())

    def pieces(self, name: str) -> list[Piece]:
        return [Piece(a, b, s) for a, b, s in self._record(name)["pieces"]]

    def is_verified(self, name: str) -> bool:
        return self._record(name).get("verified") is not None

    def unverified(self) -> list[str]:
        """Files present only in part: their whole-file digest is the hub's claim, not checked here."""
        return sorted(n for n in self.listing if (self.folder / n).exists() and not self.is_verified(n))

    def claimed_digests(self) -> dict[str, str]:
        """Each present file's SHA-256: checked for files read whole, the hub's claim for the others."""
        out = {}
        for n, f in self.listing.items():
            if (self.folder / n).exists():
                rec = self._record(n)
                out[n] = rec["verified"] or f.lfs_sha256 or ""
        return {n: d for n, d in out.items() if d}

    # --- reading ------------------------------------------------------------------------------------
    def _prepare(self, name: str) -> Path:
        f = self.file(name)
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.stat().st_size != f.size:
            with open(path, "wb") as fh:
                fh.truncate(f.size)
            self._save(name, {"size": f.size, "pieces": [], "verified": None})
        return path

    def _fetch_piece(self, name: str, start: int, end: int, advance) -> None:  # type: ignore[no-untyped-def]
        f = self.file(name)
        path = self.folder / name
        h = hashlib.sha256()
        fd = os.open(path, os.O_WRONLY)
        try:
            pos = [start]

            def sink(data: bytes) -> None:
                view = memoryview(data)
                while view:  # a short write must not leave zeros behind a digest of the full data
                    n = os.pwrite(fd, view, pos[0])
                    pos[0] += n
                    view = view[n:]
                h.update(data)
                advance(len(data))

            self.reader.read(f, start, end, sink)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        with self._lock:
            rec = self._record(name)
            rec["pieces"].append([start, end, h.hexdigest()])
            rec["pieces"].sort()
            self._save(name, rec)

    def _check_present(self, name: str, wanted: list[tuple[int, int]]) -> None:
        """Hash again every recorded piece that ``wanted`` reuses: a damaged cache is read again, never used."""
        path = self.folder / name
        bad = []
        for p in self.pieces(name):
            if not any(a < p.end and p.start < b for a, b in wanted):
                continue
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                fh.seek(p.start)
                left = p.end - p.start
                while left:
                    chunk = fh.read(min(left, 8 << 20))
                    if not chunk:
                        break
                    h.update(chunk)
                    left -= len(chunk)
            if left or h.hexdigest() != p.sha256:
                bad.append(p)
        if bad:
            with self._lock:
                rec = self._record(name)
                drop = {(p.start, p.end) for p in bad}
                rec["pieces"] = [x for x in rec["pieces"] if (x[0], x[1]) not in drop]
                rec["verified"] = None
                self._save(name, rec)

    def ensure(self, wanted: dict[str, list[tuple[int, int]]], *, jobs: int = 8, progress: Reporter = SILENT) -> int:
        """Make every wanted range present (reading only what is missing); verify files now complete.

        Returns the bytes read from the hub."""
        before = self.reader.bytes_read
        todo: list[tuple[str, int, int]] = []
        for name, ranges in sorted(wanted.items()):
            ranges = [(a, b) for a, b in ranges if b > a]
            if not ranges:
                continue
            self._prepare(name)
            self._check_present(name, ranges)
            have = [(p.start, p.end) for p in self.pieces(name)]
            todo += [(name, a, b) for a, b in _pieces(_subtract(ranges, have))]
        advance = progress.step(f"reading {self.repo} by ranges", sum(b - a for _, a, b in todo))
        parallel_map(lambda t: self._fetch_piece(t[0], t[1], t[2], advance), todo, jobs)
        for name in sorted(wanted):
            if wanted[name]:
                self._verify_if_complete(name)
        return self.reader.bytes_read - before

    def _verify_if_complete(self, name: str) -> None:
        f = self.file(name)
        rec = self._record(name)
        if rec["verified"] is not None or _subtract([(0, f.size)], [(a, b) for a, b, _ in rec["pieces"]]):
            return
        if f.size == 0:
            self._prepare(name)
        local = digest_local(self.folder / name)
        if not matches_hub(f, local):
            self.discard(name)
            raise VerificationError(
                f"{self.repo}@{self.revision}: {name}: the bytes read do not match the hub's digest {f.digest} "
                f"(read sha256 {local.sha256}); discarded, nothing was used"
            )
        rec["verified"] = local.sha256
        self._save(name, rec)

    def discard(self, name: str) -> None:
        for p in (self.folder / name, self._record_path(name)):
            p.unlink(missing_ok=True)

    def read_whole(self, names: Iterable[str], *, jobs: int = 8, progress: Reporter = SILENT) -> int:
        """Read files whole (configs, index, tokenizer, untouched shards), each checked against the hub."""
        return self.ensure({n: [(0, self.file(n).size)] for n in names if self.file(n).size}, jobs=jobs, progress=progress) + \
            sum(self._empty(n) for n in names if not self.file(n).size)

    def _empty(self, name: str) -> int:
        self._prepare(name)
        self._verify_if_complete(name)
        return 0

    def read_headers(self, shards: Iterable[str], *, jobs: int = 8, progress: Reporter = SILENT) -> int:
        """Read each shard's safetensors header (8-byte length, then the JSON), nothing of its tensors."""
        shards = sorted(shards)
        got = self.ensure({n: [(0, min(HEADER_PROBE, self.file(n).size))] for n in shards}, jobs=jobs, progress=progress)
        rest: dict[str, list[tuple[int, int]]] = {}
        for n in shards:
            size = self.file(n).size
            if size < 8:
                continue
            with open(self.folder / n, "rb") as fh:
                length = int.from_bytes(fh.read(8), "little")
            # the strict reader names a header longer than its file or than safetensors allows; never read past that
            end = min(8 + length, size, 8 + MAX_HEADER_SIZE)
            if end > HEADER_PROBE:
                rest[n] = [(HEADER_PROBE, end)]
        return got + (self.ensure(rest, jobs=jobs, progress=progress) if rest else 0)

    def read_gguf(self, name: str, *, progress: Reporter = SILENT) -> GGUFFile:
        """A GGUF file's header, strictly parsed, read by ranges: a first MiB, then what the parse says it
        needs (a large vocabulary's header is several MB), growing by half at least each time."""
        size = self.file(name).size
        want = min(size, GGUF_FIRST_READ)
        while True:
            self.ensure({name: [(0, want)]}, progress=progress)
            with open(self.folder / name, "rb") as fh:
                data = fh.read(want)
            try:
                return parse_gguf_header(self.folder / name, data, size)
            except GGUFError as e:
                if e.rule != "truncated" or e.need is None or want >= size:
                    raise
                want = min(size, max(e.need + 4096, want + want // 2))

    def prepare(self, names: Iterable[str]) -> None:
        """Full-size sparse files for ``names`` (nothing read), so the folder lists them as a snapshot would."""
        for n in names:
            self._prepare(n)

    def open_for_reading(self, *, small: Iterable[str] | None = None, jobs: int = 8, progress: Reporter = SILENT) -> int:
        """Everything the strict checkpoint reader opens: the small files (all non-shard files of the
        commit but hidden ones, or those named) read whole, and every shard's header."""
        names = [n for n in self.listing if not any(part.startswith(".") for part in n.split("/"))]
        shards = [n for n in names if n.endswith(SHARD_SUFFIX)]
        wanted_small = [n for n in names if not n.endswith(SHARD_SUFFIX) and (small is None or n in set(small))]
        return self.read_whole(wanted_small, jobs=jobs, progress=progress) + self.read_headers(shards, jobs=jobs, progress=progress)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary sibling, fsynced, renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
