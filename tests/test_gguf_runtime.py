"""A real runtime: llama.cpp (through llama-cpp-python) loads a GGUF mosaic and computes with it.

The mosaic's logits for a prompt must equal, exactly, those of the same model assembled independently
by gguf-py, and differ from the base's (the donor's tensors are really used). The mosaic is split
like ``llama-gguf-split`` and loaded by its first part, as llama.cpp users load split models.

llama-cpp-python compiles llama.cpp when installed (``make test`` installs it once, as the
``runtime`` extra, and keeps the wheel). Outside CI this module skips with the reason when it is
missing; under ``CI=true`` a missing runtime fails the run.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mosaic.build.run import build
from mosaic.testing_gguf import N_VOCAB, Geometry, assemble_with_ggufpy, write_llama_gguf

PROMPT = [1, 260, 75, 104, 111, 111, 114, 266, 263, 47, 270, 36]  # <s>, word pieces and byte tokens (all < N_VOCAB)


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        reason = f"llama-cpp-python is not installed ({e}); `make test` installs it (pip install -e '.[runtime]')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the GGUF runtime test needs llama-cpp-python: {reason}")
        pytest.skip(reason)
    return llama_cpp


def logits(path: Path) -> np.ndarray:
    """llama.cpp's logits for every position of PROMPT, on the CPU, deterministic thread count."""
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=2, n_gpu_layers=0,
                          logits_all=True, verbose=False, seed=0)
    try:
        llm.eval(PROMPT)
        out = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    finally:
        llm.close()
    assert out.shape == (len(PROMPT), N_VOCAB)
    assert np.isfinite(out).all()
    return out


@pytest.mark.parametrize(
    ("geometry", "modules"),
    [(Geometry(), "[attn, ffn_dense]"), (Geometry(n_expert=4, n_expert_used=2), "[ffn_exps]")],
    ids=["dense", "moe"],
)
def test_llama_cpp_runs_the_mosaic_as_the_independently_assembled_model(tmp_path: Path, geometry: Geometry, modules: str) -> None:
    _llama_cpp()
    base = write_llama_gguf(tmp_path / "base" / "m-Q4_0.gguf", qtype="Q4_0", geometry=geometry)
    donor = write_llama_gguf(tmp_path / "q8" / "m-Q8_0.gguf", qtype="Q8_0", geometry=geometry, split_max_size=80_000)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: rt-mosaic\n"
        f"base:\n  path: {base[0]}\n"
        f"donors:\n  q8:\n    path: {donor[0]}\n"
        f"replace:\n  - from: q8\n    layers: [\"1-2\"]\n    modules: {modules}\n"
        "  - from: q8\n    keys: [\"output.weight\"]\n"
        "output:\n  split_max_size: 60K\n"
    )
    res = build(recipe, out=tmp_path / "o")
    parts = sorted((tmp_path / "o").glob("*.gguf"))
    assert len(parts) > 1
    take = {t["name"]: t["source"] for t in res.provenance["tensors"] if t["source"] != "base"}
    ref = assemble_with_ggufpy(base, {"q8": donor}, take, tmp_path / "ref.gguf")

    # a control: the same assembly with one donor tensor left at the base's type computes differently
    one_less = dict(take)
    one_less.pop("output.weight")
    control = assemble_with_ggufpy(base, {"q8": donor}, one_less, tmp_path / "control.gguf")

    got, want, base_logits = logits(parts[0]), logits(ref), logits(base[0])
    assert np.array_equal(got, want), f"max difference {np.abs(got - want).max()}"
    assert np.abs(got - base_logits).max() > 1e-3  # the donor's tensors are the ones computing
    assert not np.array_equal(got, logits(control))
