"""From weight errors and a few measured drops to a predicted ``dkl`` for every unit and donor.

The model: what a unit costs the model is proportional to the error its version leaves in its weights,
``dkl(u, v) ≈ alpha_u × (eps_v − eps_top)``, so a swap from the base's version to a donor's buys
``alpha_u × (eps_base − eps_donor)``. The weight errors come from the files (:mod:`.weights`); ``alpha_u``,
how much the model feels unit ``u``'s error, is measured *from the top*: in the top model (every unit at its
lowest-eps version) one unit is dropped to its worst version (the highest eps: the base's, or a smaller donor's
where one is worse), and the rise in KL over the rise in eps is ``alpha_u``; a version of fewer bytes than the
base's then has its loss predicted as an upgrade's gain is, inside the measured span. Measured where every other unit is good, a drop stands out of the noise; measured from the
base (one unit swapped into a broken model) it drowns in it.

``units`` calibration gives each measured unit its own alpha; ``kinds`` pools the units of a kind (``attn_v``,
``ffn_down``, ...: the unit's group; ``layer`` for whole layers) over the measured layers and gives the pooled
alpha to that kind in every layer; ``pooled`` reads it from the kind's pass that moves every one of its units to
its drop version together. The retired ``groups`` (a few passes, each dropping a share of the kind's units) and
two-point curves (a second drop per unit, ``mid``) are still read from the documents that hold them. A line
assumes that a version costs what its weight error says, whatever its type; ``--curve versions`` measures each kind's units moved together to each version and multiplies the line
there by a factor, the measured rise over the predicted one, taken only as far as it is proved (:func:`credible`).
Everything here is arithmetic on the document's own records, so the same functions assemble a measurement after
one run and after ``--merge`` of its shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

BASE = "base"
#: the calibrations that give every unit of a kind one alpha (``groups``: retired, its documents still read)
KIND_CALIBRATIONS = ("kinds", "pooled", "groups")


def kind_of(group: str | None) -> str:
    """A unit's kind: its group (``attn_v``, ``ffn_exps``, ``token_embd``...), or ``layer`` for whole layers."""
    return group or "layer"


def unit_key(layer: int | None, group: str | None) -> str:
    """``"<layer>/<group>"``, ``null`` for a missing part (``"null/token_embd"``, ``"3/null"``): how
    ``top.versions`` and a shard's candidate list name a unit."""
    return f"{'null' if layer is None else layer}/{'null' if group is None else group}"


def top_versions(versions: Sequence[Sequence[str]], eps: Mapping[tuple[int, str], float],
                 nbytes: Mapping[tuple[int, str], int]) -> list[str]:
    """Per unit, its lowest-eps version among ``versions[u]`` (``"base"`` and the donors that have it).
    Ties: the fewer bytes, then the base, then the donor id."""
    return [min(vs, key=lambda v, u=u: (eps[(u, v)], nbytes[(u, v)], v != BASE, v)) for u, vs in enumerate(versions)]


def worst_versions(versions: Sequence[Sequence[str]], eps: Mapping[tuple[int, str], float],
                   nbytes: Mapping[tuple[int, str], int]) -> list[str]:
    """Per unit, the version its drop candidate puts it at: the highest eps among ``versions[u]`` (a version of
    fewer bytes than the base's included), so that every version's predicted dkl lies between two measured
    points. Ties: the fewer bytes, then the base, then the donor id."""
    return [min(vs, key=lambda v, u=u: (-eps[(u, v)], nbytes[(u, v)], v != BASE, v)) for u, vs in enumerate(versions)]


def drop_end(m: Mapping[str, object]) -> float:
    """The weight error a measured drop went to: ``eps_to`` (v3), the base's in a v2 record."""
    return float(m.get("eps_to", m["eps_base"]))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Alpha:
    """How much the model feels a unit's (or a kind's) weight error: nats of KL per unit of eps."""

    value: float
    se: float


