"""A measurement whose cost does not grow with the depth: under ``--calibrate kinds`` the drops run at a few
layers spread over it (``--sample-layers``), the versions curve still moving every layer's units; the fit that
turns those passes into sensitivities recovers known ones, within its standard errors, from a seeded scorer of
the model's own form; and no pass measures a version no plan can take."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

import mosaic
from mosaic._base.errors import MosaicError
from mosaic._measure import defaults
from mosaic._measure.calibrate import BASE, kind_alphas, measured_record, unit_key, version_factors
from mosaic._measure.run import MeasureRequest, _check_request
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from mosaic.testing.quantize_tool import write_tool
from tests.conftest import needs_runtime

#: The sample these tests take (bench/RESULTS.md tried 4 and 6).
SAMPLE = 4


def test_spread_takes_the_middle_of_equal_shares_of_the_depth() -> None:
    assert defaults.spread(list(range(30)), 4) == [3, 11, 18, 26]
    assert defaults.spread(list(range(28)), 4) == [3, 10, 17, 24]
    assert defaults.spread(list(range(60)), 4) == [7, 22, 37, 52]
    assert defaults.spread([3, 5, 9], 4) == [3, 5, 9]  # no more layers than asked: all of them
    assert defaults.spread(list(range(7)), 1) == [3]


def _req(**kw: object) -> MeasureRequest:
    return MeasureRequest(**{"base": "b.gguf", "donors": [("q8", "d.gguf")], "reference": "t.gguf", "text": Path("t.txt"),
                             "imatrix": "m.gguf", "ladder": True, **kw})  # type: ignore[arg-type]


def test_every_layer_is_measured_unless_a_sample_is_asked_for() -> None:
    """No sample held the every-layer default's plans on SmolLM2 (bench/RESULTS.md), so none is a default."""
    assert defaults.LADDER.sample_layers == defaults.DONORS.sample_layers == 0
    for req in (_req(), _req(ladder=False), _req(calibrate="units"), _req(only_layers="0-3"), _req(refine=1, max_size=10)):
        assert defaults.resolved(req).sample_layers == 0
    assert defaults.resolved(_req(sample_layers=6)).sample_layers == 6


@pytest.mark.parametrize(("given", "says"), [
    ({"sample_layers": 3, "calibrate": "units"}, "goes with --calibrate kinds"),
    ({"sample_layers": 3, "calibrate": "pooled"}, "goes with --calibrate kinds"),
    ({"calibrate": "pooled", "curve": "line"}, r"--calibrate pooled .* needs --curve versions, not --curve line"),
    ({"calibrate": "pooled", "method": "weights"}, "not of --method weights"),
    ({"calibrate": "groups", "method": "weights"}, "not of --method weights"),
    ({"calibrate": "groups", "curve": "line", "shard": "1/2"}, "--calibrate groups .* not with --shard"),
    ({"calibrate": "groups", "curve": "line", "refine": 1, "max_size": 10}, "not with --calibrate groups"),
    ({"sample_layers": 3, "calibrate": "groups"}, "goes with --calibrate kinds"),
    ({"calibrate": "groups", "curve": "two-point"}, "not with --calibrate groups"),
    ({"sample_layers": 3, "only_layers": "0-3"}, "give one of them"),
    ({"sample_layers": 3, "refine": 1, "max_size": 10, "curve": "line"}, "not with --sample-layers"),
    ({"sample_layers": -1}, "a number of layers"),
])
def test_a_sample_that_cannot_be_is_refused_before_anything_opens(given: dict[str, object], says: str) -> None:
    req = _req(**given)
    with pytest.raises(MosaicError, match=says):
        _check_request(defaults.resolved(req), req)


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
def test_the_fit_from_a_sample_of_layers_recovers_known_sensitivities_within_its_standard_errors(layers: int) -> None:
    """Over many seeded scorers, each kind's alpha lands within one of its standard errors about two times in
    three and within three nearly always, as a standard error promises; so does each version's factor, whose
    error adds the alpha's (the factor is a ratio to the line the alpha draws; the document's ``ratio_se`` is
    the pooled pass's alone, and ``credible`` keeps a factor within two of those)."""
    sample = defaults.spread(list(range(layers)), SAMPLE)
    z_alpha, z_factor = [], []
    for seed in range(120):
        rows, measured, pooled = _scored(seed, layers, sample, noise=0.1)
        alphas = kind_alphas(measured)
        assert {k: n for k, (_, n) in alphas.items()} == {k: len(sample) for k in KINDS}
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


