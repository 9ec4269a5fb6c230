"""The readme case: the README's loop "From a source model to the best file at any size", read from README.md itself
and run as printed on Qwen2.5-Coder-1.5B-Instruct, held to llama.cpp's ``--target-size`` in the same run.

The commands are the README's own: the fenced block after :data:`MARKER` is parsed line by line (``shlex``, comments
dropped), and any line that is not the setup the README prints (``make llama-tools``, the virtualenv's activation)
or a ``mosaic`` command fails the case, as does a loop that is not ladder, measure, plan, build in that order. The
README's placeholders are mapped through one table (:func:`placeholders`) to the model's files; the outputs it names
(``ladder/``, ``measurement.json``, ...) land in the case's working folder. The setup is checked, not assumed:
llama-cpp-python compiled into ``.venv`` (``make llama-tools``), which mosaic then prefers, and ggml's dequantizers
from it; the measurement's own document says which runtime and which dequantizer ran, and the table says both. The
caches start empty (a user's first run).

One ladder and one measurement serve the three goal sizes (the stock imatrix Q2_K, Q3_K_M and IQ4_XS bytes of the
model); each size is a plan and a build. Rivals in the same run: target-size cold (its F32 copy of the teacher, every
tensor's errors, its file) at the first size and warm at the other two. The table: each rung's seconds, the weight
errors, the passes, the plan and the build; source to the first file against 2 × target-size's cold time, each further
size against 0.2 × its warm time; and the three sizes' KL against target-size's and the stock type's on the held-out
rows and on rows no choice saw (``bench/data/fresh-paragraphs.txt``), with paired SEs and p99.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from pathlib import Path

from harness import DATA, MOSAIC, ROOT, drop, row

from cases.ladder import MODELS, TARGET_SIZE_SCRIPT, DiskPeak, _evaluate, _timed, _tool, ratio

#: The README's line the loop's block follows.
MARKER = "From a source model to the best file at any size"
#: The goal (issue's bounds): source to the first file within this many target-size cold runs, each further size
#: within this many warm ones.
FIRST, FURTHER = 2.0, 0.2
MODEL = "qwen2.5-coder-1.5b"


def readme_loop(readme: Path = ROOT / "README.md") -> list[list[str]]:
    """The loop's lines as argument lists, from the first ``bash`` block after :data:`MARKER`."""
    text = readme.read_text()
    at = text.find(MARKER)
    if at < 0:
        raise SystemExit(f"readme case: README.md has no line {MARKER!r}: the loop moved or changed")
    start = text.find("```bash\n", at)
    end = text.find("```", start + 8)
    if start < 0 or end < 0:
        raise SystemExit("readme case: no ```bash block after the loop's line")
    out = []
    for line in text[start + 8:end].splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


def placeholders(teacher: Path, imatrix: Path, rows: Path) -> dict[str, str]:
    """The one table from the README's names to the model's files (the size is mapped per goal size)."""
    return {"model-Q4_K_M.gguf": str(teacher), "imatrix.gguf": str(imatrix), "measure-rows.txt": str(rows)}


def parse(loop: list[list[str]]) -> tuple[list[list[str]], dict[str, list[str]]]:
    """(the setup's lines, ``{stage: argv}`` of ``ladder``, ``measure``, ``plan``, ``build``); a line of anything
    else, a stage missing or out of order, or a size that is not the README's placeholder fails."""
    setup, stages = [], {}
    for words in loop:
        if words in (["make", "llama-tools"], [".", ".venv/bin/activate"], ["source", ".venv/bin/activate"]):
            setup.append(words)
        elif words[0] == "mosaic" and len(words) > 1 and words[1] in ("ladder", "measure", "plan", "build"):
            if words[1] in stages:
                raise SystemExit(f"readme case: mosaic {words[1]} twice in the README's loop")
            stages[words[1]] = words[1:]
        else:
            raise SystemExit(f"readme case: the README's loop holds a line the case cannot run: {shlex.join(words)}")
    if list(stages) != ["ladder", "measure", "plan", "build"]:
        raise SystemExit(f"readme case: the README's loop runs {', '.join(stages)}; expected ladder, measure, plan, build")
    if ["make", "llama-tools"] not in setup:
        raise SystemExit("readme case: the README's loop no longer starts with make llama-tools: update this case's setup check")
    if "--max-size" not in stages["plan"]:
        raise SystemExit("readme case: the README's plan has no --max-size")
    return setup, stages


def _mapped(argv: list[str], table: dict[str, str]) -> list[str]:
    return [*MOSAIC, *(table.get(w, w) for w in argv)]


