"""The measurement document (``mosaic.measurement/v3``) assembled from the journal's records.

Everything in it is a function of the records and the schedule, so the same assembly serves a finished run, a
resumed one and each round of a refinement; the predictions are :mod:`.calibrate`'s arithmetic on the measured
records, so ``--merge`` of shards reaches the same document. It is validated against its schema before it is
written, atomically.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from mosaic._base.errors import VerificationError
from mosaic._base.version import __version__
from mosaic._build.run import fsync_dir
from mosaic._eval.reference import Reference
from mosaic._eval.rows import Rows
from mosaic._eval.scoring import counted
from mosaic._hub.partial import atomic_write
from mosaic._measure.calibrate import BASE, KIND_CALIBRATIONS, complete, measured_record, unit_key
from mosaic._measure.refine import kind_ratios, rescale, scales
from mosaic._measure.request import MeasureRequest
from mosaic._measure.schedule import Schedule
from mosaic._measure.sides import Side
from mosaic._measure.weights import Errors
from mosaic._plan.measurement import SCHEMA_ID, dumps, validation_errors


def head(req: MeasureRequest, side: Side, reference: dict | None, rows: Rows | None, settings: dict) -> dict:
    """The document's fields known before any pass runs."""
    return {
        "schema": SCHEMA_ID,
        "tool": {"name": "mosaic", "version": __version__},
        "format": side.format,
        "base": {"source": req.base, "files": side.base_files, "bytes": side.base_bytes, "kl": None, "top1": None, "nll": None},
        "donors": {d: {"source": src, "files": side.donor_files[d]} for d, src in req.donors},
        "reference": reference,
        "text": None if rows is None else {"file": str(req.text), "sha256": rows.sha256, "rows": len(rows.texts), "positions": 0},
        "settings": settings,
    }


def row(side: Side, errors: Errors, ui: int, donor: str, measured: dict | None = None) -> dict:
    """A result in the document's field order: its unit, donor, bytes and weight errors, with the measured
    figures (a swap that ran) or, left ``None``, the ones a prediction fills in."""
    u = side.units[ui]
    out = {"layer": u.layer, "group": u.group, "donor": donor, "dbytes": side.dbytes[(ui, donor)], "kl": None, "dkl": None,
           "dkl_se": None, "dtop1": None, "dnll": None, "eps": errors.eps[(ui, donor)], "eps_base": errors.eps[(ui, BASE)],
           "predicted": measured is None, "tensors": list(u.tensors)}
    if measured:
        out.update(measured)
    return out


