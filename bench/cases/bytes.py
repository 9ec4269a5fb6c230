"""The bytes case: ``mosaic build`` of the bytes preset (12 MoE layers of 64 experts; 3 layers' experts from
a 3-bit donor) against ``cp -r`` + ``sha256sum`` and plain ``cp -r``, cold and with the digest cache filled;
then ``mosaic audit`` against ``sha256sum`` and a one-thread hashlib pass. The target is a ratio to
``cp -r`` + ``sha256sum``, cold (``TARGETS["bytes"]``)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from harness import DATA, MOSAIC, TARGETS, WARM, bytes_geometry, dataset, drop, race, recipe_for, row, sh


def hashlib_pass(folder: Path) -> None:
    for p in sorted(folder.iterdir()):
        h = hashlib.sha256()
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(8 << 20)
            while n := f.readinto(buf):
                h.update(memoryview(buf)[:n])


def case_bytes(runs: int, size_gb: float) -> None:
    base = dataset(f"bytes-{size_gb}g-base", bytes_geometry(size_gb, 2, 1))
    donor = dataset(f"bytes-{size_gb}g-donor", bytes_geometry(size_gb, 3, 2))
    recipe = recipe_for(base, donor, "2, 5, 9", f"bytes-{size_gb}g")
    out, cp_out = DATA / "out-bytes", DATA / "out-cp"
    size = sum(p.stat().st_size for p in base.iterdir())
    print(f"bytes: base {size / 1e9:.2f} GB", file=sys.stderr)
    drop(out)
    sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=WARM)  # fills the digest cache, untimed
    med = race(
        f"bytes: build ({size / 1e9:.1f} GB base)",
        {
            "mosaic build": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)]), lambda: drop(out)),
            "mosaic build, digests cached": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=WARM), lambda: drop(out)),
            "cp -r + sha256sum": (lambda: sh(f"cp -r '{base}' '{cp_out}' && sha256sum '{cp_out}'/*"), lambda: drop(cp_out)),
            "cp -r": (lambda: sh(["cp", "-r", str(base), str(cp_out)]), lambda: drop(cp_out)),
        },
        runs,
        "cp -r + sha256sum",
    )
    ref = med["cp -r + sha256sum"]
    row(*("bytes: build", "mosaic / (cp -r + sha256sum)", f"{med['mosaic build'] / ref:.2f}", f"target ≤ {TARGETS['bytes']}"))
    row(*("bytes: build", "mosaic, digests cached / (cp -r + sha256sum)", f"{med['mosaic build, digests cached'] / ref:.2f}", ""))
    drop(cp_out)
    race(
        "bytes: audit",
        {
            "mosaic audit": (lambda: sh([*MOSAIC, "audit", str(out)]), None),
            "sha256sum": (lambda: sh(f"sha256sum '{out}'/*"), None),
            "python hashlib, 1 thread": (lambda: hashlib_pass(out), None),
        },
        runs,
        "python hashlib, 1 thread",
    )
