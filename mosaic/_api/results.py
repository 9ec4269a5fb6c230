"""What the public functions return: typed, frozen results, each with the document the command line prints.

A result keeps what its command produced as the command produced it: a build's PROVENANCE.json is the
parsed document with its tensor records still in columns (151,000 tensors are a few lists, not 151,000
objects), a measurement or an evaluation is its JSON document. The attributes a release script needs
are typed fields and properties; ``as_dict()`` is exactly what ``--json`` prints, as a new dict each call.

Frozen: no attribute can be rebound, and every mapping a result holds is a read-only view
(:class:`types.MappingProxyType`). Freezing goes no deeper, on purpose: copying a 151,000-tensor record
into immutable objects would cost what the columns save, so the documents inside are the command's own
(copy one before changing it). A result hashes by its plain fields only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

# the wings' own frozen records, handed out as they are
from mosaic._hub.fetched import FetchedSource as FetchedSource
from mosaic._provenance.records import FileRecord as FileRecord


def _view(names: tuple[str, ...]) -> Callable[[object], None]:
    """A ``__post_init__`` making the named mapping fields read-only views of what was passed."""

    def post_init(self: object) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(value)))

    return post_init


def _mapping(**kw: Any) -> Any:
    """A mapping field: read-only once set, left out of the hash (mappings do not hash)."""
    return field(hash=False, **kw)


@dataclass(frozen=True)
class CheckOutcome:
    """A check that ran, whether it passed, and what it found (a build's checks say what they compared)."""

    name: str
    ok: bool
    detail: str | None = None


@dataclass(frozen=True)
class BuildResult:
    """A built mosaic folder (EXL3 or GGUF), renamed into place only after every byte was read back."""

    #: the finished folder
    out: Path
    #: the recipe's name
    name: str
    #: the build's own verification (``PROVENANCE.json`` ``checks``): what was read back and compared
    checks: tuple[CheckOutcome, ...]
    #: the folder's PROVENANCE.json as written; ``provenance["tensors"]`` keeps its columns
    provenance: Mapping[str, Any] = _mapping(repr=False)
    #: how each shard (or GGUF part) was made: ``copied``, ``linked``, ``spliced``, ...
    shards: Mapping[str, str] = _mapping(default_factory=dict, repr=False)
    #: what a user should know that is not a failure (a recipe naming folders of this machine)
    notes: tuple[str, ...] = ()
    #: bytes read from the hub by ranges, per streamed source (``build(..., stream=True)``)
    hub_bytes_read: Mapping[str, int] = _mapping(default_factory=dict)

    __post_init__ = _view(("provenance", "shards", "hub_bytes_read"))

    @property
    def size(self) -> Mapping[str, Any]:
        return self.provenance["size"]

    @property
    def rate(self) -> Mapping[str, Any]:
        return self.provenance["rate"]

    @property
    def tensors(self) -> int:
        return len(self.provenance["tensors"])

    @property
    def from_donors(self) -> int:
        """How many tensors came from a donor rather than the base."""
        from mosaic._provenance.records import column

        return sum(1 for s in column(self.provenance["tensors"], "source") if s != "base")

    def as_dict(self) -> dict[str, object]:
        doc = self.provenance
        return {
            "output": str(self.out),
            "name": self.name,
            "size": doc["size"],
            "rate": doc["rate"],
            "files": len(doc["files"]) + 2,  # PROVENANCE.json and the manifest are not listed in themselves
            "tensors": self.tensors,
            "from_donors": self.from_donors,
            "shards": dict(self.shards),
            "checks": list(doc["checks"]),
            "notes": list(self.notes),
            "hub_bytes_read": dict(self.hub_bytes_read),
        }


@dataclass(frozen=True)
class AuditFailure:
    """One failed check: which check, in which file and tensor (``None`` for a whole-file or folder check)."""

    check: str
    detail: str
    file: str | None = None
    tensor: str | None = None
    #: the mosaic folder the failure is in (an audit can walk several below one folder)
    folder: Path | None = None


@dataclass(frozen=True)
class FolderAudit:
    """The audit of one mosaic folder or GGUF export."""

    path: Path
    checks: tuple[CheckOutcome, ...]
    failures: tuple[AuditFailure, ...]
    #: what was read (files, bytes, tensors, ...)
    counts: Mapping[str, int] = _mapping()
    #: what is known of ``model.sig``: present, verified, by what (``None``: unsigned)
    signature: Mapping[str, object] | None = _mapping()
    #: the SHA-256 of every file the audit read (what ``sign`` signs)
    digests: Mapping[str, str] = _mapping(repr=False, default_factory=dict)
    _doc: Mapping[str, object] = _mapping(repr=False, compare=False, default_factory=dict)

    __post_init__ = _view(("counts", "signature", "digests", "_doc"))

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, object]:
        return dict(self._doc)


@dataclass(frozen=True)
class AuditResult:
    """Every mosaic found at or below the audited folder, each re-verified from its files alone."""

    folders: tuple[FolderAudit, ...]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.folders)

    @property
    def failures(self) -> tuple[AuditFailure, ...]:
        return tuple(x for f in self.folders for x in f.failures)

    def as_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "mosaics": [f.as_dict() for f in self.folders]}


@dataclass(frozen=True)
class CensusResult:
    """What one checkpoint holds: ``format`` ``exl3`` or ``gguf``; ``ok`` when the census found no problem."""

    path: str
    format: str
    problems: tuple[str, ...]
    #: the census document ``mosaic census --json`` prints
    report: Mapping[str, Any] = _mapping(repr=False)
    #: bytes read from the hub when the checkpoint was read there by ranges (``None``: read locally)
    hub_bytes_read: int | None = None

    __post_init__ = _view(("report",))

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, object]:
        return dict(self.report)


