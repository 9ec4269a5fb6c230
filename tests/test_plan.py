"""mosaic plan: exact choice against brute force, byte-exact size prediction, scores formats, refusals."""

from __future__ import annotations

import itertools
import json
import random
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mosaic._base.errors import MosaicError
from mosaic._build.run import build
from mosaic._checkpoint.census_exl3 import analyze
from mosaic._checkpoint.folder import open_checkpoint
from mosaic._plan.costs import SizeModel, bit_weight_deltas
from mosaic._plan.planner import PlanRequest, parse_size, plan_mosaic
from mosaic._plan.scores import ScoresError
from mosaic._plan.solver import Option, choose_count, solve_knapsack, solve_pareto
from mosaic._plan.units import PlanError, find_units
from mosaic.cli.commands import main
from mosaic.testing.exl3 import every_group_geometry

BASE = every_group_geometry(bits=2, seed=1)  # exllamav3-style headers: unpadded, so a rewrite grows them
DONOR3 = every_group_geometry(bits=3, head_bits=8, seed=2, style="library", shard_size=1 << 20)
DONOR4 = every_group_geometry(bits=4, seed=3)
MOE_LAYERS = [1, 2, 3, 4, 5]


@pytest.fixture
def srcs(ckpt_factory) -> tuple[Path, Path, Path]:
    return ckpt_factory(BASE), ckpt_factory(DONOR3), ckpt_factory(DONOR4)


def shard_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def per_layer(tmp: Path, scores: dict[int, float], higher: bool = True) -> Path:
    p = tmp / "scores.json"
    p.write_text(json.dumps({"higher_is_better": higher, "scores": {str(k): v for k, v in scores.items()}}))
    return p


def request(base: Path, donors: list[tuple[str, Path]], scores: Path, **kw: object) -> PlanRequest:
    return PlanRequest(base=str(base), donors=[(d, str(p)) for d, p in donors], scores=scores, **kw)  # type: ignore[arg-type]


def model_for(base: Path, donors: dict[str, Path]) -> tuple[SizeModel, list]:
    b = analyze(open_checkpoint(base))
    ds = {d: analyze(open_checkpoint(p)) for d, p in donors.items()}
    units = find_units(b, "layer-experts")
    return SizeModel(b, ds, units), units


# --- the solver against brute force -------------------------------------------------------------


def brute(options: list[list[Option]], budget: int, accept=None):
    best = None
    for combo in itertools.product(*[[None, *row] for row in options]):
        picks = [o for o in combo if o is not None]
        if sum(o.cost for o in picks) > budget or (accept and not accept(picks)):
            continue
        score = sum((o.score for o in picks), Fraction(0))
        key = (tuple(o.unit for o in picks), tuple(o.rank for o in picks))
        if best is None or score > best[0] or (score == best[0] and key < best[1]):
            best = (score, key)
    return best


def random_instance(rng: random.Random, negative: bool) -> tuple[list[list[Option]], int]:
    n, k = rng.randint(1, 7), rng.randint(1, 3)
    options = []
    for u in range(n):
        row = []
        for r in range(k):
            if rng.random() < 0.8:
                score = Fraction(rng.randint(-2 if negative else 0, 6), rng.choice([1, 1, 2]))
                row.append(Option(u, r, f"d{r}", rng.randint(0, 12), score))
        options.append(row)
    return options, rng.randint(-1, 40)


def test_solver_matches_brute_force_on_200_instances() -> None:
    rng = random.Random(8)
    differs = 0
    for _ in range(200):
        options, budget = random_instance(rng, negative=True)
        got = solve_knapsack(options, budget)
        want = brute(options, budget)
        pareto = solve_pareto(options, budget)
        assert (None if pareto is None else (pareto.score, pareto.key)) == want, (options, budget)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assert (got.score, got.key) == want, (options, budget)
        assert sum(o.cost for o in got.picks) <= budget
        assert len({o.unit for o in got.picks}) == len(got.picks)
        differs += got.picks != []
    assert differs > 100  # the instances were not trivially empty


