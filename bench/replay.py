"""A plan replayed by stock llama-quantize from the ladder's source, held to mosaic's build tensor by tensor.

    python bench/replay.py LADDER --scores MEASUREMENT --max-size SIZE --imatrix FILE [--work DIR]

``mosaic plan --ladder LADDER --tensor-type-file`` writes the plan as ``llama-quantize --tensor-type-file`` reads
it; ``mosaic build`` builds the recipe; the ladder's own tool (``ladder.json`` names it) then makes the file from
the ladder's source with that file and the matrix (``--allow-requantize``, as the rungs were made). Every tensor of
the two files is compared by type and SHA-256 of its bytes; the table says how many match, names each that does
not and why (another type, or the same type with other bytes), and the time of each way from the plan on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import MOSAIC, row


def tensors(path: Path) -> dict[str, tuple[str, str]]:
    """Each tensor's type and the SHA-256 of its bytes, read by gguf-py (not mosaic's reader)."""
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, hashlib.sha256(bytes(t.data.tobytes())).hexdigest())
            for t in GGUFReader(str(path)).tensors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ladder", type=Path)
    ap.add_argument("--scores", type=Path, required=True)
    ap.add_argument("--max-size", required=True)
    ap.add_argument("--imatrix", type=Path, required=True)
    ap.add_argument("--work", type=Path)
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="mosaic-replay-"))
    work.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((a.ladder / "ladder.json").read_text())
    tool, source = manifest["tool"]["path"], manifest["source"]["file"]
    types, recipe = work / "tensor-types.txt", work / "planned.yaml"
    subprocess.run([*MOSAIC, "plan", "--ladder", str(a.ladder), "--scores", str(a.scores), "--max-size", a.max_size,
                    "--out", str(recipe), "--tensor-type-file", str(types), "--json"],
                   check=True, stdout=subprocess.DEVNULL)
    t0 = time.perf_counter()
    subprocess.run([*MOSAIC, "build", str(recipe), "--out", str(work / "built"), "--force"], check=True,
                   stdout=subprocess.DEVNULL)
    t_build = time.perf_counter() - t0
    replayed = work / "replayed.gguf"
    t0 = time.perf_counter()
    subprocess.run([tool, "--allow-requantize", "--imatrix", str(a.imatrix), "--tensor-type-file", str(types), source,
                    str(replayed), "Q8_0"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_replay = time.perf_counter() - t0
    mine = tensors(next((work / "built").glob("*.gguf")))
    theirs = tensors(replayed)
    case = "replay: a plan through stock llama-quantize"
    if list(mine) != list(theirs):
        row(case, "tensors", "differ", f"mosaic {len(mine)}, llama-quantize {len(theirs)}: not the same names in order")
        raise SystemExit(1)
    other_type = [n for n in mine if mine[n][0] != theirs[n][0]]
    other_bytes = [n for n in mine if mine[n][0] == theirs[n][0] and mine[n][1] != theirs[n][1]]
    same = len(mine) - len(other_type) - len(other_bytes)
    row(case, "tensors equal (type and SHA-256)", f"{same} of {len(mine)}",
        f"{len(types.read_text().splitlines())} entries in the tensor-type file; tool {tool}")
    for n in other_type:
        row(case, f"another type: {n}", f"{theirs[n][0]}", f"mosaic {mine[n][0]}")
    for n in other_bytes:
        row(case, f"other bytes: {n}", mine[n][0], "the same type quantized otherwise")
    row(case, "time from the plan on: mosaic build / llama-quantize", f"{t_build:.0f} s / {t_replay:.0f} s",
        f"{t_build / t_replay:.2f} ×")
    if other_type or other_bytes:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
