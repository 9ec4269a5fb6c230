"""What `mosaic measure` does with no method flag: the default chosen on two models (bench/RESULTS.md), each
default yielding to an explicit flag it cannot go with, and the document saying which method ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mosaic._measure import defaults
from mosaic._measure.run import MeasureRequest
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from tests.conftest import run_cli

#: The default the rule of bench/RESULTS.md chose ("Choosing the ladder's default on two models"): a change of
#: default is a change of this line, with the evidence that made it.
CHOSEN = {"imatrix_cap": False, "calibrate": "units", "curve": "line"}


def _req(**kw: object) -> MeasureRequest:
    return MeasureRequest(**{"base": "b.gguf", "donors": [("q8", "d.gguf")], "reference": "t.gguf", "text": Path("t.txt"),
                             "imatrix": "m.gguf", **kw})  # type: ignore[arg-type]


def _method(req: MeasureRequest) -> dict[str, object]:
    r = defaults.resolved(req)
    return {"imatrix_cap": r.imatrix_cap, "calibrate": r.calibrate, "curve": r.curve}


def test_no_method_flag_is_the_chosen_default() -> None:
    assert {"imatrix_cap": defaults.IMATRIX_CAP, "calibrate": defaults.CALIBRATE, "curve": defaults.CURVE} == CHOSEN
    assert _method(_req()) == CHOSEN
    assert _method(_req(imatrix=None))["imatrix_cap"] is False  # no matrix, nothing to cap


@pytest.mark.parametrize("given", [{"imatrix_cap": True}, {"imatrix_cap": False}, {"calibrate": "kinds"},
                                   {"calibrate": "units"}, {"curve": "versions"}, {"curve": "line"},
                                   {"calibrate": "kinds", "curve": "versions", "imatrix_cap": True}])
def test_a_flag_given_is_kept_and_the_others_default(given: dict[str, object]) -> None:
    got = _method(_req(**given))
    assert got == {**CHOSEN, **given}


def test_defaults_yield_to_what_they_cannot_go_with() -> None:
    assert _method(_req(curve="two-point"))["calibrate"] == "units"  # two-point is a curve per unit
    assert _method(_req(refine=2, max_size=10))["curve"] == "line"  # --refine is its own correction of the line
    weights = _method(_req(method="weights", reference=None, text=None))
    assert (weights["calibrate"], weights["curve"]) == ("units", "line")  # nothing is calibrated by passes
    swaps = _method(_req(method="swaps"))
    assert (swaps["calibrate"], swaps["curve"]) == ("units", "line")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("defaults")
    geo = Geometry(n_layer=2)
    paths = {q: write_llama_gguf(tmp / f"{q}.gguf", qtype=q, seed=7, geometry=geo)[0] for q in ("Q4_0", "Q8_0")}
    paths["imatrix"] = write_imatrix(tmp / "imatrix.gguf", imatrix_values(imatrix_targets(geo), seed=4))
    paths["text"] = tmp / "rows.txt"
    paths["text"].write_text("the model of a mosaic\nbytes and the bytes of a model\n")
    return paths


def _measure_cli(tiny: dict[str, Path], out: Path, *flags: str) -> dict:
    r = run_cli(["measure", "--base", str(tiny["Q4_0"]), "--donor", f"q8={tiny['Q8_0']}", "--reference", str(tiny["Q8_0"]),
                 "--text", str(tiny["text"]), "--ctx", "16", "--unit", "module-group", "--imatrix", str(tiny["imatrix"]),
                 *flags, "--out", str(out), "--json"], timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_document_names_the_default_that_ran_and_the_flags_that_turn_it_off(tiny: dict[str, Path], tmp_path: Path) -> None:
    plain = _measure_cli(tiny, tmp_path / "plain.json")["settings"]
    assert (plain["calibrate"], plain["curve"], "cap" in plain["imatrix"]) == (CHOSEN["calibrate"], CHOSEN["curve"],
                                                                              CHOSEN["imatrix_cap"])
    flip = ["--calibrate", "kinds" if CHOSEN["calibrate"] == "units" else "units",
            "--curve", "versions" if CHOSEN["curve"] == "line" else "line",
            "--no-imatrix-cap" if CHOSEN["imatrix_cap"] else "--imatrix-cap"]
    other = _measure_cli(tiny, tmp_path / "other.json", *flip)["settings"]
    assert (other["calibrate"], other["curve"], "cap" in other["imatrix"]) == (flip[1], flip[3], not CHOSEN["imatrix_cap"])


@pytest.mark.parametrize("curve", [[], ["--curve", "versions"]])
def test_a_shard_of_the_versions_curve_is_refused_with_the_flag_that_shards(tiny: dict[str, Path], tmp_path: Path,
                                                                            curve: list[str]) -> None:
    r = run_cli(["measure", "--base", str(tiny["Q4_0"]), "--donor", f"q8={tiny['Q8_0']}", "--reference", str(tiny["Q8_0"]),
                 "--text", str(tiny["text"]), "--ctx", "16", *curve, "--shard", "1/2", "--out", str(tmp_path / "s.json")])
    if not curve and CHOSEN["curve"] != "versions":
        assert r.returncode == 0, r.stderr  # the default curve shards
    else:
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not with --shard" in r.stderr, r.stderr
        assert ("--curve line shards" in r.stderr) == (not curve)
        assert not (tmp_path / "s.json").exists()
