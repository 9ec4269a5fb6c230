"""The public functions: one per command, each the whole command as ``mosaic <verb>`` runs it.

The command line is a thin layer over exactly these (flags become keyword arguments, ``--json`` prints
``result.as_dict()``); a release script calls them directly. Each imports its wing only when called, so
``import mosaic`` stays cheap. Failures follow one rule: bad input raises :class:`~mosaic.MosaicError`
(an :class:`OSError` arrives as :class:`~mosaic.HostError`, chained), a command whose own verification
fails raises :class:`~mosaic.VerificationError` and keeps nothing, and ``audit`` and ``census`` report a
failed check in their result (``.ok``) rather than raising. Nothing is printed unless ``progress`` asks:
``True`` draws progress bars on stderr, a :class:`~mosaic.Reporter` receives the counts instead.

The examples run offline, on the synthetic models of :mod:`mosaic.testing`; the hub's examples on
:class:`mosaic.testing.hub.FakeHub`, reached through ``HF_ENDPOINT`` as the real hub would be.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from mosaic._api.results import (
    AuditFailure,
    AuditResult,
    BuildResult,
    CensusResult,
    CheckOutcome,
    EvalResult,
    ExportResult,
    FetchResult,
    FolderAudit,
    LadderResult,
    MeasureResult,
    PlanResult,
    PublishResult,
    RebuildResult,
    SignResult,
)
from mosaic._base.errors import HostError, MosaicError
from mosaic._base.progress import SILENT, Reporter, reporter
from mosaic._recipe.document import Recipe

if TYPE_CHECKING:  # only private helpers' annotations
    from mosaic._audit.report import AuditReport
    from mosaic._sources.rung_set import RungSet

PathLike = str | os.PathLike[str]
#: ``False``: silent; ``True``: progress bars on stderr; a Reporter: the counts go to it.
Progress = bool | Reporter
#: Donors in their order: ``{"q3": "org/name@<commit>", ...}``, ``[("q3", "path/to/folder"), ...]`` or, as on the
#: command line, ``["q3=path/to/folder", ...]``.
Donors = Mapping[str, PathLike] | Sequence[tuple[str, PathLike] | str]

P = ParamSpec("P")
R = TypeVar("R")


def _host_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """An OSError raised inside a command reaches the caller as HostError, with the command line's message."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except MosaicError:
            raise
        except OSError as e:
            raise HostError.wrap(e) from e

    return wrapper


_ALLOCATOR_SET = False


@contextmanager
def _running(progress: Progress, unit: str = "bytes") -> Iterator[Reporter]:
    """A streaming command's setting-up: the reporter it was asked for, and (once per process) the allocator
    told to give freed buffers back, as the command line does, so that memory stays bounded here too
    (:func:`mosaic._base.hashing.return_freed_buffers`)."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        from mosaic._base.hashing import return_freed_buffers

        return_freed_buffers()
        _ALLOCATOR_SET = True
    if isinstance(progress, Reporter):
        yield progress
    elif progress:
        with reporter(True, unit=unit) as r:
            yield r
    else:
        yield SILENT


def _metadata_stage() -> AbstractContextManager[None]:
    """Python's cyclic collector paused: a command over a 150,000-tensor checkpoint makes millions of acyclic
    objects, and every full collection would walk them all again (:func:`mosaic._checkpoint.folder.bulk`)."""
    from mosaic._checkpoint.folder import bulk

    return bulk()


def _donor_list(donors: Donors) -> list[tuple[str, str]]:
    from mosaic._plan.planner import donor_pair, parse_donor_arg

    if isinstance(donors, str):
        donors = [donors]
    pairs = list(donors.items()) if isinstance(donors, Mapping) else list(donors)
    return [parse_donor_arg(p) if isinstance(p, str) else donor_pair(p[0], os.fspath(p[1])) for p in pairs]


def _ladder_sources(ladder: PathLike | None, base: PathLike | None, donors: Donors | None
                    ) -> tuple[str | None, list[tuple[str, str]], tuple[str, int] | None]:
    """``--ladder DIR`` in place of ``--base``/``--donor``: the rung of fewest bytes is the base, every other rung a
    donor named by its type, each file checked against ``ladder.json`` first; and the SHA-256 and size of the
    model the rungs were made of."""
    if ladder is None:
        return (None if base is None else os.fspath(base)), _donor_list(donors or []), None
    rungs = _rungs(ladder, base, donors)
    return str(rungs.base.path), [(r.id, str(r.path)) for r in rungs.donors], (rungs.source_sha256, rungs.source_bytes)


def _rungs(ladder: PathLike, base: PathLike | None, donors: Donors | None) -> RungSet:
    if base is not None or donors:
        raise MosaicError("--ladder DIR names the base and the donors itself: give it instead of --base/--donor, not with them")
    from mosaic._sources.rung_set import open_ladder

    return open_ladder(os.fspath(ladder))


def _in_range(flag: str, value: int | None, lo: int, hi: int) -> int | None:
    """The command line's bounds for a number, for callers who did not come through it."""
    if value is not None and not lo <= value <= hi:
        raise MosaicError(f"{flag} {value}: expected a whole number from {lo} to {hi}")
    return value


