"""A ladder's weight errors with ggml's own dequantizers against gguf-py's, on the same rungs in one run.

    python bench/weight_errors.py LADDER --imatrix FILE [--runs 2] [--work DIR]

LADDER is ``mosaic ladder``'s folder. Each run is ``mosaic measure --ladder LADDER --method weights --unit
module-group`` (every tensor of every rung dequantized and compared with the reference), the two contenders
interleaved, every rung's digest already cached and the weight sums' cache emptied before each: the stage
``timing.stages.weights`` records, and the command's wall time around it. ``gguf-py`` is the same command with
``MOSAIC_DEQUANTIZE=gguf-py``. Every unit's weight error of the two must be equal to the last bit; the script
says so or fails. The C functions come from a compiled llama-cpp-python (``PYTHONPATH``, as the bench sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import MOSAIC, race, row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ladder", type=Path)
    ap.add_argument("--imatrix", required=True)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--work", type=Path)
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="mosaic-weights-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    env = {**os.environ, "MOSAIC_CACHE_DIR": str(cache)}
    env.pop("MOSAIC_DEQUANTIZE", None)
    contenders = {"ggml (llama-cpp-python's libggml-base)": env, "gguf-py": {**env, "MOSAIC_DEQUANTIZE": "gguf-py"}}
    outs = {name: work / f"weights-{i}.json" for i, name in enumerate(contenders)}
    stage: dict[str, list[float]] = {name: [] for name in contenders}

    def command(name: str) -> list[str]:
        return [*MOSAIC, "measure", "--ladder", str(a.ladder), "--method", "weights", "--unit", "module-group",
                "--imatrix", a.imatrix, "--out", str(outs[name]), "--force"]

    def empty() -> None:
        shutil.rmtree(cache / "weights", ignore_errors=True)

    def runner(name: str):
        def run() -> None:
            subprocess.run(command(name), check=True, env=contenders[name], stdout=subprocess.DEVNULL)
            stage[name].append(json.loads(outs[name].read_text())["timing"]["stages"]["weights"]["seconds"])
        return run

    subprocess.run(command("gguf-py"), check=True, env=env, stdout=subprocess.DEVNULL)  # the digests, cached once
    med = race("weight errors, whole command", {n: (runner(n), empty) for n in contenders}, a.runs, "gguf-py")
    base = statistics.median(stage["gguf-py"])
    for name in contenders:
        s = statistics.median(stage[name])
        row("weight errors, the stage alone", name, f"{s:.2f} s", f"{s / base:.2f} × gguf-py" if name != "gguf-py" else "1.00")
    eps = [{(r["layer"], r["group"], r["donor"]): (r["eps"], r["eps_base"]) for r in json.loads(p.read_text())["results"]}
           for p in outs.values()]
    if eps[0] != eps[1]:
        differ = [k for k in eps[0] if eps[0][k] != eps[1].get(k)]
        raise SystemExit(f"the weight errors differ at {len(differ)} of {len(eps[0])} pairs, e.g. {differ[:3]}")
    print(f"\nthe same weight error at all {len(eps[0])} (unit, version) pairs, to the last bit; "
          f"medians of {a.runs} interleaved runs: {', '.join(f'{k} {v:.1f} s' for k, v in med.items())}")


if __name__ == "__main__":
    main()
