"""The stream case: a streamed build (ranges of the donor's selected tensors, the base's bytes) against
downloading both sources whole and building from the cache, through a local hub look-alike that counts bytes."""

from __future__ import annotations

from harness import DATA, bytes_geometry, dataset, drop, race_fetch_and_stream, row


def case_stream(runs: int, size_gb: float) -> None:
    """A streamed build (ranges of the donor's selected tensors, the base's bytes) against downloading
    both sources whole and building from the cache, through a local hub look-alike that counts bytes."""
    from mosaic.testing.hub import FakeHub

    base = dataset(f"bytes-{size_gb}g-base", bytes_geometry(size_gb, 2, 1))
    donor = dataset(f"bytes-{size_gb}g-donor", bytes_geometry(size_gb, 3, 2))
    home = DATA / "stream-hf"
    out = DATA / "stream-out"
    with FakeHub() as hub:
        hub.redirect_lfs = True
        shas = {}
        for repo, folder in (("bench/base", base), ("bench/donor", donor)):
            shas[repo] = hub.commit(repo, {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()})
        recipe = DATA / f"stream-{size_gb}g.yaml"
        recipe.write_text(
            f"name: stream\nbase:\n  repo: bench/base\n  revision: {shas['bench/base']}\n"
            f"donors:\n  q3:\n    repo: bench/donor\n    revision: {shas['bench/donor']}\n"
            "replace:\n  - from: q3\n    layers: [2, 5, 9]\n    modules: [mlp.experts]\n"
        )
        moved = race_fetch_and_stream(f"stream: {size_gb} GB pair via a local hub", hub, recipe, home, out, runs,
                                      "download then build")
        whole = moved["download then build"]
        for name, n in moved.items():
            row(f"stream: {size_gb} GB pair via a local hub", f"{name}: bytes from the hub", f"{n / 1e9:.3f} GB",
                f"{n / whole:.2f} × download")
        drop(home)
        drop(out)