def test_solver_with_a_non_additive_acceptance_matches_brute_force() -> None:
    rng = random.Random(80)
    for _ in range(120):
        options, budget = random_instance(rng, negative=False)
        salt = rng.randint(0, 10**6)

        def accept(picks: list[Option], salt: int = salt) -> bool:  # rejects about a third of all sets
            return hash((salt, tuple((o.unit, o.rank) for o in picks))) % 3 != 0 or not picks

        got = solve_knapsack(options, budget, accept=accept)
        want = brute(options, budget, accept)
        assert (None if got is None else (got.score, got.key)) == want


def test_choose_count_matches_brute_force() -> None:
    rng = random.Random(3)
    for _ in range(100):
        options, _ = random_instance(rng, negative=True)
        count = rng.randint(1, 5)
        got = choose_count(options, count)
        n_avail = sum(1 for row in options if row)
        best = None
        for units in itertools.combinations([u for u, row in enumerate(options) if row], min(count, n_avail)):
            for picks in itertools.product(*[options[u] for u in units]):
                score = sum((o.score for o in picks), Fraction(0))
                key = (tuple(o.unit for o in picks), tuple(o.rank for o in picks))
                if best is None or score > best[0] or (score == best[0] and key < best[1]):
                    best = (score, key)
        assert len(got.picks) == min(count, n_avail)
        assert (got.score, got.key) == best


def test_ties_go_to_the_lexicographically_smallest_layer_list() -> None:
    opts = [[Option(u, 0, "d", 10, Fraction(1))] for u in range(5)]
    assert solve_knapsack(opts, 25).key[0] == (0, 1)  # type: ignore[union-attr]
    # a zero-score unit makes the sorted list smaller: [0, 1, 4] < [0, 4]
    opts = [[Option(0, 0, "d", 5, Fraction(2))], [Option(1, 0, "d", 0, Fraction(0))], [], [], [Option(4, 0, "d", 5, Fraction(2))]]
    assert solve_knapsack(opts, 10).key[0] == (0, 1, 4)  # type: ignore[union-attr]


def test_exact_beats_greedy_on_a_classic_instance(srcs, tmp_path: Path) -> None:
    base, d3, _ = srcs
    model, units = model_for(base, {"q3": d3})
    delta = model.delta[(units[0].index, "q3")]  # every MoE layer costs the same
    # one layer with the best ratio crowds out two that are better together only when costs differ;
    # here equal costs: the budget fits exactly two layers, and the optimum takes the two best scores
    scores = per_layer(tmp_path, {1: 5, 2: 4, 3: 4.5, 4: 1, 5: 0.5})
    budget = model.size({units[0].index: "q3", units[2].index: "q3"})
    res = plan_mosaic(request(base, [("q3", d3)], scores, max_size=budget))
    assert [c["layer"] for c in res.report["chosen"]] == [1, 3]
    assert res.report["score"] == 9.5
    assert res.report["predicted_size"] <= budget
    assert delta > 0


# --- byte-exact prediction ----------------------------------------------------------------------


