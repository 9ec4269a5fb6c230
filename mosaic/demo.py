"""``make demo``: a small synthetic base and donor, the demo recipe built, then audited.

Run as ``python -m mosaic.demo DIR`` from the project root; DIR must be the folder that
``recipes/demo.yaml`` points at (``demo``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from mosaic.cli.commands import main as cli
from mosaic.testing import demo_geometry, write_checkpoint


def run(demo_dir: Path, recipe: Path) -> int:
    base = demo_dir / "base-2bpw"
    donor = demo_dir / "donor-3bpw"
    print(f"writing a synthetic 2-bit base to {base} and a 3-bit donor to {donor}")
    write_checkpoint(base, demo_geometry(bits=2, seed=1))
    (base / "DOWNLOAD-SEAL.json").write_text('{"note": "a download seal of the base; not carried over"}\n')
    write_checkpoint(donor, demo_geometry(bits=3, head_bits=8, seed=2, style="library"))
    runner = CliRunner()
    for args in (["census", str(base)], ["build", str(recipe)], ["audit", str(demo_dir / "out")]):
        print(f"\n$ mosaic {' '.join(args)}")
        r = runner.invoke(cli, args, catch_exceptions=False)
        sys.stdout.write(r.output)
        if r.exit_code != 0:
            return r.exit_code
    return 0


if __name__ == "__main__":
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "demo")
    sys.exit(run(d, Path("recipes/demo.yaml")))
