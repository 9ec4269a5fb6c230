"""One measurement's passes read under other settings (``mosaic._measure.variants.derive``).

The ladder's default is chosen among the variants of three flags (`--imatrix-cap`, `--calibrate kinds`, `--curve
versions`) measured on the same forward passes. Each variant derived from one `--imatrix-cap --curve versions`
measurement is checked here against the measurement of that variant itself: the same predictions for every
unit and version, hence the same plans.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import mosaic
from mosaic._measure.variants import derive
from mosaic._plan.measurement import validation_errors
from mosaic.testing.gguf import imatrix_targets, imatrix_values, write_imatrix
from tests.test_curve import DONORS, GEO, make_models


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    m = make_models(tmp_path_factory.mktemp("variants"))
    values = imatrix_values(imatrix_targets(GEO), seed=5)
    sums, counts = values["blk.1.ffn_down.weight"]
    sums = sums.copy()
    sums[0, 7] = sums[0].max() * 1e5  # a massive channel: the ceiling changes this tensor's errors
    values["blk.1.ffn_down.weight"] = (sums, counts)
    m["imatrix"] = write_imatrix(m["dir"] / "imatrix.gguf", values)
    return m


def _measure(m: dict[str, Path], out: Path, **kw: object) -> dict:
    return mosaic.measure(base=m["Q4_0"], donors={d: m[q] for d, q in DONORS.items()}, reference=m["saved"], text=m["rows"],
                          unit="module-group", imatrix=m["imatrix"], out=out, **kw).as_dict()


def _weights(m: dict[str, Path], out: Path, cap: bool) -> dict:
    """Every version's weight errors against the most-bits version, as a measurement against a saved reference
    of a model that is no ladder's source compares them."""
    return mosaic.measure(base=m["Q4_0"], donors={d: m[q] for d, q in DONORS.items()}, method="weights",
                          unit="module-group", imatrix=m["imatrix"], imatrix_cap=cap, out=out).as_dict()


@pytest.fixture(scope="module")
def source(models: dict[str, Path]) -> dict:
    return _measure(models, models["dir"] / "all.json", imatrix_cap=True, calibrate="units", curve="versions")


def _predictions(doc: dict) -> dict[tuple, tuple[float, float]]:
    return {(r["layer"], r["group"], r["donor"]): (r["dkl"], r["dkl_se"]) for r in doc["results"]}


@pytest.mark.parametrize("calibrate", ["units", "kinds"])
@pytest.mark.parametrize("curve", ["line", "versions"])
def test_each_variant_read_from_one_measurement_is_that_variants_own_measurement(
        models: dict[str, Path], source: dict, tmp_path: Path, calibrate: str, curve: str) -> None:
    kinds = {"only_layers": "0-1"} if calibrate == "kinds" else {}
    real = _measure(models, tmp_path / "real.json", imatrix_cap=True, curve=curve, calibrate=calibrate, **kinds)
    got = derive(source, calibrate=calibrate, curve=curve)
    assert validation_errors(got) == []
    assert {**got["settings"], "layers": real["settings"]["layers"]} == real["settings"]
    assert got["settings"]["layers"] is None  # every layer, as the measurement it came from
    assert got["forward_passes"] == real["forward_passes"]
    assert ("pooled" in got) == (curve == "versions")
    mine, theirs = _predictions(got), _predictions(real)
    assert mine.keys() == theirs.keys()
    for k, (dkl, se) in theirs.items():  # the same passes run twice: llama.cpp on the CPU gives the same logits
        assert mine[k][0] == pytest.approx(dkl, rel=1e-9, abs=1e-12), k
        assert mine[k][1] == pytest.approx(se, rel=1e-9, abs=1e-12), k
    assert got.get("calibration") == real.get("calibration") or all(
        got["calibration"][k]["alpha"] == pytest.approx(v["alpha"]) for k, v in real["calibration"].items())
    assert got["notes"][-1] == "derived from the passes of a measurement made with --calibrate units --curve versions"