def _check_setup() -> str:
    """The setup the README prints, as it is here: llama-cpp-python in .venv (make llama-tools) and its library."""
    from mosaic._eval.runtime import available
    from mosaic._formats.ggml_dequant import library_path

    if "llama-cpp-python" not in available():
        raise SystemExit("readme case: llama-cpp-python is not installed here: run make llama-tools, as the README says")
    lib = library_path()
    if lib is None:
        raise SystemExit("readme case: the installed llama-cpp-python ships no libggml-base: make llama-tools")
    return str(lib)


def case_readme(ctx: int, measure_rows: int) -> None:
    """See the module's docstring."""
    model = MODELS[MODEL]
    case = f"readme: the README's loop on {model.name}"
    setup, stages = parse(readme_loop())
    teacher = model.teacher()
    quantize, ts_tool = _tool("llama-quantize"), os.environ.get(model.target_size)
    if teacher is None or quantize is None or not ts_tool or not Path(ts_tool).is_file() or not TARGET_SIZE_SCRIPT.is_file():
        row(case, "skipped", f"needs the model, llama-quantize (make bench) and target-size's ({model.target_size})", "")
        return
    lib = _check_setup()
    work = DATA / "readme"
    drop(work)
    work.mkdir(parents=True)
    cache = work / "cache"  # a first run: no digest and no weight sums kept from another
    env = {k: v for k, v in os.environ.items() if k not in ("MOSAIC_RUNTIME", "MOSAIC_DEQUANTIZE", "MOSAIC_LLAMA_QUANTIZE")}
    env |= {"MOSAIC_CACHE_DIR": str(cache), "PATH": os.pathsep.join((str(Path(quantize).parent), env.get("PATH", "")))}
    lines = (ROOT / "tests" / "data" / "paragraphs.txt").read_text().splitlines()
    rows, held = work / "measure-rows.txt", work / "held-out.txt"
    rows.write_text("\n".join(lines[:measure_rows]) + "\n")
    held.write_text("\n".join(lines[measure_rows:]) + "\n")
    fresh = ROOT / "bench" / "data" / "fresh-paragraphs.txt"
    table = placeholders(teacher, model.imatrix, rows)
    costs: dict[str, float] = {}
    got: dict[str, dict] = {}
    sizes = model.goal
    stock_dir = work / "stock"
    stock_dir.mkdir()
    with DiskPeak([work]) as disk:
        started = time.perf_counter()
        budgets = {}
        for t in sizes:  # the budgets: the stock imatrix types' bytes (made here, not part of either side's cost)
            p = stock_dir / f"{model.name}.{t}.gguf"
            _timed(costs, f"stock {t}", [str(quantize), "--allow-requantize", "--imatrix", str(model.imatrix), str(teacher),
                                         str(p), t, str(os.cpu_count() or 1)])
            budgets[t] = p.stat().st_size
        mixer = {}
        for i, t in enumerate(sizes):
            dst = work / f"target-size-{t}.gguf"
            _timed(costs, "target-size, cold" if i == 0 else "target-size, warm",
                   ["bash", str(TARGET_SIZE_SCRIPT), "run", ts_tool, str(teacher), str(model.imatrix), str(budgets[t]), str(dst)])
            mixer[f"target-size at {t}"] = dst
        costs["target-size, warm"] /= max(1, len(sizes) - 1)
        (work / "teacher-f32.gguf").unlink(missing_ok=True)
        # the README's loop, as printed: one ladder, one measurement, a plan and a build per size
        _timed(costs, "mosaic ladder", _mapped(stages["ladder"], table), env=env, cwd=work)
        _timed(costs, "mosaic measure", [*_mapped(stages["measure"], table), "--json"], env=env, cwd=work)
        size_at = stages["plan"].index("--max-size") + 1
        out_at = stages["plan"].index("--out") + 1 if "--out" in stages["plan"] else None
        built: dict[str, Path] = {}
        for t in sizes:
            plan = list(stages["plan"])
            plan[size_at] = str(budgets[t])
            recipe = f"planned-{t}.yaml"
            if out_at is not None:
                plan[out_at] = recipe
            build = [recipe if w == stages["plan"][out_at or 0] else w for w in stages["build"]]
            build[build.index("--out") + 1] = f"planned-{t}"
            _timed(costs, f"plan {t}", _mapped(plan, table), env=env, cwd=work)
            _timed(costs, f"build {t}", _mapped(build, table), env=env, cwd=work)
            built[f"mosaic @ {t}"] = work / f"planned-{t}"
        loop_wall = time.perf_counter() - started
        ladder_doc = json.loads((work / _out_of(stages["ladder"]) / "ladder.json").read_text())
        measured = json.loads((work / _scores_of(stages["plan"])).read_text())
        stock = {f"{t} (imatrix)": stock_dir / f"{model.name}.{t}.gguf" for t in sizes}
        _evaluate({**built, **mixer, **stock}, teacher, held, ctx, env, costs, got)
        fresh_got: dict[str, dict] = {}
        _evaluate({**built, **mixer}, teacher, fresh, ctx, env, costs, fresh_got)
    _report(case, model.name, setup, lib, ladder_doc, measured, budgets, costs, got, fresh_got, disk.peak, loop_wall)
    (DATA / "readme.json").write_text(json.dumps({"budgets": budgets, "costs": costs, "got": got, "fresh": fresh_got,
                                                  "ladder": ladder_doc, "measurement": {k: measured.get(k) for k in (
                                                      "runtime", "dequantizer", "timing", "forward_passes", "settings")},
                                                  "disk_peak": disk.peak}, indent=1))
    shutil.rmtree(work / "ladder", ignore_errors=True)