def test_predicted_size_equals_built_size(srcs, tmp_path: Path) -> None:
    base, d3, d4 = srcs
    scores = tmp_path / "m.json"
    groups = []
    for i, layer in enumerate(MOE_LAYERS):
        keys = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")]
        groups.append({"idx": i, "layers": keys, "candidates": [{"dkld": -0.01 * layer, "dbits": 1}, {"dkld": -0.03 * layer, "dbits": 2}]})
    groups.append({"idx": 9, "layers": ["model.layers.2.self_attn.q_proj"], "candidates": [{"dkld": -5, "dbits": 1}, {"dkld": -5, "dbits": 2}]})
    scores.write_text(json.dumps({"base": {"dir": "b", "bpw": 2}, "alts": [{"dir": "q3", "bpw": 3}, {"dir": "q4", "bpw": 4}],
                                  "groups": groups, "base_kld": 0.1, "arch_string": "x"}))
    budget = shard_size(base) + 700_000
    out = tmp_path / "recipes" / "plan.yaml"
    res = plan_mosaic(request(base, [("q3", d3), ("q4", d4)], scores, max_size=budget, out=out))
    chosen = res.report["chosen"]
    assert {c["donor"] for c in chosen} == {"q3", "q4"}  # the budget forces a mix of both alternatives
    assert res.report["predicted_size"] <= budget
    built = build(out, out=tmp_path / "built", jobs=1)
    assert shard_size(built.out_dir) == res.report["predicted_size"]
    prov = json.loads((built.out_dir / "PROVENANCE.json").read_text())
    assert prov["rate"]["exact"] == pytest.approx(res.report["rate"]["exact"])
    assert prov["rate"]["by_bytes"] == pytest.approx(res.report["rate"]["by_bytes"])
    assert prov["rate"]["by_layer_mass"] == pytest.approx(res.report["rate"]["by_layer_mass"])
    # and brute force over all 3^5 assignments agrees on the best score within the exact size
    model, units = model_for(base, {"q3": d3, "q4": d4})
    best = Fraction(-1)
    for combo in itertools.product([None, "q3", "q4"], repeat=len(units)):
        choice = {u.index: d for u, d in zip(units, combo) if d}
        if model.size(choice) <= budget:
            best = max(best, sum((Fraction(1 if d == "q3" else 3, 100) * units[i].layer for i, d in choice.items()), Fraction(0)))
    assert res.report["score"] == pytest.approx(float(best))


@pytest.mark.parametrize("base_is_library", [False, True])
def test_size_model_counts_header_bytes_as_the_writer_writes_them(srcs, base_is_library: bool) -> None:
    from mosaic._formats.safetensors_writer import encode_header

    base, d3, d4 = srcs
    if base_is_library:  # padded headers with __metadata__
        base, d3 = d3, base
    model, units = model_for(base, {"a": d3, "b": d4})
    ck = model.base.ckpt
    rng = random.Random(5)
    for _ in range(12):
        choice = {u.index: rng.choice("ab") for u in units if rng.random() < 0.5}
        donor_of = {n: d for i, d in choice.items() for n in model.unit_tensors[i]}
        want = 0
        for shard in ck.shards:
            h = ck.headers[shard]
            if not any(t.name in donor_of for t in h.tensors):
                want += h.file_size
                continue
            src = [model.donors[donor_of[t.name]].ckpt.tensor(t.name) if t.name in donor_of else t for t in h.tensors]
            want += len(encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in src], h.metadata)) + sum(t.nbytes for t in src)
        assert model.size(choice) == want


@pytest.mark.parametrize("base_is_library", [False, True])
def test_header_lower_bound_is_the_writers_header_at_the_smallest_shapes(srcs, base_is_library: bool) -> None:
    """The solver's bound on header growth, counted without encoding, equals the header the writer
    writes with every tensor at its shortest shape and smallest size among the sources."""
    from mosaic._formats.safetensors_writer import encode_header

    base, d3, d4 = srcs
    if base_is_library:
        base, d3 = d3, base
    model, _ = model_for(base, {"a": d3, "b": d4})
    ck = model.base.ckpt
    in_unit = {n for ts in model.unit_tensors.values() for n in ts}
    low = 0
    for shard in ck.shards:
        h = ck.headers[shard]
        entries = []
        for t in h.tensors:
            shape, nbytes = t.shape, t.nbytes
            if t.name in in_unit:
                for d in model.donors.values():
                    dt = d.ckpt.tensor(t.name)
                    if len(json.dumps(list(dt.shape))) < len(json.dumps(list(shape))):
                        shape = dt.shape
                    nbytes = min(nbytes, dt.nbytes)
            entries.append((t.name, t.dtype, shape, nbytes))
        low += min(0, len(encode_header(entries, h.metadata)) - h.data_start)
    assert model.header_low == low
    if base_is_library:  # the 3-bit base's donors have shorter trellis shapes: its headers can shrink
        assert low < 0


