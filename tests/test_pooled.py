"""A measurement whose cost does not grow with the depth: over a ladder each kind's sensitivity is read from its
pooled pass (every layer's units moved together), the versions curve from its other pooled passes; the fit that
turns passes into sensitivities recovers known ones, within its standard errors, from a seeded scorer of the
model's own form; no pass measures a version no plan can take; and the options retired for no gain are refused,
naming where their evidence is."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import mosaic
from mosaic._base.errors import MosaicError
from mosaic._measure import defaults
from mosaic._measure.calibrate import BASE, kind_alphas, measured_record, unit_key, version_factors
from mosaic._measure.request import MeasureRequest, check_request
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from mosaic.testing.quantize_tool import write_tool
from tests.conftest import needs_runtime


def _req(**kw: object) -> MeasureRequest:
    return MeasureRequest(**{"base": "b.gguf", "donors": [("q8", "d.gguf")], "reference": "t.gguf", "text": Path("t.txt"),
                             "imatrix": "m.gguf", "ladder": True, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("given", "says"), [
    ({"calibrate": "pooled", "curve": "line"}, r"--calibrate pooled .* needs --curve versions, not --curve line"),
    ({"calibrate": "pooled", "method": "weights"}, "not of --method weights"),
    ({"calibrate": "groups"}, r"--calibrate groups: retired \(.*bench/RESULTS.md, \"Retired measurement options\"\)"),
    ({"curve": "two-point"}, r"--curve two-point: retired \("),
    ({"calibrate": "sideways"}, "one of units, kinds, pooled"),
    ({"curve": "bent"}, "one of line, versions"),
])
def test_a_measurement_that_cannot_be_is_refused_before_anything_opens(given: dict[str, object], says: str) -> None:
    req = _req(**given)
    with pytest.raises(MosaicError, match=says):
        check_request(defaults.resolved(req), req)


def test_the_retired_options_are_one_line_naming_their_evidence(tmp_path: Path) -> None:
    """--sample-layers, --refine (and its --max-size), --calibrate groups and --curve two-point are gone from the
    command line and the API: each is one line, exit 2, before anything is read."""
    import subprocess
    import sys

    for flags, option in ((["--sample-layers", "4"], "--sample-layers"), (["--refine", "1"], "--refine"),
                          (["--max-size", "1G"], "--refine"), (["--calibrate", "groups"], "--calibrate groups"),
                          (["--curve", "two-point"], "--curve two-point")):
        r = subprocess.run([sys.executable, "-m", "mosaic.cli", "measure", "--ladder", str(tmp_path / "none"), "--reference",
                            "t.gguf", "--text", "t.txt", *flags], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.startswith(f"mosaic: error: {option}: retired (") and r.stderr.count("\n") == 1, r.stderr
        assert "bench/RESULTS.md" in r.stderr
        assert ("MOSAIC_EXPERIMENTS=1 keeps it for experiments" in r.stderr) == (option == "--refine")
    with pytest.raises(TypeError):
        mosaic.measure(ladder=tmp_path / "none", reference="t.gguf", text="t.txt", sample_layers=4)  # type: ignore[call-arg]
    for kw in ({"calibrate": "groups"}, {"curve": "two-point"}, {"refine": 1}, {"max_size": 10}):
        with pytest.raises(MosaicError, match="retired"):
            mosaic.measure(ladder=tmp_path / "none", reference="t.gguf", text="t.txt", **kw)  # type: ignore[arg-type]


# A seeded scorer of the form the fit assumes: a kind's unit at version v costs alpha_kind × factor(kind, v) ×
# (eps_v − eps_top) nats over the top, every layer alike; each measured figure carries Gaussian noise of a known
# standard error. The drops go to each unit's worst version, where the factor is 1 by construction.
KINDS = {"attn_q": 0.8, "attn_k": 0.3, "attn_v": 2.5, "attn_output": 1.2, "ffn_up": 0.9, "ffn_gate": 0.7, "ffn_down": 3.0}
VERSIONS = {"IQ2_XS": 1.0, "Q3_K": 1.6, "Q4_K": 0.7}  # the factor at each; IQ2_XS is the worst (the drops' end)
EPS = {"IQ2_XS": 0.20, "Q3_K": 0.05, "Q4_K": 0.012}  # a kind's typical weight error at each version; the top's is 0.002


def _scored(seed: int, layers: int, sample: list[int], noise: float) -> tuple[list[dict], list[dict], list[dict]]:
    rng = np.random.default_rng(seed)
    rows, measured, pooled = [], [], []
    eps: dict[tuple[str, str], float] = {}
    for layer in range(layers):
        for group in KINDS:
            key = unit_key(layer, group)
            scale = float(rng.lognormal(0.0, 0.3))  # units differ in their weight errors, not in the kind's alpha
            for v, e in EPS.items():
                eps[(key, v)] = e * scale
            eps[(key, BASE)] = EPS["IQ2_XS"] * scale  # the base's version is the worst
            eps[(key, "top")] = 0.002 * scale
            for v in VERSIONS:
                rows.append({"layer": layer, "group": group, "donor": v, "eps": eps[(key, v)], "eps_base": eps[(key, BASE)]})
            rows.append({"layer": layer, "group": group, "donor": "top", "eps": eps[(key, "top")], "eps_base": eps[(key, BASE)]})
    for layer in sample:
        for group, alpha in KINDS.items():
            key = unit_key(layer, group)
            span = eps[(key, "IQ2_XS")] - eps[(key, "top")]
            true = alpha * span
            se = noise * true
            measured.append(measured_record(layer, group, 1.0 + true + float(rng.normal(0.0, se)), 0.5, 2.0, 1.0, se,
                                            eps[(key, BASE)], eps[(key, "top")], to="IQ2_XS", eps_to=eps[(key, "IQ2_XS")]))
    for group, alpha in KINDS.items():
        for v, factor in VERSIONS.items():
            keys = [unit_key(layer, group) for layer in range(layers)]
            true = sum(alpha * factor * (eps[(k, v)] - eps[(k, "top")]) for k in keys)
            se = noise * true / math.sqrt(layers)  # every layer's units moved together: the rise stands out of the noise
            pooled.append({"kind": group, "to": v, "units": keys, "kl": 1.0 + true, "top1": 0.5, "nll": 2.0,
                           "dkl": true + float(rng.normal(0.0, se)), "dkl_se": se})
    return rows, measured, pooled


def _as_standard_errors_promise(z: list[float]) -> None:
    """Estimates minus the truth over their standard errors, from many seeded scorers: within one about two times
    in three, within two and three nearly always, and no bias beyond the noise."""
    z_ = np.array(z)
    assert 0.58 <= np.mean(np.abs(z_) <= 1) <= 0.78, np.mean(np.abs(z_) <= 1)
    assert np.mean(np.abs(z_) <= 2) >= 0.92
    assert np.mean(np.abs(z_) <= 3) >= 0.99
    assert abs(np.mean(z_)) < 0.15


@pytest.mark.parametrize("layers", [30, 60])
def test_the_fit_of_each_kinds_drops_recovers_known_sensitivities_within_its_standard_errors(layers: int) -> None:
    """Over many seeded scorers, each kind's alpha lands within one of its standard errors about two times in
    three and within three nearly always, as a standard error promises; so does each version's factor, whose
    error adds the alpha's (the factor is a ratio to the line the alpha draws; the document's ``ratio_se`` is
    the pooled pass's alone, and ``credible`` keeps a factor within two of those)."""
    z_alpha, z_factor = [], []
    for seed in range(120):
        rows, measured, pooled = _scored(seed, layers, list(range(layers)), noise=0.1)
        alphas = kind_alphas(measured)
        assert {k: n for k, (_, n) in alphas.items()} == {k: layers for k in KINDS}
        for k, (a, _) in alphas.items():
            z_alpha.append((a.value - KINDS[k]) / a.se)
        for p in version_factors(pooled, measured, rows, "kinds"):
            a = alphas[p["kind"]][0]
            se = math.hypot(p["ratio_se"], p["ratio"] * a.se / a.value)
            z_factor.append((p["ratio"] - VERSIONS[p["to"]]) / se)
    _as_standard_errors_promise(z_alpha)
    _as_standard_errors_promise(z_factor)


