"""What ``mosaic measure`` does where no method flag is given.

Three flags change how ``top-down`` turns weight errors into drops: ``--imatrix-cap`` (the importances held under
a robust ceiling), ``--calibrate`` (each unit's own sensitivity, or one per kind of unit) and ``--curve`` (a line
per unit, or that line corrected at each version by moving a kind's units there together). Each is on or off by
default by held-out evidence from two models of different widths, chosen by a rule written before the runs that
decided it (bench/RESULTS.md, "Choosing the ladder's default on two models"), never by one model's numbers.

A flag given explicitly always wins; a default that cannot go with an explicit choice yields to it (a
``--curve two-point`` is per unit, so calibration stays per unit; ``--refine`` is its own correction of the line,
so the curve stays a line). ``--shard`` is the exception: it cannot take the default curve and is refused with the
flag that makes it possible, because a sharded measurement must mean what the unsharded one means.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mosaic._measure.run import MeasureRequest

#: ``--imatrix-cap`` where an importance matrix is given and neither ``--imatrix-cap`` nor ``--no-imatrix-cap`` is.
IMATRIX_CAP = False
#: ``--calibrate`` of ``--method top-down`` where none is given (pooled over ``--only-layers``, default every layer).
CALIBRATE = "units"
#: ``--curve`` of ``--method top-down`` where none is given.
CURVE = "line"


def resolved(req: MeasureRequest) -> MeasureRequest:
    """``req`` with every method flag it leaves open (None) set to the default that goes with the ones it gives."""
    top_down = req.method == "top-down"
    cap = req.imatrix_cap if req.imatrix_cap is not None else (IMATRIX_CAP and req.imatrix is not None)
    curve = req.curve if req.curve is not None else (CURVE if top_down and not req.refine else "line")
    calibrate = req.calibrate if req.calibrate is not None else (CALIBRATE if top_down and curve != "two-point" else "units")
    return dataclasses.replace(req, imatrix_cap=cap, curve=curve, calibrate=calibrate)

