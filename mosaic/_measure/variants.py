"""One measurement's forward passes read under other settings: the variants a default is chosen among.

A top-down measurement runs the same candidates whatever its calibration: the top, one drop per unit, and with
``--curve versions`` one pooled candidate per kind and version. What ``--calibrate``, ``--curve`` and the
importance matrix's ceiling change is only the arithmetic done on those passes (:mod:`.calibrate`) and the
weight errors it is done with. So a measurement made with ``--curve versions`` over every layer holds every
variant of the three: its drops pooled per kind or not, its pooled candidates used or left out, its weight
errors weighted one way or the other (read from a ``--method weights`` document of the same sources).
Comparing variants on the same passes compares the methods, not the noise of two sets of runs.

Derived is not measured: a weighting's top or worst version can differ from the one the passes were run at,
and :func:`derive` says for how many units in a note of the document it returns.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from mosaic._base.errors import MosaicError
from mosaic._measure.calibrate import BASE, alpha_of, complete, drop_version, kind_of, unit_key


def pooled_calibration(measured: list[dict], pooled: list[dict]) -> tuple[list[dict], int]:
    """``--calibrate pooled`` read from a measurement with every drop: each kind's pooled pass at the version most
    of its drops went to marked as its alpha's, and those kinds' drops left out (how many: the second value); a
    kind with no such pass (one unit) keeps its drop."""
    tos: dict[str, list[str]] = {}
    for m in measured:
        tos.setdefault(kind_of(m["group"]), []).append(m["to"])
    calibrated = set()
    for k, ts in tos.items():
        v = drop_version(ts)
        p = next((p for p in pooled if p["kind"] == k and p["to"] == v), None)
        if p is not None:
            p["alpha"] = True
            calibrated.add(k)
    kept = [m for m in measured if kind_of(m["group"]) not in calibrated]
    return kept, len(measured) - len(kept)


def _versions(doc: Mapping[str, object], eps: Mapping[tuple[str, str], float] | None = None) -> dict[str, dict[str, tuple[float, int]]]:
    """``{unit key: {version: (eps, dbytes)}}`` of every unit with a row, the base's version at ``dbytes`` 0; the
    weight errors ``eps`` in place of the document's where given."""
    out: dict[str, dict[str, tuple[float, int]]] = {}
    for r in doc["results"]:  # type: ignore[attr-defined]
        key = unit_key(r["layer"], r["group"])
        mine = out.setdefault(key, {})
        mine[r["donor"]] = (float(r["eps"]) if eps is None else eps[(key, r["donor"])], int(r["dbytes"]))
        mine[BASE] = (float(r["eps_base"]) if eps is None else eps[(key, BASE)], 0)
    return out


def _ends(versions: Mapping[str, tuple[float, int]]) -> tuple[str, str]:
    """A unit's top and worst version as the measurement picks them (:func:`.calibrate.top_versions`,
    :func:`.calibrate.worst_versions`): the least and the most eps; ties the fewer bytes, the base, the id."""
    top = min(versions, key=lambda v: (versions[v][0], versions[v][1], v != BASE, v))
    worst = min(versions, key=lambda v: (-versions[v][0], versions[v][1], v != BASE, v))
    return top, worst


