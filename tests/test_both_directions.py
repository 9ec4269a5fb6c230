"""Plans in both directions: a unit may take a version of fewer bytes than the base's, and a budget below the
base's own size is a budget like any other (CONTRACT.md, "Plans in both directions").

The solver is held to a brute force over every version of every unit in the original space (negative costs
and losses included), and a plan with downgrades is built and audited: its predicted size is the built size to
the byte, and gguf-py reads every tensor of it at the version the plan chose.
"""

from __future__ import annotations

import itertools
import random
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner

import mosaic
from mosaic._plan.solver import Option, shift, solve_pareto
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, write_llama_gguf

GEO = Geometry(n_layer=2)


def _brute(rows: list[list[Option]], room: int) -> Fraction | None:
    best = None
    for combo in itertools.product(*rows):
        if sum(o.cost for o in combo) <= room:
            s = sum((o.score for o in combo), Fraction(0))
            best = s if best is None or s > best else best
    return best


@pytest.mark.parametrize("seed", range(40))
def test_shifted_solver_is_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for u in range(rng.randint(1, 5)):
        row = [Option(u, -1, "base", 0, Fraction(0))]
        for k in range(rng.randint(0, 4)):
            cost = rng.randint(-50, 60)
            # a version of fewer bytes mostly loses, one of more mostly gains; not always (noise in a measurement)
            score = Fraction(rng.randint(-40, 40) + (cost // 2), 7)
            row.append(Option(u, k, f"d{k}", cost, score))
        rows.append(row)
    room = rng.randint(-120, 120)
    want = _brute(rows, room)
    sh = shift(rows)
    if room < sh.floor_cost:
        assert want is None
        return
    sol = solve_pareto(sh.rows, room - sh.floor_cost)
    assert sol is not None
    versions = sh.unshift(sol)
    assert [o.unit for o in versions] == list(range(len(rows)))
    assert sum(o.cost for o in versions) <= room
    assert sum((o.score for o in versions), Fraction(0)) == want
    assert all(o.cost >= 0 for row in sh.rows for o in row)


@pytest.mark.parametrize("seed", range(12))
def test_a_search_cut_short_is_feasible_and_its_gap_holds_the_optimum(seed: int) -> None:
    """With room for a few states only, the answer is no longer proven optimal: it fits, and the optimum lies
    within the gap it reports (the Lagrangian bound at the root)."""
    rng = random.Random(100 + seed)
    rows = []
    for u in range(7):
        row = [Option(u, -1, "base", 0, Fraction(0))]
        for k in range(4):
            cost = rng.randint(-30, 60)
            row.append(Option(u, k, f"d{k}", cost, Fraction(rng.randint(-20, 40) + cost // 3, 11)))
        rows.append(row)
    sh = shift(rows)
    room = sh.floor_cost + rng.randint(0, 120)
    want = _brute(rows, room)
    assert want is not None
    full = solve_pareto(sh.rows, room - sh.floor_cost)
    assert full is not None and full.gap == 0.0
    assert sum((o.score for o in sh.unshift(full)), Fraction(0)) == want
    cut = solve_pareto(sh.rows, room - sh.floor_cost, max_states=2)
    assert cut is not None
    versions = sh.unshift(cut)
    got = sum((o.score for o in versions), Fraction(0))
    assert sum(o.cost for o in versions) <= room and got <= want
    assert float(want - got) <= cut.gap + 1e-9


def test_upgrades_only_are_unchanged_by_the_shift() -> None:
    """Where no version is cheaper than the base's, the shifted problem is the upgrade problem itself."""
    rows = [[Option(u, -1, "base", 0, Fraction(0)), Option(u, 0, "q8", 10 + u, Fraction(5 - u))] for u in range(4)]
    sh = shift(rows)
    assert sh.floor_cost == 0 and all(f.donor == "base" for f in sh.floor)
    assert [[(o.donor, o.cost, o.score) for o in r] for r in sh.rows] == [[("q8", 10 + u, Fraction(5 - u))] for u in range(4)]


@pytest.fixture(scope="module")
def rungs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("both-ways")
    return {q: write_llama_gguf(tmp / f"{q}.gguf", qtype=q, seed=7, geometry=GEO)[0] for q in ("Q4_0", "Q5_0", "Q8_0", "F16")}


def _measure(rungs: dict[str, Path], out: Path) -> dict:
    """Q5_0 as the base, with a smaller (Q4_0) and a larger (Q8_0) donor, every tensor a unit, weight errors only."""
    return mosaic.measure(base=rungs["Q5_0"], donors={"q4": rungs["Q4_0"], "q8": rungs["Q8_0"]}, reference=rungs["F16"],
                          method="weights", unit="module-group", out=out).document


def _tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def test_a_budget_below_the_base_plans_downgrades_that_build_and_audit(rungs: dict[str, Path], tmp_path: Path) -> None:
    doc = _measure(rungs, tmp_path / "m.json")
    down = [r for r in doc["results"] if r["donor"] == "q4"]
    assert down and all(r["dbytes"] < 0 and r["dkl"] > 0 for r in down)  # a smaller version is a loss
    base_size = rungs["Q5_0"].stat().st_size
    limit = base_size - 6_000
    p = mosaic.plan(base=rungs["Q5_0"], donors={"q4": rungs["Q4_0"], "q8": rungs["Q8_0"]}, scores=tmp_path / "m.json",
                    max_size=limit, out=tmp_path / "down.yaml")
    assert p.report["predicted_size"] <= limit
    assert any(c["donor"] == "q4" for c in p.chosen)
    built = mosaic.build(p.out, out=tmp_path / "down")
    files = sorted(built.out.glob("*.gguf"))
    assert sum(f.stat().st_size for f in files) == p.report["predicted_size"]
    assert mosaic.audit(built.out).ok
    types = _tensor_types(files[0])
    for c in p.chosen:
        name = f"{c['group']}.weight" if c["layer"] is None else f"blk.{c['layer']}.{c['group']}.weight"
        assert types[name] == {"q4": "Q4_0", "q8": "Q8_0"}[c["donor"]]
    # every tensor not chosen is the base's
    chosen = {f"{c['group']}.weight" if c["layer"] is None else f"blk.{c['layer']}.{c['group']}.weight" for c in p.chosen}
    base_types = _tensor_types(rungs["Q5_0"])
    assert {n: t for n, t in types.items() if n not in chosen} == {n: t for n, t in base_types.items() if n not in chosen}
    # the predicted loss is the sum of the chosen versions' dkl, a loss here
    assert p.report["predicted_dkl"] > 0


def test_a_budget_between_trades_a_downgrade_for_an_upgrade(rungs: dict[str, Path], tmp_path: Path) -> None:
    """Near the base's own size the exact plan may lower what matters least to lift what matters most; it never
    loses to the base (score ≥ 0: the base's own version of every unit fits, with the mosaic's longer header)."""
    _measure(rungs, tmp_path / "m.json")
    base_size = rungs["Q5_0"].stat().st_size + 3000
    r = CliRunner().invoke(main, ["plan", "--base", str(rungs["Q5_0"]), "--donor", f"q4={rungs['Q4_0']}", "--donor",
                                  f"q8={rungs['Q8_0']}", "--scores", str(tmp_path / "m.json"), "--max-size", str(base_size),
                                  "--json"])
    assert r.exit_code == 0, r.output
    import json

    rep = json.loads(r.output)
    assert rep["predicted_size"] <= base_size and rep["score"] >= 0
    assert rep["greedy"]["score"] <= rep["score"] + 1e-12
    # with the smaller donor to trade in, the plan is never worse than the upgrades alone at the same budget
    up = mosaic.plan(base=rungs["Q5_0"], donors={"q8": rungs["Q8_0"]}, scores=tmp_path / "m.json", max_size=base_size)
    assert rep["score"] >= up.report["score"] - 1e-12
    assert {c["donor"] for c in up.chosen} == {"q8"}


def test_a_budget_no_plan_meets_names_the_smallest(rungs: dict[str, Path], tmp_path: Path) -> None:
    _measure(rungs, tmp_path / "m.json")
    r = CliRunner().invoke(main, ["plan", "--base", str(rungs["Q5_0"]), "--donor", f"q4={rungs['Q4_0']}", "--donor",
                                  f"q8={rungs['Q8_0']}", "--scores", str(tmp_path / "m.json"), "--max-size", "1000"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "no plan is that small" in lines[0]
    # the smallest is every unit at Q4_0: exactly that size plans, built, and one byte less does not
    import re

    smallest = int(re.search(r"is ([\d,]+) bytes$", lines[0]).group(1).replace(",", ""))  # type: ignore[union-attr]
    doc = _measure(rungs, tmp_path / "m2.json")
    p = mosaic.plan(base=rungs["Q5_0"], donors={"q4": rungs["Q4_0"], "q8": rungs["Q8_0"]}, scores=tmp_path / "m.json",
                    max_size=smallest, out=tmp_path / "smallest.yaml")
    assert p.report["predicted_size"] == smallest
    assert sorted((c["layer"] if c["layer"] is not None else -1, c["group"]) for c in p.chosen if c["donor"] == "q4") == sorted(
        (r["layer"] if r["layer"] is not None else -1, r["group"]) for r in doc["results"] if r["donor"] == "q4" and r["dbytes"] < 0)
    built = mosaic.build(p.out, out=tmp_path / "smallest")
    assert sum(f.stat().st_size for f in built.out.glob("*.gguf")) == smallest
    with pytest.raises(mosaic.MosaicError, match="no plan is that small"):
        mosaic.plan(base=rungs["Q5_0"], donors={"q4": rungs["Q4_0"], "q8": rungs["Q8_0"]}, scores=tmp_path / "m.json",
                    max_size=smallest - 1)


def test_an_exl3_plan_stays_an_upgrade(tmp_path: Path) -> None:
    """An EXL3 mosaic is the base's shards with donors' tensors spliced in: a donor of fewer bits than the base
    is refused in one line, naming it, before anything is chosen."""
    import json

    from mosaic.testing.exl3 import write_example

    write_example(tmp_path)
    scores = tmp_path / "s.json"
    scores.write_text(json.dumps({"higher_is_better": True, "scores": {str(i): 0.5 for i in range(6)}}))
    r = CliRunner().invoke(main, ["plan", "--base", str(tmp_path / "donor"), "--donor", f"low={tmp_path / 'base'}",
                                  "--scores", str(scores), "--layers", "2"])
    assert r.exit_code == 2
    line = r.output.strip()
    assert "\n" not in line and "--donor low" in line and "upgrades only" in line
