"""The gguf case: a GGUF mosaic (4 of 16 layers' routed experts from a Q8_0 donor) against ``cp`` +
``sha256sum`` of the base and against the usual gguf-py copy script (GGUFReader → GGUFWriter, no digests)."""

from __future__ import annotations

import os

from harness import DATA, MOSAIC, WARM, drop, gguf_dataset, race, row, sh


def case_gguf(runs: int, size_gb: float) -> None:
    """A GGUF mosaic (4 of 16 layers' routed experts from a Q8_0 donor) against ``cp`` + ``sha256sum`` of
    the base and against the usual gguf-py copy script (GGUFReader → GGUFWriter, no digests)."""
    from mosaic.testing.gguf import assemble_with_ggufpy

    base = gguf_dataset(f"gguf-{size_gb}g-Q4_0", "Q4_0", size_gb)
    donor = gguf_dataset(f"gguf-{size_gb}g-Q8_0", "Q8_0", size_gb)
    layers = [2, 5, 9, 13]
    recipe = DATA / f"gguf-{size_gb}g.yaml"
    recipe.write_text(
        f"name: gguf-bench\nbase:\n  path: {os.path.relpath(base, DATA)}\ndonors:\n  q8:\n    path: {os.path.relpath(donor, DATA)}\n"
        f"replace:\n  - from: q8\n    layers: {layers}\n    modules: [ffn_exps]\n"
    )
    take = {f"blk.{i}.ffn_{p}_exps.weight": "q8" for i in layers for p in ("gate", "up", "down")}
    out, cp_out, py_out = DATA / "out-gguf", DATA / "out-gguf-cp.gguf", DATA / "out-gguf-py.gguf"
    size = base.stat().st_size
    drop(out)
    sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=WARM)  # fills the digest cache, untimed
    case = f"gguf: build ({size / 1e9:.1f} GB Q4_0 base, 4 layers' experts from Q8_0)"
    med = race(
        case,
        {
            "mosaic build": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)]), lambda: drop(out)),
            "mosaic build, digests cached": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=WARM), lambda: drop(out)),
            "cp + sha256sum": (lambda: sh(f"cp '{base}' '{cp_out}' && sha256sum '{cp_out}'"), lambda: cp_out.unlink(missing_ok=True)),
            "gguf-py copy script": (lambda: assemble_with_ggufpy([base], {"q8": [donor]}, take, py_out),
                                    lambda: py_out.unlink(missing_ok=True)),
        },
        runs,
        "cp + sha256sum",
    )
    row("gguf: build", "mosaic / gguf-py copy script", f"{med['mosaic build'] / med['gguf-py copy script']:.2f}", "")
    row("gguf: build", "mosaic, digests cached / gguf-py copy script",
        f"{med['mosaic build, digests cached'] / med['gguf-py copy script']:.2f}", "")
    cp_out.unlink(missing_ok=True)
    py_out.unlink(missing_ok=True)
    race(
        "gguf: audit",
        {
            "mosaic audit": (lambda: sh([*MOSAIC, "audit", str(out)]), None),
            "sha256sum": (lambda: sh(f"sha256sum '{out}'/*"), None),
        },
        runs,
        "sha256sum",
    )
