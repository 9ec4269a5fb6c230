"""mosaic's benchmark suite: mosaic against the plain baselines on the same data, in one run, as ratios.

    python bench/run.py [--cases census,bytes,metadata,export,memory,stream,gguf,gguf-stream,panel,plan-ladder,eval,scale,measure] [--runs 3] [--size-gb 2] [--stream-gb 0.5] [--gguf-gb 2] [--eval-ctx 512] [--no-write]
    python bench/run.py --cases measure --measure-model qwen2.5-coder-1.5b [--measure-methods default,variants]
    python bench/run.py --cases readme     # the README's loop as printed, on Qwen2.5-Coder-1.5B, against target-size
    python bench/run.py --cases best [--measure-model smollm2]   # the default against the best llama.cpp file per size

This file is the command line only. Each case is a module of ``bench/cases/`` named for it (``gguf-stream``:
``gguf_stream.py``), over ``bench/harness.py``: the data, the timing, the peak memory and the results table
every case shares.

Synthetic data is generated once and cached outside the repository (``$MOSAIC_BENCH_DIR``, default
``~/.cache/mosaic-bench``). Each case runs every contender ``--runs`` times, interleaved, and reports
medians; ratios compare contenders measured side by side. Results go to stdout and, unless
``--no-write``, to ``bench/RESULTS.md`` with the machine they ran on. Timings of shared machines are
noisy: read the ratios, not the seconds.

The original release's packer can be run as a contender of the *metadata* case when its script is
given with ``MOSAIC_BENCH_PACK2=/path/to/mosaic_pack2.py`` (it is not part of this repository; it is
``mosaic_pack2.py`` in the public recipe repository of GLM-5.3-Flash-EXL3-Spark,
https://github.com/0xSero/glm-5.3-flash-spark-mosaic). The targets
(:data:`harness.TARGETS`) are ratios to that pipeline, measured in the same run; without it, the rows compare
mosaic with the plain baselines only.
"""

from __future__ import annotations

import argparse
import os
import sys

from cases.best import case_best
from cases.bytes import case_bytes
from cases.census import case_census
from cases.eval import case_eval
from cases.export import case_export
from cases.gguf import case_gguf
from cases.gguf_stream import case_gguf_stream
from cases.ladder import MODELS, case_frontier, case_ladder
from cases.measure import case_measure
from cases.memory import case_memory
from cases.metadata import case_metadata
from cases.panel import case_panel
from cases.plan_ladder import case_plan_ladder
from cases.readme import case_readme
from cases.scale import case_scale
from cases.stream import case_stream
from harness import DATA, ROOT, ROWS, machine, write_results

# re-exported: bench/trees.py reads the GLM preset and the table through this module (``import run as bench``)
from harness import glm_sources as glm_sources
from harness import plan_cmd as plan_cmd
from harness import recipe_for as recipe_for
from harness import row as row
from harness import scores_for as scores_for


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="census,bytes,metadata,export,memory,stream,gguf,gguf-stream,panel,plan-ladder,eval,scale,measure")
    ap.add_argument("--stream-gb", type=float, default=0.5, help="model size of the stream case (held in memory by the local hub)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--memory-gb", default="1,8", help="two base sizes for the memory case")
    ap.add_argument("--gguf-gb", type=float, default=2.0, help="size of the GGUF case's Q4_0 base")
    ap.add_argument("--eval-ctx", type=int, default=512, help="window of the eval case")
    ap.add_argument("--measure-ctx", type=int, default=128, help="window of the measure case")
    ap.add_argument("--measure-rows", type=int, default=8, help="rows of tests/data/paragraphs.txt the measure case measures on")
    ap.add_argument("--measure-calibration", type=int, default=0,
                    help="paragraphs of tests/data/calibration.txt (the importance matrix's text) the measure case measures on "
                         "as well; the held-out rows stay the paragraphs after --measure-rows")
    ap.add_argument("--measure-methods", default="default,kinds,weights",
                    help="words picking the measure case's methods (bench/cases/measure.py: METHODS): a method runs when "
                         "its label holds one")
    ap.add_argument("--measure-model", default=None, choices=sorted(MODELS),
                    help="the measure case from the model's source on one procedure (bench/cases/ladder.py): the ladder, "
                         "the rivals and target-size at the stock types' bytes; --measure-methods words 'default' (mosaic's "
                         "default measurement, and the frontier), 'goal' (the default at the goal's sizes alone, the run whose "
                         "wall and disk peak the goal bounds, its files apart) and 'variants' (the eight method variants the "
                         "default is chosen among); 'frontier' after a variants run kept (MOSAIC_BENCH_KEEP_LADDER=1, "
                         "MOSAIC_BENCH_RESUME=1): the chosen variant planned at every frontier size, drawn. Without it, "
                         "the SmolLM2 case of every method (bench/cases/measure.py)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    DATA.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    cases = args.cases.split(",")
    if "census" in cases:
        case_census(args.runs)
    if "bytes" in cases:
        case_bytes(args.runs, args.size_gb)
    if "metadata" in cases:
        case_metadata(args.runs)
    if "export" in cases:
        case_export(args.runs)
    if "memory" in cases:
        small, large = (float(x) for x in args.memory_gb.split(","))
        case_memory(small, large)
    if "stream" in cases:
        case_stream(args.runs, args.stream_gb)
    if "gguf" in cases:
        case_gguf(args.runs, args.gguf_gb)
    if "gguf-stream" in cases:
        case_gguf_stream(args.runs, args.stream_gb)
    if "panel" in cases:
        case_panel(args.runs)
    if "plan-ladder" in cases:
        case_plan_ladder(args.runs)
    if "eval" in cases:
        case_eval(args.runs, args.eval_ctx)
    if "scale" in cases:
        case_scale(args.runs, args.eval_ctx)
    if "readme" in cases:
        case_readme(args.measure_ctx, args.measure_rows)
    if "best" in cases:
        for key in (args.measure_model,) if args.measure_model else ("smollm2", "qwen2.5-coder-1.5b"):
            case_best(key, args.measure_ctx, args.measure_rows)
    if "measure" in cases and args.measure_model:
        words = args.measure_methods.split(",")
        if {"default", "variants", "goal"} & set(words):
            case_ladder(args.measure_model, args.measure_ctx, args.measure_rows,
                        {w for w in ("default", "variants", "goal") if w in words} | ({"default"} if "goal" in words else set()))
        if "frontier" in words:
            case_frontier(args.measure_model, args.measure_ctx)
    elif "measure" in cases:
        case_measure(args.measure_ctx, args.measure_rows, args.measure_methods.split(","), args.measure_calibration)
    lines = [f"machine: {machine()}", f"runs per contender: {args.runs} (medians)", "", "| case | contender | median | ratio |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in ROWS]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_results(ROOT / "bench" / "RESULTS.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