def alpha_of(dkl_drop: float, dkl_drop_se: float, eps_to: float, eps_top: float) -> Alpha:
    """``max(0, dkl_drop) / (eps_to − eps_top)`` (0 where the two are equal), its standard error the drop's
    over the same span; ``eps_to`` the weight error of the version the drop went to."""
    span = eps_to - eps_top
    return Alpha(max(0.0, dkl_drop) / span, dkl_drop_se / span) if span > 0 else Alpha(0.0, 0.0)


def measured_record(layer: int | None, group: str | None, kl: float, top1: float, nll: float, top_kl: float,
                    dkl_drop_se: float, eps_base: float, eps_top: float, mid: dict | None = None, *,
                    to: str = BASE, eps_to: float | None = None) -> dict[str, object]:
    """The document's record of one candidate that ran: the top with this unit at version ``to`` (its worst; the
    base's where that is the worst) and, with ``--curve two-point``, ``mid``: the top with it at an intermediate
    version, ``{"donor", "eps", "kl", "dkl_drop", "dkl_drop_se"}``."""
    drop = kl - top_kl
    end = eps_base if eps_to is None else eps_to
    rec: dict[str, object] = {"layer": layer, "group": group, "dkl_drop": drop, "dkl_drop_se": dkl_drop_se, "kl": kl,
                              "top1": top1, "nll": nll, "eps_base": eps_base, "eps_top": eps_top,
                              "alpha": alpha_of(drop, dkl_drop_se, end, eps_top).value, "to": to, "eps_to": end}
    if mid is not None:
        rec["mid"] = mid
    return rec


def curve_loss(m: Mapping[str, object], eps: float) -> tuple[float, float]:
    """A unit's loss over the top at weight error ``eps`` and its standard error, on the curve its drops measured:
    the line from the top through the drop (to the version it went to), or, with a second drop (``mid``), the two
    lines top → mid → drop (the mid drop kept between 0 and the drop's, so that more error never predicts less
    loss); beyond the drop's error, the last line goes on."""
    top, base = float(m["eps_top"]), drop_end(m)  # type: ignore[arg-type]
    d_base, se_base = max(0.0, float(m["dkl_drop"])), float(m["dkl_drop_se"])  # type: ignore[arg-type]
    mid = m.get("mid")
    if base <= top:
        return 0.0, 0.0
    if not mid:
        f = (eps - top) / (base - top)
        return d_base * f, se_base * abs(f)
    e_mid = float(mid["eps"])  # type: ignore[index]
    d_mid = min(d_base, max(0.0, float(mid["dkl_drop"])))  # type: ignore[index]
    se_mid = float(mid["dkl_drop_se"])  # type: ignore[index]
    if eps <= e_mid:
        f = (eps - top) / (e_mid - top)
        return d_mid * f, se_mid * abs(f)
    f = (eps - e_mid) / (base - e_mid)
    return d_mid + (d_base - d_mid) * f, math.hypot(se_mid * (1 - f), se_base * f)


