"""Cuts of a source that llama.cpp's quantizer quantizes in place of the whole (``mosaic._measure.cuts``).

The claim a cheaper ladder rests on: llama.cpp quantizes a weight row by row, so a row of a file holding only a
sample of the source's rows comes out byte for byte as that row of the whole model's rung, and a tensor of a file
holding only some tensors as that tensor of the whole rung. Held here against whole rungs made by llama.cpp's own
``llama_model_quantize`` (the suite's stand-in tool), read by gguf-py's reader, not mosaic's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mosaic
from mosaic._checkpoint.gguf_model import open_gguf_model
from mosaic._measure.cuts import sample_rows, write_sample, write_subset
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from mosaic.testing.quantize_tool import write_tool
from tests.conftest import needs_runtime

#: rows a multiple of 256 (every type takes every tensor) and more rows than the sample keeps
GEO = Geometry(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2)
TYPES = "IQ4_XS,Q2_K,Q4_K,Q8_0"
SAMPLE = {"elements": 256 * 24, "min_rows": 24}


def _tensors(path: Path) -> dict[str, object]:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


def _rows(t: object) -> np.ndarray:
    """A tensor's data as one row of bytes per weight row (gguf-py's reader: rows of quantized blocks)."""
    data = np.asarray(t.data)  # type: ignore[attr-defined]
    return data.reshape(int(t.shape[1]), -1).view(np.uint8)  # type: ignore[attr-defined]


def test_the_sample_is_fixed_by_the_name_and_the_seed() -> None:
    a = sample_rows("blk.0.ffn_down.weight", 8960, 1536)
    assert a == sample_rows("blk.0.ffn_down.weight", 8960, 1536) and a[0] == sorted(set(a[0]))
    assert len(a[0]) == 342  # half a million elements of 1,536-wide rows
    assert a != sample_rows("blk.1.ffn_down.weight", 8960, 1536)
    assert a != sample_rows("blk.0.ffn_down.weight", 8960, 1536, seed=1)
    assert sample_rows("blk.0.attn_k.weight", 200, 1536) == [list(range(200))]  # small: every row
    experts = sample_rows("blk.0.ffn_down_exps.weight", 4096, 512, slices=8)
    assert len(experts) == 8 and {len(r) for r in experts} == {256} and experts[0] != experts[1]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    needs_runtime()
    d = tmp_path_factory.mktemp("cuts")
    src = write_llama_gguf(d / "src-F16.gguf", qtype="F16", seed=11, geometry=GEO)[0]
    values = imatrix_values(imatrix_targets(GEO), seed=4)
    imatrix = write_imatrix(d / "imatrix.gguf", values)
    tool = write_tool(d / "llama-quantize")
    model = open_gguf_model(src)
    (d / "sample").mkdir()
    (d / "subset").mkdir()
    sample = write_sample(model, d / "sample" / "src-F16.gguf", **SAMPLE)  # same names: the rungs' names alike
    subset_names = ["blk.1.ffn_down.weight", "blk.0.attn_v.weight", "output_norm.weight"]
    subset = write_subset(model, d / "subset" / "src-F16.gguf", subset_names)
    # the subset's matrix: the same values, of its tensors alone (a matrix naming tensors a model lacks is refused)
    subset_imatrix = write_imatrix(d / "subset-imatrix.gguf", {k: v for k, v in values.items() if k in subset_names})
    for name, path, m in (("whole", src, imatrix), ("sample", sample.path, imatrix), ("subset", subset.path, subset_imatrix)):
        mosaic.ladder(path, out=d / f"rungs-{name}", types=TYPES, imatrix=m, llama_quantize=tool)
    return {"dir": d, "src": src, "sample": sample, "subset": subset, "subset_names": subset_names}


def test_a_sample_holds_the_sources_rows_byte_for_byte(made: dict) -> None:
    src, cut = _tensors(made["src"]), _tensors(made["sample"].path)
    assert set(cut) == set(src)
    sampled = 0
    for name, t in cut.items():
        if name not in made["sample"].rows:
            assert np.array_equal(np.asarray(t.data), np.asarray(src[name].data))  # norms: whole
            continue
        keep = made["sample"].rows[name][0]
        sampled += len(keep) < int(src[name].shape[1])
        assert np.array_equal(_rows(t), _rows(src[name])[keep])
    assert sampled >= 10  # the sample is smaller than the source, tensor by tensor


@pytest.mark.parametrize("rung", TYPES.split(","))
def test_each_sampled_row_quantized_is_that_row_of_the_whole_rung(made: dict, rung: str) -> None:
    d = made["dir"]
    stem = "src-F16-" + rung + ".gguf"
    whole, cut = _tensors(d / "rungs-whole" / stem), _tensors(d / "rungs-sample" / stem)
    compared = 0
    for name, keep in made["sample"].rows.items():
        assert cut[name].tensor_type == whole[name].tensor_type
        assert np.array_equal(_rows(cut[name]), _rows(whole[name])[keep[0]]), (rung, name)
        compared += 1
    assert compared == len(made["sample"].rows) > 10


@pytest.mark.parametrize("rung", TYPES.split(","))
def test_a_tensor_of_a_subset_quantized_is_that_tensor_of_the_whole_rung(made: dict, rung: str) -> None:
    d = made["dir"]
    stem = "src-F16-" + rung + ".gguf"
    whole, cut = _tensors(d / "rungs-whole" / stem), _tensors(d / "rungs-subset" / stem)
    assert set(cut) == set(made["subset_names"])
    for name, t in cut.items():
        assert t.tensor_type == whole[name].tensor_type
        assert bytes(np.asarray(t.data).view(np.uint8)) == bytes(np.asarray(whole[name].data).view(np.uint8)), (rung, name)


def test_a_subset_names_only_tensors_the_source_has(made: dict) -> None:
    with pytest.raises(mosaic.MosaicError, match=r"has no tensor 'blk\.9\.ffn_up\.weight'"):
        write_subset(open_gguf_model(made["src"]), made["dir"] / "bad.gguf", ["blk.9.ffn_up.weight"])
    assert not (made["dir"] / "bad.gguf").exists()
