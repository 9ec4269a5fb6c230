"""The choice: an exact multiple-choice knapsack (Pareto dynamic programming over units; branch and
bound with the LP bound of the remaining units' concave hulls), count-budget selection and the greedy
comparison. The non-additive header growth is handled by searching under a provably safe additive
budget and accepting a leaf only if its exact size fits. Among equal totals the set whose sorted
layer list is lexicographically smallest wins (CONTRACT.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise

from mosaic._plan.costs import SizeModel
from mosaic._plan.units import PlanError

# --- the exact solver ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    unit: int  # position in the solver's unit order
    rank: int  # donor order (ties between donors go to the earlier one)
    donor: str
    cost: int
    score: Fraction


@dataclass
class Solution:
    picks: list[Option]
    score: Fraction
    key: tuple[tuple[int, ...], tuple[int, ...]]
    #: how far the optimum may lie above ``score`` (0: proven optimal); > 0 only where the search was cut short
    gap: float = 0.0


def _key(picks: Sequence[Option]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(p.unit for p in picks), tuple(p.rank for p in picks)


def _hull(opts: Sequence[Option]) -> tuple[Fraction, list[tuple[int, Fraction]]]:
    """Zero-cost gain and increments (Δcost > 0, Δscore > 0) of one unit's upper concave hull,
    slopes decreasing: the unit's part of the LP relaxation."""
    best: dict[int, Fraction] = {0: Fraction(0)}
    for o in opts:
        if o.cost >= 0 and o.score >= 0:
            best[o.cost] = max(best.get(o.cost, o.score), o.score)
    hull: list[tuple[int, Fraction]] = []
    for c, s in sorted(best.items()):
        if hull and s <= hull[-1][1]:
            continue
        while len(hull) >= 2:
            (c0, s0), (c1, s1) = hull[-2], hull[-1]
            if (s1 - s0) * (c - c1) <= (s - s1) * (c1 - c0):
                hull.pop()
            else:
                break
        hull.append((c, s))
    incs = [(c1 - c0, s1 - s0) for (c0, s0), (c1, s1) in pairwise(hull)]
    return hull[0][1], incs


def _decided_better(a: tuple[Option, ...], b: tuple[Option, ...]) -> bool:
    """Is prefix ``a`` lexicographically better than ``b`` whatever later units both get?"""
    ua, ub = [o.unit for o in a], [o.unit for o in b]
    for x, y in zip(ua, ub):
        if x != y:
            return x < y
    if len(ua) != len(ub):
        return False  # a proper prefix: the answer depends on what follows
    return [o.rank for o in a] <= [o.rank for o in b]


@dataclass(frozen=True)
class _Bound:
    """The Lagrangian bound of the LP relaxation, to prune the dynamic programme: for any ``lam`` ≥ 0 and a state
    that fixed units ``< i`` at (cost, score), no completion scores more than ``score − lam × cost + lam × budget +
    rest[i]``, ``rest[i]`` = Σ over later units of their best ``s − lam × c`` (0 for taking nothing). With ``lam``
    the LP optimum's multiplier the bound is the LP relaxation's at the root, which exceeds the integer optimum
    by less than one unit's step; ``floor`` is the score of a feasible choice (the LP solution rounded down, or
    the greedy one), so a state whose bound falls below it cannot lead to the optimum."""

    lam: float
    rest: list[float]
    floor: float
    slack: float  # float rounding allowance: a state is dropped only when its bound is below floor by more

    def need(self, i: int, budget: int) -> float:
        """The least reduced profit (``score − lam × cost``) a state that fixed units ``< i`` must hold to be kept."""
        return self.floor - self.slack - self.lam * budget - self.rest[i]


