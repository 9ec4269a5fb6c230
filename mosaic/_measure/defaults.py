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

A flag given explicitly always wins; a default that cannot go with an explicit choice yields to it (a
``--curve two-point`` is per unit, so calibration stays per unit; ``--refine`` is its own correction of the line,
so the curve stays a line). ``--shard`` is the exception: it cannot take the versions curve and is refused with
the flag that makes it possible, because a sharded measurement must mean what the unsharded one means.

Over a ladder the default is ``--calibrate pooled``: each kind's alpha is read from the versions curve's pass that
moves all its units to their drop version together, and only a kind of one unit (the embedding, the output) has a
drop of its own, so the forward passes are set by the model's kinds and the ladder's types, not by its depth. It
replaced one drop per unit (``--calibrate kinds``, 3.6 × the passes on Qwen2.5-Coder-1.5B) by the rule of
bench/RESULTS.md ("`--calibrate pooled` on Qwen2.5-Coder-1.5B, decided on rows no choice saw"): on rows that no
choice was made on, its plans held the drops' within one paired SE at every goal size of both models. With
``--curve line`` (no pooled passes) or ``--sample-layers N`` the ladder's default falls back to ``kinds``. Under ``kinds``,
``--sample-layers N`` runs the drops of N layers spread over the depth instead of every layer's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

#: mosaic._measure.run's MeasureRequest (named here by its fields: run imports this module, not the reverse)
Request = TypeVar("Request", bound=Any)


@dataclasses.dataclass(frozen=True)
class Method:
    imatrix_cap: bool  # where an importance matrix is given and neither --imatrix-cap nor --no-imatrix-cap is
    calibrate: str  # of --method top-down (pooled over --only-layers, default every layer)
    curve: str  # of --method top-down
    sample_layers: int  # under --calibrate kinds with neither --only-layers nor --refine: the layers whose drops run (0: every one)


#: ``--ladder DIR`` with no method flag.
LADDER = Method(imatrix_cap=True, calibrate="pooled", curve="versions", sample_layers=0)
#: ``--base``/``--donor`` with no method flag.
DONORS = Method(imatrix_cap=False, calibrate="units", curve="line", sample_layers=0)


def resolved(req: Request) -> Request:
    """``req`` with every method flag it leaves open (None) set to the default that goes with the ones it gives."""
    d = LADDER if req.ladder else DONORS
    top_down = req.method == "top-down"
    cap = req.imatrix_cap if req.imatrix_cap is not None else (d.imatrix_cap and req.imatrix is not None)
    curve = req.curve if req.curve is not None else (d.curve if top_down and not req.refine else "line")
    if req.calibrate is not None:
        calibrate = req.calibrate
    elif not top_down or curve == "two-point":
        calibrate = "units"
    elif d.calibrate in ("pooled", "groups") and (curve != "versions" or req.sample_layers):
        calibrate = "kinds"  # a pooled alpha is read from the versions curve's passes; a sample of layers' drops fits kinds
    else:
        calibrate = d.calibrate
    sample = (req.sample_layers if req.sample_layers is not None
              else d.sample_layers if calibrate == "kinds" and req.only_layers is None and not req.refine else 0)
    return dataclasses.replace(req, imatrix_cap=cap, curve=curve, calibrate=calibrate, sample_layers=sample)


def spread(layers: list[int], n: int) -> list[int]:
    """``n`` of ``layers`` (sorted), the middle one of each of ``n`` equal shares of them, so that each sampled
    layer stands for the share of the depth it samples (a sample that always held the first and the last would
    weigh them, usually the most sensitive, as a large part of every kind); all of them where there are no more
    than ``n``."""
    if n >= len(layers):
        return list(layers)
    return sorted({layers[round((i + 0.5) * len(layers) / n - 0.5)] for i in range(n)})