@pytest.mark.parametrize("layers", [30, 60])
def test_each_kinds_alpha_from_its_pooled_pass_recovers_known_sensitivities_within_its_standard_errors(layers: int) -> None:
    """``--calibrate pooled``: no drop runs; each kind's alpha is its pooled pass at the drops' version (IQ2_XS,
    where the factor is 1) over its units' weight errors there, its standard error the pass's. Over many seeded
    scorers it lands where a standard error promises, at either depth."""
    from mosaic._measure.calibrate import pooled_alphas

    z = []
    for seed in range(120):
        rows, _, pooled = _scored(seed, layers, [], noise=0.1)
        for p in pooled:
            if p["to"] == "IQ2_XS":
                p["alpha"] = True
        alphas = pooled_alphas(pooled, rows)
        assert {k: n for k, (_, n) in alphas.items()} == {k: layers for k in KINDS}
        z += [(a.value - KINDS[k]) / a.se for k, (a, _) in alphas.items()]
    _as_standard_errors_promise(z)


def test_a_scorer_the_fit_does_not_assume_is_not_recovered() -> None:
    """The check above can fail: where the alpha grows with the depth, a few layers' pooled alpha is no longer the
    kind's at every layer, and the shallow layers' alpha lies far outside its standard errors."""
    layers, sample = 30, [3, 11, 18, 26]
    _, measured, _ = _scored(0, layers, sample, noise=0.05)
    for m in measured:  # the drops of deep layers ten times those of layer 0
        grow = 1 + 9 * m["layer"] / (layers - 1)
        m["dkl_drop"] *= grow
        m["dkl_drop_se"] *= grow
    a, _ = kind_alphas(measured)["ffn_down"]
    assert abs(a.value - KINDS["ffn_down"]) / a.se > 3


