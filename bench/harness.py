"""What the benchmark cases share: the data folder, the ``mosaic`` command, the results table, timing
and peak memory, and the synthetic checkpoints more than one case reads.

Synthetic data is generated once and cached outside the repository (``$MOSAIC_BENCH_DIR``, default
``~/.cache/mosaic-bench``). :func:`race` runs every contender ``runs`` times, interleaved, and records
medians; ratios compare contenders measured side by side. Every row goes to stderr as it is measured and
to :data:`ROWS`, which ``bench/run.py`` writes out as the results table (:func:`write_results`).
"""

from __future__ import annotations

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


def bytes_geometry(size_gb: float, bits: float, seed: int) -> Geometry:
    """12 MoE layers of 64 experts; the expert width grows with the size, the tensor count does not
    (bigger models have bigger tensors, not more of them), so memory can be compared across sizes."""
    layers, experts, hidden = 12, 64, 1024
    per_unit = layers * experts * 3 * hidden * 2 / 8  # 2-bit bytes per unit of expert width
    width = max(128, round(size_gb * 1e9 / per_unit / 128) * 128)
    return Geometry(layers=layers, dense_layers=0, experts=experts, hidden=hidden, kv_dim=256, expert_intermediate=width,
                    vocab=4096, bits=bits, seed=seed, shard_size=int(0.5e9))


def glm_sources() -> tuple[Path, Path]:
    """The GLM preset: GLM-5.3-Flash as exllamav3 stores it (mosaic.testing.exl3.glm53_geometry) at its full
    tensor count (150,547 text tensors + a vision tower), tiny widths; the 2-bit base and a 3-bit donor."""
    return (dataset("glm53-base", glm53_geometry(seed=1, vision_blocks=24)),
            dataset("glm53-donor", glm53_geometry(seed=2, bits=3, vision_blocks=24)))


def scores_for(name: str, layers: int) -> Path:
    """A per-layer scores file for ``mosaic plan`` (fixed numbers, so every run plans the same)."""
    p = DATA / f"{name}-scores.json"
    p.write_text(json.dumps({"higher_is_better": True, "scores": {str(la): 1.0 + (la * 37 % 11) / 10 for la in range(layers)}}))
    return p


def plan_cmd(base: Path, donor: Path, scores: Path, n: int = 12) -> list[str]:
    return [*MOSAIC, "plan", "--base", str(base), "--donor", f"q3={donor}", "--scores", str(scores), "--layers", str(n), "--json"]


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


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    disk = shutil.disk_usage(DATA)
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {disk.total / 1e9:.0f} GB disk ({disk.free / 1e9:.0f} GB free), Python {platform.python_version()}"


def write_results(path: Path, table: str) -> None:
    """Replace the generated table at the top of RESULTS.md; the sections written by hand below it
    (each under a ``## `` heading: targets, same-run comparisons, profiles) are kept."""
    old = path.read_text("utf-8") if path.exists() else ""
    at = old.find("\n## ")
    kept = old[at + 1 :] if at >= 0 else ""
    path.write_text("# Benchmark results\n\nProduced by `make bench` (`bench/run.py`).\n\n" + table + ("\n" + kept if kept else ""))
