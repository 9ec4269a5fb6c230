"""Two checkouts of mosaic, interleaved, on the bench's GLM preset: does a change make the metadata commands slower?

    python bench/trees.py OLD_CHECKOUT NEW_CHECKOUT [--runs 5] [--commands build,audit,census,plan]

For a change that should not move speed at all (a restructure, a new layer over the same stages), a ratio to a
baseline tool says little: what matters is this code against the code before it, on the same data, in the same
minutes. Each command runs alternately from each checkout (``python -m mosaic.cli`` with the checkout as the
working directory, so its own package is imported), the order flipping every run; the table gives the median
of each and the ratio new/old. The data is bench/run.py's GLM preset (150,547 tensors), generated once.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # bench/run.py: the data and the table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--commands", default="build,audit,census,plan")
    args = ap.parse_args()
    trees = (args.old.resolve(), args.new.resolve())
    for t in trees:
        if not (t / "mosaic" / "cli" / "__init__.py").is_file():
            sys.exit(f"{t}: not a mosaic checkout (no mosaic/cli/)")
    base, donor = bench.glm_sources()
    recipe = bench.recipe_for(base, donor, '3, 32, 33, "36-44"', "glm-spark")
    scores = bench.scores_for("glm53", 45)
    outs = {t: bench.DATA / f"trees-out-{i}" for i, t in enumerate(trees)}

    def args_for(what: str, tree: Path) -> list[str]:
        if what == "build":
            shutil.rmtree(outs[tree], ignore_errors=True)
            return ["build", str(recipe), "--out", str(outs[tree])]
        if what == "audit":
            return ["audit", str(outs[tree])]
        if what == "census":
            return ["census", str(base), "--json"]
        return bench.plan_cmd(base, donor, scores)[3:]

    commands = args.commands.split(",")
    if "audit" in commands and "build" not in commands:
        sys.exit("--commands: audit reads what build wrote; list build too")
    for what in commands:
        times: dict[Path, list[float]] = {t: [] for t in trees}
        for r in range(args.runs):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                cmd = [sys.executable, "-m", "mosaic.cli", *args_for(what, tree)]
                t0 = time.perf_counter()
                subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)
                times[tree].append(time.perf_counter() - t0)
        old, new = (statistics.median(times[t]) for t in trees)
        bench.row(f"trees: GLM preset, {args.runs} runs each", f"mosaic {what}: new / old", f"{new / old:.3f}",
                  f"medians {old:.2f} s / {new:.2f} s")
    for o in outs.values():
        shutil.rmtree(o, ignore_errors=True)


if __name__ == "__main__":
    main()
