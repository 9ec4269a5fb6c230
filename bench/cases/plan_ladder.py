"""The planner at a ladder's size: every unit with ~19 versions (a ladder's rungs) above and below the base, the
exact choice (shifted to each unit's cheapest version, the Pareto programme pruned by the Lagrangian bound) against
the greedy one, on units shaped like SmolLM2-135M's (30 layers × 7 tensor kinds + the embedding: 211 units) and like
GLM-5.3-Flash's (47 layers × 16 tensor kinds: 752 units). The scores are synthetic weight errors (each type's error
falling as 4^-bpw, each unit's sensitivity log-normal): the search's work depends on how many versions lie near the
bound, not on where the numbers come from. Goals (issue 40): SmolLM2's units × the full ladder ≤ 10 s, GLM-5.3's
≤ 60 s, exact or with the proven gap printed."""

from __future__ import annotations

import random
import time
from decimal import Decimal
from fractions import Fraction

from harness import row

#: a ladder's types and their bits per weight (256-wide blocks; the 32-wide ones for a narrow model's fallbacks)
BPW = {"IQ1_S": 1.5625, "IQ1_M": 1.75, "IQ2_XXS": 2.0625, "IQ2_XS": 2.3125, "IQ2_S": 2.5625, "IQ3_XXS": 3.0625,
       "IQ3_S": 3.4375, "IQ4_XS": 4.25, "IQ4_NL": 4.5, "Q2_K": 2.625, "Q3_K": 3.4375, "Q4_0": 4.5, "Q4_1": 5.0,
       "Q4_K": 4.5, "Q5_0": 5.5, "Q5_1": 6.0, "Q5_K": 5.5, "Q6_K": 6.5625, "Q8_0": 8.5}


def _units(shape: str) -> list[int]:
    """Weights per unit."""
    if shape == "smollm2":
        e, f, kv = 576, 1536, 192
        layer = [e * e, e * kv, e * kv, e * e, e * f, e * f, f * e]
        return [n for _ in range(30) for n in layer] + [49_152 * e]
    rng = random.Random(53)
    return [rng.choice([6144 * 6144, 6144 * 1024, 6144 * 2048, 2048 * 6144, 64 * 6144 * 2048]) for _ in range(47 * 16)]


def _options(shape: str, base: str = "Q2_K") -> list:
    from mosaic._plan.solver import Option

    rng = random.Random(7)
    rows = []
    for u, n in enumerate(_units(shape)):
        sens = rng.lognormvariate(0, 1)
        eps_base = 4.0 ** -BPW[base]
        row = [Option(u, -1, "base", 0, Fraction(0))]
        for k, (t, b) in enumerate(BPW.items()):
            if t == base:
                continue
            eps = 4.0 ** -b * (0.9 + 0.2 * rng.random())
            cost = (round(n * (b - BPW[base]) / 8) // 32) * 32
            row.append(Option(u, k, t.lower(), cost, Fraction(Decimal(repr(sens * (eps_base - eps))))))
        rows.append(row)
    return rows


def case_plan_ladder(runs: int) -> None:
    from mosaic._plan.solver import greedy, shift, solve_pareto

    for shape, goal in (("smollm2", 10.0), ("glm53", 60.0)):
        rows = _options(shape)
        sh = shift(rows)
        whole = sum(max(o.cost for o in r) for r in rows)
        case = f"plan at a ladder's size: {len(rows)} units × {len(BPW) - 1} donors + the base ({shape})"
        for frac in (0.1, 0.4):
            room = sh.floor_cost + int((whole - sh.floor_cost) * frac)
            times = []
            for _ in range(max(1, runs)):
                t0 = time.perf_counter()
                sol = solve_pareto(sh.rows, room - sh.floor_cost)
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rough = greedy(sh.rows, lambda picks, r=room - sh.floor_cost: sum(o.cost for o in picks) <= r)
            t_greedy = time.perf_counter() - t0
            assert sol is not None
            exact = "exact" if sol.gap == 0 else f"gap ≤ {sol.gap / float(sol.score):.1e} of its score"
            row(case, f"exact choice at {frac:.0%} of the ladder's span: seconds ({exact})", f"{min(times):.2f} s",
                f"goal ≤ {goal:.0f} s; {min(times) / max(t_greedy, 1e-9):.0f} × the greedy's time")
            row(case, f"score of the exact choice / the greedy's at {frac:.0%}", "",
                f"{float(sol.score) / float(rough.score):.4f}")
