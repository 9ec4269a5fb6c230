"""Running a measurement's forward passes: the teacher once, then every candidate of the schedule, each result
made durable in the journal before the next one runs.

The candidates' versions are laid out on disk for the first candidate that takes them and removed after the
last (:mod:`.parts`); the next candidate is loaded while one decodes. A resumed run skips what the journal
holds. The refinement's rounds (a plan at a budget, run, and one move of every unit from it) run here too:
each round plans from the document the records so far make.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from mosaic._base.errors import MosaicError
from mosaic._base.faults import point as fault_point
from mosaic._base.hashing import digest_file
from mosaic._base.progress import Reporter
from mosaic._build.run import fsync_dir
from mosaic._eval.reference import Reference, load_reference
from mosaic._eval.rows import Rows
from mosaic._eval.run import EvalRequest, evaluate
from mosaic._hub.partial import atomic_write
from mosaic._measure.backends import Scorer
from mosaic._measure.calibrate import BASE, unit_key
from mosaic._measure.document import document
from mosaic._measure.journal import Journal, paired_se, panel_record, stages
from mosaic._measure.parts import check_space
from mosaic._measure.refine import moves, plan_versions, predicted_move, versions_key
from mosaic._measure.request import MeasureRequest
from mosaic._measure.schedule import Schedule, moved
from mosaic._measure.sides import Side
from mosaic._plan.gguf_units import Unit
from mosaic._plan.measurement import dumps

#: One candidate of the loop: its versions, its name, and the journal record its panel makes (given its start).
Job = tuple[dict[int, str], str, Callable[[dict, float], dict]]


def remove_stale_work(workdir: Path, name: str) -> None:
    """Work folders of measurements whose process is gone (killed): each holds a copy of the base."""
    for p in workdir.glob(f".{name}.measure-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def _sha256(path: Path) -> str:
    return digest_file(path).sha256


def teacher(req: MeasureRequest, journal: Journal, reference: dict, teacher_path: Path, ctx: int, k: int,
            progress: Reporter) -> Reference:
    """The teacher's top-k on the rows: the saved reference, or the live teacher run once (kept beside the journal,
    so that a resumed run does not run it again)."""
    assert req.reference is not None and req.text is not None
    if reference["kind"] == "saved":
        return load_reference(req.reference)
    done = [r for r in journal.records if r["kind"] == "teacher"]
    if done and teacher_path.is_file() and _sha256(teacher_path) == done[0]["sha256"]:
        return load_reference(teacher_path)
    if done:
        raise MosaicError(f"--resume: the teacher's saved top-k {teacher_path} is missing or changed; measure again without --resume")
    tmp = teacher_path.with_name(teacher_path.name + ".tmp.npz")
    t0 = time.monotonic()
    evaluate(EvalRequest([], req.reference, req.text, ctx, k, save_reference=tmp, threads=req.threads, verbose=req.verbose,
                         gpu_layers=req.gpu_layers), progress)
    with open(tmp, "rb") as f:  # durable before the journal names it
        os.fsync(f.fileno())
    os.replace(tmp, teacher_path)
    fsync_dir(teacher_path.parent)
    journal.add({"kind": "teacher", "sha256": _sha256(teacher_path), "seconds": time.monotonic() - t0})
    return load_reference(teacher_path)


def _mark_job(kind: str, versions: dict[int, str], marks: dict[str, dict | None]) -> Job:
    """The base or the top, kept in ``marks`` for the records told against it."""

    def record(p: dict, t0: float) -> dict:
        marks[kind] = rec = panel_record(kind, p, t0)
        return rec

    return versions, kind, record


def _same_as_base(plan: Schedule, base_rec: dict | None, same: list[tuple[int, str]], journal: Journal) -> None:
    """Donor versions with the base's own bytes: the base's panel, not run."""
    assert base_rec is not None
    for ui, d in same:
        u = plan.side.units[ui]
        journal.add({"kind": "result", "layer": u.layer, "group": u.group, "donor": d, "kl": base_rec["kl"], "dkl": 0.0,
                     "dkl_se": 0.0, "dtop1": 0.0, "dnll": 0.0, "same_as_base": True, "seconds": 0.0})


def _swap_job(plan: Schedule, marks: dict[str, dict | None], ui: int, d: str) -> Job:
    """The base with unit ``ui`` at donor ``d``'s version: the gain of taking it."""
    u = plan.side.units[ui]

    def record(p: dict, t0: float) -> dict:
        base_rec = marks["base"]
        assert base_rec is not None
        c_kl = [r["kl"] for r in p["rows"]]
        return {"kind": "result", "layer": u.layer, "group": u.group, "donor": d, "kl": p["kl"]["mean"],
                "dkl": p["kl"]["mean"] - base_rec["kl"], "dkl_se": paired_se(c_kl, [r[0] for r in base_rec["rows"]]),
                "dtop1": p["top1"] - base_rec["top1"], "dnll": p["nll"] - base_rec["nll"], "seconds": time.monotonic() - t0}

    return {ui: d}, f"{u.describe()} from {d}", record