def test_header_growth_is_counted(srcs, tmp_path: Path) -> None:
    base, d3, _ = srcs
    model, units = model_for(base, {"q3": d3})
    first = units[0].index
    exact = model.size({first: "q3"})
    additive = model.base_size + model.delta[(first, "q3")]
    assert exact > additive  # the rewritten exllamav3-style header gains padding and offset digits
    scores = per_layer(tmp_path, {1: 100, 2: 1})
    # one byte short of the exact size: a payload-only prediction would take layer 1 and overshoot
    res = plan_mosaic(request(base, [("q3", d3)], scores, max_size=exact - 1, out=tmp_path / "a.yaml"))
    assert [c["layer"] for c in res.report["chosen"]] == [2]
    assert res.report["predicted_size"] <= exact - 1
    built = build(tmp_path / "a.yaml", out=tmp_path / "built-a", jobs=1)
    assert shard_size(built.out_dir) == res.report["predicted_size"]
    # exactly the optimum's size: it fits, to the byte
    res = plan_mosaic(request(base, [("q3", d3)], scores, max_size=exact))
    assert [c["layer"] for c in res.report["chosen"]] == [1]
    assert res.report["predicted_size"] == exact


def test_budget_larger_than_everything_takes_every_scored_unit(srcs, tmp_path: Path) -> None:
    base, d3, _ = srcs
    scores = per_layer(tmp_path, {layer: 0.8627e9 - layer for layer in MOE_LAYERS})
    res = plan_mosaic(request(base, [("q3", d3)], scores, max_size=10**12))
    assert [c["layer"] for c in res.report["chosen"]] == MOE_LAYERS
    assert res.report["greedy"]["chosen"] == res.report["chosen"]


def test_budget_too_small_is_a_clear_error(srcs, tmp_path: Path) -> None:
    base, d3, _ = srcs
    scores = per_layer(tmp_path, {1: 1.0})
    r = CliRunner().invoke(main, ["plan", "--base", str(base), "--donor", f"q3={d3}", "--scores", str(scores),
                                  "--max-size", str(shard_size(base))])
    assert r.exit_code == 2
    assert "too small for any unit" in r.stderr and "smallest mosaic" in r.stderr
    assert "Traceback" not in r.output


# --- other budgets ------------------------------------------------------------------------------


def test_target_rate_is_the_best_score_within_the_exact_rate(srcs, tmp_path: Path) -> None:
    base, d3, _ = srcs
    scores = per_layer(tmp_path, {1: 1, 2: 5, 3: 2, 4: 2, 5: 3})
    res = plan_mosaic(request(base, [("q3", d3)], scores, target_rate="2.5", out=tmp_path / "r.yaml"))
    assert res.report["rate"]["exact"] <= 2.5
    # brute force with the real planner's rate

    b = analyze(open_checkpoint(base))
    units = find_units(b, "layer-experts")
    bw = bit_weight_deltas(b, {"q3": analyze(open_checkpoint(d3))}, units)
    num = sum(Fraction(m.bits) * m.weights for m in b.modules.values() if m.is_exl3 and m.info.layer is not None)
    den = sum(m.weights for m in b.modules.values() if m.is_exl3 and m.info.layer is not None)
    sc = {1: 1, 2: 5, 3: 2, 4: 2, 5: 3}
    best = min(  # best score, then the smallest layer list
        (-sum(sc[units[i].layer] for i in s), [units[i].layer for i in s])
        for n in range(6) for s in itertools.combinations(range(5), n)
        if (num + sum(bw[(i, "q3")] for i in s)) / den <= Fraction(5, 2)
    )
    assert res.report["score"] == -best[0]
    assert [c["layer"] for c in res.report["chosen"]] == best[1]
    built = build(tmp_path / "r.yaml", out=tmp_path / "built", jobs=1)
    prov = json.loads((built.out_dir / "PROVENANCE.json").read_text())
    assert prov["rate"]["exact"] == pytest.approx(res.report["rate"]["exact"]) and prov["rate"]["exact"] <= 2.5


