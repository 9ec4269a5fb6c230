"""`mosaic measure --curve versions`: each kind's units moved together to each of their versions.

A unit's line says a version costs what its weight error says, whatever its type; on SmolLM2's ladder the
`ffn_down` at Q4_0 lose 2.5 times what they do at IQ4_NL per unit of weight error. The candidates are checked against
their rule (every version of every kind, the top's and a lone unit's drop left out), each pooled KL against
`mosaic eval` of that very model built by `mosaic build`, the factors and predictions against their formulas
written out here, and an interrupted run against one that was not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

import mosaic
from mosaic._eval.run import EvalRequest, evaluate
from mosaic._measure import backends
from mosaic._measure.calibrate import credible, version_factors
from mosaic._measure.parts import Parts
from mosaic.cli.commands import main
from tests.conftest import build_versions, run_cli
from tests.test_curve import DONORS, make_models


def test_a_factor_moves_the_line_only_as_far_as_its_measurement_proves_it_wrong() -> None:
    measured = [{"layer": 0, "group": "ffn_down", "dkl_drop": 0.2, "dkl_drop_se": 0.01, "eps_base": 0.1, "eps_top": 0.0,
                 "to": "base", "eps_to": 0.1},
                {"layer": 1, "group": "ffn_down", "dkl_drop": 0.4, "dkl_drop_se": 0.01, "eps_base": 0.1, "eps_top": 0.0,
                 "to": "base", "eps_to": 0.1}]
    rows = [{"layer": ly, "group": "ffn_down", "donor": d, "eps": e, "eps_base": 0.1}
            for ly in (0, 1) for d, e in (("q4", 0.01), ("iq4", 0.01), ("q8", 0.0))]
    pooled = [{"kind": "ffn_down", "to": "q4", "units": ["0/ffn_down", "1/ffn_down"], "dkl": 0.18, "dkl_se": 0.01},
              {"kind": "ffn_down", "to": "iq4", "units": ["0/ffn_down", "1/ffn_down"], "dkl": 0.07, "dkl_se": 0.01},
              {"kind": "ffn_down", "to": "q8", "units": ["0/ffn_down", "1/ffn_down"], "dkl": 0.001, "dkl_se": 0.001}]
    got = {p["to"]: p for p in version_factors(pooled, measured, rows, "units")}
    # the line: alpha 2 and 4 per unit of eps; at eps 0.01 it predicts 0.02 + 0.04
    assert got["q4"]["predicted"] == pytest.approx(0.06) and got["q4"]["ratio"] == pytest.approx(3.0)
    assert got["q4"]["factor"] == pytest.approx(3.0 - 2 * 0.01 / 0.06)  # proven wrong: moved to its interval's edge
    assert got["iq4"]["factor"] == 1.0  # 0.07 / 0.06 ± 0.33: the line holds
    assert got["q8"]["predicted"] == 0.0 and got["q8"]["ratio"] is None and got["q8"]["factor"] == 1.0
    assert credible(-5.0, 1.0) == -3.0 and credible(0.2, 0.1) == pytest.approx(0.4) and credible(1.5, 0.3) == 1.0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("versions"))


def _args(m: dict[str, Path], out: Path) -> list[str]:
    return ["measure", "--base", str(m["Q4_0"]), *(a for d, q in DONORS.items() for a in ("--donor", f"{d}={m[q]}")),
            "--reference", str(m["saved"]), "--text", str(m["rows"]), "--unit", "module-group", "--curve", "versions",
            "--out", str(out)]


#: What the pooled measurement laid out and removed, in order: ("make" | "release", unit index, donor).
LAYOUT: list[tuple[str, int, str]] = []


@pytest.fixture(scope="module")
def pooled(models: dict[str, Path]) -> dict:
    real = backends.lay_out

    def logged(*args: object, **kw: object) -> Parts:
        parts = real(*args, **kw)  # type: ignore[arg-type]
        make, release = parts.make, parts.release
        assert make is not None

        def made(ui: int, sid: str) -> Path:
            LAYOUT.append(("make", ui, sid))
            return make(ui, sid)

        def released(pairs: object) -> None:
            for ui, sid in list(pairs):  # type: ignore[call-overload]
                if (ui, sid) in parts.donor:
                    LAYOUT.append(("release", ui, sid))
            release(pairs)  # type: ignore[arg-type]

        parts.make, parts.release = made, released  # type: ignore[method-assign]
        return parts

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backends, "lay_out", logged)
        return mosaic.measure(base=models["Q4_0"], donors={d: models[q] for d, q in DONORS.items()}, reference=models["saved"],
                              text=models["rows"], unit="module-group", curve="versions", out=models["dir"] / "v.json").as_dict()


def _key(r: dict) -> str:
    return f"{'null' if r['layer'] is None else r['layer']}/{r['group']}"


def test_every_version_of_every_kind_is_measured_once_with_the_kind_together(pooled: dict) -> None:
    assert pooled["schema"] == "mosaic.measurement/v3" and pooled["settings"]["curve"] == "versions"
    top, drops = pooled["top"]["versions"], {_key(m): m["to"] for m in pooled["measured"]}
    have: dict[str, set[str]] = {}
    for r in pooled["results"]:
        have.setdefault(r["group"], set()).update({r["donor"], "base"})
    want = set()
    for kind, versions in have.items():
        units = [k for k in top if k.endswith("/" + kind)]
        for v in versions:
            moved = [u for u in units if top[u] != v]
            if moved and not (len(units) == 1 and drops[units[0]] == v):  # a lone unit's drop is measured already
                want.add((kind, v, tuple(sorted(moved))))
    assert {(p["kind"], p["to"], tuple(sorted(p["units"]))) for p in pooled["pooled"]} == want
    assert any(len(p["units"]) > 1 for p in pooled["pooled"])
    assert pooled["forward_passes"] == 2 + len(pooled["measured"]) + len(pooled["pooled"])  # base, top (the teacher saved)
    for p in pooled["pooled"]:
        assert p["dkl"] == pytest.approx(p["kl"] - pooled["top"]["kl"], abs=1e-12) and p["dkl_se"] >= 0


def test_each_version_is_laid_out_once_and_only_while_its_candidates_run(pooled: dict) -> None:
    """Laid out at once, every version of every unit would be the ladder's bytes again: the pooled candidates go
    version by version, each version's parts made for its first and removed after its last."""
    made = [(ui, sid) for what, ui, sid in LAYOUT if what == "make"]
    assert made and len(made) == len(set(made))  # none made twice
    assert sorted(made) == sorted((ui, sid) for what, ui, sid in LAYOUT if what == "release")  # all removed
    keys = list(pooled["top"]["versions"])
    top = {(keys.index(k), v) for k, v in pooled["top"]["versions"].items() if v != "base"}
    live: set[tuple[int, str]] = set()
    most = 0
    for what, ui, sid in LAYOUT:
        (live.add if what == "make" else live.discard)((ui, sid))
        most = max(most, len({s for u, s in live if (u, s) not in top}))
    assert most <= 2  # beside the top's: the version running and the one loaded ahead
    versions = {p["to"] for p in pooled["pooled"]} - {"base"}
    assert len(versions) >= 2 and most < len(versions) + 1