def _drop_job(plan: Schedule, marks: dict[str, dict | None], ui: int) -> Job:
    """The top with unit ``ui`` at its worst version (the base's, or a donor's of fewer bytes): the loss of it."""
    u: Unit = plan.side.units[ui]
    to = plan.to[ui]

    def record(p: dict, t0: float) -> dict:
        top_rec = marks["top"]
        assert top_rec is not None
        rec = panel_record("drop", p, t0, layer=u.layer, group=u.group)
        rec["dkl_drop_se"] = paired_se([r["kl"] for r in p["rows"]], [r[0] for r in top_rec["rows"]])
        return rec

    return moved(plan.top_map, ui, to), f"the top with {u.describe()} at {'the base' if to == BASE else to}'s version", record


def _pooled_job(plan: Schedule, marks: dict[str, dict | None], kind: str, v: str, moving: list[int]) -> Job:
    """The top with a kind's measured units at version ``v`` together: the kind's curve at that version."""
    versions = {ui: t for ui, t in plan.top_map.items() if ui not in moving}
    if v != BASE:  # the base's version: no entry
        versions.update(dict.fromkeys(moving, v))
    units = [unit_key(plan.side.units[ui].layer, plan.side.units[ui].group) for ui in sorted(moving)]

    def record(p: dict, t0: float) -> dict:
        top_rec = marks["top"]
        assert top_rec is not None
        rec = panel_record("pooled", p, t0, unit_kind=kind, to=v, units=units)
        rec["dkl_se"] = paired_se([r["kl"] for r in p["rows"]], [r[0] for r in top_rec["rows"]])
        return rec

    where = "the base's version" if v == BASE else f"{v}'s version"
    return versions, f"the top with the {len(units)} {kind} units at {where}", record


