"""``mosaic build``: recipe → sources → selection → plan → splice → provenance, atomically.

Everything is written into a hidden temporary sibling of the output folder, which is renamed into
place only when the whole build has been verified; on any error or interrupt it is removed (after a
SIGKILL, the next build removes it). An existing output is replaced only with ``force`` and only
after the new build succeeded. Nothing in the output depends on the time or the machine, so two
builds of one recipe give byte-identical folders.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._build.gguf_plan import GGUFPlan, plan_gguf
from mosaic._build.gguf_write import GGUFWriteResult, read_gguf_ranges, write_gguf
from mosaic._build.layout import BuildPlan, make_plan
from mosaic._build.provenance import build_provenance, write_checked
from mosaic._recipe.exl3_rules import donor_modules, pick, select
from mosaic._build.splice import Flusher, SpliceResult, splice
from mosaic._build.stream import check_markers, read_plan_ranges
from mosaic._provenance.card import render_card
from mosaic._checkpoint.census_exl3 import Analysis, analyze
from mosaic._checkpoint.folder import bulk, open_checkpoint
from mosaic._base.errors import OutputError, SourceError
from mosaic._base.faults import point as fault_point
from mosaic._base.lock import output_lock, pid_alive
from mosaic._sources.gguf import is_gguf_recipe
from mosaic._base.hashing import sha256_bytes
from mosaic._hub.partial import PartialSnapshot
from mosaic._base.progress import SILENT, Reporter
from mosaic._recipe.document import Recipe, load_recipe
from mosaic._provenance.records import CARD_NAME, MANIFEST_NAME, PROVENANCE_NAME, FileRecord, manifest
from mosaic._sources.resolve import CHECKPOINT_FILES, hub_folder, resolve_source

PARTIAL_TAG = ".mosaic-partial-"
#: Room kept free beyond the planned bytes (filesystem metadata, the provenance files).
SPACE_MARGIN = 64 << 20


@dataclass
class BuildResult:
    out_dir: Path
    plan: BuildPlan | GGUFPlan
    provenance: dict
    splice: SpliceResult | GGUFWriteResult
    #: bytes read from the hub by ranges, per streamed source (headers and configs included)
    streamed: dict[str, int] = field(default_factory=dict)

    @property
    def notes(self) -> list[str]:
        """What a user should know about the build that is not a failure."""
        folders = self.plan.recipe.folder_sources()
        if not folders:
            return []
        named = ", ".join(f"{sid}: {path}" for sid, path in folders.items())
        return [
            f"the recipe names folders of this machine ({named}); PROVENANCE.json records them as written. "
            "Sources given as repo + revision (a pinned hub commit) make the recipe portable."
        ]


def _census(sid: str, spec: object, folder: Path, modules: set[str] | None = None, headers_only: bool = False) -> Analysis:
    a = analyze(open_checkpoint(folder, modules=modules, headers_only=headers_only))
    if a.problems:
        more = f" (and {len(a.problems) - 1} more; run `mosaic census {folder}`)" if len(a.problems) > 1 else ""
        raise SourceError(f"source {sid!r} ({spec.describe()}): {a.problems[0]}{more}")  # type: ignore[attr-defined]
    return a


def plan_build(recipe: Recipe, *, streamed: dict[str, PartialSnapshot] | None = None, stream: bool = False,
               jobs: int = 8, progress: Reporter = SILENT) -> BuildPlan:
    """Census the base, apply the rules, census each donor for the modules it supplies, and plan.

    A donor is opened only for the modules it supplies: its other shards and quantization_config.json
    entries play no part in the mosaic. With ``stream``, a hub source that is not in the local cache
    is opened by ranges (headers and small files only) and recorded in ``streamed``."""
    used = {r.donor for r in recipe.rules}
    unused = [d for d in recipe.donors if d not in used]
    if unused:
        raise SourceError(f"{recipe.file}: donors: {', '.join(unused)} is used by no replace rule")
    folders: dict[str, Path] = {}
    remote: set[str] = set()
    for sid, spec in recipe.sources.items():
        if stream and spec.repo is not None:
            # the base's every file goes into the mosaic; a donor gives only tensors and its configs
            folder, snap = hub_folder(spec.repo, spec.revision or "", small=None if sid == "base" else CHECKPOINT_FILES,
                                      jobs=jobs, progress=progress)
            if snap is not None:
                remote.add(sid)
                if streamed is not None:
                    streamed[sid] = snap
            folders[sid] = folder
        else:
            folders[sid] = resolve_source(spec, recipe.folder)
    with bulk():  # local metadata only from here (a streamed source's headers are on disk now)
        base = _census("base", recipe.base, folders["base"], headers_only="base" in remote)
        picks = pick(recipe, base)
        needs = donor_modules(recipe, picks)
        donors = {did: _census(did, spec, folders[did], needs[did], headers_only=did in remote) for did, spec in recipe.donors.items()}
        selection = select(recipe, base, donors, picks)
        return make_plan(recipe, {"base": base, **donors}, selection)


def _verified_digests(recipe: Recipe, streamed: dict[str, PartialSnapshot]) -> dict[str, dict[str, str]]:
    """Digests of hub sources that ``mosaic fetch`` verified and that are unchanged since: those
    files need not be hashed again (only the tensors taken from them are read). For a source read by
    ranges, a file read in part has only the hub's claimed digest: its tensors are hashed as read."""
    out: dict[str, dict[str, str]] = {}
    for sid, spec in recipe.sources.items():
        if sid in streamed:
            out[sid] = streamed[sid].claimed_digests()
        elif spec.repo is not None and spec.revision is not None:
            from mosaic._hub.snapshot import verified_digests

            d = verified_digests(spec.repo, spec.revision)
            if d:
                out[sid] = d
    return out


