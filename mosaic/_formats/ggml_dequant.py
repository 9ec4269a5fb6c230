"""ggml's own dequantizers, where a compiled llama.cpp library is installed: the hot loop of the weight errors.

gguf-py's ``gguf.quants.dequantize`` is numpy written from ggml's C: exact, but on a real model 3 to 15 times
slower than the C (the IQ types most: their grids are looked up element by element). A ladder's weight errors
dequantize every tensor of every rung, so gguf-py made them a stage of minutes on a 1.5B model. llama-cpp-python,
compiled for this machine, ships ggml's base library, which exports ``dequantize_row_<type>(const void * blocks,
float * out, int64_t n)`` for every quantized type, a signature unchanged since the types were added. They are
called through ctypes, which lets go of the GIL, so :mod:`mosaic._measure.weights`' threads run them side by side.
The prebuilt cyllama links ggml in statically and exports none of them: there gguf-py does the work, as before.

Nothing is taken on trust: before a type's C function is used in a process it dequantizes the first blocks it is
given, and must give gguf-py's floats bit for bit; a type whose function is missing or disagrees stays with
gguf-py for the rest of the process. ``$MOSAIC_DEQUANTIZE=gguf-py`` keeps every type with gguf-py (the bench's
baseline); the library is found by its package's location alone (nothing of llama.cpp is imported).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

ENV = "MOSAIC_DEQUANTIZE"
#: Blocks dequantized both ways when a type's C function is first used.
PROBE_BLOCKS = 64

_Row = Callable[[int, int, int], None]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_tried = False
_rows: dict[int, _Row | None] = {}  # type id -> its trusted C function, or None: gguf-py's


def library_path() -> Path | None:
    """ggml's base library of an installed llama-cpp-python (``llama_cpp/lib/libggml-base.*``), if there is one."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    suffix = ".dylib" if sys.platform == "darwin" else ".dll" if os.name == "nt" else ".so"
    for name in (f"libggml-base{suffix}", f"ggml-base{suffix}"):
        p = Path(spec.origin).parent / "lib" / name
        if p.is_file():
            return p
    return None


def _load() -> ctypes.CDLL | None:
    global _lib, _lib_tried
    if not _lib_tried:
        _lib_tried = True
        p = library_path()
        if p is not None:
            try:
                _lib = ctypes.CDLL(str(p))
            except OSError:
                _lib = None
    return _lib


def symbol(type_name: str) -> str:
    """ggml's name of a type's dequantizer: ``Q4_K`` -> ``dequantize_row_q4_K``, ``IQ3_XXS`` -> ``dequantize_row_iq3_xxs``."""
    low = type_name.lower()
    return f"dequantize_row_{low[:-2] + '_K' if type_name.endswith('_K') else low}"


def _gguf_py(raw: np.ndarray, type_id: int) -> np.ndarray:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType(type_id)).reshape(-1)


def _call(fn: _Row, raw: np.ndarray, elements: int) -> np.ndarray:
    raw = np.ascontiguousarray(raw)
    out = np.empty(elements, dtype=np.float32)
    fn(raw.ctypes.data, out.ctypes.data, elements)
    return out


def _trusted(type_id: int, raw: np.ndarray, per: int, size: int) -> _Row | None:
    """The type's C function once it has matched gguf-py on ``raw``'s first blocks; ``None`` where it has not."""
    with _lock:
        if type_id in _rows:
            return _rows[type_id]
        from gguf.constants import GGMLQuantizationType

        fn = None
        lib = _load() if os.environ.get(ENV, "") != "gguf-py" else None
        if lib is not None:
            try:
                fn = getattr(lib, symbol(GGMLQuantizationType(type_id).name))
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                fn.restype = None
            except (AttributeError, ValueError):
                fn = None
        if fn is not None:
            probe = raw[: min(raw.size // size, PROBE_BLOCKS) * size]
            if not np.array_equal(_call(fn, probe, probe.size // size * per), _gguf_py(probe, type_id)):
                fn = None
        _rows[type_id] = fn
        return fn


def dequantize(raw: np.ndarray, type_id: int) -> np.ndarray:
    """Whole blocks of a ggml type (``raw``, bytes) as float32 values: ggml's C where it is installed and has
    matched gguf-py, else gguf-py. Raises what gguf-py raises for a type it does not know."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        per, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (KeyError, ValueError):
        return _gguf_py(raw, type_id)
    if per == 1 or raw.size < size or raw.size % size:  # F32, F16, BF16, the integers (a conversion); part of a block
        return _gguf_py(raw, type_id)
    fn = _trusted(type_id, raw, per, size)
    if fn is None:
        return _gguf_py(raw, type_id)
    return _call(fn, raw, raw.size // size * per)


def in_use() -> dict[str, str]:
    """Each type dequantized so far in this process, and by what (``ggml`` or ``gguf-py``)."""
    from gguf.constants import GGMLQuantizationType

    with _lock:
        return {GGMLQuantizationType(t).name: "ggml" if fn is not None else "gguf-py" for t, fn in sorted(_rows.items())}


def reset() -> None:
    """Forget every type's verdict and the library (tests; a changed ``$MOSAIC_DEQUANTIZE``)."""
    global _lib, _lib_tried
    with _lock:
        _rows.clear()
        _lib, _lib_tried = None, False
