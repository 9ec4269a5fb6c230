"""What ``mosaic measure`` does where no method flag is given.

Three flags change how ``top-down`` turns weight errors into drops: ``--imatrix-cap`` (the importances held under
a robust ceiling), ``--calibrate`` (each unit's own sensitivity, or one per kind of unit) and ``--curve`` (a line
per unit, or that line corrected at each version by moving a kind's units there together). Each default is set
by held-out evidence where it was measured, never by one model's numbers:

- over a ladder (``--ladder DIR``: every tensor at every type, made from the model's source), by the rule of
  bench/RESULTS.md ("Choosing the ladder's default on two models"), written before the runs that decided it, on
  two models of different families and widths;
- over published quantizations (``--base``/``--donor``), where a model offers a handful of mixes: the method as
  it was measured there (README, "The rivals people ship"), since no flag gained on them.

A flag given explicitly always wins; a default that cannot go with an explicit choice yields to it (a pooled
alpha is read from the versions curve's passes, so ``--curve line`` calibrates by kinds). ``--shard`` is the
exception: it cannot take the versions curve and is refused with the flag that makes it possible, because a
sharded measurement must mean what the unsharded one means.

Over a ladder the default is ``--calibrate pooled``: each kind's alpha is read from the versions curve's pass that
moves all its units to their drop version together, and only a kind of one unit (the embedding, the output) has a
drop of its own, so the forward passes are set by the model's kinds and the ladder's types, not by its depth. It
replaced one drop per unit (``--calibrate kinds``, 3.6 × the passes on Qwen2.5-Coder-1.5B) by the rule of
bench/RESULTS.md ("`--calibrate pooled` on Qwen2.5-Coder-1.5B, decided on rows no choice saw"): on rows that no
choice was made on, its plans held the drops' within one paired SE at every goal size of both models. With
``--curve line`` (no pooled passes) the ladder's default falls back to ``kinds``.

Over a ladder the unit is each tensor kind of each layer (``module-group``): a ladder holds every tensor at every
type, and the plans the defaults were chosen by were made of those units.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

#: mosaic._measure.request's MeasureRequest (named here by its fields: it is resolved here, defined there)
Request = TypeVar("Request", bound=Any)


@dataclasses.dataclass(frozen=True)
class Method:
    imatrix_cap: bool  # where an importance matrix is given and neither --imatrix-cap nor --no-imatrix-cap is
    calibrate: str  # of --method top-down (pooled over --only-layers, default every layer)
    curve: str  # of --method top-down
    unit: str | None  # what a candidate takes (None: layer-experts where the base has routed experts, else layer)


#: ``--ladder DIR`` with no method flag.
LADDER = Method(imatrix_cap=True, calibrate="pooled", curve="versions", unit="module-group")
#: ``--base``/``--donor`` with no method flag.
DONORS = Method(imatrix_cap=False, calibrate="units", curve="line", unit=None)


def resolved(req: Request) -> Request:
    """``req`` with every method flag it leaves open (None) set to the default that goes with the ones it gives."""
    d = LADDER if req.ladder else DONORS
    top_down = req.method == "top-down"
    cap = req.imatrix_cap if req.imatrix_cap is not None else (d.imatrix_cap and req.imatrix is not None)
    curve = req.curve if req.curve is not None else (d.curve if top_down and not req.refine else "line")
    if req.calibrate is not None:
        calibrate = req.calibrate
    elif not top_down:
        calibrate = "units"
    elif d.calibrate == "pooled" and curve != "versions":
        calibrate = "kinds"  # a pooled alpha is read from the versions curve's passes
    else:
        calibrate = d.calibrate
    unit = req.unit if req.unit is not None else d.unit
    return dataclasses.replace(req, imatrix_cap=cap, curve=curve, calibrate=calibrate, unit=unit)
