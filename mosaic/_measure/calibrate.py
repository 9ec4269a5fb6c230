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
alpha to that kind in every layer. Everything here is arithmetic on the document's own records, so the same
functions assemble a measurement after one run and after ``--merge`` of its shards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

BASE = "base"


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


def mid_version(versions: Sequence[str], eps: Mapping[str, float], nbytes: Mapping[str, int], top: str,
                to: str = BASE) -> str | None:
    """The second point of a unit's curve: among its versions strictly between the top's and the drop's (``to``)
    weight error, the one nearest their midpoint on a log scale (where a plan's versions lie: weight errors of the
    ladder's types are spread by factors, not by steps); ties: the fewer bytes, then the donor id. ``None``
    where no version lies between. A top at zero error (the teacher's own tensor) counts as 10⁻⁴ of the drop's."""
    lo, hi = eps[top], eps[to]
    inner = [v for v in versions if v not in (to, top) and lo < eps[v] < hi]
    if not inner or hi <= 0:
        return None
    target = (math.log(max(lo, hi * 1e-4)) + math.log(hi)) / 2
    return min(inner, key=lambda v: (abs(math.log(eps[v]) - target) if eps[v] > 0 else math.inf, nbytes[v], v))


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


def fill(rows: Sequence[dict], measured: Sequence[Mapping[str, object]], calibrate: str,
         base_kl: float | None) -> list[dict]:
    """Every (unit, donor) row (``layer``, ``group``, ``donor``, ``eps``, ``eps_base``...) with its predicted
    ``dkl`` from the measured drops: each unit's own alpha (``units``; 0 for a unit not run, whose top version
    is the base's), its own two-line curve where it has a second drop, or its kind's alpha (``kinds``)."""
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
            dkl = at_v - at_base
            out.append({**r, "kl": None if base_kl is None else base_kl + dkl, "dkl": dkl, "dkl_se": math.hypot(se, se_base),
                        "dtop1": None, "dnll": None, "predicted": True})
        return out
    if calibrate == "kinds":
        by_kind = {k: a for k, (a, _) in kind_alphas(measured).items()}
        alpha_of_row = lambda r: by_kind.get(kind_of(r["group"]), Alpha(0.0, 0.0))  # noqa: E731
    else:
        own = {unit_key(m["layer"], m["group"]): alpha_of(m["dkl_drop"], m["dkl_drop_se"], drop_end(m), m["eps_top"])  # type: ignore[arg-type]
               for m in measured}
        alpha_of_row = lambda r: own.get(unit_key(r["layer"], r["group"]), Alpha(0.0, 0.0))  # noqa: E731
    return [{**r, **predicted(alpha_of_row(r), r["eps_base"], r["eps"], base_kl)} for r in rows]


def complete(doc: dict) -> dict:
    """A top-down document with its predictions: every result's ``dkl`` from the measured drops and, under
    ``kinds``, each kind's pooled alpha as ``calibration``. Used after one run and after a merge of shards."""
    calibrate = doc["settings"]["calibrate"]
    doc["results"] = fill(doc["results"], doc["measured"], calibrate, doc["base"]["kl"])
    if calibrate == "kinds":
        doc["calibration"] = {k: {"alpha": a.value, "alpha_se": a.se, "units": n} for k, (a, n) in kind_alphas(doc["measured"]).items()}
    return doc