def document(plan: Schedule, records: list[dict], head_: dict, ref: Reference) -> dict:
    """The document of ``records`` (the journal's), predictions completed; a shard's part is left for the merge."""
    side, errors = plan.side, plan.errors
    units = side.units
    base_rec = next(r for r in records if r["kind"] == "base")
    doc = dict(head_)
    doc["base"] = {**head_["base"], "kl": base_rec["kl"], "top1": base_rec["top1"], "nll": base_rec["nll"]}
    counts, once = counted(ref.row_tokens, ref.ctx)  # as mosaic eval counts them
    doc["text"] = {**head_["text"], "sha256": ref.text_sha256, "rows": len(ref.row_tokens), "positions": counts, "repeated": once}
    teacher_runs = 1 if head_["reference"]["kind"] == "model" else 0
    if plan.top is None:  # swaps: every result measured
        res = {(r["layer"], r["group"], r["donor"]): r for r in records if r["kind"] == "result"}
        rows = []
        ran = []
        for ui, d in plan.swaps:
            u = units[ui]
            r = res[(u.layer, u.group, d)]
            one = row(side, errors, ui, d, {k: r[k] for k in ("kl", "dkl", "dkl_se", "dtop1", "dnll")})
            if r.get("same_as_base"):
                one["same_as_base"] = True
            else:
                ran.append(r["seconds"])
            rows.append(one)
        doc.update({"seconds": 0.0, "seconds_per_candidate": round(statistics.mean(ran), 3) if ran else None,
                    "forward_passes": teacher_runs + 1 + len(ran), "results": rows})
        return doc
    top_rec = next(r for r in records if r["kind"] == "top")
    drops = {(r["layer"], r["group"]): r for r in records if r["kind"] == "drop"}
    measured = []
    for ui in plan.drops:
        u = units[ui]
        r = drops[(u.layer, u.group)]
        measured.append(measured_record(u.layer, u.group, r["kl"], r["top1"], r["nll"], top_rec["kl"], r["dkl_drop_se"],
                                        errors.eps[(ui, BASE)], errors.eps[(ui, plan.top[ui])],  # type: ignore[index]
                                        to=plan.to[ui], eps_to=errors.eps[(ui, plan.to[ui])]))
    calibrate = head_["settings"]["calibrate"]
    row_units = range(len(units)) if calibrate in KIND_CALIBRATIONS else plan.measured_units
    rows = [row(side, errors, ui, d) for ui in row_units for d in side.versions[ui][1:]]
    seconds = [drops[(units[ui].layer, units[ui].group)]["seconds"] for ui in plan.drops]
    pooled = [r for r in records if r["kind"] == "pooled"]
    seconds += [r["seconds"] for r in pooled]
    doc.update({
        "seconds": 0.0, "seconds_per_candidate": round(statistics.mean(seconds), 3) if seconds else None,
        "forward_passes": teacher_runs + 2 + len(measured) + len(pooled),
        "top": {"kl": top_rec["kl"], "top1": top_rec["top1"], "nll": top_rec["nll"],
                "versions": {unit_key(u.layer, u.group): plan.top[i] for i, u in enumerate(units)}},  # type: ignore[index]
        "measured": measured,
    })
    doc["results"] = rows
    if plan.pooled:
        order = {(k, v): i for i, (k, v, _) in enumerate(plan.pooled)}
        doc["pooled"] = [{"kind": r["unit_kind"], "to": r["to"], "units": r["units"], "kl": r["kl"], "top1": r["top1"],
                          "nll": r["nll"], "dkl": r["kl"] - top_rec["kl"], "dkl_se": r["dkl_se"],
                          **({"alpha": True} if (r["unit_kind"], r["to"]) in plan.alpha_passes else {})}
                         for r in sorted(pooled, key=lambda r: order[(r["unit_kind"], r["to"])])]
    if plan.shard is not None:  # a part: the calibration needs every shard's drops (mosaic measure --merge)
        return doc
    doc = complete(doc)
    return with_refinement(doc, records, head_) if plan.refine else doc


def with_refinement(doc: dict, records: list[dict], head_: dict) -> dict:
    """The document with the rounds of the refinement that are complete in ``records``: every result's dkl
    scaled by its kind's ratios, the rounds themselves, and (once the refinement ended) its final plan."""
    done = {r["round"] for r in records if r["kind"] == "round-done"}
    rounds = []
    for r in records:
        if r["kind"] != "round" or r["round"] not in done:
            continue
        mv = [{k: m[k] for k in ("layer", "group", "from", "to", "kl", "dkl", "dkl_se", "predicted")}
              for m in records if m["kind"] == "move" and m["round"] == r["round"]]
        rounds.append({"round": r["round"], "versions": r["versions"], "bytes": r["bytes"], "kl": r["kl"], "top1": r["top1"],
                       "nll": r["nll"], "predicted_kl": r["predicted_kl"], "ratios": kind_ratios(mv), "moves": mv})
    scale = scales(rounds)
    doc["results"] = rescale(doc["results"], scale, doc["base"]["kl"])
    end = next((r for r in records if r["kind"] == "refined"), None)
    doc["forward_passes"] += sum(1 + len(rd["moves"]) for rd in rounds)
    doc["refinement"] = {"max_size": head_["settings"]["refine"]["max_size"], "rounds": rounds,
                         "scales": {k: scale[k] for k in sorted(scale)},
                         "versions": None if end is None else end["versions"],
                         "converged": None if end is None else end["converged"]}
    return doc


def write(doc: dict, out: Path) -> dict:
    """``doc`` at ``out``, once it matches its schema; durable before the journal that made it goes."""
    errs = validation_errors(doc)
    if errs:
        raise VerificationError(f"the measurement does not match its schema: {errs[0]}")
    atomic_write(out, dumps(doc))
    fsync_dir(out.resolve().parent)
    return doc
