"""Executing a plan: digests of the sources, streaming copies into the output, and a read-back check.

Three steps, each streaming in bounded chunks and running several files at once (``jobs``):

1. every source file the plan uses is read once, giving its SHA-256 and each of its tensors' SHA-256
   (a base file copied whole into an untouched shard is read in step 3 instead, beside its copy);
2. each output shard is written: untouched shards whole (kernel copy, or a hard link with ``link``),
   spliced shards as header + byte ranges copied from base and donors (kernel copy where possible);
3. every written file is read back from disk: its size must equal the plan and the digest of every
   tensor's written bytes must equal the digest of its source range. An untouched shard is checked by
   its whole-file digest, or compared byte for byte with its base file when step 1 did not read that
   (one SHA-256 pass over its bytes instead of two); a hard-linked one is the source file itself, so
   it is not read again.

What is checked is recorded as ``checks`` for PROVENANCE.json. A mismatch raises
:class:`~mosaic._base.errors.VerificationError`; sources are only ever opened read-only.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

from mosaic._build import digest_cache
from mosaic._build.layout import BuildPlan, ShardPlan
from mosaic._build.metadata import SplicedText
from mosaic._base.errors import VerificationError
from mosaic._base.faults import point as fault_point
from mosaic._formats.safetensors_writer import copy_range, write_shard
from mosaic._base.hashing import digest_file, digest_ranges, parallel_map, scratch
from mosaic._base.progress import SILENT, Reporter
from mosaic._provenance.records import FileRecord


@dataclass
class SourceFile:
    """A source file's digest and, for shards, each tensor's digest."""

    record: FileRecord
    tensors: dict[str, str] = field(default_factory=dict)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class SpliceResult:
    sources: dict[str, dict[str, SourceFile]]  # source id -> logical name -> digests
    files: dict[str, FileRecord]  # output name -> record (shards, carried and generated files)
    tensors: dict[str, str]  # output tensor name -> digest of its written bytes
    methods: dict[str, str]  # shard name -> how it was written
    checks: list[Check]


class Flusher:
    """Makes written files durable on a thread of its own while the build goes on.

    A file's fsync waits for the disk; the build's next step, reading the file back and hashing
    it, needs only the page cache. So each written file's descriptor is handed here (a duplicate
    of the one that wrote it, so that a write-back error is reported to it) and fsynced in the
    background, in order, while the hashing runs: the disk's time then overlaps the hashing's
    instead of adding to it. :meth:`wait` comes before the output is renamed into place and
    raises the first failure; :meth:`abandon` (a failed build) closes what was not synced."""

    #: Descriptors waiting for their fsync at most: a build of thousands of files stays far from the
    #: process's limit of open files.
    MAX_WAITING = 64

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mosaic-fsync")
        self._pending: list[tuple[int, Future[None]]] = []
        self._lock = threading.Lock()
        self._done = 0  # the pending fsyncs before this index have been waited for
        self._abandoned = False

    def take(self, fd: int) -> None:
        """Own ``fd``: fsync it, then close it (after the oldest when too many are waiting).

        Once queued, only the fsync thread, or :meth:`abandon` for one that never started, closes it:
        a descriptor closed twice could be another file's by then."""
        with self._lock:
            if self._abandoned:  # a failed build: its files will not be published, this one is closed
                os.close(fd)
                raise RuntimeError("the build was abandoned; its files are no longer synced")
            future = self._pool.submit(_fsync_close, fd)
            self._pending.append((fd, future))
            while len(self._pending) - self._done > self.MAX_WAITING:
                self._pending[self._done][1].result()
                self._done += 1

    def write(self, path: Path, chunks: Iterable[bytes]) -> tuple[int, str]:
        """Write a new file from ``chunks`` and hand it over; its size and SHA-256 as written."""
        h = hashlib.sha256()
        size = 0
        with open(path, "xb") as fo:
            for chunk in chunks:
                fo.write(chunk)
                h.update(chunk)
                size += len(chunk)
            fo.flush()
            self.take(os.dup(fo.fileno()))
        return size, h.hexdigest()

    def wait(self) -> None:
        try:
            for _, f in self._pending:
                f.result()
        finally:
            self.abandon()
        self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """Close the descriptors whose fsync has not started; one running finishes on its own
        (the caller removes the files meanwhile, and a second Ctrl-C is not kept waiting)."""
        with self._lock:
            self._abandoned = True
            for fd, f in self._pending:
                if f.cancel():
                    os.close(fd)
            self._pending = []
            self._done = 0
        self._pool.shutdown(wait=False)