def test_layers_takes_exactly_n_units(srcs, tmp_path: Path) -> None:
    base, d3, _ = srcs
    scores = tmp_path / "s.csv"
    scores.write_text("layer,score\n1,0.5\n2,0.9\n3,0.9\n4,0.1\n5,0.9\n")
    res = plan_mosaic(request(base, [("q3", d3)], scores, layers=2))
    assert [c["layer"] for c in res.report["chosen"]] == [2, 3]  # three tie at 0.9: the smallest layers
    res = plan_mosaic(request(base, [("q3", d3)], scores, layers=99))
    assert len(res.report["chosen"]) == 5


def test_losses_rank_low_values_first(srcs, tmp_path: Path) -> None:
    base, d3, _ = srcs
    scores = per_layer(tmp_path, {1: 3.0, 2: 0.5, 3: 2.0}, higher=False)
    res = plan_mosaic(request(base, [("q3", d3)], scores, layers=1))
    assert res.report["chosen"] == [{"layer": 2, "donor": "q3"}]


# --- the recipe and the command line ------------------------------------------------------------


def test_written_recipe_builds_unchanged_via_the_cli(srcs, tmp_path: Path, monkeypatch) -> None:
    base, d3, _ = srcs
    monkeypatch.chdir(tmp_path)
    scores = per_layer(tmp_path, {1: 2, 3: 1, 4: 1, 5: 1})
    runner = CliRunner()
    r = runner.invoke(main, ["plan", "--base", str(base), "--donor", f"q3={d3}", "--scores", str(scores),
                             "--max-size", "100MiB", "--out", "sub/plan.yaml", "--json"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert set(rep) == {"chosen", "predicted_size", "score", "rate", "greedy"}
    assert set(rep["rate"]) == {"exact", "by_bytes", "by_layer_mass"}
    assert set(rep["greedy"]) == {"chosen", "predicted_size", "score"}
    doc = yaml.safe_load((tmp_path / "sub" / "plan.yaml").read_text())
    assert not Path(doc["base"]["path"]).is_absolute()
    assert (tmp_path / "sub" / doc["base"]["path"]).resolve() == base.resolve()
    assert doc["replace"] == [{"from": "q3", "layers": [1, "3-5"], "modules": ["mlp.experts"]}]
    r = runner.invoke(main, ["build", "sub/plan.yaml", "--out", "built", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["size"]["shards"] == rep["predicted_size"] == shard_size(tmp_path / "built")
    r = runner.invoke(main, ["plan", "--base", str(base), "--donor", f"q3={d3}", "--scores", str(scores), "--layers", "1"])
    assert r.exit_code == 0 and "greedy" in r.stdout and "layer" in r.stdout


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"higher_is_better": true, "scores": {"99": 1}}', "layer 99 is not in the base"),
        ('{"higher_is_better": true, "scores": {"x": 1}}', "is not a layer index"),
        ('{"higher_is_better": true, "scores": {"1": "high"}}', "is not a number"),
        ('{"higher_is_better": true}', "scores must be a non-empty object"),
        ('{"scores": {"1": 1}}', "higher_is_better must be"),
        ('{"higher_is_better": true, "scores": {"0": 1}}', "missing scores"),
        ("layer,value\n1,2\n", "header line 'layer,score'"),
        ("layer,score\n1,abc\n", "is not a number"),
        ('{"alts": [{"dir": "a"}, {"dir": "b"}], "groups": []}', "2 alternative(s) measured but 1"),
        ('{"alts": [{"dir": "a"}], "groups": [{"layers": ["model.layers.1.nope"], "candidates": [{"dkld": 1}]}]}', "not in the base"),
    ],
)
def test_malformed_scores_are_clear_errors(srcs, tmp_path: Path, content: str, message: str) -> None:
    base, d3, _ = srcs
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(ScoresError) as e:
        plan_mosaic(request(base, [("q3", d3)], p, layers=1))
    assert message in str(e.value)
    r = CliRunner().invoke(main, ["plan", "--base", str(base), "--donor", f"q3={d3}", "--scores", str(p), "--layers", "1"])
    assert r.exit_code == 2 and r.stderr.startswith("mosaic: error:") and message in r.stderr


def test_command_line_refusals(srcs, tmp_path: Path) -> None:
    base, d3, d4 = srcs
    scores = per_layer(tmp_path, {1: 1})
    with pytest.raises(MosaicError, match="exactly one of"):
        plan_mosaic(request(base, [("q3", d3)], scores, layers=1, max_size=10))
    with pytest.raises(ScoresError, match="exactly one --donor"):
        plan_mosaic(request(base, [("q3", d3), ("q4", d4)], scores, layers=1))
    with pytest.raises(MosaicError, match="not a folder"):
        plan_mosaic(request(tmp_path / "nowhere", [("q3", d3)], scores, layers=1))
    with pytest.raises(PlanError, match="already at"):
        plan_mosaic(request(base, [("q3", d3)], scores, target_rate="1.5"))
    r = CliRunner().invoke(main, ["plan", "--base", str(base), "--donor", f"Q3={d3}", "--scores", str(scores), "--layers", "1"])
    assert r.exit_code == 2 and "donor ids" in r.stderr


def test_parse_size() -> None:
    assert parse_size("123") == 123
    assert parse_size("96.105137024G") == 96_105_137_024
    assert parse_size("2K") == 2000 and parse_size("2KiB") == 2048
    assert parse_size("1.5 GiB") == 3 * 2**29 and parse_size("1T") == 10**12 and parse_size("1TiB") == 2**40
    assert parse_size("3M") == 3 * 10**6 and parse_size("3MiB") == 3 * 2**20
    with pytest.raises(MosaicError, match="not a size"):
        parse_size("12 parsecs")


def test_module_group_units_build(srcs, tmp_path: Path) -> None:
    base, d3, _ = srcs
    b = analyze(open_checkpoint(base))
    units = find_units(b, "module-group")
    assert {u.pattern for u in units} >= {"mlp.experts", "mlp.shared_experts", "self_attn"}
    scores = tmp_path / "m.json"
    scores.write_text(json.dumps({"alts": [{"dir": "q3"}], "groups": [
        {"idx": 0, "layers": ["model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.k_proj"], "candidates": [{"dkld": -1}]},
        {"idx": 1, "layers": ["model.layers.3.mlp.shared_experts.down_proj"], "candidates": [{"dkld": -0.5}]},
    ]}))
    out = tmp_path / "mg.yaml"
    res = plan_mosaic(request(base, [("q3", d3)], scores, max_size=10**10, unit="module-group", out=out))
    assert res.report["chosen"] == [{"layer": 2, "donor": "q3"}, {"layer": 3, "donor": "q3"}]
    built = build(out, out=tmp_path / "built", jobs=1)
    assert shard_size(built.out_dir) == res.report["predicted_size"]


def test_header_size_counts_escaped_and_non_ascii_names_as_the_writer_writes_them() -> None:
    """Names with quotes, backslashes, control characters or non-ASCII letters: the counted header
    length is the writer's, byte for byte, with and without __metadata__."""
    from types import SimpleNamespace

    from mosaic._formats.safetensors_reader import ShardHeader, TensorInfo
    from mosaic._formats.safetensors_writer import encode_header

    for names in (["a.b", "c.d"], ['q"uote', "back\\slash", "tab\there", "é.ü", "ctl\x01"]):
        for metadata in (None, {"format": "pt", "k:é": "v\"x"}):
            tensors = [TensorInfo(n, "F16" if i % 2 else "I16", (i + 1, 3 * i), 0, 0) for i, n in enumerate(names)]
            header = ShardHeader("s", 0, 0, metadata, tuple(tensors))
            model = SizeModel.__new__(SizeModel)
            model.base = SimpleNamespace(ckpt=SimpleNamespace(headers={"s": header}))  # type: ignore[assignment]
            model._fixed, model._shape_len = {}, {}
            entries = [(t.shape, 2 * (t.shape[0] * t.shape[1])) for t in tensors]
            want = encode_header([(t.name, t.dtype, s, n) for t, (s, n) in zip(tensors, entries)], metadata)
            assert model._header_size("s", entries) == len(want)