def run(req: MeasureRequest, journal: Journal, plan: Schedule, rows: Rows, reference: dict, teacher_path: Path,
        head: dict, out: Path, weights_seconds: float, progress: Reporter) -> dict:
    """Every pass of ``plan`` this run still owes, then (with ``req.refine``) the refinement's rounds; returns the
    document of all the journal holds, its ``timing`` this run's."""
    side = plan.side
    units = side.units
    settings = head["settings"]
    ref = teacher(req, journal, reference, teacher_path, settings["ctx"], settings["top_k"], progress)
    recs = journal.records
    base_rec = next((r for r in recs if r["kind"] == "base"), None)
    top_rec = next((r for r in recs if r["kind"] == "top"), None)
    done = {(r["layer"], r["group"], r["donor"]) for r in recs if r["kind"] == "result"}
    dropped = {(r["layer"], r["group"]) for r in recs if r["kind"] == "drop"}
    same = [(ui, d) for ui, d in plan.swaps if (units[ui].layer, units[ui].group, d) not in done and side.same_bytes(ui, d)]
    swaps = [(ui, d) for ui, d in plan.swaps if (units[ui].layer, units[ui].group, d) not in done and (ui, d) not in same]
    drops = [ui for ui in plan.drops if (units[ui].layer, units[ui].group) not in dropped]
    pooled_done = {(r["unit_kind"], r["to"]) for r in recs if r["kind"] == "pooled"}
    pooled = [p for p in plan.pooled if (p[0], p[1]) not in pooled_done]
    need_top = plan.top is not None and top_rec is None
    workdir = (Path(req.workdir) if req.workdir is not None else out.parent).resolve()
    scorer: Scorer | None = None
    work: Path | None = None
    marks = {"base": base_rec, "top": top_rec}  # the panels the candidates' records are told against
    ends = [*([_mark_job("base", {}, marks)] if base_rec is None else []),
            *([_mark_job("top", plan.top_map, marks)] if need_top else [])]
    # a version's parts are laid out for the first candidate that takes it and removed after the last: the
    # pooled candidates go version by version, so that one version of every kind is laid out at a time
    jobs = [*(_swap_job(plan, marks, ui, d) for ui, d in swaps), *(_drop_job(plan, marks, ui) for ui in drops),
            *(_pooled_job(plan, marks, *p) for p in sorted(pooled, key=lambda p: (p[1] != BASE, p[1], p[0])))]
    seq = [*ends, *jobs]
    last_use = {pair: i for i, (versions, _, _) in enumerate(seq) for pair in versions.items()}
    try:
        if seq or plan.refine:
            check_space(workdir, space_needed(plan, seq))
            remove_stale_work(workdir, out.name)
            work = workdir / f".{out.name}.measure-{os.getpid()}"
            shutil.rmtree(work, ignore_errors=True)
            scorer = side.scorer(ref, rows, work, req, progress)
            head = {**head, "runtime": scorer.runtime}  # after a load: what it offloaded, and where
        advance: Callable[[int], None] = lambda n: None  # noqa: E731  (the candidates' step starts after the ends)
        for i, (versions, name, record) in enumerate(seq):  # the next one loaded while this one decodes
            assert scorer is not None
            if i == len(ends):
                _same_as_base(plan, marks["base"], same, journal)
                before = len(done) + len(dropped) + len(pooled_done)
                advance = progress.step(f"{len(jobs)} candidates ({before} measured before)", len(jobs))
            t0 = time.monotonic()
            then = (seq[i + 1][0], seq[i + 1][1]) if i + 1 < len(seq) else None
            journal.add(record(scorer.score(versions, name, then), t0))
            scorer.release([pair for pair in versions.items() if last_use[pair] == i])
            if i >= len(ends):
                fault_point("candidate")
                advance(1)
        if not jobs:
            _same_as_base(plan, marks["base"], same, journal)
        if plan.refine:
            _refine(req, journal, plan, head, ref, scorer, work, progress)
    finally:
        if scorer is not None:
            scorer.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    doc = document(plan, journal.records, head, ref)
    if scorer is not None:  # this run's (a resumed one's own): loading candidates, their decode, the panel
        doc["timing"] = {k: round(v, 3) for k, v in scorer.timing.items()}
        doc["timing"]["stages"] = stages(journal.records, weights_seconds)
    return doc


def space_needed(plan: Schedule, seq: list[Job]) -> int:
    """The most bytes the layout holds at once: the base's parts, and every version from the candidate before
    the first that takes it (loaded ahead while that one decodes) to the last; with ``--refine``, at least a
    round's: each unit at its largest version and two moves."""
    side = plan.side
    base = side.space_needed(())
    first: dict[tuple[int, str], int] = {}
    last: dict[tuple[int, str], int] = {}
    for i, (versions, _, _) in enumerate(seq):
        for pair in versions.items():
            first.setdefault(pair, max(0, i - 1))
            last[pair] = i
    change = [0] * (len(seq) + 1)
    for pair in first:
        n = side.space_needed((pair,)) - base
        change[first[pair]] += n
        change[last[pair] + 1] -= n
    held = peak = 0
    for c in change:
        held += c
        peak = max(peak, held)
    if plan.refine:
        each = [max((side.space_needed(((ui, v),)) - base for v in vs[1:]), default=0) for ui, vs in enumerate(side.versions)]
        peak = max(peak, sum(each) + 2 * max(each, default=0))
    return base + peak