@contextmanager
def durable_files(durable: Flusher | None) -> Iterator[Flusher]:
    """The caller's flusher (the caller waits for it), or one of its own: waited for when the block
    ends, so that every file handed to it is durable then, and abandoned when the block fails."""
    if durable is not None:
        yield durable
        return
    own = Flusher()
    try:
        yield own
    except BaseException:
        own.abandon()
        raise
    own.wait()


def _fsync_close(fd: int) -> None:
    try:
        fault_point("fsync")
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_whole(src: Path, dst: Path, durable: Flusher) -> str:
    size = src.stat().st_size
    buf = scratch("copy")[0]
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        method = copy_range(fi.fileno(), fo.fileno(), size, 0, 0, buf=buf) if size else "kernel"
        durable.take(os.dup(fo.fileno()))
    return method


def _link_or_copy(src: Path, dst: Path, durable: Flusher) -> str:
    try:
        os.link(src, dst)
        return "link"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    return _copy_whole(src, dst, durable)


def _used_tensors(plan: BuildPlan) -> dict[tuple[str, str], set[str]]:
    """Per source file, the tensors whose digests the verification needs."""
    used: dict[tuple[str, str], set[str]] = {}
    for shard in plan.shards:
        for t in shard.tensors:
            used.setdefault((t.source, t.source_file), set()).add(t.name)
    return used


def _untouched(plan: BuildPlan) -> set[str]:
    return {s.name for s in plan.shards if s.untouched}


def _compared_copies(plan: BuildPlan) -> set[str]:
    """Untouched shards whose source file gives nothing to any other output shard: a copy of one
    is checked against the base file byte for byte, and its digests are the base file's."""
    drawn: set[str] = set()  # base files the spliced shards take tensors from
    for shard in plan.shards:
        if not shard.untouched:
            drawn.update(f for s, f in set(zip(map(_SOURCE, shard.tensors), map(_SOURCE_FILE, shard.tensors))) if s == "base")
    return {name for name in _untouched(plan) if name not in drawn}


_SOURCE = attrgetter("source")
_SOURCE_FILE = attrgetter("source_file")


def digest_sources(
    plan: BuildPlan,
    jobs: int,
    progress: Reporter = SILENT,
    known: dict[str, dict[str, str]] | None = None,
    skip: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict[str, dict[str, SourceFile]]:
    """Step 1: the digest of every source file the plan uses, and of each tensor it takes from it.

    A file is read once, both digests together. A file whose digest is already known — verified
    when it was downloaded (``known``), or computed by an earlier build and unchanged since (the
    digest cache) — is not hashed whole again: only tensors whose digests are not known yet are read.
    Known digests are still checked: every copy is read back and compared with them. Base files in
    ``skip`` whose digests are not known are not read here: their copies are compared with them (step 3)."""
    known = known or {}
    used = _used_tensors(plan)
    work: list[tuple[str, str]] = [(sid, name) for sid, names in plan.used_files.items() for name in names]
    trusted: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}
    for sid, name in work:
        if name not in plan.sources[sid].ckpt.headers:
            continue  # configs, index, tokenizer: small, and not all are copied back to be compared: hash them
        path = plan.sources[sid].ckpt.root / name
        entry = digest_cache.lookup(path)
        if name in known.get(sid, {}):
            sha = known[sid][name]
            tensors = entry.tensors if entry is not None and entry.sha256 == sha else {}
            trusted[(sid, name)] = (sha, tensors)
        elif entry is not None:
            trusted[(sid, name)] = (entry.sha256, entry.tensors)
    # an untouched shard whose digest is trusted needs no read here: its copy is read back (and
    # compared with that digest) once, which gives its tensors' digests too
    for name in _untouched(plan):
        if ("base", name) in trusted:
            used.pop(("base", name), None)
        elif name in skip:
            used.pop(("base", name), None)
            work.remove(("base", name))

    def missing(item: tuple[str, str]) -> list[str]:
        have = trusted[item][1] if item in trusted else {}
        return [n for n in used.get(item, ()) if n not in have]

    def cost(item: tuple[str, str]) -> int:
        sid, name = item
        ck = plan.sources[sid].ckpt
        if item in trusted and name in ck.headers:
            return sum(ck.tensor(n).nbytes for n in missing(item))
        return (ck.root / name).stat().st_size

    advance = progress.step("hashing sources", sum(cost(w) for w in work))

    def one(item: tuple[str, str]) -> tuple[str, str, SourceFile]:
        sid, name = item
        ck = plan.sources[sid].ckpt
        path = ck.root / name
        h = ck.headers.get(name)
        names = sorted(used.get(item, ()), key=lambda n: h[n].begin) if h else []
        before = digest_cache.identity(path)
        if item in trusted and (h is not None or not names):
            sha, have = trusted[item]
            todo = missing(item)
            fresh = dict(zip(todo, digest_ranges(path, [h.file_range(n) for n in todo], on_bytes=advance))) if todo else {}
            if fresh:
                digest_cache.store(path, sha, fresh, identity_before=before)
            size = h.file_size if h is not None else path.stat().st_size
            record = FileRecord(name, size, sha)
            tensors = {n: fresh[n] if n in fresh else have[n] for n in names}
        else:
            d = digest_file(path, [h.file_range(n) for n in names] if h else [], on_bytes=advance)
            if h is not None and d.size != h.file_size:
                raise VerificationError(f"source {sid!r}: {name} changed size while the build ran ({h.file_size} -> {d.size})")
            tensors = dict(zip(names, d.ranges))
            record = FileRecord(name, d.size, d.sha256)
            if h is not None:
                digest_cache.store(path, d.sha256, tensors, identity_before=before)
        fault_point("source")
        return sid, name, SourceFile(record, tensors)

    out: dict[str, dict[str, SourceFile]] = {sid: {} for sid in plan.used_files}
    for sid, name, sf in parallel_map(one, work, jobs):
        out[sid][name] = sf
    return out