def _out_of(argv: list[str]) -> str:
    return argv[argv.index("--out") + 1]


def _scores_of(argv: list[str]) -> str:
    return argv[argv.index("--scores") + 1]


def _report(case: str, name: str, setup: list[list[str]], lib: str, ladder: dict, measured: dict, budgets: dict[str, int],
            costs: dict[str, float], got: dict[str, dict], fresh: dict[str, dict], peak: int, wall: float) -> None:
    rt, dq = measured.get("runtime") or {}, measured.get("dequantizer") or {}
    by: dict[str, list[str]] = {}
    for t, how in dq.get("types", {}).items():
        by.setdefault(how, []).append(t)
    row(case, "setup, as the README prints it", "; ".join(shlex.join(w) for w in setup),
        f"runtime {rt.get('name')} {rt.get('version')} ({rt.get('threads')} threads); dequantizer "
        + "; ".join(f"{how}: {', '.join(ts)}" for how, ts in sorted(by.items())) + f" ({lib})")
    rungs = {r["type"]: r.get("seconds", 0.0) for r in ladder["rungs"]}
    rung_sum = sum(rungs.values())
    row(case, "cost: the ladder, llama-quantize per rung", f"{rung_sum:.0f} s",
        ", ".join(f"{t} {s:.0f} s" for t, s in sorted(rungs.items(), key=lambda kv: -kv[1])))
    row(case, "cost: the ladder, the rest (reading back, hashing)", f"{costs['mosaic ladder'] - rung_sum:.0f} s",
        f"options {ladder.get('options')}")
    st = (measured.get("timing") or {}).get("stages") or {}
    row(case, "cost: the measurement", f"{costs['mosaic measure']:.0f} s",
        ", ".join(f"{k} {v['passes']} passes {v['seconds']:.0f} s" if v["passes"] else f"{k} {v['seconds']:.0f} s"
                  for k, v in st.items()) + f"; {measured.get('forward_passes')} forward passes")
    first_t = next(iter(budgets))
    first = costs["mosaic ladder"] + costs["mosaic measure"] + costs[f"plan {first_t}"] + costs[f"build {first_t}"]
    further = [costs[f"plan {t}"] + costs[f"build {t}"] for t in list(budgets)[1:]]
    cold, warm = costs["target-size, cold"], costs["target-size, warm"]
    for t in budgets:
        row(case, f"cost: plan and build at {t}", f"{costs[f'plan {t}']:.0f} + {costs[f'build {t}']:.0f} s", "")
    row(case, "cost: source to the first file (ladder, measure, plan, build)", f"{first:.0f} s",
        f"{first / cold:.2f} × target-size cold ({cold:.0f} s); goal ≤ {FIRST:g} ×: {'met' if first <= FIRST * cold else 'missed'}")
    if further:
        each = max(further)
        row(case, "cost: each further size (a plan and its build), the slower", f"{each:.0f} s",
            f"{each / warm:.2f} × target-size warm ({warm:.0f} s); goal ≤ {FURTHER:g} ×: "
            f"{'met' if each <= FURTHER * warm else 'missed'}")
    for label, scored in (("held-out rows", got), ("rows no choice saw", fresh)):
        for t, n in budgets.items():
            c, ts = scored[f"mosaic @ {t}"], scored[f"target-size at {t}"]
            q, se = ratio(c, ts)
            stock = scored.get(f"{t} (imatrix)")
            vs_stock = ""
            if stock is not None:
                q2, se2 = ratio(c, stock)
                vs_stock = f"; {q2:.2f} ± {se2:.2f} × the imatrix {t}'s ({stock['kl']:.4f}, p99 {stock['p99']:.3f})"
            row(case, f"{label}: mosaic at {t}'s bytes ({n:,})", f"{c['bytes']:,} bytes",
                f"KL {c['kl']:.4f}: {q:.2f} ± {se:.2f} × target-size's ({ts['kl']:.4f}); p99 {c['p99']:.3f} "
                f"(target-size {ts['p99']:.3f}); top-1 {c['top1']:.4f} ({ts['top1']:.4f}){vs_stock}")
    row(case, "the loop's wall, the rivals included", f"{wall / 3600:.2f} h", f"disk peak {peak / 1e9:.1f} GB")
