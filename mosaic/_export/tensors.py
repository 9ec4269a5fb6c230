"""What one GGUF tensor of an export is made of, the converter's dtype rule, and its bytes, streamed.

An :class:`OutTensor` names its source tensors (:class:`SourceRef`, each possibly a part of its tensor)
and a ``layout`` saying how the bytes are made from them. Every layout but two moves bytes without
changing a value:

=================  =====================================================================================
``copy``           the bytes of the sources (or of a range of their first-dimension rows), concatenated
``exl3-retile``    EXL3 trellis tiles re-ordered into 128-row strips (optionally 128-row groups of a part
                   of the output rows), see :func:`retiled_chunks`
``mla-k-b``        an F16 MLA ``kv_b_proj`` [H·(Km+Vm), Kl]: per head the first Km rows, transposed -> [H, Kl, Km]
``mla-v-b``        the same tensor: per head the last Vm rows -> [H, Vm, Kl]
``f32``            **a value change, exact**: BF16 / F16 widened to F32 (the converter's rule for norms,
                   1-D tensors, routers, convolutions; :func:`gguf_dtype`)
``neg-exp-f32``    **a value change**: ``ssm_a = -exp(A_log)``, computed in float64 and rounded once to F32,
                   so that every machine writes the same bytes
=================  =====================================================================================

Both value changes are re-derived independently by ``mosaic audit --sources`` of an export
(:mod:`mosaic._audit.gguf_folder`), never taken on trust. Memory stays bounded: every producer reads a
few MiB at a time through a memory map, whatever the size of the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mosaic._base.errors import MosaicError
from mosaic._checkpoint.exl3 import Module
from mosaic._formats.gguf_container import GGML_TYPE_OF_DTYPE, exl3_type

CHUNK = 8 << 20
F32, F16, BF16 = 0, 1, 30
LAYOUTS = ("copy", "exl3-retile", "mla-k-b", "mla-v-b", "f32", "neg-exp-f32")
_NP = {"F16": "<f2", "F32": "<f4", "BF16": "<u2"}


class GGUFExportError(MosaicError):
    """The checkpoint cannot be exported as GGUF (unsupported architecture, layout or tensor)."""


@dataclass
class SourceRef:
    """One safetensors tensor (or a part of it) an output tensor is made of."""

    tensor: str
    file: str
    start: int  # absolute position of the whole tensor in the file
    nbytes: int  # of the whole tensor
    shape: tuple[int, ...] = ()
    dtype: str = ""
    #: a part: ``{"rows": [a, b]}`` = first-dimension rows a..b (for a trellis: output features a..b,
    #: whole 128-row groups); ``{"heads": H, "k": Km, "v": Vm}`` = an MLA kv_b_proj's head layout
    part: dict[str, object] | None = None

    def record(self) -> dict[str, object]:
        out: dict[str, object] = {"file": self.file, "tensor": self.tensor}
        if self.part:
            out["part"] = self.part
        return out


@dataclass
class OutTensor:
    name: str
    ne: tuple[int, ...]
    type_id: int
    nbytes: int
    layout: str
    sources: list[SourceRef] = field(default_factory=list)


# ---- the converter's dtype rule -------------------------------------------------------------------------------


def forced_f32(name: str, n_dims: int) -> bool:
    """Upstream ``convert_hf_to_gguf.py`` ``prepare_tensors`` (the fork's converter runs it with the file type
    of each source tensor, conversion/exl3.py ``tensor_force_quant``): 1-D tensors, ``*_norm.weight``,
    anything not ending in ``.weight`` (biases, ``ssm_a``), MoE routers (``ffn_gate_inp``) and convolutions
    (``ssm_conv1d*``) are written as F32; everything else keeps its source type."""
    base = name.rsplit(".", 1)[0]
    leaf = base.rsplit(".", 1)[-1]
    return (
        n_dims <= 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or leaf in ("ffn_gate_inp", "ffn_gate_inp_shexp")
        or leaf.startswith("ssm_conv1d")
    )


def gguf_dtype(name: str, ne: tuple[int, ...], src_dtype: str, where: str) -> int:
    """The GGUF type the converter gives a plain (not EXL3) tensor."""
    if forced_f32(name, len(ne)):
        if src_dtype not in ("F32", "F16", "BF16"):
            raise GGUFExportError(f"{where}: {src_dtype} cannot be written as F32 without changing its values")
        return F32
    tid = GGML_TYPE_OF_DTYPE.get(src_dtype)
    if tid is None:
        raise GGUFExportError(f"{where}: dtype {src_dtype} has no GGUF type")
    return tid


def plain(ref: SourceRef, gguf_name: str, ne: tuple[int, ...] | None = None) -> OutTensor:
    """A non-EXL3 tensor (or a row part of one) under its GGUF name and the converter's type."""
    rows = ref.part.get("rows") if ref.part else None
    shape = list(ref.shape)
    if rows is not None:
        a, b = rows  # type: ignore[misc]
        shape[0] = b - a
    shape_ne = tuple(reversed(shape)) or (1,)
    ne = ne or shape_ne
    if len(ne) > 4:
        raise GGUFExportError(f"{ref.tensor}: {len(ne)} dimensions; GGUF allows 4")
    tid = gguf_dtype(gguf_name, ne, ref.dtype, ref.tensor)
    count = int(np.prod(shape)) if shape else 1
    size = {F32: 4, F16: 2, BF16: 2}.get(tid)
    if size is None:
        return OutTensor(gguf_name, ne, tid, ref.nbytes, "copy", [ref])
    layout = "f32" if tid == F32 and ref.dtype != "F32" else "copy"
    return OutTensor(gguf_name, ne, tid, count * size, layout, [ref])