def test_a_kinds_units_are_dealt_into_groups_that_each_span_the_depth() -> None:
    from mosaic._measure.calibrate import drop_groups

    assert drop_groups(list(range(10)), 4) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert drop_groups([7, 2, 5], 4) == [[1], [2], [0]]  # fewer units than groups: one each, in depth order
    assert drop_groups([None], 4) == [[0]]
    for layers in (30, 60):
        groups = drop_groups(list(range(layers)))
        assert len(groups) == 4 and sorted(i for g in groups for i in g) == list(range(layers))
        assert all(min(g) < 4 and max(g) >= layers - 4 for g in groups)  # each from the top of the depth to its end
        assert all(b - a == 4 for g in groups for a, b in itertools.pairwise(g))  # never two neighbours in one pass


def _grouped(seed: int, layers: int, noise: float) -> tuple[list[dict], list[dict]]:
    """The seeded scorer's rows and one pass per group (:func:`drop_groups`): the group's units at the drops'
    version together cost the sum of their drops, with noise of a pass's standard error."""
    from mosaic._measure.calibrate import drop_groups

    rows, _, _ = _scored(seed, layers, [], noise)
    rng = np.random.default_rng([seed, 1])  # a stream of its own: the groups' noise owes nothing to the units' scales
    eps = {(unit_key(r["layer"], r["group"]), r["donor"]): r["eps"] for r in rows}
    groups = []
    for group, alpha in KINDS.items():
        for g in drop_groups(list(range(layers))):
            keys = [unit_key(layer, group) for layer in g]
            true = sum(alpha * (eps[(k, "IQ2_XS")] - eps[(k, "top")]) for k in keys)
            se = noise * true / math.sqrt(len(keys))
            groups.append({"kind": group, "units": keys, "to": ["IQ2_XS"] * len(keys), "kl": 1.0 + true, "top1": 0.5,
                           "nll": 2.0, "dkl": true + float(rng.normal(0.0, se)), "dkl_se": se})
    return rows, groups


@pytest.mark.parametrize("layers", [30, 60])
def test_each_kinds_alpha_from_its_group_passes_recovers_known_sensitivities_within_its_standard_errors(layers: int) -> None:
    """``--calibrate groups``: no unit's drop runs; each kind's alpha is its four group passes over their units'
    weight errors at the drops' version. Over many seeded scorers it lands where a standard error promises, at
    either depth, from the same four passes per kind."""
    from mosaic._measure.calibrate import group_alphas

    z = []
    for seed in range(120):
        rows, groups = _grouped(seed, layers, noise=0.1)
        assert len(groups) == 4 * len(KINDS)
        alphas = group_alphas(groups, rows)
        assert {k: n for k, (_, n) in alphas.items()} == {k: layers for k in KINDS}
        z += [(a.value - KINDS[k]) / a.se for k, (a, _) in alphas.items()]
    _as_standard_errors_promise(z)


def test_a_group_that_costs_less_than_its_drops_is_not_recovered() -> None:
    """The check above can fail: where a group's units together cost 0.7 × their drops (they interact), the
    groups' alpha lies many standard errors under the kind's."""
    from mosaic._measure.calibrate import group_alphas

    rows, groups = _grouped(0, 30, noise=0.05)
    for g in groups:
        g["dkl"] *= 0.7
    a, _ = group_alphas(groups, rows)["ffn_down"]
    assert (KINDS["ffn_down"] - a.value) / a.se > 3


def test_a_scorer_the_fit_does_not_assume_is_not_recovered() -> None:
    """The check above can fail: where the alpha grows with the depth, the sample's pooled alpha is no longer the
    kind's at every layer, and the shallow layers' alpha lies far outside its standard errors."""
    layers, sample = 30, defaults.spread(list(range(30)), SAMPLE)
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