def _verify_copy(shard: ShardPlan, path: Path, advance: Callable[[int], None], before: list[int] | None) -> tuple[FileRecord, dict[str, str], list[str]]:
    """Step 3 for an untouched shard whose base file step 1 did not read: the copy is read back
    beside the base file and compared with it byte for byte; its digests, file and tensors, are
    then the base file's (and are remembered for it in the digest cache)."""
    assert shard.copy_of is not None
    size = path.stat().st_size
    # a base file that changed size since it was planned: its copy is not read by the planned tensor ranges
    ranges = [(t.offset, t.offset + t.nbytes) for t in shard.tensors] if size == shard.size else []
    d = digest_file(path, ranges, on_bytes=advance, same_as=shard.copy_of)
    problems = []
    if d.size != shard.size:
        problems.append(f"{shard.name}: {d.size} bytes written, {shard.size} planned")
    if not d.same:
        problems.append(f"{shard.name}: copy differs from the base file")
    tensors = dict(zip([t.name for t in shard.tensors], d.ranges)) if ranges else {}
    if not problems:
        digest_cache.store(shard.copy_of, d.sha256, tensors, identity_before=before)
    return FileRecord(shard.name, d.size, d.sha256), tensors, problems


def _verify_shard(shard: ShardPlan, path: Path, sources: dict[str, dict[str, SourceFile]], advance: Callable[[int], None]) -> tuple[FileRecord, dict[str, str], list[str]]:
    """Step 3 for one shard: read it back; compare size and every tensor with its source digest."""
    problems: list[str] = []
    if shard.untouched:
        src = sources["base"][shard.name]
        have_tensors = len(src.tensors) == len(shard.tensors)
        if have_tensors and path.stat().st_ino == os.stat(shard.copy_of).st_ino:  # type: ignore[arg-type]
            advance(shard.size)  # a hard link: the very file whose digests step 1 computed
            return FileRecord(shard.name, src.record.size, src.record.sha256), dict(src.tensors), problems
        ranges = [] if have_tensors else [(t.offset, t.offset + t.nbytes) for t in shard.tensors]
        d = digest_file(path, ranges, on_bytes=advance)
        if d.size != shard.size:
            problems.append(f"{shard.name}: {d.size} bytes written, {shard.size} planned")
        if d.sha256 != src.record.sha256:
            problems.append(f"{shard.name}: copy differs from the base file")
        tensors = dict(src.tensors) if have_tensors else {t.name: g for t, g in zip(shard.tensors, d.ranges)}
        return FileRecord(shard.name, d.size, d.sha256), tensors, problems
    ranges = [(t.offset, t.offset + t.nbytes) for t in shard.tensors]
    d = digest_file(path, ranges, on_bytes=advance)
    if d.size != shard.size:
        problems.append(f"{shard.name}: {d.size} bytes written, {shard.size} planned")
    digests: dict[str, str] = {}
    for t, got in zip(shard.tensors, d.ranges):
        want = sources[t.source][t.source_file].tensors[t.name]
        digests[t.name] = got
        if got != want:
            problems.append(f"{shard.name}: tensor {t.name!r} differs from its source ({t.source}: {t.source_file})")
    return FileRecord(shard.name, d.size, d.sha256), digests, problems