def _lagrangian(options: Sequence[Sequence[Option]], budget: int) -> _Bound:
    incs: list[tuple[Fraction, int, int, Fraction]] = []
    for i, row in enumerate(options):
        _, inc = _hull([o for o in row if o.cost <= budget])
        incs.extend((Fraction(ds, dc), i, dc, ds) for dc, ds in inc)
    incs.sort(key=lambda t: -t[0])
    room, lam, lp_floor = budget, Fraction(0), Fraction(0)
    for slope, _, dc, ds in incs:
        if dc <= room:
            room -= dc
            lp_floor += ds
        else:
            lam = slope
            break
    lam_f = float(lam)
    rest = [0.0] * (len(options) + 1)
    for i in range(len(options) - 1, -1, -1):
        best = max((float(o.score) - lam_f * o.cost for o in options[i] if o.score >= 0 and o.cost <= budget), default=0.0)
        rest[i] = rest[i + 1] + max(0.0, best)
    rough = greedy([[o for o in row if o.cost <= budget] for row in options],
                   lambda picks: sum(o.cost for o in picks) <= budget)
    floor = float(max(lp_floor, rough.score))
    scale = abs(floor) + rest[0] + abs(lam_f) * budget + 1.0
    return _Bound(lam_f, rest, floor, 1e-9 * scale)


#: A state's picks as a chain (option, earlier chain): growing a state copies nothing.
Chain = tuple | None

#: The states the dynamic programme may grow over all units together (per unit: this over the unit count, at least
#: ``MIN_STATES``); beyond it, the most promising by the Lagrangian bound are kept and the solution carries its
#: proven gap (the root bound less its score) instead of being exact. Sized so that a plan of GLM-5.3's size
#: (752 units × 19 versions) takes well under a minute on one core.
STATE_BUDGET = 1_000_000
MIN_STATES = 1000


