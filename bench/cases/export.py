"""The export case, the second seed: the Spark mosaic of the GLM preset repackaged as glm5-next GGUF, and its
audits."""

from __future__ import annotations

import json

from harness import DATA, MOSAIC, drop, glm_sources, race, recipe_for, row, sh, timed


def case_export(runs: int) -> None:
    """The second seed: the Spark mosaic of the GLM preset repackaged as glm5-next GGUF, and its audits."""
    base, donor = glm_sources()
    recipe = recipe_for(base, donor, '3, 32, 33, "36-44"', "glm-spark")
    built, out = DATA / "out-glm-export-src", DATA / "out-glm-gguf"
    drop(built)
    t_build = timed(lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(built)]))
    t_audit = timed(lambda: sh([*MOSAIC, "audit", str(built), "--sources", str(recipe)]))
    row("export: GLM preset (Spark mosaic)", "mosaic build", f"{t_build:.2f} s", "")
    row("export: GLM preset (Spark mosaic)", "mosaic audit --sources", f"{t_audit:.2f} s", "")
    race(
        "export: GLM preset -> glm5-next GGUF",
        {"mosaic export gguf": (lambda: sh([*MOSAIC, "export", "gguf", str(built), "--out", str(out)]), lambda: drop(out))},
        runs,
        "mosaic export gguf",
    )
    t_ga = timed(lambda: sh([*MOSAIC, "audit", str(out)]))
    t_gs = timed(lambda: sh([*MOSAIC, "audit", str(out), "--sources", str(built)]))
    n = len(json.loads((out / "manifest.json").read_text())["tensors"])
    row("export: GLM preset -> glm5-next GGUF", "mosaic audit (export)", f"{t_ga:.2f} s", f"{n:,} GGUF tensors")
    row("export: GLM preset -> glm5-next GGUF", "mosaic audit --sources (export)", f"{t_gs:.2f} s", "")
    drop(out)
    drop(built)