def splice(
    plan: BuildPlan,
    out_dir: Path,
    *,
    jobs: int = 1,
    link: bool = False,
    progress: Reporter = SILENT,
    known: dict[str, dict[str, str]] | None = None,
    durable: Flusher | None = None,
) -> SpliceResult:
    """Steps 1-3 into the (new, empty) folder ``out_dir``. Written files are fsynced while the next
    are written and read back: by ``durable``, which the caller waits for before publishing the
    folder, or by a flusher of this call's own, waited for before it returns.

    An untouched shard that is copied (not linked) is not hashed in step 1: its copy is compared
    with the base file byte for byte in step 3 and hashed there once, which spares one SHA-256
    pass over its bytes."""
    with durable_files(durable) as flusher:
        return _splice(plan, out_dir, jobs, link, progress, known, flusher)


def _splice(plan: BuildPlan, out_dir: Path, jobs: int, link: bool, progress: Reporter,
            known: dict[str, dict[str, str]] | None, durable: Flusher) -> SpliceResult:
    compared = set() if link else _compared_copies(plan)
    sources = digest_sources(plan, jobs, progress, known, skip=compared)
    compared = {n for n in compared if n not in sources["base"]}
    write_total = plan.bytes_to_write(link)
    adv_write = progress.step("writing", write_total)
    adv_verify = progress.step("verifying", plan.shard_bytes + sum(f.size for f in plan.carried))
    methods: dict[str, str] = {}
    lock = threading.Lock()

    def write_one(shard: ShardPlan) -> tuple[FileRecord, dict[str, str], list[str]]:
        dst = out_dir / shard.name
        before = digest_cache.identity(shard.copy_of) if shard.name in compared else None  # type: ignore[arg-type]
        if shard.untouched:
            assert shard.copy_of is not None
            m = _link_or_copy(shard.copy_of, dst, durable) if link else _copy_whole(shard.copy_of, dst, durable)
            if m != "link":
                adv_write(shard.size)
        else:
            assert shard.layout is not None
            ms = write_shard(shard.layout, dst, on_bytes=adv_write, hand_off=durable.take)
            adv_write(len(shard.layout.header))
            m = "+".join(sorted(ms)) or "header only"
        with lock:
            methods[shard.name] = m
        fault_point("written")
        if shard.name in compared:
            out = _verify_copy(shard, dst, adv_verify, before)
        else:
            out = _verify_shard(shard, dst, sources, adv_verify)
        fault_point("verified")
        return out

    results = parallel_map(write_one, plan.shards, jobs)
    files: dict[str, FileRecord] = {}
    tensors: dict[str, str] = {}
    problems: list[str] = []
    for shard, (rec, digests, probs) in zip(plan.shards, results):
        files[shard.name] = rec
        tensors.update(digests)
        problems += probs
        if shard.name in compared:  # the base file's digests are its identical copy's
            sources["base"][shard.name] = SourceFile(FileRecord(shard.name, rec.size, rec.sha256), dict(digests))

    for f in plan.carried:
        dst = out_dir / f.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        _copy_whole(f.path, dst, durable)
        adv_write(f.size)
        d = digest_file(dst, on_bytes=adv_verify)
        src = sources["base"][f.name].record
        if (d.size, d.sha256) != (src.size, src.sha256):
            problems.append(f"{f.name}: copy differs from the base file")
        files[f.name] = FileRecord(f.name, d.size, d.sha256)
        fault_point("carried")

    for name, data in plan.generated.items():
        dst = out_dir / name
        durable.write(dst, data.chunks() if isinstance(data, SplicedText) else (data,))
        adv_write(len(data))
        fault_point("metadata")
        d = digest_file(dst)
        if d.size != len(data):
            problems.append(f"{name}: {d.size} bytes written, {len(data)} planned")
        files[name] = FileRecord(name, d.size, d.sha256)

    n_spliced = sum(1 for s in plan.shards if not s.untouched)
    n_tensors = sum(len(s.tensors) for s in plan.shards)
    n_donor = sum(1 for s in plan.shards for t in s.tensors if t.source != "base")
    size_ok = not any("planned" in p for p in problems)
    tensors_ok = not any("tensor" in p or "differs" in p for p in problems)
    checks = [
        Check("sizes_as_planned", size_ok, f"{len(files)} files; shards {plan.shard_bytes} bytes as planned before writing"),
        Check(
            "tensors_equal_sources",
            tensors_ok,
            f"{n_tensors} tensors read back from the written files; digest of each equals the digest of its source range "
            f"({n_donor} from donors, {n_tensors - n_donor} from the base)",
        ),
        Check(
            "untouched_shards_identical",
            not any("copy differs" in p for p in problems),
            f"{len(plan.shards) - n_spliced} untouched shard(s) and {len(plan.carried)} carried file(s) byte-identical to the base",
        ),
    ]
    if problems:
        raise VerificationError("build verification failed: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    return SpliceResult(sources, files, tensors, methods, checks)
