"""`mosaic measure --refine N --max-size SIZE`: the top-down model measured again where the plan lands. Retired for
no gain on held-out rows (bench/RESULTS.md), it is kept behind the experiments' switch (``MOSAIC_EXPERIMENTS=1``,
which this module sets) for a check of a chosen plan on the measurement's rows.

Each figure is checked against something that is not the refinement's own: the round's plan against
`mosaic plan --max-size` of the measurement without it, a move's KL against `mosaic eval` of that very mosaic
built by `mosaic build`, the ratios and scaled predictions against their formula over the document's own
records, an interrupted refinement against one that was not. A small synthetic model keeps it fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mosaic._eval.run import EvalRequest, evaluate
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from tests.conftest import build_versions, needs_runtime, run_cli

GEO = Geometry(n_layer=2)
ROWS = "the model of a mosaic\nbytes and the bytes of a model\nthe mosaic is a model of bytes and bytes\n"


@pytest.fixture(scope="module", autouse=True)
def _experiments():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOSAIC_EXPERIMENTS", "1")
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    needs_runtime()
    d = tmp_path_factory.mktemp("refine")
    paths = {q: write_llama_gguf(d / f"{q}.gguf", qtype=q, seed=5, geometry=GEO)[0] for q in ("Q4_0", "Q5_0", "Q8_0", "F16")}
    (d / "rows.txt").write_text(ROWS)
    paths["rows"] = d / "rows.txt"
    paths["imatrix"] = write_imatrix(d / "imatrix.gguf", imatrix_values(imatrix_targets(GEO), seed=2))
    saved = d / "teacher.npz"
    evaluate(EvalRequest([], str(paths["F16"]), paths["rows"], ctx=16, top_k=16, save_reference=saved))
    paths["saved"] = saved
    paths["dir"] = d
    paths["size"] = Path(str(paths["Q4_0"].stat().st_size + 24_000))  # a budget between the base and the top
    return paths


def _args(m: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["measure", "--base", str(m["Q4_0"]), "--donor", f"q5={m['Q5_0']}", "--donor", f"q8={m['Q8_0']}",
            "--reference", str(m["saved"]), "--text", str(m["rows"]), "--unit", "module-group", "--imatrix",
            str(m["imatrix"]), "--out", str(out), *extra]


def _plan(m: dict[str, Path], scores: Path, size: int) -> list[dict]:
    r = CliRunner().invoke(main, ["plan", "--base", str(m["Q4_0"]), "--donor", f"q5={m['Q5_0']}", "--donor", f"q8={m['Q8_0']}",
                                  "--scores", str(scores), "--max-size", str(size), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["chosen"]


def _key(chosen: list[dict]) -> dict[str, str]:
    return {f"{'null' if c['layer'] is None else c['layer']}/{c['group']}": c["donor"] for c in chosen}


@pytest.fixture(scope="module")
def refined(models: dict[str, Path]) -> dict:
    out = models["dir"] / "refined.json"
    r = CliRunner().invoke(main, [*_args(models, out, "--refine", "2", "--max-size", str(models["size"])), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_round_runs_the_plan_mosaic_plan_makes_and_one_move_of_every_unit(models: dict[str, Path], refined: dict,
                                                                            tmp_path: Path) -> None:
    size = int(str(models["size"]))
    assert refined["settings"]["refine"] == {"rounds": 2, "max_size": size}
    plain = tmp_path / "plain.json"
    r = CliRunner().invoke(main, _args(models, plain))
    assert r.exit_code == 0, r.output
    rounds = refined["refinement"]["rounds"]
    assert rounds and rounds[0]["versions"] == _key(_plan(models, plain, size))
    units = {f"{'null' if m['layer'] is None else m['layer']}/{m['group']}" for m in refined["measured"]}
    for rd in rounds:
        assert rd["bytes"] <= size
        moved = {f"{'null' if m['layer'] is None else m['layer']}/{m['group']}" for m in rd["moves"]}
        assert moved <= units and len(moved) == len(rd["moves"]) >= len(units) - 1
        for mv in rd["moves"]:
            key = f"{'null' if mv['layer'] is None else mv['layer']}/{mv['group']}"
            assert mv["from"] == rd["versions"].get(key, "base") != mv["to"]
            assert mv["dkl"] == pytest.approx(mv["kl"] - rd["kl"], abs=1e-12)
    # the teacher was saved: the base, the top, one drop per unit, then each round's plan and its moves
    assert refined["forward_passes"] == 2 + len(refined["measured"]) + sum(1 + len(rd["moves"]) for rd in rounds)
    # the final plan is what mosaic plan makes of the refined document; converged: the last round's plan
    final = _plan(models, models["dir"] / "refined.json", size)
    assert refined["refinement"]["versions"] == _key(final)
    assert refined["refinement"]["converged"] == (_key(final) == rounds[-1]["versions"])


def test_ratios_and_scaled_predictions_follow_from_the_moves(models: dict[str, Path], refined: dict, tmp_path: Path) -> None:
    plain = tmp_path / "plain.json"
    CliRunner().invoke(main, _args(models, plain))
    before = {(r["layer"], r["group"], r["donor"]): r for r in json.loads(plain.read_text())["results"]}
    scale: dict[str, float] = {}
    for rd in refined["refinement"]["rounds"]:
        for kind, rt in rd["ratios"].items():
            mv = [m for m in rd["moves"] if m["group"] == kind and m["predicted"] != 0]
            num = sum((1 if m["predicted"] > 0 else -1) * m["dkl"] for m in mv)
            den = sum(abs(m["predicted"]) for m in mv)
            assert rt["moves"] == len(mv) and rt["ratio"] == pytest.approx(max(0.0, num / den), rel=1e-12)
            r, se = rt["ratio"], rt["ratio_se"]
            near = min(1.0, r + 2 * se) if r < 1 else max(1.0, r - 2 * se)  # nearest 1 within two SEs
            scale[kind] = scale.get(kind, 1.0) * near
    assert refined["refinement"]["scales"] == pytest.approx(scale, rel=1e-12)
    for r in refined["results"]:
        b = before[(r["layer"], r["group"], r["donor"])]
        assert r["dkl"] == pytest.approx(b["dkl"] * scale.get(r["group"], 1.0), rel=1e-12, abs=1e-15)
    # a move's prediction is the top-down model's (before any round) for the first round
    rd = refined["refinement"]["rounds"][0]
    for mv in rd["moves"]:
        def dkl(v: str, mv: dict = mv) -> float:
            return 0.0 if v == "base" else before[(mv["layer"], mv["group"], v)]["dkl"]

        assert mv["predicted"] == pytest.approx(dkl(mv["to"]) - dkl(mv["from"]), rel=1e-12, abs=1e-15)


def test_a_move_is_what_mosaic_eval_gives_for_that_very_mosaic(models: dict[str, Path], refined: dict, tmp_path: Path) -> None:
    rd = refined["refinement"]["rounds"][0]
    mv = max(rd["moves"], key=lambda m: abs(m["dkl"]))
    files = {"q5": models["Q5_0"], "q8": models["Q8_0"]}
    key = f"{'null' if mv['layer'] is None else mv['layer']}/{mv['group']}"
    planned = build_versions(models["Q4_0"], files, rd["versions"], tmp_path / "planned")
    moved = build_versions(models["Q4_0"], files, {**rd["versions"], key: mv["to"]}, tmp_path / "moved")
    ev = evaluate(EvalRequest([str(planned), str(moved)], str(models["saved"]), models["rows"]))
    p, c = ev["candidates"]
    assert rd["kl"] == pytest.approx(p["kl"]["mean"], abs=1e-6)
    assert mv["kl"] == pytest.approx(c["kl"]["mean"], abs=1e-6)


def test_an_interrupted_refinement_resumes_to_the_same_document(models: dict[str, Path], refined: dict, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    args = _args(models, out, "--refine", "2", "--max-size", str(models["size"]))
    drops = len(refined["measured"])
    r = run_cli(args, fault=f"candidate:{drops + 3}:int", timeout=600)  # three moves into the first round
    assert r.returncode == 130, r.stderr
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "m.json.partial").read_text().splitlines()[1:]]
    assert kinds.count("round") == 1 and kinds.count("move") == 3 and "round-done" not in kinds
    r = run_cli([*args, "--resume", "--json"], timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for d in (doc, json.loads(json.dumps(refined))):
        for k in ("seconds", "seconds_per_candidate"):
            d.pop(k)
        d.pop("text")  # the file's name differs; its digest is in the journal's fingerprint
        d.pop("base")["source"]
    assert doc["refinement"] == refined["refinement"] and doc["results"] == refined["results"]


def test_refine_refusals_are_one_line(models: dict[str, Path], ckpt_factory, tmp_path: Path) -> None:
    out = tmp_path / "m.json"

    def one(*args: str) -> str:
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code == 2 and r.stderr.startswith("mosaic: error: ") and r.stderr.count("\n") == 1, r.output
        return r.stderr

    size = str(models["size"])
    assert "needs --max-size" in one(*_args(models, out, "--refine", "1"))
    assert "give both" in one(*_args(models, out, "--max-size", size))
    assert "not --method weights" in one(*_args(models, out, "--refine", "1", "--max-size", size, "--method", "weights"))
    assert "not with --shard" in one(*_args(models, out, "--refine", "1", "--max-size", size, "--shard", "1/2"))
    assert "smaller than any plan" in one(*_args(models, out, "--refine", "1", "--max-size", "1000"))
    assert "is not a size" in one(*_args(models, out, "--refine", "1", "--max-size", "lots"))
    from mosaic.testing.exl3 import Geometry as Exl3Geometry

    exl3 = ckpt_factory(Exl3Geometry())
    assert "EXL3" in one("measure", "--base", str(exl3), "--donor", f"q={exl3}", "--reference", str(models["saved"]),
                         "--text", str(models["rows"]), "--refine", "1", "--max-size", "1G", "--out", str(out))
    assert not out.exists() and not (tmp_path / "m.json.partial").exists()


def test_moves_go_down_where_a_version_lies_below_and_up_only_from_the_bottom() -> None:
    """Both directions: a unit at the base's version with a smaller donor below it moves down to that donor; a unit
    at a donor's moves to the next larger error (the base's, where that is next); a unit at its worst version moves
    up to its best. With upgrades only every number is as before: the base's version is the bottom."""
    from mosaic._measure.refine import moves

    versions = [["base", "q2", "q8"], ["base", "q2", "q8"], ["base", "q2", "q8"], ["base", "q8"]]
    eps = {}
    nbytes = {}
    for ui in range(4):
        eps.update({(ui, "base"): 0.2, (ui, "q2"): 0.5, (ui, "q8"): 0.01})
        nbytes.update({(ui, "base"): 0, (ui, "q2"): -100, (ui, "q8"): 300})
    plan = {1: "q8", 2: "q2"}
    got = moves(plan, [0, 1, 2, 3], versions, eps, nbytes)
    assert got == [(0, "base", "q2"), (1, "q8", "base"), (2, "q2", "q8"), (3, "base", "q8")]


def test_a_kind_moves_only_as_far_as_its_moves_prove_the_model_wrong() -> None:
    """A ratio near the plan is a measurement: taken as the value nearest 1 within two standard errors. At face
    value, a noisy 0 made every version of a kind free and the next plan dropped it to the ladder's worst."""
    from mosaic._measure.refine import credible, scales

    def rnd(**ratios: tuple[float, float]) -> dict:
        return {"ratios": {k: {"ratio": r, "ratio_se": se, "moves": 30} for k, (r, se) in ratios.items()}}

    assert credible(0.0, 1.644) == 1.0 and credible(1.262, 0.2) == 1.0  # the interval holds 1: no change
    assert credible(9.628, 1.585) == pytest.approx(6.458) and credible(0.5, 0.1) == pytest.approx(0.7)
    assert credible(0.0, 0.0) == 0.0  # proved to be free: free
    got = scales([rnd(attn_k=(0.0, 1.644), ffn_down=(11.698, 3.11)), rnd(ffn_down=(0.5, 0.05), attn_v=(2.0, 0.25))])
    assert got == pytest.approx({"attn_k": 1.0, "ffn_down": (11.698 - 6.22) * 0.6, "attn_v": 1.5})
