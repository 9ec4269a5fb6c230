"""The best-file case: mosaic's default against the best file llama.cpp can make at each size, the tail included.

A ratio to one rival says as much of the rival as of mosaic: where target-size's own mix breaks (Qwen's Q3_K sizes)
any plan looks good. So the anchor at each goal size is, on each row set, the file of lowest mean KL among
target-size's mix at those bytes and every stock imatrix type (:data:`STOCK`) of no more bytes, all made from the
same teacher and matrix. Where mosaic's ladder can keep the teacher's own bytes (Qwen's Q4_K_M, ``--lean``)
target-size gets every type (``MOSAIC_BENCH_TARGET_SIZE_ALL``). The README's loop as printed makes that ladder over
both models' teachers (its default types hold SmolLM2's Q4_1 too, so ``--lean`` is on there as well); a ladder that
leaves the teacher's type out stops the case, since target-size would then need the build without it.

mosaic's side is the README's loop as printed (its commands parsed from README.md, as the readme case does): one
ladder, one measurement, and a plan and a build per size, no method flag. The goal sizes are the stock types' bytes
of :data:`GOALS`; a size at or above the teacher's own is dropped and said. Per size and row set (the held-out
paragraphs, and ``bench/data/fresh-paragraphs.txt``, which no choice saw): the plan's mean KL over the anchor's with
a paired SE (the delta method over rows) and a bootstrap SE (rows resampled, the same for both files), p99 and
top-1 beside the anchor's with the bootstrap SE of each difference (``mosaic eval --per-position`` keeps each row's
KL at every position, so a resample's p99 is the pooled positions' own), and the goal: KL ≤ :data:`RATIO` × the
anchor's, p99 no worse, top-1 no lower. A size that misses says by how much and which tensors differ from the
anchor's mix.

Everything made and every score is kept in ``best-<model>/`` (``scores.json`` after each evaluation), so a run cut
off, or the next one, makes and scores only what is missing: rivals by their label, mosaic's plans by what they
choose (a plan that changed is built and scored again). ``MOSAIC_BENCH_FRESH_START=1`` starts from nothing. A
measurement already in the folder is reused (``measurement.json``: a run's cost is not this case's subject; the
readme case times the loop); delete it to measure again. The held-out rows are scored first at every size, then the
fresh ones. Built plans go once scored (a build is seconds); the ladder, the stock files and target-size's files
stay.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
from harness import DATA, ROOT, drop, row

from cases.ladder import MODELS, TARGET_SIZE_SCRIPT, _evaluate, _timed, _tool, differences, ratio
from cases.readme import _mapped, parse, placeholders, readme_loop

#: Every stock type llama-quantize makes from an importance matrix at 2.5 bits a weight or more (the ladder's own
#: floor), in the order of its own size table; those under the floor (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, Q2_0, Q1_0,
#: the ternary types) are left out: each sits below every goal size by more than a sixth of the model.
STOCK = ("IQ2_S", "IQ2_M", "Q2_K_S", "Q2_K", "IQ3_XXS", "IQ3_XS", "Q3_K_S", "IQ3_S", "IQ3_M", "Q3_K_M", "Q3_K_L",
         "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_K_S", "Q4_1", "Q4_K_M", "Q5_0")
#: The goal's sizes: the bytes of these stock types of each model.
GOALS = {
    "qwen2.5-coder-1.5b": ("Q2_K", "IQ3_XXS", "Q3_K_S", "IQ3_S", "Q3_K_M", "Q3_K_L", "IQ4_XS", "Q4_K_S"),
    "smollm2": ("Q2_K", "IQ3_XXS", "Q3_K_S", "IQ3_S", "Q3_K_M", "IQ4_XS", "Q4_K_S", "Q4_K_M"),
}
#: The goal: a plan's mean KL at most this much of the anchor's.
RATIO = 0.80
ROW_SETS = ("held-out", "fresh")
#: Files scored in one ``mosaic eval`` (the teacher's pass over the rows shared among them).
BATCH = 4


def plan_key(recipe: Path) -> str:
    """What a plan chooses, as a digest: its base rung and every donor's keys by the rung's file name (paths
    differ between folders, choices do not)."""
    import yaml

    doc = yaml.safe_load(recipe.read_text())
    donors = {k: Path(v["path"]).name for k, v in doc.get("donors", {}).items()}
    body = {"base": Path(doc["base"]["path"]).name,
            "replace": sorted((donors[r["from"]], sorted(r["keys"])) for r in doc.get("replace", []))}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def bootstrap(c: dict, a: dict, n: int = 2000) -> dict[str, float | None]:
    """Standard errors over ``n`` resamples of the rows, the same rows for both files (paired): of KL(c) / KL(a),
    of p99(c) − p99(a) (the pooled positions' 99th percentile, where both kept them; else None) and of
    top-1(c) − top-1(a)."""
    ka = np.array([x[0] for x in c["rows"]], dtype=np.float64)
    kb = np.array([x[0] for x in a["rows"]], dtype=np.float64)
    pos = np.array([x[1] for x in c["rows"]], dtype=np.float64)
    picks = np.random.default_rng(0).integers(0, len(ka), (n, len(ka)))
    out: dict[str, float | None] = {"kl": float(np.std(ka[picks].sum(axis=1) / kb[picks].sum(axis=1), ddof=1)),
                                    "p99": None, "top1": None}
    if "row_top1" in c and "row_top1" in a:
        ta, tb = np.array(c["row_top1"]) * pos, np.array(a["row_top1"]) * pos
        out["top1"] = float(np.std((ta[picks].sum(axis=1) - tb[picks].sum(axis=1)) / pos[picks].sum(axis=1), ddof=1))
    if "positions_kl" in c and "positions_kl" in a:
        pc = [np.asarray(x) for x in c["positions_kl"]]
        pa = [np.asarray(x) for x in a["positions_kl"]]
        d = [np.percentile(np.concatenate([pc[i] for i in p]), 99) - np.percentile(np.concatenate([pa[i] for i in p]), 99)
             for p in picks[:400]]  # 400 resamples: a percentile of thousands of positions each
        out["p99"] = float(np.std(d, ddof=1))
    return out


def anchor(scored: dict[str, dict], budget: int, teacher_bytes: int, size: str) -> str | None:
    """The label of the best llama.cpp file at ``budget`` bytes among those scored: target-size's at that size and
    every stock file of no more bytes (and under the teacher's), by mean KL."""
    rivals = [k for k, v in scored.items() if (k == f"target-size at {size}")
              or (k.endswith("(imatrix)") and v["bytes"] <= budget and v["bytes"] < teacher_bytes)]
    return min(rivals, key=lambda k: scored[k]["kl"]) if rivals else None


def frontier_of(scored: dict[str, dict]) -> list[str]:
    """The labels no other file of no more bytes beats on mean KL."""
    return [k for k, v in scored.items()
            if not any(o["bytes"] <= v["bytes"] and o["kl"] < v["kl"] for j, o in scored.items() if j != k)]


def verdict(c: dict, a: dict) -> tuple[bool, str, tuple[float, float, dict[str, float | None]]]:
    """Whether the plan ``c`` meets the goal against the anchor ``a``, the sentence that says so (each difference
    with its bootstrap SE: a miss within one SE is said to be), and the numbers behind it (the KL ratio, its paired
    SE, the bootstrap SEs), so the table reads them without resampling again."""
    q, se = ratio(c, a)
    b = bootstrap(c, a)

    def pm(x: float | None, fmt: str) -> str:
        return f" ± {x:{fmt}}" if x is not None else " (± n/a: scored without per-position KL)"

    misses = [*([f"KL {q:.2f} × (over {RATIO:.2f} by {q - RATIO:.2f})"] if q > RATIO else []),
              *([f"p99 {c['p99'] - a['p99']:+.3f}" + pm(b["p99"], ".3f")] if c["p99"] > a["p99"] else []),
              *([f"top-1 {c['top1'] - a['top1']:+.4f}" + pm(b["top1"], ".4f")] if c["top1"] < a["top1"] else [])]
    return not misses, (f"KL {c['kl']:.4f}: {q:.2f} × (± {se:.2f} paired, ± {b['kl']:.2f} bootstrap); p99 {c['p99']:.3f} "
                        f"({a['p99']:.3f}{pm(b['p99'], '.3f')} on the difference); top-1 {c['top1']:.4f} ({a['top1']:.4f}"
                        f"{pm(b['top1'], '.4f')}): " + ("met" if not misses else "missed: " + "; ".join(misses))), (q, se, b)


class Scores:
    """``scores.json`` of the case's folder: ``{row set: {label: eval result}}`` and each plan's key, written after
    every evaluation so that nothing scored is scored again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        doc = json.loads(path.read_text()) if path.is_file() else {}
        # a score from before a repeated context counted once (no ``repeated``) is another statistic: scored again
        self.got: dict[str, dict[str, dict]] = {s: {k: v for k, v in doc.get("got", {}).get(s, {}).items() if "repeated" in v}
                                                for s in ROW_SETS}
        self.keys: dict[str, str] = doc.get("keys", {})
        self.costs: dict[str, float] = doc.get("costs", {})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"got": self.got, "keys": self.keys, "costs": self.costs}))
        tmp.replace(self.path)


def case_best(model_key: str, ctx: int, measure_rows: int) -> None:
    """See the module's docstring."""
    model = MODELS[model_key]
    case = f"best file: {model.name}, mosaic's default against the best llama.cpp file at each size"
    _, stages = parse(readme_loop())
    teacher = model.teacher()
    quantize, ts_tool = _tool("llama-quantize"), os.environ.get("MOSAIC_BENCH_TARGET_SIZE_ALL")
    if teacher is None or quantize is None or not ts_tool or not Path(ts_tool).is_file() or not TARGET_SIZE_SCRIPT.is_file():
        row(case, "skipped", "needs the model, llama-quantize (make bench) and target-size's (MOSAIC_BENCH_TARGET_SIZE_ALL)", "")
        return
    work = DATA / f"best-{model.key}"
    if os.environ.get("MOSAIC_BENCH_FRESH_START") == "1":
        drop(work)
    stock_dir = work / "stock"
    stock_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MOSAIC_RUNTIME", "MOSAIC_DEQUANTIZE", "MOSAIC_LLAMA_QUANTIZE")}
    env |= {"MOSAIC_CACHE_DIR": str(work / "cache"), "PATH": os.pathsep.join((str(Path(quantize).parent), env.get("PATH", "")))}
    lines = (ROOT / "tests" / "data" / "paragraphs.txt").read_text().splitlines()
    rows = work / "measure-rows.txt"
    rows.write_text("\n".join(lines[:measure_rows]) + "\n")
    texts = {"held-out": work / "held-out.txt", "fresh": ROOT / "bench" / "data" / "fresh-paragraphs.txt"}
    texts["held-out"].write_text("\n".join(lines[measure_rows:]) + "\n")
    scores = Scores(work / "scores.json")
    teacher_bytes = teacher.stat().st_size
    started = time.perf_counter()

    def score(files: dict[str, Path], sets: tuple[str, ...] = ROW_SETS) -> None:
        """Each file on each row set it has no score on, :data:`BATCH` a run (the teacher's pass shared), saved after
        each run."""
        for s in sets:
            todo = [k for k in files if k not in scores.got[s]]
            for i in range(0, len(todo), BATCH):
                _evaluate({k: files[k] for k in todo[i:i + BATCH]}, teacher, texts[s], ctx, env, scores.costs, scores.got[s],
                          per_position=True)
                scores.save()

    def make_stock(t: str) -> Path:
        p = stock_dir / f"{model.name}.{t}.gguf"
        if not p.is_file():
            tmp = p.with_suffix(".partial")
            _timed(scores.costs, f"stock {t}", [str(quantize), "--allow-requantize", "--imatrix", str(model.imatrix), str(teacher),
                                                str(tmp), t, str(os.cpu_count() or 1)])
            tmp.rename(p)
        return p

    # 1. the goal's sizes (the goal types' stock files), target-size at each (its state kept beside its files: warm
    #    after the first) and mosaic's plans: the README's loop, one ladder and one measurement, a plan and a build
    #    per size; all scored on both row sets
    goals = GOALS[model.key]
    goal_files = {t: make_stock(t) for t in goals}
    budgets = {t: p.stat().st_size for t, p in goal_files.items() if p.stat().st_size < teacher_bytes}
    dropped = [t for t in goals if t not in budgets]
    mixer: dict[str, Path] = {}
    for t, n in budgets.items():
        dst = work / f"target-size-{t}.gguf"
        if not dst.is_file():
            _timed(scores.costs, "target-size", ["bash", str(TARGET_SIZE_SCRIPT), "run", ts_tool, str(teacher), str(model.imatrix),
                                                 str(n), str(dst)])
        mixer[f"target-size at {t}"] = dst
    (work / "teacher-f32.gguf").unlink(missing_ok=True)
    table = placeholders(teacher, model.imatrix, rows)
    _timed(scores.costs, "mosaic ladder", _mapped(stages["ladder"], table), env=env, cwd=work)
    options = json.loads((work / stages["ladder"][stages["ladder"].index("--out") + 1] / "ladder.json").read_text())["options"]
    if not options["lean"]:
        raise SystemExit(f"best-file case: the ladder of {model.name} does not keep the teacher's bytes ({options}); "
                         "target-size's full type list is then no fair rival: build it without the teacher's type")
    scores_doc = stages["plan"][stages["plan"].index("--scores") + 1]
    if not (work / scores_doc).is_file():
        _timed(scores.costs, "mosaic measure", [*_mapped(stages["measure"], table), "--json"], env=env, cwd=work)
    scores.save()
    size_at = stages["plan"].index("--max-size") + 1
    out_at = stages["plan"].index("--out") + 1
    built: dict[str, Path] = {}
    for t, n in budgets.items():
        plan = list(stages["plan"])
        plan[size_at], plan[out_at] = str(n), f"planned-{t}.yaml"
        _timed(scores.costs, "plans", _mapped(plan, table), env=env, cwd=work)
        key, label = plan_key(work / f"planned-{t}.yaml"), f"mosaic @ {t}"
        if scores.keys.get(label) != key:
            for s in ROW_SETS:
                scores.got[s].pop(label, None)
            scores.keys[label] = key
        if all(label in scores.got[s] for s in ROW_SETS):
            continue
        build = [f"planned-{t}.yaml" if w == stages["plan"][out_at] else w for w in stages["build"]]
        build[build.index("--out") + 1] = f"planned-{t}"
        drop(work / f"planned-{t}")
        _timed(scores.costs, "builds", _mapped(build, table), env=env, cwd=work)
        built[label] = work / f"planned-{t}"
    first = built | mixer | {f"{t} (imatrix)": goal_files[t] for t in budgets}
    score(first, ("held-out",))  # every size's verdict on the held-out rows before any on the fresh ones
    score(first, ("fresh",))
    for p in built.values():
        drop(p)

    # 2. every other stock type of no more bytes than the largest size (and under the teacher's), on the held-out
    #    rows; those no size can take go
    top = max(budgets.values())
    rivals: dict[str, Path] = {}
    for t in STOCK:
        p = make_stock(t)
        if p.stat().st_size <= top and p.stat().st_size < teacher_bytes:
            rivals[f"{t} (imatrix)"] = p
        elif t not in goals:
            p.unlink()
    score(rivals, ("held-out",))
    # 3. on the fresh rows, the stock files on the held-out rows' frontier: a file beaten there by one of no more
    #    bytes is no anchor at any size on those rows' evidence, and its fresh score is left out (said in the table)
    front = frontier_of({k: scores.got["held-out"][k] for k in rivals})
    score({k: rivals[k] for k in front}, ("fresh",))
    _report(case, model.name, teacher_bytes, budgets, dropped, scores.got)
    (DATA / f"best-{model.key}.json").write_text(json.dumps({
        "model": model.key, "budgets": budgets, "dropped": dropped, "teacher_bytes": teacher_bytes, "got": scores.got,
        "costs": scores.costs, "wall": time.perf_counter() - started}, indent=1))
    print(markdown(DATA / f"best-{model.key}.json"))


def _report(case: str, name: str, teacher_bytes: int, budgets: dict[str, int], dropped: list[str],
            got: dict[str, dict[str, dict]]) -> None:
    some = next(iter(got["held-out"].values()))
    row(case, "setup", f"{len(some['rows'])} held-out rows, {len(next(iter(got['fresh'].values()))['rows'])} fresh rows",
        f"teacher {name} ({teacher_bytes:,} bytes); {some['runtime']['name']} {some['runtime']['version']}")
    for t in dropped:
        row(case, f"{t}: dropped", "at or above the teacher's bytes", "")
    met = {s: 0 for s in ROW_SETS}
    for t, n in budgets.items():
        for s in ROW_SETS:
            scored = got[s]
            a = anchor(scored, n, teacher_bytes, t)
            c = scored.get(f"mosaic @ {t}")
            if a is None or c is None:
                row(case, f"{s}: {t} ({n:,} bytes)", "not scored", "")
                continue
            ts = scored[f"target-size at {t}"]
            ok, words, _ = verdict(c, scored[a])
            met[s] += ok
            row(case, f"{s}: mosaic at {t}'s bytes ({n:,})", f"anchor: {a} (KL {scored[a]['kl']:.4f}; target-size "
                f"{ts['kl']:.4f})", words)
            if not ok:
                row(case, f"{s}: at {t}, what the plan did differently from {a}", "plan's types / the anchor's",
                    differences(c["mix"], scored[a]["mix"]))
    unscored = sorted(k for k in got["held-out"] if k.endswith("(imatrix)") and k not in got["fresh"])
    if unscored:
        row(case, "fresh rows: stock files left out", ", ".join(unscored),
            "each beaten on the held-out rows by a file of no more bytes")
    row(case, "goal", f"≤ {RATIO:.2f} × the best llama.cpp file's KL, p99 no worse, top-1 no lower",
        ", ".join(f"{s}: met at {met[s]} of {len(budgets)} sizes" for s in ROW_SETS))


def _cell(x: dict) -> str:
    return f"{x['kl']:.4f} / {x['p99']:.3f} / {x['top1']:.4f}"


def _se(x: float | None, f: str) -> str:
    return f"{x:{f}}" if x is not None else "n/a"


def markdown(path: Path) -> str:
    """The case's verdicts as one markdown table per row set (bench/RESULTS.md's form), from its saved
    ``best-<model>.json``: per size, the anchor, target-size, the plan, and the plan against the anchor."""
    d = json.loads(path.read_text())
    out = []
    for s in ROW_SETS:
        got = d["got"][s]
        out += [f"{s} rows: mean KL / p99 / top-1", "",
                "| size (bytes) | the best llama.cpp file | target-size | mosaic | KL ratio (paired, bootstrap SE) | "
                "p99 difference (SE) | top-1 difference (SE) | goal |", "|---|---|---|---|---|---|---|---|"]
        for t, n in d["budgets"].items():
            a, c = anchor(got, n, d["teacher_bytes"], t), got.get(f"mosaic @ {t}")
            if a is None or c is None:
                out.append(f"| {t} ({n:,}) | not scored | | | | | | |")
                continue
            ts, A = got[f"target-size at {t}"], got[a]
            ok, _, (q, se, b) = verdict(c, A)
            out.append(f"| {t} ({n:,}) | {a.removesuffix(' (imatrix)') if a.endswith('(imatrix)') else 'target-size'}: "
                       f"{_cell(A)} | {_cell(ts)} | {_cell(c)} | {q:.2f} ({se:.2f}, {b['kl']:.2f}) | "
                       f"{c['p99'] - A['p99']:+.3f} ({_se(b['p99'], '.3f')}) | {c['top1'] - A['top1']:+.4f} "
                       f"({_se(b['top1'], '.4f')}) | {'met' if ok else 'missed'} |")
        out.append("")
    return "\n".join(out)
