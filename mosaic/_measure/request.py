"""What ``mosaic measure`` is asked: the request, and every refusal that needs no source opened.

A measurement runs for hours on a real model, so what cannot go together is refused before anything is read:
each refusal is one line naming the flags and, where there is one, the flag that makes the request possible.
The method's flags left open are set by :mod:`.defaults` first, so the checks see what will run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import MosaicError
from mosaic._measure.calibrate import KIND_CALIBRATIONS
from mosaic._measure.shards import Shard, parse_shard

METHODS = ("top-down", "weights", "swaps")
CALIBRATIONS = ("units", "kinds", "pooled")
CURVES = ("line", "versions")
#: Options a measurement had once and no longer makes, with why (bench/RESULTS.md, "Retired measurement options"):
#: none gained over the default on rows no choice had seen. Their documents are still read.
RETIRED = {
    "--calibrate groups": "four passes per kind planned the very files of the pooled pass on rows no choice saw, with "
                          "more passes (76 against 48 on SmolLM2)",
    "--curve two-point": "a second drop per unit planned 1.08-1.18 x target-size's KL over a ladder, no better than one "
                         "line, its p99 above target-size's at every size",
    "--sample-layers": "no sample of layers held the every-layer plans on SmolLM2 (1-6 % worse at its Q3_K_M's bytes), "
                       "and the default's passes no longer grow with the depth",
    "--refine": "a round at the plan gained nothing over the ladder's default at any size (1.09-1.31 x target-size's KL)",
}


@dataclass
class MeasureRequest:
    base: str
    donors: list[tuple[str, str]]
    reference: str | None
    text: Path | None
    unit: str | None = None
    only_layers: str | None = None
    ctx: int | None = None
    top_k: int | None = None
    out: Path = field(default_factory=lambda: Path("measurement.json"))
    resume: bool = False
    force: bool = False
    workdir: Path | None = None
    threads: int | None = None
    verbose: bool = False
    method: str = "top-down"
    calibrate: str | None = None  # None: the default (mosaic._measure.defaults), set by measure() before anything runs
    shard: str | None = None
    imatrix: str | None = None
    #: rounds measured where the plan of ``max_size`` lands (top-down, GGUF). Retired (:data:`RETIRED`), kept behind
    #: :data:`EXPERIMENTS` for a check of a chosen plan on the measurement's rows
    refine: int = 0
    max_size: int | None = None  # the budget the refinement plans at
    gpu_layers: int | str | None = None  # llama.cpp's offload ("all", a count; None: the default)
    curve: str | None = None  # top-down: one drop per unit (a line), or that line times each kind's factor per version
    ladder: bool = False  # the sources are a ladder's rungs: a unit alike in several (type and bytes) is one version
    imatrix_cap: bool | None = None  # --imatrix-cap: the importances held under a robust ceiling (importance.capped)
    ladder_source: tuple[str, int] | None = None  # --ladder: the SHA-256 and size of the model its rungs were made of


#: The one switch that keeps a retired option's code reachable, for experiments (its option then works as it did).
EXPERIMENTS = "MOSAIC_EXPERIMENTS"
#: The retired options the switch keeps: code a check of a chosen plan on the measurement's rows may reuse.
KEPT_FOR_EXPERIMENTS = ("--refine",)


def experiments() -> bool:
    """Is ``$MOSAIC_EXPERIMENTS`` set to 1?"""
    return os.environ.get(EXPERIMENTS) == "1"


def retired(option: str) -> MosaicError:
    """The one line a retired option gets: what it was and that its evidence is in bench/RESULTS.md."""
    kept = f"; {EXPERIMENTS}=1 keeps it for experiments" if option in KEPT_FOR_EXPERIMENTS else ""
    return MosaicError(f"{option}: retired ({RETIRED[option]}: bench/RESULTS.md, \"Retired measurement options\"); "
                       f"with no method flag, measure runs the default{kept}")


def check_retired(calibrate: str | None, curve: str | None, refine: int | None = None, max_size: object = None) -> None:
    """A retired choice of ``--calibrate`` or ``--curve``, or ``--refine`` without the experiments' switch, refused
    before anything is read."""
    if calibrate == "groups":
        raise retired("--calibrate groups")
    if curve == "two-point":
        raise retired("--curve two-point")
    if (refine or max_size is not None) and not experiments():
        raise retired("--refine")


def check_request(req: MeasureRequest, asked: MeasureRequest) -> Shard | None:
    """Everything that can be refused before a source is opened (``req`` resolved, ``asked`` as given)."""
    if req.method not in METHODS:
        raise MosaicError(f"--method {req.method}: one of {', '.join(METHODS)}")
    check_retired(req.calibrate, req.curve)
    if req.calibrate not in CALIBRATIONS:
        raise MosaicError(f"--calibrate {req.calibrate}: one of {', '.join(CALIBRATIONS)}")
    if req.calibrate in KIND_CALIBRATIONS and req.method != "top-down":
        raise MosaicError(f"--calibrate {req.calibrate} calibrates the drops of --method top-down, not of --method {req.method}")
    if req.calibrate == "pooled" and req.curve != "versions":
        raise MosaicError(f"--calibrate pooled reads each kind's alpha from its pooled pass: it needs --curve versions, "
                          f"not --curve {req.curve}")
    shard = parse_shard(req.shard) if req.shard is not None else None
    if req.curve not in CURVES:
        raise MosaicError(f"--curve {req.curve}: one of {', '.join(CURVES)}")
    if req.curve != "line" and req.method != "top-down":
        raise MosaicError(f"--curve {req.curve} shapes the drops of --method top-down, not of --method {req.method}")
    if req.curve == "versions" and req.shard is not None:
        raise MosaicError("--curve versions moves each kind's units together, across every layer: not with --shard"
                          + ("" if asked.curve else " (versions is the default curve over --ladder; --curve line "
                                                    "--calibrate kinds shards)"))
    if req.curve == "versions" and req.refine:
        raise MosaicError("--curve versions and --refine both correct the line, each from its own moves: choose one")
    if req.refine < 0:
        raise MosaicError(f"--refine {req.refine}: a number of rounds, at least 1")
    if req.refine and req.max_size is None:
        raise MosaicError("--refine needs --max-size SIZE: the budget whose plan the refinement measures around")
    if req.max_size is not None and not req.refine:
        raise MosaicError("--max-size is the budget of --refine N; give both (mosaic plan takes the budget otherwise)")
    if req.refine and req.method != "top-down":
        raise MosaicError(f"--refine refines the drops of --method top-down, not --method {req.method}")
    if req.refine and req.shard is not None:
        raise MosaicError("--refine runs its rounds one after another, each planned from the last: not with --shard")
    if req.method == "weights":
        given = [flag for flag, v in (("--text", req.text), ("--ctx", req.ctx), ("--top-k", req.top_k)) if v is not None]
        if given:
            raise MosaicError(f"--method weights runs no model: {', '.join(given)} not used (they go with top-down or swaps)")
        if shard is not None:
            raise MosaicError("--shard: --method weights runs no candidate to share out")
    else:
        if req.reference is None:
            raise MosaicError(f"--method {req.method} needs --reference: the teacher the candidates are scored against")
        if req.text is None:
            raise MosaicError(f"--method {req.method} needs --text: the rows the candidates are scored on")
    if not req.donors:
        raise MosaicError("give at least one --donor ID=SRC")
    ids = [d for d, _ in req.donors]
    if len(set(ids)) != len(ids):
        raise MosaicError(f"--donor {next(d for d in ids if ids.count(d) > 1)}: given twice")
    return shard
