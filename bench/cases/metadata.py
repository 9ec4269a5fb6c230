"""The metadata case: build, audit, census and plan on the GLM-5.3 geometry (150k tensors), against ``cp -r``
and ``sha256sum``.

The original release's packer can be run as a contender when its script is given with
``MOSAIC_BENCH_PACK2=/path/to/mosaic_pack2.py`` (it is not part of this repository; it is ``mosaic_pack2.py``
in the public recipe repository of GLM-5.3-Flash-EXL3-Spark, :data:`PACK2_SOURCE`). The targets
(``TARGETS``) are ratios to that pipeline, measured in the same run; without it, the rows compare mosaic
with the plain baselines only."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from harness import DATA, MOSAIC, TARGETS, drop, glm_sources, plan_cmd, race, recipe_for, row, scores_for, sh

#: Where the original release's packer (``mosaic_pack2.py``) is published.
PACK2_SOURCE = "https://github.com/0xSero/glm-5.3-flash-spark-mosaic"


def case_metadata(runs: int) -> None:
    base, donor = glm_sources()
    recipe = recipe_for(base, donor, '3, 32, 33, "36-44"', "glm-spark")
    scores = scores_for("glm53", 45)
    out, cp_out = DATA / "out-glm", DATA / "out-glm-cp"
    contenders: dict[str, tuple[Callable[[], None], Callable[[], None] | None]] = {
        "mosaic build": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)]), lambda: drop(out)),
        "cp -r": (lambda: sh(["cp", "-r", str(base), str(cp_out)]), lambda: drop(cp_out)),
    }
    pack2 = os.environ.get("MOSAIC_BENCH_PACK2")
    ref = "cp -r"
    if pack2:
        # the original release's pipeline (its run-build-12l.sh): cp -a the base, run the packer with a
        # plan of every expert of the 12 layers, sha256sum the base's and the output's shards
        layers = [3, 32, 33, *range(36, 45)]
        plan_file = DATA / "pack2-plan.json"
        plan_file.write_text(json.dumps({"upgraded_expert_ids_by_layer": {str(la): list(range(288)) for la in layers}}))
        receipt = DATA / "pack2-receipt.json"
        name = "original pipeline (cp -a, pack2, sha256sum)"
        contenders[name] = (
            lambda: sh(
                f"cp -a '{base}' '{cp_out}' && {sys.executable} '{pack2}' --a0 '{base}' --base '{donor}' --out '{cp_out}' "
                f"--plan '{plan_file}' --receipt '{receipt}' && (cd '{base}' && sha256sum model-*.safetensors) >/dev/null "
                f"&& (cd '{cp_out}' && sha256sum model-*.safetensors) >/dev/null"
            ),
            lambda: drop(cp_out),
        )
        ref = name
    built = race("metadata: GLM preset build (150k tensors)", contenders, runs, ref)
    drop(cp_out)
    audited = race(
        "metadata: GLM geometry audit",
        {"mosaic audit": (lambda: sh([*MOSAIC, "audit", str(out)]), None), "sha256sum": (lambda: sh(f"sha256sum '{out}'/*"), None)},
        runs,
        "sha256sum",
    )
    looked = race(
        "metadata: GLM geometry census and plan",
        {"mosaic census --json": (lambda: sh([*MOSAIC, "census", str(base), "--json"]), None),
         "mosaic plan --layers 12": (lambda: sh(plan_cmd(base, donor, scores)), None)},
        runs,
        "mosaic census --json",
    )
    if pack2:
        for what, t in (("build", built["mosaic build"]), ("audit", audited["mosaic audit"]),
                        ("census", looked["mosaic census --json"]), ("plan", looked["mosaic plan --layers 12"])):
            row("metadata: GLM geometry", f"mosaic {what} / original pipeline", f"{t / built[ref]:.2f}", f"target ≤ {TARGETS[what]}")
    else:
        row("metadata: GLM geometry", "ratios to the original pipeline", "not measured",
            f"set MOSAIC_BENCH_PACK2=/path/to/mosaic_pack2.py (from {PACK2_SOURCE})")
