"""The census case: ``mosaic census --json`` on the GLM preset (GLM-5.3-Flash as exllamav3 stores it, at its
full tensor count): its median seconds and its throughput in tensors per second."""

from __future__ import annotations

from harness import MOSAIC, glm_sources, race, row, sh


def case_census(runs: int) -> None:
    base, _ = glm_sources()
    from mosaic._checkpoint.folder import open_checkpoint

    n = len(open_checkpoint(base).tensor_file)
    med = race("census: GLM geometry", {"mosaic census --json": (lambda: sh([*MOSAIC, "census", str(base), "--json"]), None)}, runs, "mosaic census --json")
    row(*("census: GLM geometry", "throughput", f"{n:,} tensors", f"{n / med['mosaic census --json']:,.0f} tensors/s"))