def test_without_the_ceiling_the_weight_errors_are_the_raw_weightings(models: dict[str, Path], source: dict,
                                                                       tmp_path: Path) -> None:
    raw = _weights(models, tmp_path / "raw.json", cap=False)
    real = _measure(models, tmp_path / "real.json", imatrix_cap=False, calibrate="units", curve="line")  # the raw weighting
    got = derive(source, calibrate="units", curve="line", weights=raw)
    assert validation_errors(got) == []
    assert got["settings"] == real["settings"] and "cap" not in got["settings"]["imatrix"]
    by = {(r["layer"], r["group"], r["donor"]): r for r in real["results"]}
    assert any(r["eps"] != s["eps"] for r, s in zip(got["results"], source["results"]))  # the ceiling mattered
    moved = {(m["layer"], m["group"]) for m in real["measured"]} ^ {(m["layer"], m["group"]) for m in got["measured"]}
    assert not moved
    assert [m["to"] for m in got["measured"]] == [m["to"] for m in real["measured"]]  # the same drops here
    assert "under it, 0 units' top and 0 units' drop would be at other versions" in got["notes"][-2]
    for r in got["results"]:
        s = by[(r["layer"], r["group"], r["donor"])]
        assert (r["eps"], r["eps_base"]) == (s["eps"], s["eps_base"])
        assert r["dkl"] == pytest.approx(s["dkl"], rel=1e-9, abs=1e-12)


def test_each_kinds_alpha_from_its_pooled_pass_is_that_calibrations_own_measurement(
        models: dict[str, Path], source: dict, tmp_path: Path) -> None:
    """``--calibrate pooled`` runs no drop for a kind whose pooled pass at its drop version runs: that pass gives
    the kind's alpha. Read from a measurement with every drop, it is the measurement itself: the same passes,
    alphas, predictions, and fewer passes."""
    real = _measure(models, tmp_path / "real.json", imatrix_cap=True, calibrate="pooled", curve="versions")
    got = derive(source, calibrate="pooled", curve="versions")
    assert validation_errors(got) == [] and validation_errors(real) == []
    assert got["settings"] == real["settings"] and real["settings"]["calibrate"] == "pooled"
    assert got["pooled"] == real["pooled"]
    marked = [p for p in real["pooled"] if p.get("alpha")]
    kinds = {p["kind"] for p in real["pooled"]}
    assert {p["kind"] for p in marked} == {k for k in kinds if sum(1 for u in source["measured"] if u["group"] == k) > 1}
    assert all(p["factor"] == 1.0 for p in marked)  # the line goes through its own pass
    assert {m["group"] for m in real["measured"]}.isdisjoint({p["kind"] for p in marked})  # their drops did not run
    assert got["measured"] == real["measured"]
    assert got["forward_passes"] == real["forward_passes"] == source["forward_passes"] - (
        len(source["measured"]) - len(real["measured"]))
    assert got["calibration"].keys() == real["calibration"].keys()
    for k, v in real["calibration"].items():
        assert got["calibration"][k]["alpha"] == pytest.approx(v["alpha"], rel=1e-9, abs=1e-15)
    mine, theirs = _predictions(got), _predictions(real)
    assert mine.keys() == theirs.keys()
    for k, (dkl, se) in theirs.items():
        assert mine[k][0] == pytest.approx(dkl, rel=1e-9, abs=1e-12), k
        assert mine[k][1] == pytest.approx(se, rel=1e-9, abs=1e-12), k


def test_what_the_passes_cannot_give_is_refused(models: dict[str, Path], source: dict, tmp_path: Path) -> None:
    line = derive(source, calibrate="units", curve="line")
    with pytest.raises(mosaic.MosaicError, match="needs the pooled candidates"):
        derive(line, calibrate="units", curve="versions")
    with pytest.raises(mosaic.MosaicError, match="a variant is units, kinds or pooled, line or versions"):
        derive(source, calibrate="units", curve="two-point")
    with pytest.raises(mosaic.MosaicError, match=r"--calibrate pooled .* needs --curve versions"):
        derive(source, calibrate="pooled", curve="line")
    some = _measure(models, tmp_path / "some.json", imatrix_cap=True, calibrate="kinds", curve="line", only_layers="0")
    with pytest.raises(mosaic.MosaicError, match=r"every unit needs a drop of its own .*; 1/\w+ has none"):
        derive(some, calibrate="units", curve="line")
    other = mosaic.measure(base=models["Q4_0"], donors={"q8": models["Q8_0"]}, reference=models["F16"], method="weights",
                           unit="module-group", imatrix=models["imatrix"], out=tmp_path / "w.json").as_dict()
    with pytest.raises(mosaic.MosaicError, match="not a --method weights document of the measurement's sources"):
        derive(source, calibrate="units", curve="line", weights=other)