def kind_alphas(measured: Iterable[Mapping[str, object]]) -> dict[str, tuple[Alpha, int]]:
    """Per kind: ``Σ max(0, dkl_drop) / Σ (eps_to − eps_top)`` over its measured units, the ratio's standard
    error (the drops' errors in quadrature over the same sum), and how many units it pools."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    var: dict[str, float] = {}
    n: dict[str, int] = {}
    for m in measured:
        k = kind_of(m["group"])  # type: ignore[arg-type]
        num[k] = num.get(k, 0.0) + max(0.0, float(m["dkl_drop"]))  # type: ignore[arg-type]
        den[k] = den.get(k, 0.0) + drop_end(m) - float(m["eps_top"])  # type: ignore[arg-type]
        var[k] = var.get(k, 0.0) + float(m["dkl_drop_se"]) ** 2  # type: ignore[arg-type]
        n[k] = n.get(k, 0) + 1
    return {k: (Alpha(num[k] / den[k], math.sqrt(var[k]) / den[k]) if den[k] > 0 else Alpha(0.0, 0.0), n[k])
            for k in sorted(num)}


def predicted(alpha: Alpha | None, eps_base: float, eps_donor: float, base_kl: float | None) -> dict[str, object]:
    """The predicted fields of a (unit, donor) result: ``dkl = −alpha × (eps_base − eps_donor)``, its standard
    error (the alpha's × the same span), ``kl`` = the base's + dkl; no top-1 or NLL (nothing ran for it).
    ``alpha`` ``None``: the weight error itself (``--method weights``: alpha 1, no standard error)."""
    gain = eps_base - eps_donor
    a = alpha.value if alpha is not None else 1.0
    dkl = -a * gain
    return {"kl": None if base_kl is None else base_kl + dkl, "dkl": dkl,
            "dkl_se": None if alpha is None else alpha.se * abs(gain), "dtop1": None, "dnll": None, "predicted": True}


def credible(ratio: float, se: float) -> float:
    """The value nearest 1 within two standard errors of ``ratio`` (1 itself when the interval holds it): a
    correction moves the model only as far as its measurement proves the model wrong."""
    return min(1.0, ratio + 2 * se) if ratio < 1 else max(1.0, ratio - 2 * se)


def drop_version(tos: Sequence[str]) -> str:
    """The version a kind's drops go to: the one most of its units' worst versions are (ties: the base, then
    the id)."""
    return min(set(tos), key=lambda v: (-tos.count(v), v != BASE, v))


def pooled_alphas(pooled: Sequence[Mapping[str, object]], rows: Sequence[Mapping[str, object]],
                  measured: Sequence[Mapping[str, object]] = ()) -> dict[str, tuple[Alpha, int]]:
    """``--calibrate pooled``: per kind, its alpha from its pooled pass marked ``alpha`` (every unit of the
    kind moved together to the kind's drop version): ``max(0, dkl) / Σ (eps_to − eps_top)`` over the units it
    moved, the pass's standard error over the same sum; a kind with no such pass (one unit, whose drop is that
    pass) from its measured drops, as ``kinds``."""
    top = _tops(rows)
    eps = _eps(rows)
    out = dict(kind_alphas(measured))
    for p in pooled:
        if not p.get("alpha"):
            continue
        den = sum(eps[(key, str(p["to"]))] - top[key] for key in p["units"])  # type: ignore[attr-defined]
        a = Alpha(max(0.0, float(p["dkl"])) / den, float(p["dkl_se"]) / den) if den > 0 else Alpha(0.0, 0.0)  # type: ignore[arg-type]
        out[str(p["kind"])] = (a, len(p["units"]))  # type: ignore[arg-type]
    return dict(sorted(out.items()))


def group_alphas(groups: Sequence[Mapping[str, object]], rows: Sequence[Mapping[str, object]],
                 measured: Sequence[Mapping[str, object]] = ()) -> dict[str, tuple[Alpha, int]]:
    """``--calibrate groups``: per kind, ``Σ max(0, dkl) / Σ (eps_to − eps_top)`` over its group passes (each the
    top with a share of its units at their drop versions together) and the units they moved, the passes' standard
    errors in quadrature over the same sum: :func:`kind_alphas` with a group's pass in place of its units' drops
    summed. A kind with no group (one unit, whose drop is its group) from its measured drop, as ``kinds``."""
    top = _tops(rows)
    eps = _eps(rows)
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    var: dict[str, float] = {}
    n: dict[str, int] = {}
    for g in groups:
        k = str(g["kind"])
        num[k] = num.get(k, 0.0) + max(0.0, float(g["dkl"]))  # type: ignore[arg-type]
        den[k] = den.get(k, 0.0) + sum(eps[(u, str(v))] - top[u] for u, v in zip(g["units"], g["to"]))  # type: ignore[call-overload]
        var[k] = var.get(k, 0.0) + float(g["dkl_se"]) ** 2  # type: ignore[arg-type]
        n[k] = n.get(k, 0) + len(g["units"])  # type: ignore[arg-type]
    out = dict(kind_alphas(measured))
    out |= {k: (Alpha(num[k] / den[k], math.sqrt(var[k]) / den[k]) if den[k] > 0 else Alpha(0.0, 0.0), n[k]) for k in num}
    return dict(sorted(out.items()))


def kind_calibration(calibrate: str, measured: Sequence[Mapping[str, object]], pooled: Sequence[Mapping[str, object]] = (),
                     rows: Sequence[Mapping[str, object]] = (), groups: Sequence[Mapping[str, object]] = ()
                     ) -> dict[str, tuple[Alpha, int]]:
    """Each kind's alpha and how many units it stands for, under ``kinds``, ``pooled`` or ``groups``."""
    if calibrate == "pooled":
        return pooled_alphas(pooled, rows, measured)
    if calibrate == "groups":
        return group_alphas(groups, rows, measured)
    return kind_alphas(measured)


def _alphas(measured: Sequence[Mapping[str, object]], calibrate: str, pooled: Sequence[Mapping[str, object]] = (),
            rows: Sequence[Mapping[str, object]] = (), groups: Sequence[Mapping[str, object]] = ()
            ) -> Callable[[object, object], Alpha]:
    """``(layer, group) -> Alpha``: each unit's own (``units``; 0 for a unit not run, whose top version is the
    base's), or its kind's (:func:`kind_calibration`)."""
    if calibrate in KIND_CALIBRATIONS:
        by_kind = {k: a for k, (a, _) in kind_calibration(calibrate, measured, pooled, rows, groups).items()}
        return lambda layer, group: by_kind.get(kind_of(group), Alpha(0.0, 0.0))  # type: ignore[arg-type]
    own = {unit_key(m["layer"], m["group"]): alpha_of(m["dkl_drop"], m["dkl_drop_se"], drop_end(m), m["eps_top"])  # type: ignore[arg-type]
           for m in measured}
    return lambda layer, group: own.get(unit_key(layer, group), Alpha(0.0, 0.0))  # type: ignore[arg-type]


def version_factors(pooled: Sequence[Mapping[str, object]], measured: Sequence[Mapping[str, object]],
                    rows: Sequence[Mapping[str, object]], calibrate: str, groups: Sequence[Mapping[str, object]] = ()) -> list[dict]:
    """``--curve versions``: each pooled candidate (a kind's measured units moved together to one version) with
    what the line predicted for it (the sum of its units' ``alpha × (eps_v − eps_top)``), the ratio of the
    measured rise to that sum, its standard error, and the ``factor`` the kind's curve takes at that version: the
    credible ratio, at least 0 (1 where the line predicted nothing)."""
    alpha = _alphas(measured, calibrate, pooled, rows, groups)
    top = _tops(rows)
    eps = _eps(rows)
    out = []
    for p in pooled:
        pred = 0.0
        for key in p["units"]:  # type: ignore[attr-defined]
            layer, group = key.split("/")
            pred += alpha(None if layer == "null" else int(layer), group).value * (eps[(key, str(p["to"]))] - top[key])
        if pred > 0:
            ratio, se = float(p["dkl"]) / pred, float(p["dkl_se"]) / pred  # type: ignore[arg-type]
            factor = max(0.0, credible(ratio, se))
        else:
            ratio, se, factor = None, None, 1.0
        out.append({**p, "predicted": pred, "ratio": ratio, "ratio_se": se, "factor": factor})
    return out


def fill(rows: Sequence[dict], measured: Sequence[Mapping[str, object]], calibrate: str,
         base_kl: float | None, factors: Mapping[tuple[str, str], float] | None = None,
         pooled: Sequence[Mapping[str, object]] = (), groups: Sequence[Mapping[str, object]] = ()) -> list[dict]:
    """Every (unit, donor) row (``layer``, ``group``, ``donor``, ``eps``, ``eps_base``...) with its predicted
    ``dkl`` from the measured drops: each unit's own alpha (``units``; 0 for a unit not run, whose top version
    is the base's), its own two-line curve where it has a second drop, or its kind's alpha (``kinds``); with
    ``factors`` (``--curve versions``: ``{(kind, version): factor}``), each version's loss over the top times its
    kind's factor there (1 where none was measured)."""
    if calibrate == "units" and any(m.get("mid") for m in measured):
        curves = {unit_key(m["layer"], m["group"]): m for m in measured}  # type: ignore[arg-type]
        out = []
        for r in rows:
            m = curves.get(unit_key(r["layer"], r["group"]))
            if m is None:
                out.append({**r, **predicted(Alpha(0.0, 0.0), r["eps_base"], r["eps"], base_kl)})
                continue
            at_base, se_base = curve_loss(m, r["eps_base"])
            at_v, se = curve_loss(m, r["eps"])
            out.append(_loss_row(r, at_v - at_base, math.hypot(se, se_base), base_kl))
        return out
    alpha = _alphas(measured, calibrate, pooled, rows, groups)
    if not factors:
        return [{**r, **predicted(alpha(r["layer"], r["group"]), r["eps_base"], r["eps"], base_kl)} for r in rows]
    top = _tops(rows)
    out = []
    for r in rows:
        a, k = alpha(r["layer"], r["group"]), kind_of(r["group"])
        e_top = top[unit_key(r["layer"], r["group"])]
        span = factors.get((k, r["donor"]), 1.0) * (r["eps"] - e_top) - factors.get((k, BASE), 1.0) * (r["eps_base"] - e_top)
        out.append(_loss_row(r, a.value * span, a.se * abs(span), base_kl))
    return out


def _eps(rows: Sequence[Mapping[str, object]]) -> dict[tuple[str, str], float]:
    """``{(unit key, version): weight error}`` of every row's donor and its base."""
    eps = {(unit_key(r["layer"], r["group"]), str(r["donor"])): float(r["eps"]) for r in rows}  # type: ignore[arg-type]
    eps |= {(unit_key(r["layer"], r["group"]), BASE): float(r["eps_base"]) for r in rows}  # type: ignore[arg-type]
    return eps


def _tops(rows: Sequence[Mapping[str, object]]) -> dict[str, float]:
    """Each unit's lowest weight error among its versions: its top's (:func:`top_versions`), for a unit outside
    the measured layers too."""
    top: dict[str, float] = {}
    for r in rows:
        key = unit_key(r["layer"], r["group"])  # type: ignore[arg-type]
        top[key] = min(top.get(key, math.inf), float(r["eps"]), float(r["eps_base"]))  # type: ignore[arg-type]
    return top


def _loss_row(r: dict, dkl: float, se: float, base_kl: float | None) -> dict:
    return {**r, "kl": None if base_kl is None else base_kl + dkl, "dkl": dkl, "dkl_se": se,
            "dtop1": None, "dnll": None, "predicted": True}


def complete(doc: dict) -> dict:
    """A top-down document with its predictions: every result's ``dkl`` from the measured drops, under
    ``kinds`` each kind's pooled alpha as ``calibration``, and under ``--curve versions`` each pooled
    candidate's factor. Used after one run and after a merge of shards."""
    calibrate = doc["settings"]["calibrate"]
    factors = None
    pooled = doc.get("pooled") or []
    groups = doc.get("groups") or []
    if doc.get("pooled") is not None:
        doc["pooled"] = version_factors(doc["pooled"], doc["measured"], doc["results"], calibrate, groups)
        factors = {(p["kind"], p["to"]): p["factor"] for p in doc["pooled"]}
    doc["results"] = fill(doc["results"], doc["measured"], calibrate, doc["base"]["kl"], factors, pooled, groups)
    if calibrate in KIND_CALIBRATIONS:
        alphas = kind_calibration(calibrate, doc["measured"], pooled, doc["results"], groups)
        doc["calibration"] = {k: {"alpha": a.value, "alpha_se": a.se, "units": n} for k, (a, n) in alphas.items()}
    return doc
