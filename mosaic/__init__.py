"""mosaic: build mixed-precision "mosaic" checkpoints of quantized LLMs and prove how they were made.

The public API is this module: one function per command, each returning a typed, frozen result.

    >>> import mosaic
    >>> res = mosaic.build("recipes/spark.yaml")             # doctest: +SKIP
    >>> mosaic.audit(res.out, sources=True).ok                # doctest: +SKIP
    True

Bad input raises :class:`MosaicError` (its message is the command line's error line); a command whose own
verification fails raises :class:`VerificationError` and keeps nothing; ``audit`` and ``census`` report
failed checks in their result. Nothing prints unless ``progress=True`` (or a :class:`Reporter`) is passed.
Each function's docstring has an example that runs offline on :mod:`mosaic.testing`'s synthetic models.
Public besides: :mod:`mosaic.testing` (those generators and a local fake hub) and the ``mosaic`` command
(:mod:`mosaic.cli`). The wings under ``mosaic._*`` are private: they move when the pipeline does.

``import mosaic`` loads nothing but the version; each name is imported when first used.
"""

from typing import TYPE_CHECKING

from mosaic._base.version import __version__

_FUNCTIONS = ("build", "audit", "census", "plan", "measure", "ladder", "evaluate", "export_gguf", "fetch", "publish",
              "rebuild", "sign", "load_recipe", "Recipe")
_RESULTS = ("AuditFailure", "AuditResult", "BuildResult", "CensusResult", "CheckOutcome", "EvalResult",
            "ExportResult", "FetchResult", "FetchedSource", "FileRecord", "FolderAudit", "LadderResult", "MeasureResult",
            "PlanResult", "PublishResult", "RebuildResult", "SignResult")
_ERRORS = ("MosaicError", "VerificationError", "HostError", "FormatError", "CheckpointError", "RecipeError",
           "SourceError", "OutputError", "SigningError")
#: where each public name lives; only the API façade and the base, never a wing
_HOME = {
    **dict.fromkeys(_FUNCTIONS, "mosaic._api.functions"),
    **dict.fromkeys(_RESULTS, "mosaic._api.results"),
    **dict.fromkeys(_ERRORS, "mosaic._base.errors"),
    "Reporter": "mosaic._base.progress",
}

__all__ = [  # what _HOME names, and the version (tests/test_api.py holds the two lists together)
    "AuditFailure", "AuditResult", "BuildResult", "CensusResult", "CheckOutcome", "CheckpointError", "EvalResult",
    "ExportResult", "FetchResult", "FetchedSource", "FileRecord", "FolderAudit", "FormatError", "HostError",
    "LadderResult", "MeasureResult", "MosaicError", "OutputError", "PlanResult", "PublishResult", "RebuildResult", "Recipe",
    "RecipeError", "Reporter", "SignResult", "SigningError", "SourceError", "VerificationError", "__version__",
    "audit", "build", "census", "evaluate", "export_gguf", "fetch", "ladder", "load_recipe", "measure", "plan", "publish",
    "rebuild", "sign",
]


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'mosaic' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


if TYPE_CHECKING:
    from mosaic._api.functions import (
        Recipe,
        audit,
        build,
        census,
        evaluate,
        export_gguf,
        fetch,
        load_recipe,
        measure,
        plan,
        publish,
        rebuild,
        sign,
    )
    from mosaic._api.results import (
        AuditFailure,
        AuditResult,
        BuildResult,
        CensusResult,
        CheckOutcome,
        EvalResult,
        ExportResult,
        FetchedSource,
        FetchResult,
        FileRecord,
        FolderAudit,
        MeasureResult,
        PlanResult,
        PublishResult,
        RebuildResult,
        SignResult,
    )
    from mosaic._base.errors import (
        CheckpointError,
        FormatError,
        HostError,
        MosaicError,
        OutputError,
        RecipeError,
        SigningError,
        SourceError,
        VerificationError,
    )
    from mosaic._base.progress import Reporter
