"""A real runtime: llama.cpp (through the `runtime` extra) loads a GGUF mosaic and computes with it.

The mosaic's logits for a prompt must equal, exactly, those of the same model assembled independently
by gguf-py, and differ from the base's (the donor's tensors are really used). The mosaic is split
like ``llama-gguf-split`` and loaded by its first part, as llama.cpp users load split models.

``make test`` installs the ``runtime`` extra (a prebuilt wheel). Outside CI this module skips with the
reason when no runtime is installed; under ``CI=true`` a missing runtime fails the run.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mosaic._build.run import build
from mosaic.testing.gguf import N_VOCAB, Geometry, assemble_with_ggufpy, write_llama_gguf

PROMPT = [1, 260, 75, 104, 111, 111, 114, 266, 263, 47, 270, 36]  # <s>, word pieces and byte tokens (all < N_VOCAB)


def _runtime():  # type: ignore[no-untyped-def]
    from mosaic._eval.runtime import available
    from mosaic._eval.worker import get_runtime

    if not available():
        reason = "no llama.cpp runtime is installed; `make test` installs the runtime extra (pip install -e '.[runtime]')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the GGUF runtime test needs a runtime: {reason}")
        pytest.skip(reason)
    return get_runtime()


def logits(path: Path) -> np.ndarray:
    """llama.cpp's logits for every position of PROMPT, on the CPU, loaded by the (first) file's name."""
    m = _runtime().load(path, ctx=64, batch=64)
    try:
        out = np.array(m.decode(PROMPT, 0), dtype=np.float32)
    finally:
        m.close()
    assert out.shape == (len(PROMPT), N_VOCAB)
    assert np.isfinite(out).all()
    return out


@pytest.mark.parametrize(
    ("geometry", "modules"),
    [(Geometry(), "[attn, ffn_dense]"), (Geometry(n_expert=4, n_expert_used=2), "[ffn_exps]")],
    ids=["dense", "moe"],
)
def test_llama_cpp_runs_the_mosaic_as_the_independently_assembled_model(tmp_path: Path, geometry: Geometry, modules: str) -> None:
    _runtime()
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