def test_a_pooled_candidate_is_what_mosaic_eval_gives_for_that_very_model(models: dict[str, Path], pooled: dict,
                                                                           tmp_path: Path) -> None:
    p = max((x for x in pooled["pooled"] if len(x["units"]) > 1), key=lambda x: x["dkl"])
    versions = {**pooled["top"]["versions"], **dict.fromkeys(p["units"], p["to"])}
    built = build_versions(models["Q4_0"], {d: models[q] for d, q in DONORS.items()}, versions, tmp_path / "pooled")
    ev = evaluate(EvalRequest([str(built)], str(models["saved"]), models["rows"]))
    assert p["kl"] == pytest.approx(ev["candidates"][0]["kl"]["mean"], abs=1e-6)


def _eps(doc: dict) -> dict[tuple[str, str], float]:
    eps = {(_key(r), r["donor"]): r["eps"] for r in doc["results"]}
    eps.update({(_key(r), "base"): r["eps_base"] for r in doc["results"]})
    return eps


def test_predictions_are_each_line_times_its_kinds_factor(pooled: dict) -> None:
    meas = {_key(m): m for m in pooled["measured"]}
    eps = _eps(pooled)

    def alpha(key: str) -> float:
        m = meas[key]
        return max(0.0, m["dkl_drop"]) / (m["eps_to"] - m["eps_top"]) if m["eps_to"] > m["eps_top"] else 0.0

    factor = {}
    for p in pooled["pooled"]:
        pred = sum(alpha(u) * (eps[(u, p["to"])] - meas[u]["eps_top"]) for u in p["units"])
        assert p["predicted"] == pytest.approx(pred, rel=1e-12, abs=1e-18)
        if pred > 0:
            r, se = p["dkl"] / pred, p["dkl_se"] / pred
            lo, hi = r - 2 * se, r + 2 * se
            assert p["ratio"] == pytest.approx(r) and p["factor"] == pytest.approx(max(0.0, min(max(1.0, lo), hi)))
        else:
            assert p["factor"] == 1.0
        factor[(p["kind"], p["to"])] = p["factor"]
    assert any(f != 1.0 for f in factor.values()), "the synthetic models' types should bend some kind's line"

    def loss(key: str, v: str) -> float:
        return alpha(key) * (eps[(key, v)] - meas[key]["eps_top"]) * factor.get((key.split("/")[1], v), 1.0)

    for r in pooled["results"]:
        k = _key(r)
        assert r["predicted"] is True
        assert r["dkl"] == pytest.approx(loss(k, r["donor"]) - loss(k, "base"), rel=1e-9, abs=1e-15)
        assert r["kl"] == pytest.approx(pooled["base"]["kl"] + r["dkl"], abs=1e-12)
        assert math.isfinite(r["dkl_se"]) and r["dkl_se"] >= 0


