"""ggml's own dequantizers beside gguf-py's: a type's C function is used only once it has matched gguf-py bit for
bit in this process; a missing or disagreeing one leaves the type with gguf-py, and so does ``MOSAIC_DEQUANTIZE``."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from mosaic._base.errors import MosaicError
from mosaic._formats import ggml_dequant

Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ggml_dequant.ENV, raising=False)
    ggml_dequant.reset()
    yield
    ggml_dequant.reset()


def _blocks(t: GGMLQuantizationType, n_blocks: int = 300, seed: int = 0) -> np.ndarray:
    per, _ = GGML_QUANT_SIZES[t]
    x = np.random.default_rng(seed).standard_normal((n_blocks // 4, 4 * per)).astype(np.float32)
    return np.ascontiguousarray(quantize(x, t)).reshape(-1).view(np.uint8)


class _Lib:
    """A stand-in for libggml-base: ``dequantize_row_q8_0`` as a C callback, right (gguf-py's floats) or wrong."""

    def __init__(self, right: bool) -> None:
        self.calls = 0

        def row(src: int, dst: int, n: int) -> None:
            self.calls += 1
            per, size = GGML_QUANT_SIZES[Q8_0]
            raw = np.ctypeslib.as_array(ctypes.cast(src, ctypes.POINTER(ctypes.c_uint8)), (n // per * size,)).copy()
            out = np.ctypeslib.as_array(ctypes.cast(dst, ctypes.POINTER(ctypes.c_float)), (n,))
            out[:] = gguf_dequantize(raw, Q8_0).reshape(-1) * (1.0 if right else 1.0001)

        self._keep = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(row)
        self.dequantize_row_q8_0 = self._keep


def test_the_symbol_of_each_type() -> None:
    assert ggml_dequant.symbol("Q4_K") == "dequantize_row_q4_K"
    assert ggml_dequant.symbol("IQ3_XXS") == "dequantize_row_iq3_xxs"
    assert ggml_dequant.symbol("Q8_0") == "dequantize_row_q8_0"
    assert ggml_dequant.symbol("TQ2_0") == "dequantize_row_tq2_0"


def test_without_the_library_gguf_py_does_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ggml_dequant, "_load", lambda: None)
    raw = _blocks(Q8_0)
    assert np.array_equal(ggml_dequant.dequantize(raw, Q8_0), gguf_dequantize(raw, Q8_0).reshape(-1))
    assert ggml_dequant.in_use() == {"Q8_0": "gguf-py"}


def test_a_function_that_matches_gguf_py_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _Lib(right=True)
    monkeypatch.setattr(ggml_dequant, "_load", lambda: lib)
    raw = _blocks(Q8_0)
    got = ggml_dequant.dequantize(raw, Q8_0)
    assert got.dtype == np.float32 and np.array_equal(got, gguf_dequantize(raw, Q8_0).reshape(-1))
    assert lib.calls == 2  # the probe of the first blocks, then the whole
    assert ggml_dequant.in_use() == {"Q8_0": "ggml"}
    ggml_dequant.dequantize(_blocks(Q8_0, seed=1), Q8_0)
    assert lib.calls == 3  # trusted once: no second probe


def test_a_function_that_disagrees_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by one part in ten thousand: the probe catches it, and every value comes from gguf-py."""
    lib = _Lib(right=False)
    monkeypatch.setattr(ggml_dequant, "_load", lambda: lib)
    for seed in (0, 1):
        raw = _blocks(Q8_0, seed=seed)
        assert np.array_equal(ggml_dequant.dequantize(raw, Q8_0), gguf_dequantize(raw, Q8_0).reshape(-1))
    assert lib.calls == 1 and ggml_dequant.in_use() == {"Q8_0": "gguf-py"}


def test_a_type_the_library_lacks_and_the_environment_keep_gguf_py(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _Lib(right=True)
    monkeypatch.setattr(ggml_dequant, "_load", lambda: lib)
    raw = _blocks(Q4_0)
    assert np.array_equal(ggml_dequant.dequantize(raw, Q4_0), gguf_dequantize(raw, Q4_0).reshape(-1))
    assert ggml_dequant.in_use() == {"Q4_0": "gguf-py"}
    ggml_dequant.reset()
    monkeypatch.setenv(ggml_dequant.ENV, "gguf-py")
    monkeypatch.setattr(ggml_dequant, "_load", lambda: lib)
    ggml_dequant.dequantize(_blocks(Q8_0), Q8_0)
    assert lib.calls == 0 and ggml_dequant.in_use() == {"Q8_0": "gguf-py"}


def test_plain_types_are_converted_not_decoded() -> None:
    x = np.random.default_rng(3).standard_normal(64).astype(np.float16)
    got = ggml_dequant.dequantize(x.view(np.uint8), GGMLQuantizationType.F16)
    assert np.array_equal(got, x.astype(np.float32)) and ggml_dequant.in_use() == {}


@pytest.mark.skipif(ggml_dequant.library_path() is None, reason="no compiled llama-cpp-python with libggml-base here")
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_llama_cpp_pythons_own_library_matches_gguf_py(name: str) -> None:
    """The real library (where installed: ``make bench PERPLEXITY=1`` compiles one): every type gguf-py can write
    matches it, so its C functions are the ones used. (The bench compares every rung of a real ladder:
    bench/weight_errors.py.)"""
    t = GGMLQuantizationType[name]
    raw = _blocks(t, n_blocks=1000, seed=7)
    assert np.array_equal(ggml_dequant.dequantize(raw, t), gguf_dequantize(raw, t).reshape(-1))
    assert ggml_dequant.in_use() == {name: "ggml"}


def test_the_environment_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for ok in ("auto", "ggml", "gguf-py", ""):
        monkeypatch.setenv(ggml_dequant.ENV, ok)
        assert ggml_dequant.mode() == (ok or "auto")
    monkeypatch.setenv(ggml_dequant.ENV, "fast")
    with pytest.raises(MosaicError, match="MOSAIC_DEQUANTIZE=fast: one of auto"):
        ggml_dequant.mode()
    with pytest.raises(MosaicError, match="MOSAIC_DEQUANTIZE=fast"):
        ggml_dequant.dequantize(_blocks(Q8_0), Q8_0)


def test_ggml_is_the_c_or_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ggml_dequant.ENV, "ggml")
    monkeypatch.setattr(ggml_dequant, "_load", lambda: None)
    with pytest.raises(MosaicError, match="no compiled llama-cpp-python"):
        ggml_dequant.dequantize(_blocks(Q8_0), Q8_0)
    ggml_dequant.reset()
    monkeypatch.setattr(ggml_dequant, "_load", lambda: _Lib(right=False))
    with pytest.raises(MosaicError, match="does not give gguf-py's values for Q8_0"):
        ggml_dequant.dequantize(_blocks(Q8_0), Q8_0)
    ggml_dequant.reset()
    lib = _Lib(right=True)
    monkeypatch.setattr(ggml_dequant, "_load", lambda: lib)
    with pytest.raises(MosaicError, match="has no dequantize_row_q4_0"):  # a type the library lacks
        ggml_dequant.dequantize(_blocks(Q4_0), Q4_0)
    assert np.array_equal(ggml_dequant.dequantize(_blocks(Q8_0), Q8_0), gguf_dequantize(_blocks(Q8_0), Q8_0).reshape(-1))
    assert ggml_dequant.record()["types"] == {"Q8_0": "ggml"} and ggml_dequant.record()["mode"] == "ggml"


def _zero_then(t: GGMLQuantizationType, zero_blocks: int, live_blocks: int) -> np.ndarray:
    """``zero_blocks`` blocks of all-zero values (a zero scale) and then ``live_blocks`` of real ones."""
    per, _ = GGML_QUANT_SIZES[t]
    zeros = np.ascontiguousarray(quantize(np.zeros((zero_blocks // 4, 4 * per), dtype=np.float32), t)).reshape(-1).view(np.uint8)
    return np.concatenate([zeros, _blocks(t, live_blocks)])


def test_the_probe_takes_blocks_with_values_from_across_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """A function wrong on every value but zero would pass a probe of the first 64 blocks of a tensor whose first
    rows are zeros; blocks with values from across the data catch it."""
    raw = _zero_then(Q8_0, 400, 100)
    lib = _Lib(right=False)
    monkeypatch.setattr(ggml_dequant, "_load", lambda: lib)
    got = ggml_dequant.dequantize(raw, Q8_0)
    assert np.array_equal(got, gguf_dequantize(raw, Q8_0).reshape(-1)) and ggml_dequant.in_use() == {"Q8_0": "gguf-py"}
    _, values = ggml_dequant.probe_blocks(raw, Q8_0, *GGML_QUANT_SIZES[Q8_0])
    live = values.reshape(-1, 32)  # the last fifth of the data has values: the probe's blocks are all from it
    assert len(live) > 32 and np.all(np.any(live != 0, axis=1))


def test_data_with_no_value_leaves_the_type_undecided_until_data_with_values(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _Lib(right=True)
    monkeypatch.setattr(ggml_dequant, "_load", lambda: lib)
    zeros = _zero_then(Q8_0, 200, 0)
    assert not np.any(ggml_dequant.dequantize(zeros, Q8_0)) and lib.calls == 0
    assert ggml_dequant.in_use() == {"Q8_0": "gguf-py"}  # gguf-py decoded it; no verdict yet
    assert ggml_dequant.verify(zeros, Q8_0) is None
    assert ggml_dequant.verify(_blocks(Q8_0), Q8_0) == "ggml" and ggml_dequant.in_use() == {"Q8_0": "ggml"}


def test_spread_blocks_cover_the_whole_tensor() -> None:
    _, size = GGML_QUANT_SIZES[Q8_0]
    at = ggml_dequant.spread_blocks(10_000 * size, Q8_0)
    assert len(at) == ggml_dequant.PROBE_CANDIDATES and at[0] == 0 and at[-1] == 9_999 * size
    assert all(a % size == 0 for a in at) and at == sorted(set(at))
    assert ggml_dequant.spread_blocks(3 * size, Q8_0) == [0, size, 2 * size]
