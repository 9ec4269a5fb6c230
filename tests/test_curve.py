"""`mosaic measure --curve two-point`: each unit's loss as two lines, through a second drop from the top.

The second point is checked against its rule (the version nearest the log-midpoint of the top's and the base's
weight errors), its drop against `mosaic eval` of that very model built by `mosaic build`, the predictions against
the two-line formula written out here, and a sharded run against one run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

import mosaic
from mosaic._eval.run import EvalRequest, evaluate
from mosaic._measure.calibrate import mid_version
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, write_llama_gguf
from tests.conftest import build_versions, needs_runtime

GEO = Geometry(n_layer=2)
ROWS = "the model of a mosaic\nbytes and the bytes of a model\nthe mosaic is a model of bytes and bytes\n"
DONORS = {"q41": "Q4_1", "q5": "Q5_0", "q8": "Q8_0"}


def test_the_second_point_is_nearest_the_log_midpoint() -> None:
    eps = {"base": 1e-2, "a": 5e-3, "b": 1.2e-3, "c": 2e-4, "top": 1e-4}
    size = dict.fromkeys(eps, 10)
    assert mid_version(list(eps), eps, size, "top") == "b"  # sqrt(1e-2 · 1e-4) = 1e-3
    assert mid_version(["base", "top"], eps, size, "top") is None  # nothing between
    zero = {**eps, "top": 0.0}  # the teacher's own tensor: 1e-4 of the base's stands in for 0
    assert mid_version(list(zero), zero, size, "top") == "c"  # log-midpoint of 1e-6 and 1e-2: 1e-4
    tie = {"base": 1e-2, "x": 1e-3, "y": 1e-3, "top": 1e-4}
    assert mid_version(list(tie), tie, {"base": 9, "x": 8, "y": 5, "top": 9}, "top") == "y"  # the fewer bytes


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("curve"))


def make_models(d: Path) -> dict[str, Path]:
    """A two-layer synthetic llama in ``d``: the Q4_0 base, the donors, the F16 teacher, the rows and the teacher's
    saved top-k on them."""
    needs_runtime()
    paths = {q: write_llama_gguf(d / f"{q}.gguf", qtype=q, seed=9, geometry=GEO)[0] for q in ("Q4_0", *DONORS.values(), "F16")}
    (d / "rows.txt").write_text(ROWS)
    paths["rows"] = d / "rows.txt"
    saved = d / "teacher.npz"
    evaluate(EvalRequest([], str(paths["F16"]), paths["rows"], ctx=16, top_k=16, save_reference=saved))
    paths["saved"] = saved
    paths["dir"] = d
    return paths


def _measure(m: dict[str, Path], out: Path, **kw: object) -> dict:
    return mosaic.measure(base=m["Q4_0"], donors={d: m[q] for d, q in DONORS.items()}, reference=m["saved"], text=m["rows"],
                          unit="module-group", curve="two-point", out=out, **kw).as_dict()


@pytest.fixture(scope="module")
def two(models: dict[str, Path]) -> dict:
    return _measure(models, models["dir"] / "two.json")


def _two_lines(m: dict, eps: float) -> float:
    """The loss over the top at ``eps``: top → mid → base, the mid drop kept between 0 and the base's."""
    top, base, d_base = m["eps_top"], m["eps_base"], max(0.0, m["dkl_drop"])
    e_mid, d_mid = m["mid"]["eps"], min(d_base, max(0.0, m["mid"]["dkl_drop"]))
    if eps <= e_mid:
        return d_mid * (eps - top) / (e_mid - top)
    return d_mid + (d_base - d_mid) * (eps - e_mid) / (base - e_mid)


def test_predictions_follow_the_two_lines_through_both_drops(two: dict) -> None:
    assert two["settings"]["curve"] == "two-point"
    with_mid = [m for m in two["measured"] if "mid" in m]
    assert with_mid and two["forward_passes"] == 2 + len(two["measured"]) + len(with_mid)
    curves = {(m["layer"], m["group"]): m for m in with_mid}
    rows = {(r["layer"], r["group"], r["donor"]): r for r in two["results"]}
    for m in with_mid:
        assert m["eps_top"] < m["mid"]["eps"] < m["eps_base"] and m["mid"]["donor"] in DONORS
        assert m["mid"]["dkl_drop"] == pytest.approx(m["mid"]["kl"] - two["top"]["kl"], abs=1e-12)
    checked = 0
    for (layer, group, _donor), r in rows.items():
        m = curves.get((layer, group))
        if m is None:
            continue
        want = _two_lines(m, r["eps"]) - _two_lines(m, r["eps_base"])
        assert r["dkl"] == pytest.approx(want, rel=1e-12, abs=1e-15) and r["predicted"] is True
        assert r["kl"] == pytest.approx(two["base"]["kl"] + r["dkl"], abs=1e-12)
        checked += 1
    assert checked >= 3 * len(curves) - len(curves)  # every donor of every unit with a curve
    assert all(math.isfinite(r["dkl_se"]) and r["dkl_se"] >= 0 for r in two["results"])


