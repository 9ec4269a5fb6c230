"""Refining a top-down measurement where the plan lands (``mosaic measure --refine N --max-size SIZE``).

The top-down model measures how much the model feels each unit's error from the *top*, where every other
unit is at its best version. A plan at a budget lands far below the top, and there the units' effects do not
add as they do near it: the drops from the top of SmolLM2's or a larger model's units add up to about twice the
base's own KL, and they overstate some kinds of tensor against others (cheap attention tensors against the
feed-forward ones a 3-bit model needs). So, after the top-down measurement:

1. plan at ``SIZE`` from the current predictions, exactly as ``mosaic plan --max-size SIZE`` would;
2. run that plan, and for every measured unit one candidate that moves only that unit: one version *down* from
   where the plan put it (the next larger weight error it has: a smaller donor's, or the base's), a unit already
   at its worst version *up* to its best;
3. per kind of unit (``attn_v``, ``ffn_down``, ...), the ratio of what those moves measured to what the
   current model predicted for them, pooled over every layer: ``r_k = Σ s·dkl / Σ |predicted|`` (``s`` the
   predicted move's sign), at least 0, with its standard error;
4. every unit's alpha times its kind's *credible* ratio, every (unit, donor) ``dkl`` predicted again, and back
   to 1 until the plan repeats or ``N`` rounds have run.

The credible ratio is the value nearest 1 within two standard errors of ``r_k``: the model moves only as far as
the moves prove it wrong. A kind's scale multiplies its whole curve, down to its worst version, from moves of
one version each near the plan; near a good plan those moves are as small as their noise, and a ratio taken at
face value there (0 ± 1.6, as SmolLM2's attention kinds measured one round at Q4_K_M's bytes) makes every version
of the kind free: the next plan dropped them to the ladder's IQ1_S and its KL was 30 × the rival's.

Why per kind and not per unit: one unit's move at the operating point changes the KL by as little as its
noise (a model at KL 0.1 is noisy where the top, at 0.005, is not), while a kind pooled over 30 layers is
measured to a few percent; what goes wrong at the operating point is a kind's scale (which the plan trades
kinds by), and the shape across layers of one kind is what the clean drops from the top measure well. A kind
no move measured keeps its scale. Everything here is arithmetic on the document's records; the orchestration
(which candidates run, the journal) is :mod:`.run`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from mosaic._measure.calibrate import BASE, credible, kind_of, unit_key


def moves(plan: Mapping[int, str], selected: Sequence[int], versions: Sequence[Sequence[str]],
          eps: Mapping[tuple[int, str], float], nbytes: Mapping[tuple[int, str], int]) -> list[tuple[int, str, str]]:
    """``(unit, from version, to version)`` for every selected unit: one version down from where the plan put it
    (the next larger weight error; ties: the fewer bytes), the base's version included where a donor of fewer
    bytes lies below it; a unit already at its worst version goes up to its lowest weight error instead. A unit
    with nowhere to go (one version only) has none. With upgrades only, the base's version is the worst: a unit
    the plan left there goes up, as before."""
    out = []
    for ui in selected:
        here = plan.get(ui, BASE)
        e = eps[(ui, here)]
        worse = [v for v in versions[ui] if v != here and eps[(ui, v)] > e]
        if worse:
            out.append((ui, here, min(worse, key=lambda v: (eps[(ui, v)], nbytes[(ui, v)], v != BASE, v))))
            continue
        better = [v for v in versions[ui] if v != here and eps[(ui, v)] < e]
        if better:
            out.append((ui, here, min(better, key=lambda v: (eps[(ui, v)], nbytes[(ui, v)], v != BASE, v))))
    return out


def kind_ratios(records: Sequence[Mapping[str, object]]) -> dict[str, dict[str, float | int]]:
    """Per kind, over one round's moves: ``ratio`` = Σ s·dkl / Σ |predicted| (at least 0), its standard error
    (the moves' paired errors in quadrature over the same sum) and how many moves it pools."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    var: dict[str, float] = {}
    n: dict[str, int] = {}
    for r in records:
        p = float(r["predicted"])  # type: ignore[arg-type]
        if p == 0:
            continue
        k = kind_of(r["group"])  # type: ignore[arg-type]
        s = 1.0 if p > 0 else -1.0
        num[k] = num.get(k, 0.0) + s * float(r["dkl"])  # type: ignore[arg-type]
        den[k] = den.get(k, 0.0) + abs(p)
        var[k] = var.get(k, 0.0) + float(r["dkl_se"]) ** 2  # type: ignore[arg-type]
        n[k] = n.get(k, 0) + 1
    return {k: {"ratio": max(0.0, num[k] / den[k]), "ratio_se": math.sqrt(var[k]) / den[k], "moves": n[k]} for k in sorted(num)}


def scales(rounds: Sequence[Mapping[str, object]]) -> dict[str, float]:
    """Each kind's scale after ``rounds``: the product of its credible ratios (a kind a round did not measure
    keeps what it had)."""
    out: dict[str, float] = {}
    for rd in rounds:
        for k, r in rd["ratios"].items():  # type: ignore[attr-defined]
            out[k] = out.get(k, 1.0) * credible(float(r["ratio"]), float(r["ratio_se"]))
    return out


def rescale(results: Sequence[dict], scale: Mapping[str, float], base_kl: float | None) -> list[dict]:
    """Every (unit, donor) result with its predicted ``dkl`` (and ``kl``, ``dkl_se``) times its kind's scale."""
    out = []
    for r in results:
        f = scale.get(kind_of(r["group"]), 1.0)
        if f == 1.0 or r["dkl"] is None:
            out.append(r)
            continue
        dkl = r["dkl"] * f
        out.append({**r, "dkl": dkl, "kl": None if base_kl is None else base_kl + dkl,
                    "dkl_se": None if r["dkl_se"] is None else r["dkl_se"] * f})
    return out


def predicted_move(results_by_unit: Mapping[tuple[object, object], Mapping[str, dict]], layer: object, group: object,
                   here: str, to: str) -> float:
    """The current model's KL change of moving a unit from version ``here`` to ``to`` (the base's dkl is 0)."""
    row = results_by_unit[(layer, group)]

    def dkl(v: str) -> float:
        return 0.0 if v == BASE else float(row[v]["dkl"])

    return dkl(to) - dkl(here)


def plan_versions(chosen: Sequence[Mapping[str, object]], index: Mapping[tuple[object, object], int]) -> dict[int, str]:
    """``mosaic plan``'s chosen list as ``{unit index: donor}``."""
    return {index[(c["layer"], c["group"])]: str(c["donor"]) for c in chosen}


def versions_key(plan: Mapping[int, str], units: Sequence[object]) -> dict[str, str]:
    """A plan as the document writes it: ``{"<layer>/<group>": donor}`` for the units it takes from a donor."""
    return {unit_key(units[ui].layer, units[ui].group): d for ui, d in sorted(plan.items())}  # type: ignore[attr-defined]
