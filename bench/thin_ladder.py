"""Whether a ladder can be made thin: weight errors from a sample of rows, and each kind's passes from a share of
its layers, so that whole tensors are quantized only where a pass or a plan takes them.

    python bench/thin_ladder.py rows LADDER MEASUREMENT BYTES[,BYTES...] [--work DIR] [--lean] [--min-bpw BITS]
        [--score TEACHER HELD_OUT CTX]
    python bench/thin_ladder.py layers LADDER MEASUREMENT BYTES[,BYTES...] --reference TOP_K.npz --text ROWS
        --imatrix FILE [--share 4] [--work DIR] [--score TEACHER HELD_OUT CTX]

LADDER is a whole ladder (``mosaic ladder``'s folder) and MEASUREMENT the default measurement made over it (the
bench's goal run, its ladder kept with ``MOSAIC_BENCH_KEEP_LADDER=1``); each part prints a table and plans at each
of BYTES, against MEASUREMENT's own plans there (``--score``: where they differ, both built and scored on the
held-out rows, the ratio of their KL with its paired standard error).

``rows``: :func:`mosaic._measure.cuts.write_sample` of the ladder's source (about half a million elements of every
weight, the rows drawn by the tensor's name), made into a ladder by ``mosaic ladder`` with the whole ladder's types
and matrix: each rung's seconds against the whole rung's; whether every sampled row is the whole rung's row byte for
byte (llama.cpp quantizes a weight row by row); how far the sampled weight errors (``mosaic measure --method
weights`` over the sampled ladder) are from the whole ones; and the plans of MEASUREMENT's passes read with the
sampled weight errors.

``layers``: the default measurement again with ``--only-layers`` one layer in SHARE, spread over the depth
(:func:`mosaic._measure.defaults.spread`): each kind's pooled passes move those layers' units alone, so they would
need only those layers' tensors of each version. Its passes (each kind's alpha and its factor at each version, the
one-unit kinds' drops) read with MEASUREMENT's weight errors of every unit, planned.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cases.ladder import ratio  # noqa: E402  (the bench case's paired KL ratio)
from harness import MOSAIC  # noqa: E402

from mosaic._checkpoint.gguf_model import open_gguf_model  # noqa: E402
from mosaic._formats.gguf_container import GGUFFile, TensorInfo, read_gguf  # noqa: E402
from mosaic._measure.calibrate import BASE, _eps, complete, kind_of, unit_key  # noqa: E402
from mosaic._measure.cuts import write_sample  # noqa: E402


def _tensor_rows(path: Path, g: GGUFFile, t: TensorInfo) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(g.data_start + t.offset)
        return np.frombuffer(f.read(t.nbytes), np.uint8).reshape(math.prod(t.ne[1:]), -1)


def same_rows(full: Path, sampled: Path, kept: dict[str, list[list[int]]]) -> tuple[int, int]:
    """(weights whose sampled rows are the whole rung's rows byte for byte and at its type, weights compared);
    ``kept``: each weight's rows in the sample, per slice."""
    a, b = read_gguf(full), read_gguf(sampled)
    theirs = {t.name: t for t in b.tensors}
    same = 0
    for name, slices in kept.items():
        t, s = next(x for x in a.tensors if x.name == name), theirs[name]
        rows = t.ne[1]
        index = [si * rows + r for si, rs in enumerate(slices) for r in rs]
        same += t.type_id == s.type_id and np.array_equal(_tensor_rows(full, a, t)[index], _tensor_rows(sampled, b, s))
    return same, len(kept)


def with_weights(doc: dict, eps: dict[tuple[str, str], float]) -> dict:
    """``doc`` (a top-down measurement) with ``eps`` in place of its weight errors, its predictions made again from
    the same passes: each kind's alpha and each version's factor are ratios of a pass to weight errors."""
    out = copy.deepcopy(doc)
    for r in out["results"]:
        key = unit_key(r["layer"], r["group"])
        r["eps"], r["eps_base"] = eps[(key, r["donor"])], eps[(key, BASE)]
    for m in out["measured"]:
        key = unit_key(m["layer"], m["group"])
        m["eps_base"], m["eps_top"] = eps[(key, BASE)], eps[(key, out["top"]["versions"][key])]
        m["eps_to"] = eps[(key, m.get("to", BASE))]
    out.pop("calibration", None)
    out["notes"] = [*out.get("notes", []), "weight errors from a ladder of sampled rows"]
    return complete(out)


def _quantile(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]


def _plan(ladder: Path, scores: Path, n: int, out: Path) -> dict[str, str]:
    r = subprocess.run([*MOSAIC, "plan", "--ladder", str(ladder), "--scores", str(scores), "--max-size", str(n), "--out",
                        str(out), "--json"], check=True, capture_output=True, text=True)
    picks: dict[str, list[str]] = {}
    for c in json.loads(r.stdout)["chosen"]:  # a unit not listed stays at the base's version
        picks.setdefault(f"{c['layer']}/{c.get('group')}", []).append(str(c["donor"]))
    return {k: "+".join(v) for k, v in picks.items()}


def _score(recipes: dict[str, Path], work: Path, score: list[str]) -> dict[str, list[list[float]]]:
    """Each recipe built and scored on the held-out rows against the teacher live: its rows' summed KL."""
    teacher, held, ctx = score
    built = {}
    for name, recipe in recipes.items():
        out = work / f"built-{name}"
        subprocess.run([*MOSAIC, "build", str(recipe), "--out", str(out), "--force"], check=True, stdout=subprocess.DEVNULL)
        built[name] = out
    r = subprocess.run([*MOSAIC, "eval", *map(str, built.values()), "--reference", teacher, "--text", held, "--ctx", ctx,
                        "--json"], check=True, capture_output=True, text=True)
    ev = json.loads(r.stdout)
    return {name: [[x["kl"] * x["positions"], x["positions"]] for x in c["rows"]] for name, c in zip(built, ev["candidates"])}


def _compare(ladder: Path, own_scores: Path, scores: Path, budgets: str, work: Path, label: str,
             score: list[str] | None) -> None:
    print(f"\n| bytes | units at another version than the measurement's own plan ({label}) | held-out KL, × the own plan's |")
    print("|---|---|---|")
    for n in (int(b) for b in budgets.split(",")):
        own = _plan(ladder, own_scores, n, work / f"own-{n}.yaml")
        got = _plan(ladder, scores, n, work / f"{label}-{n}.yaml")
        moved = sorted(k for k in set(own) | set(got) if own.get(k) != got.get(k))
        shown = ", ".join(f"{k} {own.get(k, 'base')}→{got.get(k, 'base')}" for k in moved[:8])
        kl = "not scored (--score)" if moved else "the same plan"
        if moved and score:
            rows = _score({f"own-{n}": work / f"own-{n}.yaml", f"{label}-{n}": work / f"{label}-{n}.yaml"}, work, score)
            q, se = ratio({"rows": rows[f"{label}-{n}"]}, {"rows": rows[f"own-{n}"]})
            kl = (f"{sum(r[0] for r in rows[f'{label}-{n}']) / sum(r[1] for r in rows[f'{label}-{n}']):.4f}, "
                  f"{q:.3f} ± {se:.3f}")
        print(f"| {n:,} | {len(moved)} of {len(set(own) | set(got))} units upgraded{': ' + shown if moved else ''} | {kl} |")


def rows_part(a: argparse.Namespace) -> None:
    full = json.loads((a.ladder / "ladder.json").read_text())
    src = a.work / "sample.gguf"
    t0 = time.perf_counter()
    cut = write_sample(open_gguf_model(full["source"]["file"]), src)
    print(f"the sample: {cut.bytes:,} bytes of the source's {full['source']['bytes']:,}, written in {time.perf_counter() - t0:.1f} s")
    matrix = a.ladder / full["imatrix"]["file"]
    sampled_dir = a.work / "ladder"
    t0 = time.perf_counter()
    subprocess.run([*MOSAIC, "ladder", str(src), "--out", str(sampled_dir), "--imatrix", str(matrix),
                    "--types", ",".join(r["type"] for r in full["rungs"]), "--llama-quantize", full["tool"]["path"],
                    *(["--lean"] if a.lean else []), *(["--min-bpw", a.min_bpw] if a.min_bpw else [])],
                   check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    mine = {r["type"]: r for r in json.loads((sampled_dir / "ladder.json").read_text())["rungs"]}
    print("| rung | whole s | sample's s | ratio | weights whose sampled rows are the whole rung's bytes |")
    print("|---|---|---|---|---|")
    for r in full["rungs"]:
        s = mine[r["type"]]
        same, n = same_rows(a.ladder / r["file"], sampled_dir / s["file"], cut.rows)
        print(f"| {r['type']} | {r['seconds']:.0f} | {s['seconds']:.1f} | {s['seconds'] / r['seconds']:.3f} | {same} of {n} |")
    total_full, total_mine = sum(r["seconds"] for r in full["rungs"]), sum(r["seconds"] for r in mine.values())
    print(f"| every rung | {total_full:.0f} | {total_mine:.0f} | {total_mine / total_full:.3f} | `mosaic ladder` wall {wall:.0f} s |")

    doc = json.loads(a.measurement.read_text())
    weights = a.work / "weights.json"
    t0 = time.perf_counter()
    subprocess.run([*MOSAIC, "measure", "--ladder", str(sampled_dir), "--reference", str(src), "--method", "weights",
                    "--unit", doc["settings"]["unit"], "--imatrix", str(matrix), "--out", str(weights), "--force"], check=True,
                   stdout=subprocess.DEVNULL)
    weights_s = time.perf_counter() - t0
    theirs, ours = _eps(doc["results"]), _eps(json.loads(weights.read_text())["results"])
    logs: dict[str, list[float]] = {}
    for key, e in theirs.items():
        if e > 0 and ours.get(key, 0) > 0:
            logs.setdefault(kind_of(key[0].split("/", 1)[1]), []).append(abs(math.log(ours[key] / e)))
    every = [x for v in logs.values() for x in v]
    print(f"\nweight errors, the sample's over the whole's, |ln ratio| ({weights_s:.0f} s over the sampled ladder): "
          f"{len(every)} (unit, version) pairs, median {_quantile(every, 0.5):.4f}, p90 {_quantile(every, 0.9):.4f}, "
          f"max {max(every):.4f}; p90 by kind: " + ", ".join(f"{k} {_quantile(v, 0.9):.4f}" for k, v in sorted(logs.items())))
    derived = a.work / "measurement-sampled-weights.json"
    derived.write_text(json.dumps(with_weights(doc, ours)))
    _compare(a.ladder, a.measurement, derived, a.budgets, a.work, "sampled", a.score)


def with_passes(doc: dict, other: dict) -> dict:
    """``doc``'s rows (every unit's weight errors) read with ``other``'s passes: its pooled passes (each kind's
    alpha and its factor at each version) and its measured drops (the one-unit kinds')."""
    out = copy.deepcopy(doc)
    out["pooled"], out["measured"] = copy.deepcopy(other["pooled"]), copy.deepcopy(other["measured"])
    out["forward_passes"] = other["forward_passes"]
    out.pop("calibration", None)
    out["notes"] = [*out.get("notes", []), f"the passes of layers {other['settings']['layers']}"]
    return complete(out)


def layers_part(a: argparse.Namespace) -> None:
    from mosaic._measure.defaults import spread

    doc = json.loads(a.measurement.read_text())
    every = sorted({r["layer"] for r in doc["results"] if r["layer"] is not None})
    share = spread(every, max(1, round(len(every) / a.share)))
    out = a.work / "share.json"
    t0 = time.perf_counter()
    subprocess.run([*MOSAIC, "measure", "--ladder", str(a.ladder), "--reference", str(a.reference), "--text", str(a.text),
                    "--unit", doc["settings"]["unit"], "--imatrix", str(a.imatrix), "--only-layers", ",".join(map(str, share)),
                    "--out", str(out), "--force"], check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    other = json.loads(out.read_text())
    print(f"layers {share}: {other['forward_passes']} passes in {wall:.0f} s (the measurement of every layer: "
          f"{doc['forward_passes']})")
    mine = {(p["kind"], p["to"]): p for p in doc["pooled"]}
    print("\n| kind | version | every layer's factor | the share's | alpha pass: every layer's alpha, the share's |")
    print("|---|---|---|---|---|")
    derived = with_passes(doc, other)
    alphas = {k: v["alpha"] for k, v in (doc.get("calibration") or {}).items()}
    theirs = {k: v["alpha"] for k, v in (derived.get("calibration") or {}).items()}
    for p in derived["pooled"]:
        q = mine.get((p["kind"], p["to"]))
        alpha = f"{alphas.get(p['kind'], 0):.4g}, {theirs.get(p['kind'], 0):.4g}" if p.get("alpha") else ""
        print(f"| {p['kind']} | {p['to']} | {q['factor'] if q else float('nan'):.3f} | {p['factor']:.3f} | {alpha} |")
    scores = a.work / "measurement-share-passes.json"
    scores.write_text(json.dumps(derived))
    _compare(a.ladder, a.measurement, scores, a.budgets, a.work, "share", a.score)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    for name in ("rows", "layers"):
        p = sub.add_parser(name)
        p.add_argument("ladder", type=Path)
        p.add_argument("measurement", type=Path)
        p.add_argument("budgets", help="bytes to plan at, comma-separated")
        p.add_argument("--work", type=Path, default=Path(f"thin-ladder-{name}"))
        p.add_argument("--score", nargs=3, metavar=("TEACHER", "HELD_OUT", "CTX"), default=None,
                       help="build and score each plan that differs from the own plan, and the own plan, on these rows")
    r = sub.choices["rows"]
    r.add_argument("--lean", action="store_true")
    r.add_argument("--min-bpw", default=None)
    lay = sub.choices["layers"]
    lay.add_argument("--reference", type=Path, required=True)
    lay.add_argument("--text", type=Path, required=True)
    lay.add_argument("--imatrix", type=Path, required=True)
    lay.add_argument("--share", type=int, default=4)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    (rows_part if a.part == "rows" else layers_part)(a)


if __name__ == "__main__":
    main()
