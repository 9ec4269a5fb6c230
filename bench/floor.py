"""The floor: what one tensor changed in the teacher costs near the teacher, whatever the size of the change.

    python bench/floor.py [--layers 0,13,27] [--text bench/data/fresh-paragraphs.txt] [--ctx 128] [--work DIR]
        [--perplexity]

The bench's Qwen2.5-Coder-1.5B teacher (its Q4_K_M) is quantized again by ``llama-quantize --allow-requantize`` with
the bench's matrix from its weights in F32, twice: at its own Q4_K_M (each Q4_K weight through the quantizer again: a
few in a thousand move one step) and at Q3_K_M (``attn_q`` at Q3_K). For each layer of LAYERS, ``mosaic build`` makes the teacher with that
layer's ``attn_q`` taken from each, and ``mosaic eval`` scores every file against the teacher on TEXT; the teacher's
own bytes rebuilt the same way are the zero. The table gives each tensor's weight error (relative, unweighted, from
gguf-py's dequantizers) and the file's KL; ``--perplexity`` reads each file with llama.cpp's ``llama-perplexity
--kl-divergence`` too (the same rows, context and batch). The tools come from ``MOSAIC_BENCH_LLAMA_BIN`` (``make
llama-tools``). bench/RESULTS.md, "The loss at Q4_K_S's bytes: a floor every change pays".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from cases.best import BATCH  # noqa: E402
from cases.ladder import MODELS, _evaluate, _tool  # noqa: E402
from harness import MOSAIC  # noqa: E402


def requantized(quantize: Path, teacher: Path, imatrix: Path, ftypes: list[str], work: Path) -> dict[str, Path]:
    """The teacher quantized again at each of ``ftypes`` with the matrix (made once, kept in ``work``), from its
    weights in F32 (written once for all of them): the tool copies a tensor already at the type it would give, so
    the teacher itself would come back whole."""
    outs = {ftype: work / f"teacher-{ftype}.gguf" for ftype in ftypes}
    todo = [ftype for ftype, out in outs.items() if not out.is_file()]
    if todo:
        f32 = work / "teacher-F32.gguf"
        subprocess.run([str(quantize), "--allow-requantize", str(teacher), str(f32), "F32"], check=True, capture_output=True)
        for ftype in todo:
            tmp = outs[ftype].with_suffix(".partial")
            subprocess.run([str(quantize), "--allow-requantize", "--imatrix", str(imatrix), str(f32), str(tmp), ftype,
                            str(os.cpu_count())], check=True, capture_output=True)
            tmp.rename(outs[ftype])
        f32.unlink()
    return outs


def spliced(teacher: Path, donor: Path, tensor: str, name: str, work: Path) -> Path:
    """The teacher with ``tensor`` taken from ``donor``, byte for byte (``mosaic build``)."""
    recipe = work / f"{name}.yaml"
    recipe.write_text(json.dumps({"name": name, "base": {"path": str(teacher)}, "donors": {"d": {"path": str(donor)}},
                                  "replace": [{"from": "d", "keys": [tensor]}]}))  # JSON is YAML
    subprocess.run([*MOSAIC, "build", str(recipe), "--out", str(work / name), "--force"], check=True, capture_output=True,
                   env=os.environ | {"PYTHONPATH": str(ROOT)})
    return next((work / name).glob("*.gguf"))


def weight_error(path: Path, reference: Path, tensor: str) -> float:
    """``Σ (W − W_ref)² / Σ W_ref²`` of one tensor, both dequantized by gguf-py."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    def read(p: Path) -> np.ndarray:
        t = next(t for t in GGUFReader(p).tensors if t.name == tensor)
        return dequantize(t.data, t.tensor_type).astype(np.float64)

    w, ref = read(path), read(reference)
    return float(((w - ref) ** 2).sum() / (ref ** 2).sum())


def perplexity_kld(tool: Path, teacher: Path, files: dict[str, Path], text: Path, ctx: int, work: Path) -> dict[str, str]:
    """Each file's ``Mean KLD`` as ``llama-perplexity --kl-divergence`` prints it, against the teacher's saved logits."""
    base = work / "teacher.kld"
    common = ["-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(os.cpu_count())]
    subprocess.run([str(tool), "-m", str(teacher), *common, "--kl-divergence-base", str(base)], check=True, capture_output=True)
    out = {}
    for label, f in files.items():
        r = subprocess.run([str(tool), "-m", str(f), *common, "--kl-divergence-base", str(base), "--kl-divergence"],
                           check=True, capture_output=True, text=True)
        m = re.search(r"Mean\s+KLD:\s+([0-9.]+)\s+±\s+([0-9.]+)", r.stdout + r.stderr)
        out[label] = f"{float(m.group(1)):.5f} ± {float(m.group(2)):.5f}" if m else "not read"
    base.unlink(missing_ok=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="0,13,27")
    ap.add_argument("--text", type=Path, default=ROOT / "bench" / "data" / "fresh-paragraphs.txt")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "mosaic-bench" / "floor")
    ap.add_argument("--perplexity", action="store_true")
    a = ap.parse_args()
    quantize, ppl = _tool("llama-quantize"), _tool("llama-perplexity")
    if quantize is None or (a.perplexity and ppl is None):
        sys.exit("MOSAIC_BENCH_LLAMA_BIN must hold llama-quantize (and llama-perplexity with --perplexity): make llama-tools")
    a.work.mkdir(parents=True, exist_ok=True)
    model = MODELS["qwen2.5-coder-1.5b"]
    teacher = model.teacher()
    again = requantized(quantize, teacher, model.imatrix, ["Q4_K_M", "Q3_K_M"], a.work)
    donors = {"its own type, quantized again": again["Q4_K_M"], "Q3_K": again["Q3_K_M"]}
    files: dict[str, Path] = {}
    errors: dict[str, float] = {}
    layers = [int(x) for x in a.layers.split(",")]
    first = f"blk.{layers[0]}.attn_q.weight"
    files["nothing (the teacher's bytes rebuilt)"] = spliced(teacher, teacher, first, "same", a.work)
    errors["nothing (the teacher's bytes rebuilt)"] = 0.0
    for layer in layers:
        tensor = f"blk.{layer}.attn_q.weight"
        for i, (how, donor) in enumerate(donors.items()):
            label = f"`{tensor}` at {how}"
            files[label] = spliced(teacher, donor, tensor, f"l{layer}-{i}", a.work)
            errors[label] = weight_error(donor, teacher, tensor)
    got: dict[str, dict] = {}
    env = {k: v for k, v in os.environ.items() if k != "MOSAIC_RUNTIME"} | {"PYTHONPATH": str(ROOT)}
    labels = list(files)
    for i in range(0, len(labels), BATCH):
        _evaluate({k: files[k] for k in labels[i:i + BATCH]}, teacher, a.text, a.ctx, env, {}, got)
    kld = perplexity_kld(ppl, teacher, files, a.text, a.ctx, a.work) if a.perplexity and ppl else {}
    print(f"| the teacher with ({a.text.name}, ctx {a.ctx}) | weight error | mosaic eval: KL / p99 / top-1 |"
          + (" llama-perplexity: Mean KLD |" if kld else ""))
    print("|---|---|---|" + ("---|" if kld else ""))
    for k in labels:
        g = got[k]
        print(f"| {k} | {errors[k]:.2g} | {g['kl']:.5f} / {g['p99']:.4f} / {g['top1']:.4f} |" + (f" {kld[k]} |" if kld else ""))


if __name__ == "__main__":
    main()