def _sources_arg(sources: bool | PathLike | None) -> bool | str:
    if sources is None or sources is False:
        return False
    return True if sources is True else os.fspath(sources)


@_host_errors
def load_recipe(recipe: PathLike) -> Recipe:
    """Read and validate a recipe file without building it (its sources are not opened).

    >>> from mosaic.testing.exl3 import write_example
    >>> recipe = mosaic.load_recipe(write_example(tmp))
    >>> recipe.name, sorted(recipe.donors)
    ('example-mosaic', ['q3'])
    >>> recipe.output_path().name
    'example-mosaic'
    """
    from mosaic._recipe.document import load_recipe as _load

    return _load(recipe)


@_host_errors
def census(source: PathLike) -> CensusResult:
    """What one checkpoint holds: tensors, shards, codebook, bits per layer and module, and its problems.

    ``source`` is a folder; ``org/name@<40-hex commit>`` (from the local cache if it is there, else only its
    configs and shard headers read from the hub by ranges); or a GGUF model: a ``.gguf`` file, a split set's
    first file, a folder of one GGUF model, or ``org/name@<commit>:<file or glob>``.

    >>> from mosaic.testing.exl3 import demo_geometry, write_checkpoint
    >>> base = write_checkpoint(tmp / "base", demo_geometry(bits=2))
    >>> c = mosaic.census(base)
    >>> c.ok, c.format, c.report["tensors"] > 0
    (True, 'exl3', True)
    """
    from mosaic._checkpoint.census_exl3 import analyze, census_report
    from mosaic._checkpoint.folder import open_checkpoint
    from mosaic._checkpoint.gguf_model import is_gguf_location
    from mosaic._recipe.document import parse_hub_ref
    from mosaic._sources.gguf import is_gguf_src

    text = os.fspath(source)
    where = Path(text)
    hub_read: int | None = None
    with _metadata_stage():
        if not where.exists() and is_gguf_src(text):  # org/name@<commit>:<file or glob>
            from mosaic._checkpoint.census_gguf import gguf_census
            from mosaic._sources.gguf import gguf_source, open_gguf_source

            snaps: dict = {}
            rep = gguf_census(open_gguf_source(gguf_source(text, "census", "base"), Path.cwd(), ranges=snaps))
            rep["path"] = text
            if snaps:
                hub_read = rep["hub_bytes_read"] = sum(s.reader.bytes_read for s in snaps.values())
            fmt = "gguf"
        elif where.exists() and is_gguf_location(where):
            from mosaic._checkpoint.census_gguf import gguf_census
            from mosaic._checkpoint.gguf_model import open_gguf_model

            rep, fmt = gguf_census(open_gguf_model(where)), "gguf"
        else:
            ref = None if where.exists() else parse_hub_ref(text)
            snap = None
            folder = where
            if ref is not None:
                from mosaic._sources.resolve import hub_folder

                folder, snap = hub_folder(*ref)
            rep, fmt = census_report(analyze(open_checkpoint(folder, headers_only=snap is not None))), "exl3"
            if snap is not None:
                rep["path"] = text
                hub_read = rep["hub_bytes_read"] = snap.reader.bytes_read
    return CensusResult(str(rep.get("path", text)), fmt, tuple(rep["problems"]), rep, hub_read)