def derive(doc: Mapping[str, object], *, calibrate: str, curve: str, weights: Mapping[str, object] | None = None) -> dict:
    """The document a top-down measurement with ``--calibrate calibrate --curve curve`` would have written from
    the passes of ``doc`` (a complete top-down document, not a shard); with ``weights`` (a ``--method weights``
    document of the same sources), its weight errors in place of ``doc``'s.

    Refused: a document whose passes cannot give the variant (``--curve versions`` from one that has no pooled
    candidates, a unit with no drop of its own, a two-point curve or a refinement, which no other variant reads
    the same way), and weights of other sources."""
    s = doc["settings"]  # type: ignore[index]
    if s["method"] != "top-down" or "shard" in s or doc.get("refinement") or s.get("curve") == "two-point":  # type: ignore[attr-defined]
        raise MosaicError("only a whole top-down measurement with a line or versions curve can be read under other settings")
    if curve not in ("line", "versions") or calibrate not in ("units", "kinds", "pooled"):
        raise MosaicError(f"--calibrate {calibrate} --curve {curve}: a variant is units, kinds or pooled, line or versions")
    if calibrate == "pooled" and curve != "versions":
        raise MosaicError("--calibrate pooled reads each kind's alpha from its pooled pass: it needs --curve versions")
    if curve == "versions" and not doc.get("pooled"):  # type: ignore[attr-defined]
        raise MosaicError("--curve versions needs the pooled candidates of a measurement made with it")
    out = copy.deepcopy(dict(doc))
    measured = {unit_key(m["layer"], m["group"]): m for m in out["measured"]}
    have = _versions(out)
    lacking = [k for k, vs in have.items() if k not in measured and len({e for e, _ in vs.values()}) > 1]
    if lacking:  # a unit of a layer outside --only-layers: only its kind's alpha says anything of it
        raise MosaicError(f"every unit needs a drop of its own to be read under other settings; {lacking[0]} has none")
    notes = list(out.get("notes", []))
    if weights is not None:
        if weights["settings"]["method"] != "weights" or weights["base"]["files"] != out["base"]["files"] or any(  # type: ignore[index]
                weights["donors"].get(d, {}).get("files") != v["files"] for d, v in out["donors"].items()):  # type: ignore[attr-defined]
            raise MosaicError("the weight errors are not a --method weights document of the measurement's sources")
        eps: dict[tuple[str, str], float] = {}
        for r in weights["results"]:  # type: ignore[attr-defined]
            key = unit_key(r["layer"], r["group"])
            eps[(key, r["donor"])], eps[(key, BASE)] = float(r["eps"]), float(r["eps_base"])
        have = _versions(out, eps)
        moved_top = moved_drop = 0
        for key, m in measured.items():
            mine = have[key]
            top, worst = _ends(mine)
            moved_top += top != out["top"]["versions"][key]
            moved_drop += worst != m["to"]
            m["eps_base"], m["eps_top"], m["eps_to"] = mine[BASE][0], mine[out["top"]["versions"][key]][0], mine[m["to"]][0]
            m["alpha"] = alpha_of(m["dkl_drop"], m["dkl_drop_se"], m["eps_to"], m["eps_top"]).value
        for r in out["results"]:
            key = unit_key(r["layer"], r["group"])
            r["eps"], r["eps_base"] = eps[(key, r["donor"])], eps[(key, BASE)]
        out["settings"].pop("imatrix", None)
        if "imatrix" in weights["settings"]:  # type: ignore[operator]
            out["settings"]["imatrix"] = copy.deepcopy(weights["settings"]["imatrix"])  # type: ignore[index]
        out["settings"]["weights_reference"] = weights["settings"]["weights_reference"]  # type: ignore[index]
        notes.append(f"weight errors of another weighting than the passes were chosen by: under it, {moved_top} units' top "
                     f"and {moved_drop} units' drop would be at other versions")
    if calibrate == "pooled":
        out["measured"], dropped = pooled_calibration(out["measured"], out["pooled"])
        out["forward_passes"] -= dropped  # type: ignore[operator]
        notes.append(f"each kind's alpha from its pooled pass at its drop version; {dropped} drops of those kinds left out")
    if curve == "line" and out.pop("pooled", None):
        out["forward_passes"] -= len(doc["pooled"])  # type: ignore[arg-type]
    out["settings"]["calibrate"], out["settings"]["curve"] = calibrate, curve
    out.pop("calibration", None)
    out["notes"] = [*notes, f"derived from the passes of a measurement made with --calibrate {s['calibrate']} --curve {s['curve']}"]
    return complete(out)
