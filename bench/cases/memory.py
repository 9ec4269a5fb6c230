"""The memory case: peak resident memory of build, audit, census and plan on the bytes preset at two sizes and
on the GLM geometry. The target is a peak RSS in MiB for every command, at every size (``TARGETS["rss_mib"]``);
the bytes preset's tensor count does not grow with its size, so memory can be compared across sizes."""

from __future__ import annotations

from harness import (
    DATA,
    MOSAIC,
    TARGETS,
    bytes_geometry,
    dataset,
    drop,
    glm_sources,
    peak_rss_mib,
    plan_cmd,
    recipe_for,
    row,
    scores_for,
)


def case_memory(small_gb: float, large_gb: float) -> None:
    for label, gb in (("small", small_gb), ("large", large_gb)):
        base = dataset(f"bytes-{gb}g-base", bytes_geometry(gb, 2, 1))
        donor = dataset(f"bytes-{gb}g-donor", bytes_geometry(gb, 3, 2))
        recipe = recipe_for(base, donor, "2, 5, 9", f"bytes-{gb}g")
        out = DATA / f"out-mem-{label}"
        drop(out)
        b = peak_rss_mib([*MOSAIC, "build", str(recipe), "--out", str(out)])
        a = peak_rss_mib([*MOSAIC, "audit", str(out)])
        c = peak_rss_mib([*MOSAIC, "census", str(base), "--json"])
        pl = peak_rss_mib(plan_cmd(base, donor, scores_for(f"bytes-{gb}g", 12), 3))
        size = sum(p.stat().st_size for p in base.iterdir()) / 1e9
        row(*(f"memory: {label} ({size:.1f} GB base)", "peak RSS build / audit / census / plan", f"{b:.0f} / {a:.0f} / {c:.0f} / {pl:.0f} MiB",
              f"target ≤ {TARGETS['rss_mib']}, flat"))
        drop(out)
    glm_base, glm_donor = glm_sources()
    recipe = recipe_for(glm_base, glm_donor, '3, 32, 33, "36-44"', "glm-spark")
    out = DATA / "out-mem-glm"
    drop(out)
    b = peak_rss_mib([*MOSAIC, "build", str(recipe), "--out", str(out)])
    a = peak_rss_mib([*MOSAIC, "audit", str(out)])
    c = peak_rss_mib([*MOSAIC, "census", str(glm_base), "--json"])
    pl = peak_rss_mib(plan_cmd(glm_base, glm_donor, scores_for("glm53", 45)))
    row(*("memory: GLM geometry (151k tensors)", "peak RSS build / audit / census / plan", f"{b:.0f} / {a:.0f} / {c:.0f} / {pl:.0f} MiB",
          f"target ≤ {TARGETS['rss_mib']}"))
    drop(out)