@_host_errors
def plan(
    *,
    base: PathLike | None = None,
    donors: Donors | None = None,
    scores: PathLike,
    max_size: int | str | None = None,
    target_rate: float | str | None = None,
    layers: int | None = None,
    unit: str | None = None,
    out: PathLike | None = None,
    ladder: PathLike | None = None,
    pins: Sequence[str] = (),
    tensor_type_file: PathLike | None = None,
) -> PlanResult:
    """Choose exactly (not greedily) which units to take from which donor under a budget; write the recipe.

    ``scores``: a measurement from :func:`measure`, per-layer scores (JSON or CSV), or exllamav3's measurement
    JSON. One budget: ``max_size`` (bytes, or text such as ``"12.5G"``/``"40GiB"``), ``target_rate`` (bits
    per weight) or ``layers`` (a count). ``unit``: ``layer-experts`` (the default), ``layer`` or
    ``module-group``; a measurement's own unit unless given. With ``out``, the recipe is written there
    (sources relative to its folder); it has been checked by the build's own layout either way.

    GGUF plans over a measurement also take ``pins`` (``"PATTERN=TYPE"``, read as ``llama-quantize --tensor-type``
    reads them: the pattern lower-cased and searched in each tensor's name, the first match deciding): every
    matching tensor is held at that type, within the budget, or the plan is refused. ``tensor_type_file``: the plan
    also written as ``llama-quantize --tensor-type-file`` reads it, every tensor the tool quantizes named alone at
    its planned type, so that the stock tool makes the same file from the ladder's source.

    >>> import json
    >>> from mosaic.testing.exl3 import write_example
    >>> recipe = write_example(tmp)
    >>> scores = {"0": 0.2, "1": 0.9, "2": 0.1, "3": 0.3, "4": 0.8, "5": 0.7}  # per layer: higher is better
    >>> _ = (tmp / "scores.json").write_text(json.dumps({"higher_is_better": True, "scores": scores}))
    >>> p = mosaic.plan(base=tmp / "base", donors={"q3": tmp / "donor"}, scores=tmp / "scores.json", layers=2,
    ...                 out=tmp / "planned.yaml")
    >>> [c["layer"] for c in p.chosen]
    [1, 4]
    >>> mosaic.load_recipe(p.out).donors["q3"].path  # sources relative to the recipe's folder
    'donor'
    >>> mosaic.build(p.out, out=tmp / "planned").from_donors
    192
    """
    from mosaic._plan.planner import PlanRequest, parse_size, plan_mosaic
    from mosaic._sources.gguf import is_gguf_src

    base_src, donor_list, _ = _ladder_sources(ladder, base, donors)  # before the budget, as the command line reads them
    if base_src is None or not donor_list:
        raise MosaicError("give --base SRC and at least one --donor ID=SRC, or --ladder DIR")
    size = parse_size(max_size) if isinstance(max_size, str) else max_size
    req = PlanRequest(
        base=base_src, donors=donor_list, scores=Path(scores), max_size=size,
        target_rate=None if target_rate is None else str(target_rate), layers=layers,
        unit=unit or "layer-experts", out=None if out is None else Path(out), unit_explicit=unit is not None,
        pins=tuple(pins), tensor_type_file=None if tensor_type_file is None else Path(tensor_type_file),
    )
    with _metadata_stage():
        if is_gguf_src(req.base):
            from mosaic._plan.gguf_planner import plan_gguf_mosaic
            from mosaic._plan.units import TooSmall

            try:
                report, text, _, notes = plan_gguf_mosaic(req)
            except TooSmall as e:
                low = None if ladder is None else _rungs(ladder, None, None).min_bpw
                if not low:
                    raise
                # the budget lies below the ladder's floor: the versions under it were never made
                raise TooSmall(f"{e}; the ladder has no type under {low:g} bits a weight (its floor): "
                               f"mosaic ladder --min-bpw 0 makes them") from None
        else:
            if req.pins or req.tensor_type_file is not None:
                raise MosaicError("--pin and --tensor-type-file: GGUF plans only (llama-quantize's types)")
            res = plan_mosaic(req)
            report, text, notes = res.report, res.recipe_text, res.notes
    return PlanResult(report, text, req.out, tuple(notes))


@_host_errors
def build(
    recipe: PathLike | Recipe,
    *,
    out: PathLike | None = None,
    force: bool = False,
    jobs: int | None = None,
    link: bool = False,
    stream: bool = False,
    progress: Progress = False,
) -> BuildResult:
    """Build the mosaic a recipe (a file, or one :func:`load_recipe` read) describes, byte for byte, with PROVENANCE.json, manifest and model card.

    ``out`` overrides the recipe's ``output.dir``; an existing folder is replaced only with ``force``, and only
    after the new build succeeded. ``link`` hard-links untouched shards; ``stream`` reads hub sources missing
    from the cache by byte ranges (only the bytes the mosaic takes). Every written file is read back and
    compared before the folder is renamed into place: :class:`~mosaic.VerificationError` otherwise, and
    nothing is kept.

    >>> from mosaic.testing.exl3 import write_example
    >>> res = mosaic.build(write_example(tmp))
    >>> res.out.name, res.tensors, res.from_donors
    ('example-mosaic', 696, 196)
    >>> res.provenance["tensors"][0]["name"], res.provenance["tensors"][0]["source"]  # records kept as columns
    ('model.embed_tokens.weight', 'base')
    >>> [(c.name, c.ok) for c in res.checks]  # what the build read back and compared before renaming into place
    [('sizes_as_planned', True), ('tensors_equal_sources', True), ('untouched_shards_identical', True)]
    """
    from mosaic._build.run import build as _build

    _in_range("--jobs", jobs, 1, 256)
    with _running(progress) as r:
        res = _build(os.fspath(recipe) if isinstance(recipe, (str, os.PathLike)) else recipe, out=out, force=force, jobs=jobs, link=link, stream=stream, progress=r)
    doc = res.provenance
    checks = tuple(CheckOutcome(c["name"], c["ok"], c.get("detail")) for c in doc["checks"])
    return BuildResult(res.out_dir, doc["name"], checks, doc, res.splice.methods, tuple(res.notes), res.streamed)


def _folder_audit(rep: AuditReport) -> FolderAudit:
    failures = tuple(AuditFailure(f.check, f.detail, f.file, f.tensor, rep.path) for f in rep.failures)
    failed = {f.check for f in rep.failures}
    checks = tuple(CheckOutcome(c, c not in failed) for c in rep.ran)
    return FolderAudit(rep.path, checks, failures, dict(rep.counts), rep.signature, dict(rep.digests), rep.as_dict())