@dataclass(frozen=True)
class PlanResult:
    """The exact choice under the budget and the recipe that expresses it (written to ``out`` when given)."""

    #: the plan report ``mosaic plan --json`` prints (budget, chosen units, sizes, rates, greedy comparison)
    report: Mapping[str, Any] = _mapping(repr=False)
    #: the recipe's YAML text
    recipe: str = field(repr=False)
    #: where the recipe was written (``None``: not written)
    out: Path | None = None
    notes: tuple[str, ...] = ()

    __post_init__ = _view(("report",))

    @property
    def chosen(self) -> list[Any]:
        return list(self.report.get("chosen", []))

    def as_dict(self) -> dict[str, object]:
        return dict(self.report)


@dataclass(frozen=True)
class MeasureResult:
    """A complete ``mosaic.measurement`` document (v3), written to ``out``."""

    out: Path
    document: Mapping[str, Any] = _mapping(repr=False)

    __post_init__ = _view(("document",))

    @property
    def results(self) -> list[Any]:
        """One record per measured unit and donor: ``layer``, ``group``, ``donor``, ``dbytes``, ``dkl`` (and its
        standard error ``dkl_se``), ``dtop1``, ``dnll``."""
        return list(self.document["results"])

    def as_dict(self) -> dict[str, object]:
        return dict(self.document)


@dataclass(frozen=True)
class LadderResult:
    """A ladder made (or completed): its folder and its manifest, ``ladder.json`` (the ``--json`` document)."""

    out: Path
    manifest: Mapping[str, Any] = _mapping(repr=False)
    notes: tuple[str, ...] = ()

    __post_init__ = _view(("manifest",))

    @property
    def rungs(self) -> list[Any]:
        """One record per rung: ``type``, ``id``, ``file``, ``sha256``, ``bytes``, ``command``, ``fallbacks``."""
        return list(self.manifest["rungs"])

    def as_dict(self) -> dict[str, object]:
        return dict(self.manifest)


@dataclass(frozen=True)
class EvalResult:
    """The quality panel: each candidate against the teacher on the same tokens, and the comparisons."""

    document: Mapping[str, Any] = _mapping(repr=False)

    __post_init__ = _view(("document",))

    @property
    def candidates(self) -> list[Any]:
        return list(self.document["candidates"])

    def as_dict(self) -> dict[str, object]:
        return dict(self.document)


@dataclass(frozen=True)
class ExportResult:
    """A GGUF export for ranma.cpp: the folder and its ``manifest.json`` (every tensor's layout and digest)."""

    out: Path
    manifest: Mapping[str, Any] = _mapping(repr=False)
    _summary: Mapping[str, object] = _mapping(repr=False, compare=False, default_factory=dict)

    __post_init__ = _view(("manifest", "_summary"))

    def as_dict(self) -> dict[str, object]:
        return dict(self._summary)


@dataclass(frozen=True)
class FetchResult:
    """Every ``repo`` + ``revision`` source of a recipe, fetched and verified."""

    sources: tuple[FetchedSource, ...]

    @property
    def ok(self) -> bool:
        return True  # a file that differs from the hub's digest raises VerificationError instead

    def as_dict(self) -> dict[str, object]:
        return {"ok": True, "sources": [s.as_dict() for s in self.sources]}


@dataclass(frozen=True)
class PublishResult:
    """One commit on the hub (or, with ``dry_run``, what it would hold), its digests read back."""

    repo: str
    branch: str
    commit_message: str
    files: tuple[FileRecord, ...]
    dry_run: bool
    #: the commit id (``None`` on a dry run)
    commit: str | None
    #: files of an earlier upload the commit removed
    deleted: tuple[str, ...]
    #: the hub's digest of every uploaded file equals the manifest's
    verified: bool
    #: the signature file uploaded with the mosaic, if it has one
    signature: str | None

    def as_dict(self) -> dict[str, object]:
        return {
            "repo": self.repo, "branch": self.branch, "dry_run": self.dry_run, "commit": self.commit,
            "commit_message": self.commit_message, "files": [f.as_dict() for f in self.files],
            "bytes": sum(f.size for f in self.files), "deleted": list(self.deleted), "verified": self.verified,
            "signature": self.signature,
        }


@dataclass(frozen=True)
class RebuildResult:
    """A published mosaic made again from its sources, every tensor and file equal to what was published."""

    out: Path
    repo: str
    revision: str
    files: int
    tensors: int
    #: bytes read from the hub: the published repository's small files, and each streamed source's ranges
    hub_bytes: Mapping[str, int] = _mapping()
    #: sources read from local folders
    local_sources: Mapping[str, str] = _mapping()

    __post_init__ = _view(("hub_bytes", "local_sources"))

    def as_dict(self) -> dict[str, object]:
        return {"output": str(self.out), "repo": self.repo, "revision": self.revision, "files": self.files,
                "tensors": self.tensors, "hub_bytes_read": dict(self.hub_bytes),
                "local_sources": dict(self.local_sources), "identical": True}


@dataclass(frozen=True)
class SignResult:
    """``model.sig`` written over the digests of a passing audit."""

    #: the signature file
    signature: Path
    #: how many files it covers
    files: int
    #: who signed (a key's description, or the Sigstore identity)
    by: str
    audit: FolderAudit

    def as_dict(self) -> dict[str, object]:
        sig = {"file": self.signature.name, "path": str(self.signature), "files": self.files, "by": self.by}
        return {"ok": True, "signature": sig, "audit": self.audit.as_dict()}