def test_kinds_calibration_takes_the_factors_too(models: dict[str, Path], tmp_path: Path) -> None:
    doc = mosaic.measure(base=models["Q4_0"], donors={d: models[q] for d, q in DONORS.items()}, reference=models["saved"],
                         text=models["rows"], unit="module-group", curve="versions", calibrate="kinds", only_layers="0",
                         out=tmp_path / "k.json").as_dict()
    assert doc["pooled"] and {p["kind"] for p in doc["pooled"]} >= {"attn_q", "ffn_down"}
    assert all(len(p["units"]) == 1 for p in doc["pooled"] if p["kind"] not in ("token_embd", "output"))  # layer 0 only
    alphas = {k: c["alpha"] for k, c in doc["calibration"].items()}
    eps, top = _eps(doc), {_key(m): m["eps_top"] for m in doc["measured"]}
    for p in doc["pooled"]:  # the line the factors correct is the kind's own
        pred = sum(alphas[p["kind"]] * (eps[(u, p["to"])] - top[u]) for u in p["units"])
        assert p["predicted"] == pytest.approx(pred, rel=1e-12, abs=1e-18)
    factor = {(p["kind"], p["to"]): p["factor"] for p in doc["pooled"]}
    low: dict[str, float] = {}  # each unit's top: its lowest weight error, in the layer not measured too
    for (u, _), e in eps.items():
        low[u] = min(low.get(u, math.inf), e)

    def loss(u: str, v: str) -> float:
        kind = u.split("/")[1]
        return alphas[kind] * factor.get((kind, v), 1.0) * (eps[(u, v)] - low[u])

    assert {r["layer"] for r in doc["results"] if r["layer"] is not None} == {0, 1}  # every layer predicted
    for r in doc["results"]:
        u = _key(r)
        assert r["dkl"] == pytest.approx(loss(u, r["donor"]) - loss(u, "base"), rel=1e-9, abs=1e-15)
    assert all(low[u] == top[u] for u in top)  # the measured units' tops are their lowest errors


def test_interrupted_and_resumed_it_writes_what_one_run_writes(models: dict[str, Path], pooled: dict, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    n_drops = len(pooled["measured"])
    r = run_cli(_args(models, out), fault=f"candidate:{n_drops + 2}:int", timeout=600)  # inside the pooled candidates
    assert r.returncode == 130, r.stderr
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "m.json.partial").read_text().splitlines()[1:]]
    assert kinds.count("pooled") == 2 and kinds.count("drop") == n_drops
    r = run_cli([*_args(models, out), "--resume", "--json"], timeout=600)
    assert r.returncode == 0, r.stderr
    resumed = json.loads(r.stdout)
    assert resumed["pooled"] == pooled["pooled"] and resumed["results"] == pooled["results"]


def test_versions_refusals_are_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    common = _args(models, tmp_path / "m.json")
    for extra, want in ((["--shard", "1/2"], "not with --shard"),
                        (["--refine", "1", "--max-size", "1M"], "--refine: retired ("),
                        (["--method", "swaps"], "not of --method swaps")):
        r = CliRunner().invoke(main, [*common, *extra])
        assert r.exit_code == 2 and want in r.stderr and r.stderr.count("\n") == 1, r.output
    assert not (tmp_path / "m.json").exists()