@_host_errors
def audit(
    folder: PathLike,
    *,
    sources: bool | PathLike | None = None,
    key: PathLike | None = None,
    identity: str | None = None,
    issuer: str | None = None,
    require_signature: bool = False,
    jobs: int | None = None,
    progress: Progress = False,
) -> AuditResult:
    """Verify a mosaic (or every mosaic below ``folder``) from its files alone; a failed check is ``.ok`` false.

    ``sources=True`` also compares every tensor with its source, resolved from the folder's own recipe (paths
    relative to the current directory); a path names the recipe file the build used. ``key`` (a PEM public
    key) or ``identity`` + ``issuer`` (Sigstore) verify ``model.sig``; ``require_signature`` makes an absent
    or unverified signature a failure. Raises :class:`~mosaic.MosaicError` only when ``folder`` holds no
    mosaic or a key cannot be used.

    >>> from mosaic.testing.exl3 import write_example
    >>> built = mosaic.build(write_example(tmp)).out
    >>> mosaic.audit(built).ok
    True
    >>> with open(built / "model-00001-of-00002.safetensors", "r+b") as f:
    ...     _ = f.seek(-1, 2); _ = f.write(b"?")
    >>> bad = mosaic.audit(built)
    >>> bad.ok, [(f.check, f.file) for f in bad.failures][:2]
    (False, [('manifest', 'model-00001-of-00002.safetensors'), ('provenance', 'model-00001-of-00002.safetensors')])
    >>> [f.tensor for f in bad.failures if f.check == "tensors"]
    ['model.layers.4.mlp.experts.7.down_proj.mul1']
    """
    from mosaic._audit.report import NotAMosaic
    from mosaic._audit.run import audit as _audit
    from mosaic._audit.run import find_mosaics
    from mosaic._provenance.signature import load_trust

    _in_range("--jobs", jobs, 1, 256)
    trust = load_trust(key, identity, issuer)
    root = Path(folder)
    found = find_mosaics(root) if root.is_dir() else []
    if not found:
        raise NotAMosaic(f"{root}: no mosaic here (no PROVENANCE.json, nor manifest.json with .gguf files, in it or below it)")
    src = _sources_arg(sources)
    with _metadata_stage(), _running(progress) as r:
        reports = [_audit(f, sources=src, jobs=jobs, progress=r, trust=trust, require_signature=require_signature)
                   for f in found]
    return AuditResult(tuple(_folder_audit(rep) for rep in reports))


@_host_errors
def sign(
    folder: PathLike,
    *,
    key: PathLike | None = None,
    password: str | Callable[[], str | None] | None = None,
    sigstore: bool = False,
    sources: bool | PathLike | None = None,
    force: bool = False,
    jobs: int | None = None,
    progress: Progress = False,
) -> SignResult:
    """Audit ``folder`` and, if every check passes, sign the digests that audit read: ``folder/model.sig``.

    Sign with ``key`` (a PEM elliptic-curve private key; ``password`` its passphrase, or a function asked for
    it only if the key is encrypted) or keylessly with ``sigstore=True``. ``sources`` as for :func:`audit`.
    A folder already signed needs ``force``; one whose audit fails raises :class:`~mosaic.VerificationError`
    and is not signed.

    >>> from mosaic.testing.exl3 import write_example
    >>> from mosaic.testing.keys import write_signing_key
    >>> built = mosaic.build(write_example(tmp)).out
    >>> private, public = write_signing_key(tmp / "keys")
    >>> s = mosaic.sign(built, key=private)
    >>> s.signature.name, mosaic.audit(built, key=public, require_signature=True).ok
    ('model.sig', True)
    """
    from mosaic._provenance.signature import Signer, SigningError, Sigstore, load_signing_key
    from mosaic._release.signing import sign as _sign

    if (key is None) == (not sigstore):
        raise SigningError("give --key PRIVATE_KEY, or --sigstore for keyless signing (one of them)")
    if password is not None and key is None:
        raise SigningError("--password-file goes with --key")
    _in_range("--jobs", jobs, 1, 256)
    if callable(password):
        ask = password
    else:
        given = password if password is not None else os.environ.get("MOSAIC_KEY_PASSWORD") or None
        ask = lambda: given  # noqa: E731
    signer: Signer = Sigstore() if key is None else load_signing_key(key, ask)
    with _running(progress) as r:
        res = _sign(folder, signer, sources=_sources_arg(sources), force=force, jobs=jobs, progress=r)
    return SignResult(res.signed.path, res.signed.files, res.signed.by, _folder_audit(res.report))


