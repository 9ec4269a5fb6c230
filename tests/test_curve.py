"""`mosaic measure` over published quantizations: each unit's loss as the line through its drop from the top.

A drop is checked against `mosaic eval` of that very model built by `mosaic build`, a sharded run against one run,
the timing's stages against the passes; and a document of the retired `--curve two-point` (each unit's loss as
two lines through a second drop) still reads as it was made: its predictions are the two lines' arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import mosaic
from mosaic._eval.run import EvalRequest, evaluate
from mosaic._measure.calibrate import fill, measured_record
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, write_llama_gguf
from tests.conftest import build_versions, needs_runtime

GEO = Geometry(n_layer=2)
ROWS = "the model of a mosaic\nbytes and the bytes of a model\nthe mosaic is a model of bytes and bytes\n"
DONORS = {"q41": "Q4_1", "q5": "Q5_0", "q8": "Q8_0"}


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
                          unit="module-group", out=out, **kw).as_dict()


@pytest.fixture(scope="module")
def line(models: dict[str, Path]) -> dict:
    return _measure(models, models["dir"] / "line.json")


def _two_lines(m: dict, eps: float) -> float:
    """The loss over the top at ``eps``: top → mid → base, the mid drop kept between 0 and the base's."""
    top, base, d_base = m["eps_top"], m["eps_base"], max(0.0, m["dkl_drop"])
    e_mid, d_mid = m["mid"]["eps"], min(d_base, max(0.0, m["mid"]["dkl_drop"]))
    if eps <= e_mid:
        return d_mid * (eps - top) / (e_mid - top)
    return d_mid + (d_base - d_mid) * (eps - e_mid) / (base - e_mid)


def test_a_retired_two_point_document_still_reads_as_two_lines() -> None:
    """A unit measured with a second drop (``mid``) keeps its two-line curve in the arithmetic that completes a
    document (a merge of a two-point measurement's shards), as it was when the method ran."""
    m = measured_record(0, "ffn_down", 1.5, 0.5, 2.0, 1.0, 0.01, 0.2, 0.002,
                        {"donor": "q5", "eps": 0.03, "kl": 1.05, "dkl_drop": 0.05, "dkl_drop_se": 0.005})
    rows = [{"layer": 0, "group": "ffn_down", "donor": d, "eps": e, "eps_base": 0.2} for d, e in (("q5", 0.03), ("q8", 0.01))]
    got = fill(rows, [m], "units", 1.5)
    for r, e in zip(got, (0.03, 0.01)):
        assert r["dkl"] == pytest.approx(_two_lines(m, e) - _two_lines(m, 0.2), rel=1e-12) and r["predicted"] is True


def test_a_drop_is_what_mosaic_eval_gives_for_that_very_model(models: dict[str, Path], line: dict, tmp_path: Path) -> None:
    m = max(line["measured"], key=lambda x: x["dkl_drop"])
    key = f"{'null' if m['layer'] is None else m['layer']}/{m['group']}"
    versions = {**line["top"]["versions"], key: m["to"]}
    built = build_versions(models["Q4_0"], {d: models[q] for d, q in DONORS.items()}, versions, tmp_path / "drop")
    ev = evaluate(EvalRequest([str(built)], str(models["saved"]), models["rows"]))
    assert m["kl"] == pytest.approx(ev["candidates"][0]["kl"]["mean"], abs=1e-6)


def test_shards_of_a_measurement_merge_to_the_one_run(models: dict[str, Path], line: dict, tmp_path: Path) -> None:
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
    assert summed["base"][0] == 2 and summed["drop"][0] == len(line["measured"])  # each shard ran its own base
    one = json.loads(json.dumps(line))  # a copy
    for d in (merged, one):
        for key in ("seconds", "seconds_per_candidate", "timing", "dequantizer"):  # run to run: time, what decoded
            d.pop(key)
        d["runtime"].pop("threads")
    assert merged == one


def test_timing_counts_each_stage_s_passes(line: dict) -> None:
    """One run against a saved teacher: its stages' passes are its forward passes, stage by stage."""
    st = line["timing"]["stages"]
    assert st["weights"]["passes"] == 0 and st["weights"]["seconds"] >= 0
    assert (st["base"]["passes"], st["top"]["passes"]) == (1, 1) and "teacher" not in st
    assert st["drop"]["passes"] == len(line["measured"])
    assert sum(v["passes"] for v in st.values()) == line["forward_passes"]
    assert all(v["seconds"] > 0 for k, v in st.items() if k != "weights")


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
