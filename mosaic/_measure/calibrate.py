"""From weight errors and a few measured drops to a predicted ``dkl`` for every unit and donor.

The model: what a unit costs the model is proportional to the error its version leaves in its weights,
``dkl(u, v) ≈ alpha_u × (eps_v − eps_top)``, so a swap from the base's version to a donor's buys
``alpha_u × (eps_base − eps_donor)``. The weight errors come from the files (:mod:`.weights`); ``alpha_u``,
how much the model feels unit ``u``'s error, is measured *from the top*: in the top model (every unit at its
lowest-eps version) one unit is dropped back to the base's version, and the rise in KL over the rise in eps
is ``alpha_u``. Measured where every other unit is good, a drop stands out of the noise; measured from the
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


@dataclass(frozen=True)
class Alpha:
    """How much the model feels a unit's (or a kind's) weight error: nats of KL per unit of eps."""

    value: float
    se: float


def alpha_of(dkl_drop: float, dkl_drop_se: float, eps_base: float, eps_top: float) -> Alpha:
    """``max(0, dkl_drop) / (eps_base − eps_top)`` (0 where the two are equal), its standard error the drop's
    over the same span."""
    span = eps_base - eps_top
    return Alpha(max(0.0, dkl_drop) / span, dkl_drop_se / span) if span > 0 else Alpha(0.0, 0.0)


def measured_record(layer: int | None, group: str | None, kl: float, top1: float, nll: float, top_kl: float,
                    dkl_drop_se: float, eps_base: float, eps_top: float) -> dict[str, object]:
    """The document's record of one candidate that ran: the top with this unit at the base's version."""
    drop = kl - top_kl
    return {"layer": layer, "group": group, "dkl_drop": drop, "dkl_drop_se": dkl_drop_se, "kl": kl, "top1": top1,
            "nll": nll, "eps_base": eps_base, "eps_top": eps_top,
            "alpha": alpha_of(drop, dkl_drop_se, eps_base, eps_top).value}


def kind_alphas(measured: Iterable[Mapping[str, object]]) -> dict[str, tuple[Alpha, int]]:
    """Per kind: ``Σ max(0, dkl_drop) / Σ (eps_base − eps_top)`` over its measured units, the ratio's standard
    error (the drops' errors in quadrature over the same sum), and how many units it pools."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    var: dict[str, float] = {}
    n: dict[str, int] = {}
    for m in measured:
        k = kind_of(m["group"])  # type: ignore[arg-type]
        num[k] = num.get(k, 0.0) + max(0.0, float(m["dkl_drop"]))  # type: ignore[arg-type]
        den[k] = den.get(k, 0.0) + float(m["eps_base"]) - float(m["eps_top"])  # type: ignore[arg-type]
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
    is the base's) or its kind's (``kinds``)."""
    if calibrate == "kinds":
        by_kind = {k: a for k, (a, _) in kind_alphas(measured).items()}
        alpha_of_row = lambda r: by_kind.get(kind_of(r["group"]), Alpha(0.0, 0.0))  # noqa: E731
    else:
        own = {unit_key(m["layer"], m["group"]): alpha_of(m["dkl_drop"], m["dkl_drop_se"], m["eps_base"], m["eps_top"])  # type: ignore[arg-type]
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
