"""``mosaic plan --out`` writes the recipe whole or not at all: a temporary sibling, fsynced, renamed over the file.

Each plan runs in a process of its own and is stopped at the fault point between the write and the rename
(``plan-write``): killed (SIGKILL: the previous recipe is there, or none, never part of one; the temporary it
left is removed by the next plan of that recipe), interrupted (Ctrl-C) or failing (EIO): the previous recipe is
there and nothing else is. Both planners (EXL3 folders and GGUF files) write through the same function.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from mosaic._plan.planner import write_recipe
from mosaic.testing.gguf import Geometry, write_llama_gguf

from .conftest import run_cli
from .test_plan import BASE, DONOR3, per_layer

EARLIER = "# the recipe of an earlier plan\n"


def _gguf_args(tmp: Path) -> list[str]:
    g = Geometry(n_layer=2)
    base = write_llama_gguf(tmp / "Q4_0.gguf", qtype="Q4_0", seed=1, geometry=g)[0]
    q8 = write_llama_gguf(tmp / "Q8_0.gguf", qtype="Q8_0", seed=1, geometry=g)[0]
    scores = tmp / "scores.csv"
    scores.write_text("layer,score\n0,1\n1,4\n")
    return ["plan", "--base", str(base), "--donor", f"q8={q8}", "--scores", str(scores), "--unit", "layer", "--layers", "1"]


def _exl3_args(tmp: Path, ckpt_factory: Callable) -> list[str]:
    base, d3 = ckpt_factory(BASE), ckpt_factory(DONOR3)
    scores = per_layer(tmp, {1: 1.0, 2: 3.0, 4: 2.0})
    return ["plan", "--base", str(base), "--donor", f"q3={d3}", "--scores", str(scores), "--layers", "1"]


@pytest.fixture(params=["gguf", "exl3"])
def plan_args(request: pytest.FixtureRequest, tmp_path: Path, ckpt_factory: Callable) -> list[str]:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    return _gguf_args(inputs) if request.param == "gguf" else _exl3_args(inputs, ckpt_factory)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("earlier", [True, False], ids=["over-a-recipe", "no-recipe"])
def test_a_plan_killed_between_write_and_rename_leaves_the_earlier_recipe_or_none(
        plan_args: list[str], tmp_path: Path, earlier: bool) -> None:
    out = tmp_path / "plans" / "planned.yaml"
    out.parent.mkdir()
    if earlier:
        out.write_text(EARLIER)
    r = run_cli([*plan_args, "--out", str(out)], fault="plan-write:1:kill")
    assert r.returncode == -signal.SIGKILL, r.stderr
    if earlier:
        assert out.read_text() == EARLIER
    else:
        assert not out.exists()
    left = [n for n in _listing(out.parent) if n not in ("planned.yaml", "planned.yaml.lock")]
    assert len(left) == 1 and left[0].startswith("planned.yaml.") and left[0].endswith(".tmp")  # written, not renamed
    assert "replace:" in (out.parent / left[0]).read_text()
    # the next plan of that recipe takes the dead holder's lock over, removes its temporary and writes the recipe
    r = run_cli([*plan_args, "--out", str(out)])
    assert r.returncode == 0, r.stderr
    assert "replace:" in out.read_text()
    assert _listing(out.parent) == ["planned.yaml"]


@pytest.mark.parametrize(("fault", "code"), [("plan-write:1:eio", 2), ("plan-write:1:int", 130)])
def test_a_plan_failing_or_interrupted_before_the_rename_keeps_the_earlier_recipe_and_no_temporary(
        plan_args: list[str], tmp_path: Path, fault: str, code: int) -> None:
    out = tmp_path / "planned.yaml"
    out.write_text(EARLIER)
    r = run_cli([*plan_args, "--out", str(out)], fault=fault)
    assert r.returncode == code, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("mosaic: "), r.stderr
    assert out.read_text() == EARLIER
    assert _listing(tmp_path) == ["inputs", "planned.yaml"]


def test_write_recipe_replaces_whole_and_leaves_only_the_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "deep" / "planned[1].yaml"  # a name glob would misread
    write_recipe(out, "one: 1\n")
    assert out.read_text() == "one: 1\n" and _listing(out.parent) == ["planned[1].yaml"]
    (out.parent / "planned[1].yaml.123.tmp").write_text("half")  # a killed plan's
    (out.parent / "planned[1].yaml.notes.tmp").write_text("kept")  # not a plan's temporary: left alone
    write_recipe(out, "two: 2\n")
    assert out.read_text() == "two: 2\n"
    assert _listing(out.parent) == ["planned[1].yaml", "planned[1].yaml.notes.tmp"]

    def fail(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("mosaic._plan.planner.os.replace", fail)
    with pytest.raises(OSError, match="No space"):
        write_recipe(out, "three: 3\n")
    assert out.read_text() == "two: 2\n"
    assert _listing(out.parent) == ["planned[1].yaml", "planned[1].yaml.notes.tmp"]
