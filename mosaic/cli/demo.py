"""``make demo``: the whole tour on a small synthetic model, from census to signing and the audit of a GGUF export.

Run as ``python -m mosaic.cli.demo DIR`` from the project root; DIR must be the folder that
``recipes/demo.yaml`` points at (``demo``). The model is Qwen3-MoE-shaped (every layer MoE, no shared
experts), a shape every step supports, the GGUF export included.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from click.testing import CliRunner

from mosaic._api.functions import load_recipe
from mosaic.cli import main as cli
from mosaic.testing.exl3 import demo_geometry, write_checkpoint
from mosaic.testing.keys import write_signing_key

#: Illustrative per-layer scores (higher is better): what a measurement of each layer's gain from the
#: 3-bit donor might say. The plan picks the best three layers, the ones recipes/demo.yaml takes.
DEMO_SCORES = {"0": 0.21, "1": 0.93, "2": 0.12, "3": 0.34, "4": 0.88, "5": 0.71}


def outputs(recipe: Path) -> tuple[Path, Path]:
    """Where the tour puts the mosaic (the recipe's output folder) and its GGUF export (beside it)."""
    out = load_recipe(recipe).output_path(Path.cwd())
    if out.is_relative_to(Path.cwd()):
        out = out.relative_to(Path.cwd())
    return out, out.with_name(out.name + "-gguf")


def tour(demo_dir: Path, recipe: Path) -> list[tuple[str, list[str]]]:
    """The steps of the tour: a title and the command line of each."""
    base, donor = demo_dir / "base-2bpw", demo_dir / "donor-3bpw"
    out, gguf = outputs(recipe)
    return [
        ("what is in the base", ["census", str(base)]),
        ("which layers to take, exactly, from scores", [
            "plan", "--base", str(base), "--donor", f"q3={donor}", "--scores", str(demo_dir / "scores.json"),
            "--layers", "3", "--out", str(demo_dir / "planned.yaml"),
        ]),
        ("build the demo recipe", ["build", str(recipe)]),
        ("verify it from its files alone", ["audit", str(out)]),
        ("sign it (OpenSSF model signing; a throwaway key made for the demo)",
         ["sign", str(out), "--key", str(demo_dir / "demo-signing.pem")]),
        ("verify who signed it, with every check again", ["audit", str(out), "--key", str(demo_dir / "demo-signing.pub")]),
        ("repackage it as GGUF for ranma.cpp", ["export", "gguf", str(out), "--out", str(gguf)]),
        ("verify the export, and every tensor against the mosaic", ["audit", str(gguf), "--sources", str(out)]),
    ]


def run(demo_dir: Path, recipe: Path) -> int:
    base, donor = demo_dir / "base-2bpw", demo_dir / "donor-3bpw"
    print(f"writing a synthetic 2-bit base to {base} and a 3-bit donor to {donor}")
    write_checkpoint(base, demo_geometry(bits=2, seed=1))
    (base / "DOWNLOAD-SEAL.json").write_text('{"note": "a download seal of the base; not carried over"}\n')
    write_checkpoint(donor, demo_geometry(bits=3, head_bits=8, seed=2, style="library"))
    (demo_dir / "scores.json").write_text(json.dumps({"higher_is_better": True, "scores": DEMO_SCORES}, indent=2) + "\n")
    write_signing_key(demo_dir, "demo-signing")
    runner = CliRunner()
    steps = tour(demo_dir, recipe)
    for i, (title, args) in enumerate(steps, 1):
        print(f"\n# {i}/{len(steps)}: {title}\n$ mosaic {' '.join(args)}")
        r = runner.invoke(cli, args, catch_exceptions=False)
        sys.stdout.write(r.output)
        if r.exit_code != 0:
            print(f"\nthe demo stopped: `mosaic {args[0]}` exited {r.exit_code}", file=sys.stderr)
            return r.exit_code
    out, gguf = outputs(recipe)
    print(f"""
Done. Where everything is:
  {base}, {donor}   the synthetic base and donor
  {demo_dir / 'planned.yaml'}   the recipe `mosaic plan` chose (compare it with {recipe})
  {out}   the mosaic, signed: {out / 'model.sig'} (public key {demo_dir / 'demo-signing.pub'})
  {gguf}   its GGUF export for ranma.cpp

What to read next:
  {out / 'README.md'}   the model card: rates, which layers come from where, how to verify
  {out / 'PROVENANCE.json'}   every tensor's SHA-256 and source
  (cd {out} && sha256sum -c sha256-manifest.txt)   check every file without mosaic
  model_signing verify key {out} --signature {out / 'model.sig'} --public_key {demo_dir / 'demo-signing.pub'}
      the signature, without mosaic (pip install model-signing)
  {gguf / 'manifest.json'}   every GGUF tensor's digest and the source tensors it came from""")
    return 0


if __name__ == "__main__":
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "demo")
    sys.exit(run(d, Path("recipes/demo.yaml")))