@_host_errors
def export_gguf(
    folder: PathLike,
    out: PathLike,
    *,
    split_max_size: int | str | None = "50G",
    tensor_first_split: bool = False,
    name: str | None = None,
    progress: Progress = False,
) -> ExportResult:
    """Repackage an EXL3 checkpoint (a mosaic or any other) for ranma.cpp: its tensors bit for bit in GGUF
    shards of at most ``split_max_size`` tensor bytes (``"50G"``: K/M/G = 10^3/10^6/10^9, as
    ``llama-gguf-split`` counts; ``None``: one file), with ``manifest.json``, into the new folder ``out``.
    The first shard holds metadata only unless ``tensor_first_split``.

    >>> from mosaic.testing.exl3 import demo_geometry, write_checkpoint
    >>> model = write_checkpoint(tmp / "model", demo_geometry(bits=3))
    >>> e = mosaic.export_gguf(model, tmp / "model-gguf", split_max_size="2M")
    >>> e.as_dict()["architecture"], mosaic.audit(e.out).ok
    ('qwen3moe', True)
    """
    from mosaic._export.gguf import export_gguf as _export
    from mosaic._export.gguf import export_summary, parse_size

    size = parse_size(split_max_size if isinstance(split_max_size, str) else str(split_max_size)) \
        if split_max_size is not None else None
    with _metadata_stage(), _running(progress) as r:
        res = _export(folder, out, split_max_size=size, no_tensor_first_split=not tensor_first_split, name=name,
                      progress=r)
    return ExportResult(res.out_dir, res.manifest, export_summary(res))


@_host_errors
def fetch(recipe: PathLike, *, local_dir: PathLike | None = None, jobs: int | None = None,
          progress: Progress = False) -> FetchResult:
    """Download every ``repo`` + ``revision`` source of a recipe at its pinned commit and verify every file
    against the hub's own digests (LFS SHA-256, git blob id); a file that differs is removed and raises
    :class:`~mosaic.VerificationError`. With ``HF_HUB_OFFLINE=1`` the cache is checked instead. ``local_dir``:
    download into ``local_dir/<org>/<name>@<revision>`` rather than the Hugging Face cache.

    >>> from mosaic.testing.exl3 import write_example
    >>> from mosaic.testing.hub import FakeHub, publish_folder
    >>> hub = FakeHub().serve(tmp / "hf")  # a hub on 127.0.0.1; HF_ENDPOINT and HF_HOME point at it from now on
    >>> _ = write_example(tmp)
    >>> base = publish_folder(hub, "org/model-2bpw", tmp / "base")
    >>> donor = publish_folder(hub, "org/model-3bpw", tmp / "donor")
    >>> _ = (tmp / "r.yaml").write_text(f"name: m\\nbase: {{repo: org/model-2bpw, revision: {base}}}\\n"
    ...     f"donors: {{q3: {{repo: org/model-3bpw, revision: {donor}}}}}\\nreplace: [{{from: q3, layers: [1]}}]\\n")
    >>> got = mosaic.fetch(tmp / "r.yaml")
    >>> [(s.repo, s.files == s.hashed) for s in got.sources]
    [('org/model-2bpw', True), ('org/model-3bpw', True)]
    >>> mosaic.build(tmp / "r.yaml", out=tmp / "m").tensors  # the build finds them in the cache, verified
    696
    """
    from mosaic._hub.download import fetch as _fetch

    _in_range("--jobs", jobs, 1, 256)
    with _running(progress) as r:
        got = _fetch(recipe, local_dir=local_dir, jobs=jobs, progress=r, show_hub_progress=bool(progress) and not
                     isinstance(progress, Reporter))
    return FetchResult(tuple(got))


@_host_errors
def publish(
    folder: PathLike,
    repo: str,
    *,
    branch: str | None = None,
    private: bool = False,
    dry_run: bool = False,
    recipe_only: bool = False,
    jobs: int | None = None,
    progress: Progress = False,
) -> PublishResult:
    """Upload a mosaic folder to ``repo`` in one commit, only after :func:`audit` passes; then read the hub's
    digest of every uploaded file back and compare it with the manifest (:class:`~mosaic.VerificationError`
    on any difference). ``dry_run`` audits and lists, with no network at all; ``recipe_only`` uploads all but
    the shards (users rebuild them with :func:`rebuild`). The token comes from huggingface_hub's usual places.

    >>> from mosaic.testing.exl3 import write_example
    >>> from mosaic.testing.hub import FakeHub
    >>> hub = FakeHub().serve(tmp / "hf")
    >>> built = mosaic.build(write_example(tmp)).out
    >>> pub = mosaic.publish(built, "org/example-mosaic")
    >>> pub.verified, len(pub.commit)
    (True, 40)
    """
    from mosaic._release.publishing import publish as _publish

    _in_range("--jobs", jobs, 1, 256)
    with _running(progress) as r:
        res = _publish(folder, repo, branch=branch, private=private, dry_run=dry_run, recipe_only=recipe_only,
                       jobs=jobs, progress=r, show_hub_progress=bool(progress) and not isinstance(progress, Reporter))
    return PublishResult(res.repo, res.branch, res.commit_message, tuple(res.files), res.dry_run, res.commit,
                         tuple(res.deleted), res.verified, res.signature)