def clean_stale_partials(out_dir: Path) -> list[Path]:
    """Remove temporary folders left by killed builds of this output.

    A build killed between moving the previous output aside and renaming the new one into place
    leaves the previous output as ``...-previous``: it is put back, not deleted."""
    removed = []
    pat = re.compile(rf"^\.{re.escape(out_dir.name)}{re.escape(PARTIAL_TAG)}(\d+)-([0-9a-f]+|previous)$")
    if not out_dir.parent.is_dir():
        return removed
    for p in sorted(out_dir.parent.iterdir()):
        m = pat.match(p.name)
        if not m or not p.is_dir() or p.is_symlink() or pid_alive(int(m.group(1))):
            continue
        if m.group(2) == "previous" and not out_dir.exists():
            os.rename(p, out_dir)
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Let SIGTERM clean up like Ctrl-C does (only possible on the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _check_space(plan: BuildPlan | GGUFPlan, parent: Path, link: bool) -> None:
    need = plan.bytes_to_write(link) + SPACE_MARGIN
    free = shutil.disk_usage(parent).free
    if free < need:
        raise OutputError(f"{parent}: {free:,} bytes free, the mosaic needs {need:,} (planned exactly, plus margin)")


def _finish(plan: BuildPlan, res: SpliceResult, tmp: Path, durable: Flusher, unverified: dict[str, set[str]] | None = None) -> dict:
    """Write README.md, PROVENANCE.json and the manifest (durable once ``durable`` has been waited
    for, as every other output file); returns the provenance document."""
    doc = build_provenance(plan, res, unverified=unverified)
    card = render_card(doc)
    durable.write(tmp / CARD_NAME, (card,))
    fault_point("card")
    res.files[CARD_NAME] = FileRecord(CARD_NAME, len(card), sha256_bytes(card))
    doc["files"] = [{"name": r.name, "size": r.size, "sha256": r.sha256} for r in sorted(res.files.values(), key=lambda r: r.name)]
    prov = write_checked(doc, tmp / PROVENANCE_NAME, durable)
    fault_point("provenance")
    records = [*res.files.values(), prov]
    durable.write(tmp / MANIFEST_NAME, (manifest(records),))
    fault_point("manifest")
    return doc


def build(
    recipe_path: str | Path | Recipe,
    *,
    out: str | Path | None = None,
    force: bool = False,
    jobs: int | None = None,
    link: bool = False,
    stream: bool = False,
    progress: Reporter = SILENT,
    gguf_keys: dict[str, object] | None = None,
    lock: bool = True,
) -> BuildResult:
    """Build the mosaic a recipe (a file, or one already parsed) describes. ``gguf_keys``: a GGUF mosaic's
    ``mosaic.*`` keys to write instead of this version's (``mosaic rebuild`` of a published one).

    ``<out>.lock`` is held from before the output is looked at until the build has ended (a second build of
    the same output is refused, ``--force`` included, rather than swapping folders with this one).
    ``lock=False``: the caller holds the lock of the output this build is part of (``rebuild`` builds into
    a hidden folder of its own beside the output it holds).

    Raises MosaicError (exit 2) or VerificationError (exit 1)."""
    recipe = recipe_path if isinstance(recipe_path, Recipe) else load_recipe(recipe_path)
    out_dir = Path(out).absolute() if out is not None else recipe.output_path()
    jobs = jobs or os.cpu_count() or 1
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{parent}: cannot create the output's parent folder: {e.strerror or e}") from None
    if not os.access(parent, os.W_OK):
        raise OutputError(f"{parent}: not writable")
    with output_lock(out_dir, "mosaic build") if lock else nullcontext():
        return _build(recipe, out_dir, force=force, jobs=jobs, link=link, stream=stream, progress=progress,
                      gguf_keys=gguf_keys)


def _build(recipe: Recipe, out_dir: Path, *, force: bool, jobs: int, link: bool, stream: bool, progress: Reporter,
           gguf_keys: dict[str, object] | None) -> BuildResult:
    parent = out_dir.parent
    if out_dir.exists() and not force:
        raise OutputError(f"{out_dir}: already exists; pass --force to replace it after a successful build")
    if out_dir.is_symlink():
        raise OutputError(f"{out_dir}: is a symbolic link; refusing to build through it")
    clean_stale_partials(out_dir)

    # A recipe whose base is a GGUF model builds a GGUF mosaic (mosaic._build.gguf_plan / gguf_write).
    gguf = is_gguf_recipe(recipe)
    streamed: dict[str, PartialSnapshot] = {}
    if gguf:
        plan = plan_gguf(recipe, ranges=streamed if stream else None, keys=gguf_keys)
    else:
        plan = plan_build(recipe, streamed=streamed, stream=stream, jobs=max(jobs, 8), progress=progress)
    fault_point("plan")
    if not gguf:
        # The layout is the last reader of the parsed quantization_config.json documents (its output
        # bytes are in plan.generated): release them before the splice and PROVENANCE.json, where the
        # build's memory peaks (about 90 MiB at GLM-5.3-Flash's 38,000 entries).
        for a in plan.sources.values():
            a.ckpt.qconfig = None
    roots = plan.source_roots if gguf else [a.ckpt.root for a in plan.sources.values()]
    sources_resolved = {str(r): r.resolve() for r in roots}
    o = out_dir.resolve()
    if any(o == r or o in r.parents or r in o.parents for r in sources_resolved.values()):
        raise OutputError(f"{out_dir}: is, contains or lies inside a source folder; choose another output")
    _check_space(plan, parent, link)

    tmp = parent / f".{out_dir.name}{PARTIAL_TAG}{os.getpid()}-{os.urandom(4).hex()}"
    tmp.mkdir()
    old: Path | None = None
    durable = Flusher()  # every output file is fsynced before the folder is renamed into place
    try:
        with _sigterm_as_interrupt():
            if gguf:
                if streamed:
                    read_gguf_ranges(plan, streamed, jobs=max(jobs, 8), progress=progress)
                res, doc = write_gguf(plan, tmp, jobs=jobs, progress=progress, durable=durable, streamed=streamed)
            else:
                if streamed:
                    read_plan_ranges(plan, streamed, jobs=max(jobs, 8), progress=progress)
                    check_markers(plan, streamed)
                # no hub traffic from here on: the collector stays paused while 151,000 digests and
                # records are made (each full collection would walk the whole plan again)
                with bulk():
                    res = splice(plan, tmp, jobs=jobs, link=link, progress=progress, known=_verified_digests(recipe, streamed),
                                 durable=durable)
                    doc = _finish(plan, res, tmp, durable, unverified={sid: set(s.unverified()) for sid, s in streamed.items()})
            durable.wait()
            fsync_dir(tmp)
            fault_point("rename")
            if out_dir.exists():
                old = parent / f".{out_dir.name}{PARTIAL_TAG}{os.getpid()}-previous"
                os.rename(out_dir, old)
                fault_point("swap")
            os.rename(tmp, out_dir)
            fsync_dir(parent)
    except BaseException:
        durable.abandon()
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists():
            os.rename(old, out_dir)
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return BuildResult(out_dir, plan, doc, res, {sid: snap.reader.bytes_read for sid, snap in streamed.items()})


def fsync_dir(path: Path) -> None:
    """Make a folder's entries durable (after a rename into it); a folder that cannot be opened is left."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