def solve_pareto(options: Sequence[Sequence[Option]], budget: int, max_states: int | None = None) -> Solution | None:
    """The same optimum as :func:`solve_knapsack` without acceptance, by dynamic programming over
    units that keeps only non-dominated (cost, score) states: a state is dropped when another costs
    no more and scores more, or equal with a lexicographic lead no later unit can change, or when the
    Lagrangian bound (:class:`_Bound`) says no completion of it can reach a choice already in hand.
    Exact; fast when costs repeat (every MoE layer of a model costs the same) and when the LP bound is
    tight (many versions per unit: a ladder). Where more than ``max_states`` states survive both, the most
    promising are kept and the answer carries its proven ``gap``."""
    if budget < 0:
        return None
    if max_states is None:
        max_states = max(MIN_STATES, STATE_BUDGET // max(1, len(options)))
    bound = _lagrangian(options, budget)
    # exact integer arithmetic: every score over one common denominator (Fractions are slow in the inner loop)
    den = 1
    for row in options:
        for o in row:
            den = math.lcm(den, o.score.denominator)
    rows = [[(o, o.cost, int(o.score * den)) for o in row if o.score >= 0 and o.cost <= budget] for row in options]
    cut = False
    states: list[tuple[int, int, Chain]] = [(0, 0, None)]
    lam = bound.lam

    def picks_of(chain: Chain) -> tuple[Option, ...]:
        out = []
        while chain is not None:
            out.append(chain[0])
            chain = chain[1]
        return tuple(reversed(out))

    for i, row in enumerate(rows):
        # a state's reduced profit (score − lam × cost) plus an option's must reach what the bound needs: with the
        # options in decreasing reduced profit, the first that falls short ends the state's options
        need = bound.need(i + 1, budget)
        ranked = sorted(((o, oc, os_, os_ / den - lam * oc) for o, oc, os_ in row), key=lambda t: -t[3])
        grown = []
        for c, sc, chain in states:
            r = sc / den - lam * c
            if r >= need:
                grown.append((c, sc, chain))
            for o, oc, os_, red in ranked:
                if r + red < need:
                    break
                if c + oc <= budget:
                    grown.append((c + oc, sc + os_, (o, chain)))
        grown.sort(key=lambda st: (st[0], -st[1]))
        kept: list[tuple[int, int, Chain]] = []
        top: int | None = None
        for st in grown:
            if top is not None and st[1] < top:
                continue
            if top is not None and st[1] == top and any(
                    k[1] == top and _decided_better(picks_of(k[2]), picks_of(st[2])) for k in kept):
                continue
            kept.append(st)
            top = st[1] if top is None else max(top, st[1])
        if len(kept) > max_states:
            cut = True
            kept.sort(key=lambda st: -(st[1] / den - lam * st[0]))
            kept = sorted(kept[:max_states], key=lambda st: (st[0], -st[1]))
        states = kept
    best_i = max(st[1] for st in states)
    winners = [picks_of(st[2]) for st in states if st[1] == best_i]
    picks = min(winners, key=_key)
    best = Fraction(best_i, den)
    gap = max(0.0, bound.lam * budget + bound.rest[0] - float(best)) if cut else 0.0
    return Solution(list(picks), best, _key(picks), gap)


def solve_knapsack(options: Sequence[Sequence[Option]], budget: int,
                   accept: Callable[[list[Option]], bool] | None = None,
                   incumbent: Solution | None = None) -> Solution | None:
    """The best choice of at most one option per unit with Σ cost ≤ budget (and ``accept``), exactly.

    Maximizes the total score; among equal totals the lexicographically smallest sorted unit list
    (then donor order). Branch and bound over units in order; the bound at a node is the LP
    relaxation of the remaining units (their concave hulls taken by decreasing slope, the last one
    fractionally), which is a valid upper bound, so pruning never loses the optimum. An
    ``incumbent`` (a feasible, accepted solution) only speeds the search up. Costs must be
    ≥ 0; options with a negative score are never needed (dropping one raises the total) and skipped.
    """
    n = len(options)
    opts = [[o for o in row if o.score >= 0] for row in options]
    if any(o.cost < 0 for row in opts for o in row):
        raise PlanError("an option costs less than nothing (a donor smaller than the base); plan only upgrades")
    zero_gain = []
    incs: list[tuple[Fraction | None, int, int, Fraction]] = []  # slope, unit, dc, ds
    for i, row in enumerate(opts):
        z, inc = _hull(row)
        zero_gain.append(z)
        incs.extend((Fraction(ds, dc), i, dc, ds) for dc, ds in inc)
    incs.sort(key=lambda t: -t[0])  # type: ignore[operator]
    suffix_zero = [Fraction(0)] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_zero[i] = suffix_zero[i + 1] + zero_gain[i]

    def bound(i: int, room: int) -> Fraction:
        acc = suffix_zero[i]
        for _, u, dc, ds in incs:
            if u < i:
                continue
            if dc <= room:
                acc += ds
                room -= dc
            else:
                return acc + ds * room / dc
        return acc

    best: Solution | None = incumbent
    chosen: list[Option] = []

    def offer(score: Fraction) -> None:
        nonlocal best
        key = _key(chosen)
        if best is not None and (score < best.score or (score == best.score and key >= best.key)):
            return
        if accept is not None and not accept(list(chosen)):
            return
        best = Solution(list(chosen), score, key)

    def lex_hopeless(i: int, score: Fraction) -> bool:
        """With bound == best score: can no completion of this node be lexicographically smaller?"""
        assert best is not None
        inc_units = best.key[0]
        pre = tuple(u for u in inc_units if u < i)
        mine = tuple(o.unit for o in chosen)
        for a, b in zip(mine, pre):
            if a != b:
                return a > b
        if len(mine) < len(pre):  # only stopping here can be smaller
            if score == best.score:
                offer(score)
            return True
        if len(mine) > len(pre):
            return len(inc_units) == len(pre)
        return False

    def dfs(i: int, room: int, score: Fraction) -> None:
        if i == n:
            offer(score)
            return
        if best is not None:
            b = score + bound(i, room)
            if b < best.score or (b == best.score and lex_hopeless(i, score)):
                return
        for o in opts[i]:
            if o.cost <= room:
                chosen.append(o)
                dfs(i + 1, room - o.cost, score + o.score)
                chosen.pop()
        dfs(i + 1, room, score)

    if budget >= 0:
        if best is None:  # a good first incumbent makes the bound prune from the start
            seed = greedy(opts, lambda picks: sum(o.cost for o in picks) <= budget)
            chosen.extend(seed.picks)
            offer(seed.score)
            chosen.clear()
        dfs(0, budget, Fraction(0))
    return best


def solve_within_size(options: Sequence[Sequence[Option]], limit: int, model: SizeModel) -> Solution | None:
    """The best choice whose exact output size is at most ``limit``.

    Header growth is not additive, so the search runs on tensor-byte deltas under the additive
    budget ``limit - base - header_low``: every set that fits exactly fits that budget (header_low
    is a lower bound on any set's header growth), so its optimum is an upper bound. If that optimum
    fits exactly, it is the answer. Otherwise a feasible incumbent is found by shrinking the budget
    by the overshoot (each round removes at least one byte, and budget < 0 leaves only the empty
    choice, so this ends), and a second search under the original additive budget, seeded with it,
    accepts only sets whose exact size fits: the true optimum, visiting few leaves."""

    def fits(picks: Sequence[Option]) -> bool:
        return model.size({o.unit: o.donor for o in picks}) <= limit

    top = limit - model.base_size - model.header_low
    first = solve_pareto(options, top)
    if first is None or fits(first.picks):
        return first
    budget = top
    incumbent = first
    while not fits(incumbent.picks):
        over = model.size({o.unit: o.donor for o in incumbent.picks}) - limit
        budget -= max(over, 1)
        found = solve_pareto(options, budget)
        if found is None:
            return None
        incumbent = found
    return solve_knapsack(options, top, accept=fits, incumbent=incumbent)


def choose_count(options: Sequence[Sequence[Option]], count: int) -> Solution:
    """Exactly ``count`` units (all when fewer), best total; ties to the smallest unit list."""
    best_of = []
    for row in options:
        if row:
            best_of.append(max(row, key=lambda o: (o.score, -o.rank)))
    ranked = sorted(best_of, key=lambda o: (-o.score, o.unit))[:count]
    picks = sorted(ranked, key=lambda o: o.unit)
    return Solution(picks, sum((o.score for o in picks), Fraction(0)), _key(picks))


def greedy(options: Sequence[Sequence[Option]], fits: Callable[[list[Option]], bool], count: int | None = None) -> Solution:
    """The usual heuristic: rank every option by score per unit of cost, take while it fits."""
    flat = [o for row in options for o in row if o.score > 0 or count is not None]
    flat.sort(key=lambda o: (o.cost > 0, -(o.score / o.cost) if o.cost > 0 else -o.score, o.unit, o.rank))
    picks: list[Option] = []
    used: set[int] = set()
    for o in flat:
        if o.unit in used or (count is not None and len(picks) >= count):
            continue
        if fits([*picks, o]):
            picks.append(o)
            used.add(o.unit)
    picks.sort(key=lambda o: o.unit)
    return Solution(picks, sum((o.score for o in picks), Fraction(0)), _key(picks))




# --- plans in both directions -------------------------------------------------------------------


@dataclass(frozen=True)
class Shifted:
    """Every unit's versions (the base's among them, as an option of cost 0 and score 0) moved so that each
    unit's cheapest version is the zero point: every option then costs ≥ 0, and the upgrade-only solvers above
    choose among them unchanged. ``floor`` is each unit's cheapest version (its most useful one on a cost tie),
    ``rows`` the options that are worth their extra cost over it, ``floor_cost`` what the floors cost together."""

    floor: list[Option]
    rows: list[list[Option]]
    originals: dict[tuple[int, int], Option]  # (unit, rank) of a shifted option -> the option as given
    floor_cost: int

    def unshift(self, sol: Solution) -> list[Option]:
        """Every unit's version in the original space: the chosen one, else its floor."""
        by_unit = {o.unit: self.originals[(o.unit, o.rank)] for o in sol.picks}
        return [by_unit.get(f.unit, f) for f in self.floor]


def shift(rows: Sequence[Sequence[Option]]) -> Shifted:
    """``rows[u]`` holds every version of unit ``u``, its current one included (cost 0, score 0). A version that
    costs no less than another and scores no more is never worth taking over it and is left out."""
    floor: list[Option] = []
    shifted: list[list[Option]] = []
    originals: dict[tuple[int, int], Option] = {}
    for row in rows:
        if not row:
            raise PlanError("a unit has no version to choose")
        low = min(row, key=lambda o: (o.cost, -o.score, o.rank))
        floor.append(low)
        mine = []
        for o in row:
            if o is low or o.score <= low.score:
                continue
            s = Option(o.unit, o.rank, o.donor, o.cost - low.cost, o.score - low.score)
            originals[(o.unit, o.rank)] = o
            mine.append(s)
        shifted.append(mine)
    return Shifted(floor, shifted, originals, sum(f.cost for f in floor))