@_host_errors
def rebuild(
    ref: str,
    *,
    out: PathLike | None = None,
    sources: Mapping[str, PathLike] | Sequence[str] | None = None,
    jobs: int | None = None,
    progress: Progress = False,
) -> RebuildResult:
    """Rebuild a published mosaic ``org/name@<40-hex commit>`` from its sources instead of downloading its
    shards: only the published small files are read, every tensor is checked against the published
    PROVENANCE.json and every file against its manifest (:class:`~mosaic.VerificationError` and nothing kept on
    a difference). ``sources`` maps source ids to local folders (or lists ``"ID=PATH"`` texts) (required for a recipe's ``path`` sources);
    the others come from the cache or by byte ranges from the hub. ``out``: default ``./<name>``.

    >>> from mosaic.testing.exl3 import write_example
    >>> from mosaic.testing.hub import FakeHub
    >>> hub = FakeHub().serve(tmp / "hf")
    >>> built = mosaic.build(write_example(tmp)).out
    >>> pub = mosaic.publish(built, "org/example-mosaic", recipe_only=True)
    >>> again = mosaic.rebuild(f"org/example-mosaic@{pub.commit}", out=tmp / "again",
    ...                        sources={"base": tmp / "base", "q3": tmp / "donor"})
    >>> again.tensors == mosaic.census(built).report["tensors"]
    True
    """
    from mosaic._release.rebuilding import parse_source_override, source_override
    from mosaic._release.rebuilding import rebuild as _rebuild

    _in_range("--jobs", jobs, 1, 256)
    if isinstance(sources, Mapping):
        given = dict(source_override(sid, os.fspath(p)) for sid, p in sources.items())
    else:
        given = dict(parse_source_override(p) for p in ([sources] if isinstance(sources, str) else sources or ()))
    with _running(progress) as r:
        res = _rebuild(ref, out=out, sources=given, jobs=jobs, progress=r)
    return RebuildResult(res.out_dir, res.repo, res.revision, res.files, res.tensors, dict(res.hub_bytes),
                         dict(res.local_sources))


@_host_errors
def evaluate(
    candidates: Sequence[PathLike],
    *,
    reference: PathLike,
    text: PathLike,
    ctx: int | None = None,
    top_k: int | None = None,
    save_reference: PathLike | None = None,
    plot: PathLike | None = None,
    threads: int | None = None,
    runtime: str | None = None,
    gpu_layers: int | str | None = None,
    per_position: bool = False,
    verbose: bool = False,
    progress: Progress = False,
) -> EvalResult:
    """Score each candidate against the teacher on the same tokens: top-1 agreement, KL(teacher ‖ candidate)
    (exact with a live teacher, the top-k lower bound from a saved one), the text's NLL, per row, and
    between candidates. ``reference``: a model, or a reference saved with ``save_reference`` (``.npz``; with
    no candidates, the teacher alone runs). ``plot``: an ``.svg`` or ``.png`` of each candidate's KL and top-1
    against its size on disk (the ``plot`` extra). GGUF models run on llama.cpp (the ``runtime`` extra;
    ``runtime`` picks ``cyllama`` or ``llama-cpp-python``; ``gpu_layers``: ``"all"`` or a count of layers
    llama.cpp offloads, by default all where the binding can offload, else 0), EXL3 folders on exllamav3 (the
    ``exl3`` extra, a CUDA GPU). ``per_position``: each row also carries its KL at every position
    (``kl_positions``), for resampling the tail by rows.

    >>> from mosaic.testing.gguf import write_llama_gguf
    >>> teacher = write_llama_gguf(tmp / "q8.gguf", qtype="Q8_0", seed=1)[0]
    >>> student = write_llama_gguf(tmp / "q4.gguf", qtype="Q4_0", seed=1)[0]
    >>> _ = (tmp / "rows.txt").write_text("the model of a mosaic\\nbytes and the bytes of a model\\n")
    >>> ev = mosaic.evaluate([student, teacher], reference=teacher, text=tmp / "rows.txt", ctx=16)
    >>> kl = [c["kl"]["mean"] for c in ev.candidates]
    >>> kl[0] > 0, abs(kl[1]) < 1e-9
    (True, True)
    """
    if isinstance(candidates, (str, os.PathLike)):
        candidates = [candidates]
    from mosaic._eval.run import EvalRequest
    from mosaic._eval.run import evaluate as _evaluate
    from mosaic._eval.runtime import parse_gpu_layers

    _in_range("--ctx", ctx, 2, 1 << 20)
    _in_range("--top-k", top_k, 1, 1 << 16)
    _in_range("--threads", threads, 1, 1024)
    req = EvalRequest([os.fspath(c) for c in candidates], os.fspath(reference), Path(text), ctx, top_k,
                      None if save_reference is None else Path(save_reference), verbose=verbose, runtime=runtime,
                      threads=threads, plot=None if plot is None else Path(plot), gpu_layers=parse_gpu_layers(gpu_layers),
                      per_position=per_position)
    with _running(progress, unit="tokens") as r:
        return EvalResult(_evaluate(req, r))