def _plan_at(req: MeasureRequest, side: Side, doc: dict, work: Path) -> tuple[dict[int, str], dict]:
    """The plan ``mosaic plan --max-size`` makes of ``doc`` at the refinement's budget: ``{unit: donor}`` and
    the planner's report."""
    from mosaic._plan.gguf_planner import plan_gguf_mosaic
    from mosaic._plan.planner import PlanRequest

    path = work / "refine-measurement.json"
    atomic_write(path, dumps({k: v for k, v in doc.items() if k != "refinement"}))
    report, _, _, _ = plan_gguf_mosaic(PlanRequest(req.base, req.donors, path, max_size=req.max_size, unit=side.unit))
    index = {(u.layer, u.group): i for i, u in enumerate(side.units)}
    return plan_versions(report["chosen"], index), report


def _refine(req: MeasureRequest, journal: Journal, plan: Schedule, head: dict, ref: Reference, scorer: Scorer | None,
            work: Path | None, progress: Reporter) -> None:
    """The rounds of the refinement: plan from the current predictions, run the plan and one move of every measured
    unit from it (:mod:`.refine`), until the plan repeats or the rounds are spent; each run kept in the journal."""
    assert scorer is not None and work is not None
    side, units = plan.side, plan.side.units
    last: dict[int, str] | None = None
    converged = False
    for rnd in range(1, plan.refine + 1):
        doc = document(plan, journal.records, head, ref)
        chosen, report = _plan_at(req, side, doc, work)
        if last is not None and chosen == last:
            converged = True
            break
        key = versions_key(chosen, units)
        by_unit: dict[tuple[object, object], dict[str, dict]] = {}
        for r in doc["results"]:
            by_unit.setdefault((r["layer"], r["group"]), {})[r["donor"]] = r
        done = {(m["layer"], m["group"]) for m in journal.records if m["kind"] == "move" and m["round"] == rnd}
        todo = [mv for mv in moves(chosen, plan.measured_units, side.versions, plan.errors.eps, side.dbytes)
                if (units[mv[0]].layer, units[mv[0]].group) not in done]
        cands = [moved(chosen, ui, to) for ui, _, to in todo]
        names = [f"round {rnd}: the plan with {units[ui].describe()} at {to}'s version" for ui, _, to in todo]
        rec = next((r for r in journal.records if r["kind"] == "round" and r["round"] == rnd), None)
        if rec is None:
            t0 = time.monotonic()
            p = scorer.score(chosen, f"round {rnd}: the plan at {req.max_size:,} bytes", (cands[0], names[0]) if todo else None)
            rec = panel_record("round", p, t0, round=rnd, versions=key, bytes=report["predicted_size"],
                               predicted_kl=doc["base"]["kl"] + report["predicted_dkl"])
            journal.add(rec)
        elif rec["versions"] != key:
            raise MosaicError(f"--resume: round {rnd} of the refinement planned another mosaic than the interrupted run; "
                              "measure again without --resume")
        advance = progress.step(f"refinement round {rnd}: {len(todo)} moves from the plan", len(todo))
        plan_kl = [row[0] for row in rec["rows"]]
        for i, (ui, here, to) in enumerate(todo):
            u = units[ui]
            t0 = time.monotonic()
            p = scorer.score(cands[i], names[i], (cands[i + 1], names[i + 1]) if i + 1 < len(todo) else None)
            c_kl = [r["kl"] for r in p["rows"]]
            journal.add({"kind": "move", "round": rnd, "layer": u.layer, "group": u.group, "from": here, "to": to,
                         "kl": p["kl"]["mean"], "dkl": p["kl"]["mean"] - rec["kl"], "dkl_se": paired_se(c_kl, plan_kl),
                         "predicted": predicted_move(by_unit, u.layer, u.group, here, to), "seconds": time.monotonic() - t0})
            fault_point("candidate")
            advance(1)
        if not any(r["kind"] == "round-done" and r["round"] == rnd for r in journal.records):
            journal.add({"kind": "round-done", "round": rnd})
        scorer.release({pair for c in (chosen, *cands) for pair in c.items()})  # the next round lays out its own
        last = chosen
    if not converged:
        final, _ = _plan_at(req, side, document(plan, journal.records, head, ref), work)
        converged = final == last
        last = final
    if not any(r["kind"] == "refined" for r in journal.records):
        assert last is not None
        journal.add({"kind": "refined", "versions": versions_key(last, units), "converged": converged})