def test_the_default_and_a_sampled_measurement_make_as_many_forward_passes_at_60_layers_as_at_30(tmp_path: Path) -> None:
    needs_runtime()
    from rich.console import Console

    from mosaic.cli.render import render_measurement

    docs, pooled, grouped = {}, {}, {}
    for layers in (30, 60):
        m = _model(tmp_path / str(layers), layers)
        grouped[layers] = mosaic.measure(ladder=m["rungs"], reference=m["source"], imatrix=m["imatrix"], text=m["rows"],
                                         ctx=16, unit="module-group", calibrate="groups",
                                         out=tmp_path / f"{layers}-groups.json").document
        docs[layers] = mosaic.measure(ladder=m["rungs"], reference=m["source"], imatrix=m["imatrix"], text=m["rows"],
                                      ctx=16, unit="module-group", sample_layers=SAMPLE, out=tmp_path / f"{layers}.json").document
        pooled[layers] = mosaic.measure(ladder=m["rungs"], reference=m["source"], imatrix=m["imatrix"], text=m["rows"],
                                        ctx=16, unit="module-group", out=tmp_path / f"{layers}-pooled.json").document
    # the default, --calibrate pooled: no layer's drops at all, the same passes at either depth
    assert pooled[30]["settings"]["calibrate"] == pooled[60]["settings"]["calibrate"] == "pooled"
    assert docs[30]["settings"]["calibrate"] == "kinds"  # a sample of layers' drops fits each kind's factor
    assert pooled[30]["forward_passes"] == pooled[60]["forward_passes"] < docs[30]["forward_passes"]
    assert all(m["layer"] is None for d in pooled.values() for m in d["measured"])
    assert pooled[30]["timing"]["stages"].get("drop", {}).get("passes", 0) == pooled[60]["timing"]["stages"].get(
        "drop", {}).get("passes", 0)
    for layers, doc in docs.items():
        want = defaults.spread(list(range(layers)), SAMPLE)
        assert doc["settings"]["sampled_layers"] == want
        assert {m["layer"] for m in doc["measured"]} - {None} == set(want)
        assert {p["kind"] for p in doc["pooled"]} and all(  # the pooled passes move every layer's units
            len({u.split("/")[0] for u in p["units"]}) == layers for p in doc["pooled"] if p["kind"] not in ("token_embd", "output"))
        assert len({(r["layer"], r["group"]) for r in doc["results"]}) > len(doc["measured"])  # every unit is priced
    assert docs[30]["forward_passes"] == docs[60]["forward_passes"]
    assert docs[30]["timing"]["stages"]["drop"]["passes"] == docs[60]["timing"]["stages"]["drop"]["passes"]
    # --calibrate groups: four passes per kind of many units, whatever the depth; each unit dropped in exactly one
    assert grouped[30]["forward_passes"] == grouped[60]["forward_passes"]
    for layers, doc in grouped.items():
        assert all(m["layer"] is None for m in doc["measured"])
        kinds = {g["kind"] for g in doc["groups"]}
        assert len(doc["groups"]) == 4 * len(kinds) == doc["timing"]["stages"]["group"]["passes"]
        for k in kinds:
            units = [u for g in doc["groups"] if g["kind"] == k for u in g["units"]]
            assert sorted(units) == sorted(unit_key(layer, k) for layer in range(layers))
        assert set(doc["calibration"]) >= kinds and all(doc["calibration"][k]["units"] == layers for k in kinds)
        versions = {"base", *doc["donors"]}
        assert all(len(g["to"]) == len(g["units"]) and set(g["to"]) <= versions for g in doc["groups"])
        console = Console(record=True, width=400)
        render_measurement(console, doc, tmp_path / "m.json")
        assert f"{len(doc['groups'])} passes each dropping a group of a kind's units together" in console.export_text()


def test_no_pooled_pass_runs_for_a_version_no_plan_can_take(tmp_path: Path) -> None:
    """Over a ladder made from a Q4_0 model, its Q4_0 rung is the source's own bytes: no weight error, and fewer
    bytes than the Q8_0 rung. No plan takes Q8_0 then, and no forward pass measures it; the smaller rung is."""
    needs_runtime()
    from tests.test_ladder import WIDE

    src = write_llama_gguf(tmp_path / "Q4_0.gguf", qtype="Q4_0", seed=11, geometry=WIDE)[0]
    imatrix = write_imatrix(tmp_path / "imatrix.gguf", imatrix_values(imatrix_targets(WIDE), seed=4))
    mosaic.ladder(src, out=tmp_path / "rungs", types="Q2_K,Q4_0,Q8_0", imatrix=imatrix,
                  llama_quantize=write_tool(tmp_path / "llama-quantize"))
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