@_host_errors
def measure(
    *,
    base: PathLike | None = None,
    donors: Donors | None = None,
    reference: PathLike | None = None,
    text: PathLike | None = None,
    method: str = "top-down",
    calibrate: str | None = None,
    curve: str | None = None,
    unit: str | None = None,
    only_layers: str | Sequence[int] | None = None,
    ctx: int | None = None,
    top_k: int | None = None,
    shard: str | None = None,
    imatrix: PathLike | None = None,
    imatrix_cap: bool | None = None,
    merge: Sequence[PathLike] | None = None,
    out: PathLike = "measurement.json",
    workdir: PathLike | None = None,
    resume: bool = False,
    force: bool = False,
    threads: int | None = None,
    gpu_layers: int | str | None = None,
    verbose: bool = False,
    progress: Progress = False,
    ladder: PathLike | None = None,
    refine: int = 0,
    max_size: int | str | None = None,
) -> MeasureResult:
    """Measure what each unit buys from each donor, on the model itself, and write it to ``out`` as a
    ``mosaic.measurement/v3`` document for :func:`plan`.

    ``method``: ``"top-down"`` (the default: every unit's weight error at every version, read from the files,
    and the top model, every unit at its best version, from which a few passes calibrate how much the model feels
    each unit's error; every (unit, donor) ``dkl`` predicted from both), ``"weights"`` (the weight errors alone,
    nothing runs: no ``reference`` needed, no ``text``) or ``"swaps"`` (every "base + one unit from one donor"
    run). Left at None, ``calibrate``, ``curve``, ``imatrix_cap`` and, over a ladder, ``unit`` take mosaic's
    defaults (:mod:`mosaic._measure.defaults`: chosen by held-out KL on two models), each yielding to a flag given
    that it cannot go with. Over ``ladder``: each tensor kind of each layer a unit, each kind's units moved
    together to each of their versions (``curve="versions"``) and each kind's sensitivity read from its pass at its
    drop version (``calibrate="pooled"``), the importances under their ceiling. ``calibrate``: ``"units"`` (one
    drop per unit, each its own: the default over ``base``/``donors``), ``"kinds"`` (those drops pooled per kind
    over ``only_layers``, given to every layer) or ``"pooled"``. ``curve``: ``"line"`` (each unit's loss as the
    line through its drop: the default over ``base``/``donors``) or ``"versions"`` (that line times its kind's
    factor at each version, one forward pass per kind and version).
    ``unit``: ``layer``, ``layer-experts`` or ``module-group``; ``only_layers``: ``"0-5,9"`` or a list.
    ``imatrix``: an importance matrix (llama-imatrix's GGUF or legacy ``.dat``, a file or a pinned hub file
    ``"ORG/NAME@COMMIT:FILE"``) that weights every weight error by each input channel's importance (GGUF bases);
    ``imatrix_cap``: those importances held under a robust ceiling first (a row's median × e^(3.5 robust standard
    deviations of its logs)), so that one channel of massive activations cannot hide the error of every other.
    ``shard``: ``"K/N"``, this run's share of the candidates; ``merge``: the shards' documents to join
    (then no other input). Each result is kept durably in ``<out>.partial`` as it finishes; ``resume``
    continues one with the same inputs; ``force`` replaces. ``threads``, ``gpu_layers`` (``"all"`` or a count):
    the runtime's, as for :func:`evaluate`. Retired (their evidence in bench/RESULTS.md, "Retired measurement
    options"): ``calibrate="groups"`` and ``curve="two-point"`` are refused, and so are ``refine`` (rounds measured
    where the plan of ``max_size`` bytes lands) and ``max_size`` unless ``MOSAIC_EXPERIMENTS=1`` is set, the one
    switch that keeps a retired option for experiments.

    >>> from mosaic.testing.gguf import Geometry, write_llama_gguf
    >>> g = Geometry(n_layer=2)
    >>> paths = {q: write_llama_gguf(tmp / f"{q}.gguf", qtype=q, seed=1, geometry=g)[0] for q in ("Q4_0", "Q8_0")}
    >>> _ = (tmp / "rows.txt").write_text("the model of a mosaic\\nbytes and the bytes of a model\\n")
    >>> m = mosaic.measure(base=paths["Q4_0"], donors={"q8": paths["Q8_0"]}, reference=paths["Q8_0"],
    ...                    text=tmp / "rows.txt", ctx=16, unit="layer", out=tmp / "measurement.json")
    >>> sorted((r["layer"], r["donor"]) for r in m.results)
    [(0, 'q8'), (1, 'q8')]
    >>> all(r["dbytes"] > 0 and r["eps"] < r["eps_base"] for r in m.results)  # exact bytes, smaller weight errors
    True
    >>> m.document["forward_passes"]  # the teacher, the base, the top and one drop per layer
    5
    """
    from mosaic._eval.runtime import parse_gpu_layers
    from mosaic._measure.request import MeasureRequest, check_retired
    from mosaic._measure.run import measure as _measure
    from mosaic._plan.planner import parse_size

    check_retired(calibrate, curve, refine, max_size)

    if merge is not None:
        from mosaic._measure.shards import merge as _merge

        given = [k for k, v in (("base", base), ("donors", donors), ("reference", reference), ("text", text),
                                ("shard", shard), ("only_layers", only_layers), ("imatrix", imatrix),
                                ("max_size", max_size), ("ladder", ladder)) if v is not None] \
            + [k for k, on in (("refine", refine), ("imatrix_cap", imatrix_cap is not None)) if on]
        if given:
            raise MosaicError(f"--merge joins the shards' documents alone: {', '.join(given)} not used")
        return MeasureResult(Path(out), _merge([Path(p) for p in merge], Path(out), force=force))
    base_src, donor_list, ladder_source = _ladder_sources(ladder, base, donors)
    if base_src is None:
        raise MosaicError("give --base SRC (or --ladder DIR, or --merge PART.json ...)")
    _in_range("--ctx", ctx, 2, 1 << 20)
    _in_range("--top-k", top_k, 1, 1 << 16)
    _in_range("--threads", threads, 1, 1024)
    if only_layers is None or isinstance(only_layers, str):
        layers = only_layers
    elif not only_layers:
        raise MosaicError("--only-layers: an empty list of layers (None measures every layer)")
    else:
        layers = ",".join(str(int(la)) for la in only_layers)
    req = MeasureRequest(base_src, donor_list, None if reference is None else os.fspath(reference),
                         None if text is None else Path(text), unit, layers, ctx, top_k, Path(out), resume, force,
                         None if workdir is None else Path(workdir), threads, verbose, method, calibrate, shard,
                         None if imatrix is None else os.fspath(imatrix), refine,
                         parse_size(max_size) if isinstance(max_size, str) else max_size, parse_gpu_layers(gpu_layers),
                         curve, ladder is not None, imatrix_cap, ladder_source)
    with _running(progress, unit="candidates") as r:
        doc = _measure(req, r)
    return MeasureResult(Path(out), doc)


