"""ggml's own dequantizers, where a compiled llama.cpp library is installed: the hot loop of the weight errors.

gguf-py's ``gguf.quants.dequantize`` is numpy written from ggml's C: exact, but on a real model 3 to 15 times
slower than the C (the IQ types most: their grids are looked up element by element). A ladder's weight errors
dequantize every tensor of every rung, so gguf-py made them a stage of minutes on a 1.5B model. llama-cpp-python,
compiled for this machine (``make llama-tools``), ships ggml's base library, which exports
``dequantize_row_<type>(const void * blocks, float * out, int64_t n)`` for every quantized type, a signature
unchanged since the types were added. They are called through ctypes, which lets go of the GIL, so
:mod:`mosaic._measure.weights`' threads run them side by side. The prebuilt cyllama links ggml in statically and
exports none of them: there gguf-py does the work.

Nothing is taken on trust: before a type's C function is used in a process it dequantizes blocks spread over the
first data it is given (those whose values are not all zero: a block of zero scale decodes to zeros whatever the
function does), and must give gguf-py's floats bit for bit; a type whose function is missing or disagrees stays
with gguf-py for the rest of the process. ``$MOSAIC_DEQUANTIZE`` chooses: ``auto`` (the default: the C where it is
checked, else gguf-py), ``gguf-py`` (every type with gguf-py: the bench's baseline) or ``ggml`` (the C or an
error, for a run that must be the fast one); any other value is an error. The library is found by its package's
location alone (nothing of llama.cpp is imported). What decoded each type is kept (:func:`record`), so that a
measurement says which ran.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from mosaic._base.errors import MosaicError

ENV = "MOSAIC_DEQUANTIZE"
MODES = ("auto", "ggml", "gguf-py")
#: Blocks dequantized both ways when a type's C function is first used: of non-zero values, spread over the data.
PROBE_BLOCKS = 64
#: Blocks looked at, spread evenly over the data, to find those.
PROBE_CANDIDATES = 4 * PROBE_BLOCKS

_Row = Callable[[int, int, int], None]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_tried = False
_rows: dict[int, _Row | None] = {}  # type id -> its trusted C function, or None: gguf-py's
_undecided: set[int] = set()  # types gguf-py decoded while no block of theirs had a value to probe with


def mode() -> str:
    """``$MOSAIC_DEQUANTIZE``, checked (``auto`` where unset)."""
    value = os.environ.get(ENV, "").strip() or "auto"
    if value not in MODES:
        raise MosaicError(f"{ENV}={value}: one of auto (ggml's C where a compiled llama-cpp-python ships it, checked "
                          "against gguf-py; else gguf-py), ggml (ggml's C or an error), gguf-py")
    return value


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


def probe_blocks(raw: np.ndarray, type_id: int, per: int, size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Up to :data:`PROBE_BLOCKS` blocks of ``raw``, spread over all of it, whose gguf-py values are not all zero,
    as (their bytes, gguf-py's floats); ``None`` where no block looked at has a value."""
    n = raw.size // size
    at = np.unique(np.linspace(0, n - 1, min(n, PROBE_CANDIDATES)).round().astype(np.int64))
    blocks = raw[: n * size].reshape(n, size)[at]
    values = _gguf_py(blocks.reshape(-1), type_id).reshape(len(at), per)
    live = np.flatnonzero(np.any(values != 0, axis=1))
    if live.size == 0:
        return None
    pick = live[np.unique(np.linspace(0, live.size - 1, min(live.size, PROBE_BLOCKS)).round().astype(np.int64))]
    return np.ascontiguousarray(blocks[pick]).reshape(-1), values[pick].reshape(-1)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def _function(lib: ctypes.CDLL, name: str) -> _Row | None:
    try:
        fn = getattr(lib, symbol(name))
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
    except (AttributeError, ValueError):
        return None
    return fn  # type: ignore[no-any-return]


def _trusted(type_id: int, raw: np.ndarray, per: int, size: int) -> _Row | None:
    """The type's C function once it has matched gguf-py on blocks of ``raw`` (or of earlier data); ``None`` where
    it has not, or where ``raw`` has no block with a value to compare (the next data decides)."""
    with _lock:
        if type_id in _rows:
            return _rows[type_id]
        from gguf.constants import GGMLQuantizationType

        how, name = mode(), GGMLQuantizationType(type_id).name
        if how == "gguf-py":
            _rows[type_id] = None
            return None
        lib = _load()
        fn = _function(lib, name) if lib is not None else None
        if fn is None and how == "ggml":
            raise MosaicError(f"{ENV}=ggml: " + (f"{library_path()} has no {symbol(name)}" if lib is not None else
                                                 "no compiled llama-cpp-python with ggml's base library here "
                                                 "(make llama-tools compiles one)"))
        if fn is not None:
            probe = probe_blocks(raw, type_id, per, size)
            if probe is None:
                _undecided.add(type_id)
                return None
            if not _same_bits(_call(fn, probe[0], probe[1].size), probe[1]):
                if how == "ggml":
                    raise MosaicError(f"{ENV}=ggml: {symbol(name)} of {library_path()} does not give gguf-py's values "
                                      f"for {name}; leave {ENV} unset to decode it with gguf-py")
                fn = None
        _rows[type_id] = fn
        _undecided.discard(type_id)
        return fn


def verify(raw: np.ndarray, type_id: int) -> str | None:
    """Decide a type's decoder from ``raw``: whole blocks gathered from across a tensor (:func:`spread_blocks`), so
    that the probe sees the tensor's range, not only its first rows. Returns ``"ggml"`` or ``"gguf-py"``, or ``None``
    where ``raw`` held no block with a value (the type stays undecided)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        per, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (KeyError, ValueError):
        return None
    if per == 1 or raw.size < size or raw.size % size:
        return None
    fn = _trusted(type_id, raw, per, size)
    with _lock:
        if type_id not in _rows:
            return None
    return "ggml" if fn is not None else "gguf-py"


def spread_blocks(nbytes: int, type_id: int, count: int = PROBE_CANDIDATES) -> list[int]:
    """Byte offsets of ``count`` whole blocks spread evenly over a tensor of ``nbytes`` bytes of ``type_id``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    n = nbytes // size
    return [int(i) * size for i in np.unique(np.linspace(0, max(0, n - 1), min(n, count)).round().astype(np.int64))]


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
    """Each quantized type dequantized so far in this process, and by what (``ggml`` or ``gguf-py``)."""
    from gguf.constants import GGMLQuantizationType

    with _lock:
        out = {t: "ggml" if fn is not None else "gguf-py" for t, fn in _rows.items()}
        out |= {t: "gguf-py" for t in _undecided if t not in out}
        return {GGMLQuantizationType(t).name: out[t] for t in sorted(out)}


def record(types: Iterable[str] | None = None) -> dict:
    """What decoded the quantized types in this process (of ``types`` alone, where given: a document's own), for a
    document: the mode, ggml's library where one was loaded, and each type's decoder (none: nothing was decoded,
    every sum came from mosaic's cache)."""
    how = mode()
    with _lock:
        lib = library_path() if _lib is not None else None
    used = in_use()
    if types is not None:
        mine = set(types)
        used = {t: h for t, h in used.items() if t in mine}
    return {"mode": how, "library": None if lib is None or not used else str(lib), "types": used}


def reset() -> None:
    """Forget every type's verdict and the library (tests; a changed ``$MOSAIC_DEQUANTIZE``)."""
    global _lib, _lib_tried
    with _lock:
        _rows.clear()
        _undecided.clear()
        _lib, _lib_tried = None, False