def _model(tmp: Path, layers: int) -> dict[str, Path]:
    geo = Geometry(n_layer=layers)  # narrow: the count of passes is the point, not their cost
    src = write_llama_gguf(tmp / "F16.gguf", qtype="F16", seed=11, geometry=geo)[0]
    imatrix = write_imatrix(tmp / "imatrix.gguf", imatrix_values(imatrix_targets(geo), seed=4))
    mosaic.ladder(src, out=tmp / "rungs", types="Q4_0,Q8_0", imatrix=imatrix, llama_quantize=write_tool(tmp / "llama-quantize"))
    rows = tmp / "rows.txt"
    rows.write_text("the model of a mosaic\nbytes and the bytes of a model\n")
    return {"source": src, "imatrix": imatrix, "rungs": tmp / "rungs", "rows": rows}


def test_the_default_makes_as_many_forward_passes_at_60_layers_as_at_30(tmp_path: Path) -> None:
    """Over a ladder with no method flag (``--calibrate pooled``): no layer's unit has a drop of its own, and the
    passes are fixed by the kinds and the ladder's types, not by the depth."""
    needs_runtime()
    pooled = {}
    for layers in (30, 60):
        m = _model(tmp_path / str(layers), layers)
        pooled[layers] = mosaic.measure(ladder=m["rungs"], reference=m["source"], imatrix=m["imatrix"], text=m["rows"],
                                        ctx=16, out=tmp_path / f"{layers}-pooled.json").document
    assert pooled[30]["settings"]["calibrate"] == pooled[60]["settings"]["calibrate"] == "pooled"
    assert pooled[30]["settings"]["unit"] == "module-group"  # the unit over a ladder, by default
    assert pooled[30]["forward_passes"] == pooled[60]["forward_passes"]
    assert all(m["layer"] is None for d in pooled.values() for m in d["measured"])
    assert pooled[30]["timing"]["stages"].get("drop", {}).get("passes", 0) == pooled[60]["timing"]["stages"].get(
        "drop", {}).get("passes", 0)
    for layers, doc in pooled.items():  # the pooled passes move every layer's units
        assert {p["kind"] for p in doc["pooled"]} and all(
            len({u.split("/")[0] for u in p["units"]}) == layers for p in doc["pooled"] if p["kind"] not in ("token_embd", "output"))


def test_no_pooled_pass_runs_for_a_version_no_plan_can_take(tmp_path: Path) -> None:
    """Over a ladder made from a Q4_0 model, its Q4_0 rung is the source's own bytes: no weight error, and fewer
    bytes than the Q8_0 rung. No plan takes Q8_0 then, and no forward pass measures it; the smaller rung is."""
    needs_runtime()
    from tests.test_ladder import WIDE

    src = write_llama_gguf(tmp_path / "Q4_0.gguf", qtype="Q4_0", seed=11, geometry=WIDE)[0]
    imatrix = write_imatrix(tmp_path / "imatrix.gguf", imatrix_values(imatrix_targets(WIDE), seed=4))
    mosaic.ladder(src, out=tmp_path / "rungs", types="Q2_K,Q4_0,Q8_0", imatrix=imatrix,
                  llama_quantize=write_tool(tmp_path / "llama-quantize"), lean=False)  # the Q8_0 rung made all the same
    rows = tmp_path / "rows.txt"
    rows.write_text("the model of a mosaic\nbytes and the bytes of a model\n")
    doc = mosaic.measure(ladder=tmp_path / "rungs", reference=src, imatrix=imatrix, text=rows, ctx=16,
                         unit="module-group", out=tmp_path / "m.json").document
    tops = set(doc["top"]["versions"].values())
    assert tops == {"q4_0"}  # the source's own bytes, lossless, at every unit
    assert {p["to"] for p in doc["pooled"]} == {"base"}  # Q2_K measured; Q8_0 (more bytes than the top) not
    assert doc["timing"]["stages"]["pooled"]["passes"] == len(doc["pooled"])
    q8 = [r for r in doc["results"] if r["donor"] == "q8_0"]
    assert q8 and all(r["dkl"] > -1e-12 + min(x["dkl"] for x in doc["results"] if x["donor"] == "q4_0"
                                               and (x["layer"], x["group"]) == (r["layer"], r["group"])) for r in q8)