def exl3_check(m: Module) -> tuple[int, int, int]:
    """(K, N, type id) of an EXL3 module the fork can store, else a refusal naming it."""
    t = m.tensors
    if "su" in t or "sv" in t:
        raise GGUFExportError(f"{m.key}: legacy packed signs (su/sv) cannot be carried over bit for bit; not supported")
    k, n, bits = m.in_features, m.out_features, m.bits
    if k is None or n is None or bits is None or t["trellis"].dtype != "I16":
        raise GGUFExportError(f"{m.key}.trellis: {t['trellis'].dtype} {list(t['trellis'].shape)} is not an EXL3 trellis")
    if k % 128 or n % 128:
        raise GGUFExportError(f"{m.key}: K = {k}, N = {n}; ranma.cpp needs both to be multiples of 128")
    for side, dim in (("suh", k), ("svh", n)):
        s = t.get(side)
        if s is None or s.dtype != "F16" or s.shape != (dim,):
            got = "missing" if s is None else f"{s.dtype} {list(s.shape)}"
            raise GGUFExportError(f"{m.key}.{side}: {got}, expected F16 [{dim}]")
    try:
        return k, n, exl3_type(m.codebook or "3inst", bits)
    except ValueError as e:
        raise GGUFExportError(f"{m.key}: {e}") from None


# ---- bytes ----------------------------------------------------------------------------------------------------


def _rows(ref: SourceRef) -> tuple[int, int]:
    rows = ref.part.get("rows") if ref.part else None
    return (int(rows[0]), int(rows[1])) if rows is not None else (0, ref.shape[0] if ref.shape else 1)  # type: ignore[index]


def retiled_chunks(path: Path, ref: SourceRef, chunk: int = CHUNK) -> Iterator[memoryview]:
    """The GGUF bytes of one trellis, a few 128-row groups at a time: int16 ``[K/16, N/16, w]`` ->
    ``[N/128, K/16, 8, w]`` (the fork's ``to_ggml``). With a ``rows`` part (output features a..b, whole
    128-row groups), only those groups: a split of a fused projection by output rows."""
    kt, nt, words = ref.shape
    seg = 8 * words * 2
    groups = nt // 8
    g_lo, g_hi = 0, groups
    if ref.part and "rows" in ref.part:
        a, b = ref.part["rows"]  # type: ignore[misc]
        g_lo, g_hi = a // 128, b // 128
    src = np.memmap(path, dtype=np.uint8, mode="r", offset=ref.start, shape=(kt, groups, seg))
    try:
        step = max(1, chunk // (kt * seg))
        for g0 in range(g_lo, g_hi, step):
            block = np.ascontiguousarray(src[:, g0 : min(g0 + step, g_hi), :].transpose(1, 0, 2))
            yield memoryview(block).cast("B")
    finally:
        del src


def copied_chunks(fd: int, ref: SourceRef, chunk: int = CHUNK) -> Iterator[bytes]:
    a, b = _rows(ref)
    row = ref.nbytes // (ref.shape[0] if ref.shape else 1)
    pos, end = ref.start + a * row, ref.start + b * row
    while pos < end:
        data = os.pread(fd, min(chunk, end - pos), pos)
        if not data:
            raise MosaicError(f"{ref.file}: tensor {ref.tensor!r}: file ended while reading it")
        pos += len(data)
        yield data


def _as_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.astype("<u4") << 16).view("<f4")
    return raw.astype("<f4")


def _memmap(path: Path, ref: SourceRef) -> np.ndarray:
    count = ref.nbytes // np.dtype(_NP[ref.dtype]).itemsize
    return np.memmap(path, dtype=_NP[ref.dtype], mode="r", offset=ref.start, shape=(count,))


def f32_chunks(path: Path, ref: SourceRef, chunk: int = CHUNK) -> Iterator[bytes]:
    """BF16 / F16 / F32 -> F32, exactly (every BF16 and F16 value is an F32 value)."""
    if ref.dtype not in _NP:
        raise GGUFExportError(f"{ref.tensor}: {ref.dtype} cannot be widened to F32")
    flat = _memmap(path, ref)
    a, b = _rows(ref)
    per_row = flat.shape[0] // (ref.shape[0] if ref.shape else 1)
    step = max(1, chunk // 4)
    for i in range(a * per_row, b * per_row, step):
        yield _as_f32(np.asarray(flat[i : min(i + step, b * per_row)]), ref.dtype).tobytes()
    del flat


def neg_exp_chunks(path: Path, ref: SourceRef) -> Iterator[bytes]:
    """``-exp(x)`` of a (small, 1-D) tensor: float64, rounded once to F32."""
    flat = _memmap(path, ref)
    x = _as_f32(np.asarray(flat), ref.dtype).astype("<f8")
    del flat
    with np.errstate(over="ignore"):
        yield (-np.exp(x)).astype("<f4").tobytes()


def mla_chunks(path: Path, ref: SourceRef, which: str) -> Iterator[bytes]:
    """Per head of an MLA ``kv_b_proj`` [H·(Km+Vm), Kl]: ``k`` = the first Km rows transposed (ne [Km, Kl, H]),
    ``v`` = the last Vm rows as they are (ne [Kl, Vm, H]); one head in memory at a time."""
    part = ref.part or {}
    h, km, vm = int(part["heads"]), int(part["k"]), int(part["v"])  # type: ignore[call-overload]
    kl = ref.shape[1]
    src = np.memmap(path, dtype=_NP[ref.dtype], mode="r", offset=ref.start, shape=(h, km + vm, kl))
    try:
        for i in range(h):
            block = np.asarray(src[i])
            out = block[:km].T if which == "k" else block[km:]
            yield np.ascontiguousarray(out).tobytes()
    finally:
        del src