def test_a_second_drop_is_what_mosaic_eval_gives_for_that_very_model(models: dict[str, Path], two: dict, tmp_path: Path) -> None:
    m = max((x for x in two["measured"] if "mid" in x), key=lambda x: x["mid"]["dkl_drop"])
    key = f"{'null' if m['layer'] is None else m['layer']}/{m['group']}"
    versions = {**two["top"]["versions"], key: m["mid"]["donor"]}
    built = build_versions(models["Q4_0"], {d: models[q] for d, q in DONORS.items()}, versions, tmp_path / "mid")
    ev = evaluate(EvalRequest([str(built)], str(models["saved"]), models["rows"]))
    assert m["mid"]["kl"] == pytest.approx(ev["candidates"][0]["kl"]["mean"], abs=1e-6)


def test_shards_of_a_two_point_measurement_merge_to_the_one_run(models: dict[str, Path], two: dict, tmp_path: Path) -> None:
    parts = [tmp_path / f"p{k}.json" for k in (1, 2)]
    for k, p in enumerate(parts, 1):
        part = _measure(models, p, shard=f"{k}/2")
        assert all(r["dkl"] is None for r in part["results"])
    merged = mosaic.measure(merge=parts, out=tmp_path / "m.json").as_dict()
    summed: dict[str, list[float]] = {}  # timing.stages: every shard's passes and seconds, summed
    for p in parts:
        for k, v in json.loads(p.read_text())["timing"]["stages"].items():
            summed.setdefault(k, [0, 0.0])
            summed[k] = [summed[k][0] + v["passes"], summed[k][1] + v["seconds"]]
    assert {k: v["passes"] for k, v in merged["timing"]["stages"].items()} == {k: v[0] for k, v in summed.items()}
    assert all(merged["timing"]["stages"][k]["seconds"] == pytest.approx(v[1], abs=2e-3) for k, v in summed.items())
    assert summed["base"][0] == 2 and summed["drop"][0] == len(two["measured"])  # each shard ran its own base
    one = json.loads(json.dumps(two))  # a copy
    for d in (merged, one):
        for key in ("seconds", "seconds_per_candidate", "timing"):  # where the time went differs from run to run
            d.pop(key)
        d["runtime"].pop("threads")
    assert merged == one


def test_timing_counts_each_stage_s_passes(two: dict) -> None:
    """One run against a saved teacher: its stages' passes are its forward passes, stage by stage."""
    st = two["timing"]["stages"]
    assert st["weights"]["passes"] == 0 and st["weights"]["seconds"] >= 0
    assert (st["base"]["passes"], st["top"]["passes"]) == (1, 1) and "teacher" not in st
    assert st["drop"]["passes"] == len(two["measured"])
    assert st["drop-mid"]["passes"] == sum("mid" in m for m in two["measured"])
    assert sum(v["passes"] for v in st.values()) == two["forward_passes"]
    assert all(v["seconds"] > 0 for k, v in st.items() if k != "weights")


def test_curve_refusals_are_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    common = ["measure", "--base", str(models["Q4_0"]), "--donor", f"q8={models['Q8_0']}", "--reference", str(models["saved"]),
              "--text", str(models["rows"]), "--out", str(tmp_path / "m.json"), "--curve", "two-point"]
    for extra, want in ((["--calibrate", "kinds", "--only-layers", "0"], "not with --calibrate kinds"),
                        (["--method", "swaps"], "not of --method swaps")):
        r = CliRunner().invoke(main, [*common, *extra])
        assert r.exit_code == 2 and want in r.stderr and r.stderr.count("\n") == 1, r.output
    assert not (tmp_path / "m.json").exists()


def test_the_command_line_counts_the_drops_its_rows_cannot_resolve(models: dict[str, Path], tmp_path: Path) -> None:
    from rich.console import Console

    from mosaic.cli.render import render_measurement

    out = tmp_path / "m.json"
    r = CliRunner().invoke(main, ["measure", "--base", str(models["Q4_0"]), "--donor", f"q8={models['Q8_0']}",
                                  "--reference", str(models["saved"]), "--text", str(models["rows"]), "--unit", "module-group",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    drops = doc["measured"]
    assert all(abs(d["dkl_drop"]) >= 2 * d["dkl_drop_se"] for d in drops)  # every drop here stands out of its noise
    assert "within two standard errors of none" not in r.output
    for d in drops[:2]:  # two drops no larger than their standard error: rows that cannot resolve them
        d["dkl_drop_se"] = abs(d["dkl_drop"])
    console = Console(record=True, width=400)
    render_measurement(console, doc, out)
    assert f"2 of {len(drops)} drops are within two standard errors of none" in console.export_text()