def retired_option(option: str) -> str:
    """The one line a retired option of ``measure`` gets (what the command line prints for it)."""
    from mosaic._measure.request import retired

    return str(retired(option))


@_host_errors
def ladder(
    source: PathLike,
    *,
    out: PathLike,
    imatrix: PathLike | None = None,
    types: str | Sequence[str] | None = None,
    llama_quantize: PathLike | None = None,
    threads: int | None = None,
    lean: bool | None = None,
    min_bpw: float | None = None,
    no_superseded: bool | None = None,
    progress: Progress = False,
) -> LadderResult:
    """Make the donors of a model from its own source: one GGUF per ggml type in ``out``, every quantizable
    tensor at that type, made by llama.cpp's ``llama-quantize`` (``llama_quantize``, else ``$MOSAIC_LLAMA_QUANTIZE``,
    else ``PATH``, else the one ``make llama-tools`` built), with the importance matrix ``imatrix`` where given; ``out/ladder.json`` records the tool, the
    inputs' SHA-256, each rung's exact command and its fallbacks. Resumable: a rung made from the same inputs and
    still intact is kept. ``types``: ggml type names (default: every type llama.cpp's own mixer considers, less
    those that need a matrix when none is given, and those under ``min_bpw``). ``lean``: a tensor at a type of no
    fewer bytes than its own in the source keeps its source bytes there (no plan would take that version), and a
    type no tensor takes is not made: a smaller, quicker ladder of a quantized source. ``min_bpw``: the types of
    fewer bits per weight are not made (0: none left out), and rungs of them an earlier run made leave the manifest.
    ``no_superseded`` (with ``lean``): a 32-wide type (Q4_0, Q4_1, IQ4_NL, Q5_0, Q5_1) is made only for the tensors
    whose rows the 256-wide type of no more bytes that supersedes it (Q4_K, Q4_K, IQ4_XS, Q5_K, Q5_K), made too,
    cannot take; on a model whose rows all divide 256 those rungs are not made. Left at None, each takes the
    default the bench measured, decided by the source (:func:`mosaic._measure.rungs.options`): ``lean`` and
    ``no_superseded`` over a quantization whose every type the ladder holds, a floor of 2.5 bits a weight under the
    default types; ``notes`` says what a default left out. :func:`measure` and :func:`plan` take the folder as
    ``ladder``.

    >>> from mosaic.testing.gguf import Geometry, write_llama_gguf
    >>> from mosaic.testing.quantize_tool import write_tool
    >>> src = write_llama_gguf(tmp / "model-F16.gguf", qtype="F16", geometry=Geometry(n_layer=1, n_embd=256, n_ff=256))[0]
    >>> lad = mosaic.ladder(src, out=tmp / "ladder", types="Q4_K,Q8_0", llama_quantize=write_tool(tmp / "llama-quantize"))
    >>> [(r["id"], r["fallbacks"]) for r in lad.rungs]
    [('q4_k', {}), ('q8_0', {})]
    """
    from mosaic._measure.rungs import LadderRequest, make_ladder

    _in_range("--threads", threads, 1, 1024)
    type_text = types if types is None or isinstance(types, str) else ",".join(types)
    req = LadderRequest(os.fspath(source), Path(out), None if imatrix is None else os.fspath(imatrix), type_text,
                        None if llama_quantize is None else os.fspath(llama_quantize), threads, lean=lean, min_bpw=min_bpw,
                        no_superseded=no_superseded)
    with _running(progress, unit="rungs") as r:
        doc = make_ladder(req, r)
    return LadderResult(Path(out), doc, tuple(req.notes))

