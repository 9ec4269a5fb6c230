"""The README's loop "From a source model to the best file at any size" is what ``bench/run.py --cases readme`` runs
as printed: it must keep parsing into the setup and the four stages the case maps to a real model, and each of
its ``mosaic`` lines must be a command line mosaic accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from cases.readme import parse, placeholders, readme_loop  # noqa: E402


def test_the_readme_loop_parses_into_the_setup_and_four_stages() -> None:
    setup, stages = parse(readme_loop(ROOT / "README.md"))
    assert ["make", "llama-tools"] in setup
    assert list(stages) == ["ladder", "measure", "plan", "build"]
    named = {w for argv in stages.values() for w in argv}
    assert set(placeholders(Path("t"), Path("m"), Path("r"))) <= named  # every placeholder the table maps is there


def test_each_stage_is_a_command_line_mosaic_accepts() -> None:
    from click.testing import CliRunner

    from mosaic.cli.commands import main

    _, stages = parse(readme_loop(ROOT / "README.md"))
    ctx = main.make_context("mosaic", ["--help"], resilient_parsing=True)
    for argv in stages.values():
        cmd = main.get_command(ctx, argv[0])
        assert cmd is not None
        cmd.make_context(argv[0], argv[1:], resilient_parsing=False)  # parses, or raises click's usage error
    assert CliRunner().invoke(main, ["ladder", "--help"]).exit_code == 0


@pytest.mark.parametrize("line", ["rm -rf ladder/", "mosaic eval x.gguf --reference y", "mosaic ladder a --out b\nmosaic ladder a --out b"])
def test_a_loop_the_case_cannot_run_fails(tmp_path: Path, line: str) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("From a source model to the best file at any size:\n\n```bash\nmake llama-tools\n" + line + "\n```\n")
    with pytest.raises(SystemExit):
        parse(readme_loop(readme))
