"""The llama.cpp runtimes behind ``mosaic eval`` and ``mosaic measure``: one small interface, two bindings.

- **cyllama** (the ``runtime`` extra): a prebuilt manylinux2014 wheel bundling llama.cpp, so
  ``pip install 'mosaic[runtime]'`` needs no compiler. Chosen by measurement: it is the wheel on PyPI that
  loads on glibc 2.17+ and gives what eval, measure and the tests need (tokenize, a batch decode with every
  position's logits, model metadata, a split set loaded by its first part, ``llama_model_quantize``).
  ``llama-cpp-py-sync`` needs glibc 2.38 although tagged manylinux2014; ``xllamacpp`` exposes a server, not
  per-position logits, and no quantizer.
- **llama-cpp-python**, where a user has it (it compiles llama.cpp on install: for this CPU, or with
  ``CMAKE_ARGS="-DGGML_CUDA=on"``, Metal or ROCm, for the GPU), through its low-level C API: its high-level
  ``Llama`` keeps ``n_ctx × vocabulary`` scores, which the memory bound below forbids. Preferred where
  installed (a version with ``llama_memory_clear``): native speed, the GPU, and each batch's logits handed
  over as one buffer rather than a Python list per position.

A model decodes a window a batch at a time and hands back that batch's logits, so memory is the model, its
KV cache and ``batch × vocabulary`` floats, whatever the window or the text. The runtime's log lines go to
a sink that drops them unless ``verbose`` (each load's "offloaded N/M layers to GPU" is read from them
first); a load or decode the runtime refuses is a :class:`RuntimeFailure` (one line), never a traceback.
``MOSAIC_RUNTIME`` (``cyllama`` or ``llama-cpp-python``) picks one binding; by default llama-cpp-python where
it is installed, else cyllama.

``gpu_layers`` is what llama.cpp offloads (``"all"`` or a count; above the model's layers + 1 it is all):
by default all where the binding can offload (a GPU or integrated GPU device exists), else 0. Where it
cannot, a count or ``"all"`` runs on the CPU with one note, never an error. The runtime's record names the
device the layers run on (its ggml name and description, never its memory or bus id) and how many layers
the last model loaded put there.

These bindings load llama.cpp into the process that calls them: mosaic's commands call them only inside
their llama.cpp worker (:mod:`.worker`), a process of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mosaic._base.errors import MosaicError

NAMES = ("cyllama", "llama-cpp-python")
#: ``n_gpu_layers`` for "all": above any model's layers + 1, which llama.cpp caps it at.
ALL_LAYERS = 1 << 30
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
#: ggml's device types (``enum ggml_backend_dev_type``): the ones layers are offloaded to.
_GPU_TYPES = {1: "GPU", 2: "iGPU"}


class RuntimeFailure(MosaicError):
    """The runtime refused a model, a context or a batch (its reason in one line)."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What ran: recorded in eval's JSON, a saved reference and a measurement. ``gpu_layers`` as asked (or
    its default), ``device`` where the offloaded layers run (the CPU when none are), ``offloaded`` the layers
    the last model loaded put there (``None`` before any), ``note`` why a GPU was asked for and not used."""

    name: str
    version: str
    llama_cpp: str
    threads: int
    gpu_layers: int | str = 0
    device: str = "CPU"
    offloaded: int | None = None
    note: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "version": self.version, "llama_cpp": self.llama_cpp, "threads": self.threads,
                "gpu_layers": self.gpu_layers, "offloaded": self.offloaded, "device": self.device}

    def describe(self) -> str:
        where = f", {self.offloaded} layers on {self.device}" if self.offloaded else f", on {self.device}"
        return f"{self.name} {self.version} (llama.cpp {self.llama_cpp}, {self.threads} threads{where})"


def parse_gpu_layers(value: object) -> int | str | None:
    """``--gpu-layers``: ``"all"`` or an integer ≥ 0 (``None``: the default)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "all":
        return "all"
    try:
        n = int(str(value).strip()) if not isinstance(value, bool) else -1
    except ValueError:
        n = -1
    if n < 0:
        raise MosaicError(f"--gpu-layers {value!r}: a number of layers (0 or more) or 'all'")
    return n


class _Offload:
    """What a binding can offload and where: the GPU layers it is asked for, resolved against its devices
    (``devices``: ggml's ``(name, description, type)`` of each), the count it gives llama.cpp, and the
    "offloaded N/M layers" of each load read from llama.cpp's log lines."""

    def __init__(self, binding: str, asked: int | str | None, supports: bool, devices: list[tuple[str, str, int]]) -> None:
        gpus = [d for d in devices if d[2] in _GPU_TYPES]
        self.supported = supports and bool(gpus)
        self.asked: int | str = asked if asked is not None else ("all" if self.supported else 0)
        self.note: str | None = None
        want = ALL_LAYERS if self.asked == "all" else int(self.asked)
        if want and not self.supported:
            self.note = (f"--gpu-layers {self.asked}: {binding} finds no GPU to offload to here (a build for the CPU, or no "
                         "device); every layer ran on the CPU")
            want = 0
        self.n_gpu_layers = want
        cpu = next((d for d in devices if d[2] == 0), ("CPU", "", 0))
        d = gpus[0] if want and gpus else cpu
        self.device = f"{d[0]} ({d[1]})" if d[1] and d[1] != d[0] else d[0]
        self._seen: list[str] = []

    def log(self, text: str) -> None:
        if "offloaded" in text:
            self._seen.append(text)

    def loaded(self) -> int | None:
        """The layers the load just finished put on the device, as llama.cpp's log says; 0 when none were asked
        for or none could be, ``None`` when some were and llama.cpp did not say."""
        got = None
        for line in self._seen:
            m = _OFFLOADED.search(line)
            if m:
                got = int(m.group(1))
        self._seen.clear()
        return got if self.n_gpu_layers else 0


class LoadedModel(Protocol):
    n_vocab: int

    def tokenize(self, text: str) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def meta(self, key: str) -> str | None: ...

    def decode(self, tokens: Sequence[int], pos: int) -> np.ndarray: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


class Runtime(Protocol):
    info: RuntimeInfo

    def load(self, path: Path, *, ctx: int, batch: int) -> LoadedModel: ...

    def quantize(self, src: Path, dst: Path, ftype: int) -> None: ...


#: Where a CPU quota is read: cgroup v2's ``cpu.max``, then v1's CFS quota and period.
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cpu_quota() -> int | None:
    """The CPUs a cgroup's quota allows this process (rounded up), or None without a quota. A container
    limited to 2 CPUs on a 64-core host sees 64 in its affinity; 64 decoding threads there would thrash."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = (int(p.read_text().strip()) for p in CGROUP_V1)
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None


def default_threads() -> int:
    """Every core this process may run on — its CPU affinity, within its cgroup's CPU quota (what
    llama-perplexity's ``-t`` defaults to, near enough)."""
    try:
        n = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cpu_quota()
    return min(n, quota) if quota is not None else n


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# --------------------------------------------------------------------------------------------- cyllama


class _CyllamaModel:
    def __init__(self, cy: Any, path: Path, ctx: int, batch: int, threads: int, offload: _Offload) -> None:
        class _Model(cy.LlamaModel):  # type: ignore[misc, name-defined]
            # cyllama 0.2.18's get_logits_ith reads ``model.n_vocab``, which its LlamaModel lacks
            @property
            def n_vocab(self) -> int:
                return int(self.get_vocab().n_vocab)

        mp = cy.LlamaModelParams()
        mp.n_gpu_layers = offload.n_gpu_layers
        try:
            self._model = _Model(str(path), mp)
        except (ValueError, RuntimeError, OSError) as e:
            raise RuntimeFailure(f"{path}: llama.cpp could not load the model: {_one_line(e).split('. The file')[0]}") from None
        self._vocab = self._model.get_vocab()
        self.n_vocab = int(self._vocab.n_vocab)
        cp = cy.LlamaContextParams()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = ctx, batch, batch, 1
        cp.n_threads = cp.n_threads_batch = threads
        try:
            self._ctx = cy.LlamaContext(self._model, cp)
        except (ValueError, RuntimeError, MemoryError) as e:
            self._model.close()
            raise RuntimeFailure(f"{path}: llama.cpp could not create a context of {ctx} tokens: {_one_line(e)}") from None
        self._batch = cy.LlamaBatch(n_tokens=batch, embd=0, n_seq_max=1)
        self._cap = batch
        self._out = np.empty((batch, self.n_vocab), dtype=np.float32)
        self._path = path
        self.offloaded = offload.loaded()

    def tokenize(self, text: str) -> list[int]:
        return list(self._vocab.tokenize(text, True, False))

    def piece(self, token: int) -> bytes:
        out = self._vocab.detokenize([token], 256, False, True)
        return out.encode("utf-8", "surrogateescape") if isinstance(out, str) else bytes(out)

    def meta(self, key: str) -> str | None:
        try:
            return str(self._model.meta_val_str(key))
        except (ValueError, KeyError):
            return None

    def decode(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        n = len(tokens)
        if not 0 < n <= self._cap:
            raise ValueError(f"a batch of {n} tokens (1..{self._cap})")
        self._batch.set_batch(list(tokens), n_past=pos, logits_all=True)
        try:
            self._ctx.decode(self._batch)
        except (ValueError, RuntimeError, InterruptedError) as e:
            raise RuntimeFailure(f"{self._path}: llama.cpp refused a batch of {n} tokens at position {pos}: {_one_line(e)}") from None
        out = self._out[:n]
        v = self.n_vocab
        for i in range(n):  # cyllama hands back a list per position: the fastest way into numpy, measured
            out[i] = np.fromiter(self._ctx.get_logits_ith(i), dtype=np.float32, count=v)
        return out

    def clear(self) -> None:
        self._ctx.kv_cache_clear()

    def close(self) -> None:
        for name in ("_batch", "_ctx", "_model"):
            obj = getattr(self, name, None)
            if obj is not None and hasattr(obj, "close"):
                obj.close()
            setattr(self, name, None)


class CyllamaRuntime:
    def __init__(self, threads: int, verbose: bool, gpu_layers: int | str | None = None) -> None:
        import cyllama.llama.llama_cpp as cy

        self._cy = cy
        cy.llama_backend_init()
        types = {"CPU": 0, "GPU": 1, "iGPU": 2}
        devices = [(str(d.get("name", "")), str(d.get("description", "")), types.get(str(d.get("type")), 3))
                   for d in cy.ggml_backend_dev_info()]
        self._offload = _Offload("cyllama", gpu_layers, bool(cy.llama_supports_gpu_offload()), devices)

        def sink(level: int, text: str) -> None:
            self._offload.log(text)
            if verbose:
                sys.stderr.write(text)

        self._sink = sink
        cy.set_log_callback(sink)
        o = self._offload
        self.info = RuntimeInfo("cyllama", _version("cyllama"), _cyllama_llama_cpp(), threads, o.asked, o.device, None, o.note)

    def load(self, path: Path, *, ctx: int, batch: int) -> LoadedModel:
        return _CyllamaModel(self._cy, path, ctx, batch, self.info.threads, self._offload)

    def quantize(self, src: Path, dst: Path, ftype: int) -> None:
        params = self._cy.LlamaModelQuantizeParams()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, self.info.threads
        try:
            self._cy.model_quantize(str(src), str(dst), params)
        except (RuntimeError, ValueError) as e:
            raise RuntimeFailure(f"{src}: llama.cpp could not quantize it to ftype {ftype}: {_one_line(e)}") from None


def _cyllama_llama_cpp() -> str:
    try:
        import json

        import cyllama

        cfg = json.loads((Path(cyllama.__file__).parent / "build_config.json").read_text())
        return str(cfg["versions"]["llama_cpp_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


# ------------------------------------------------------------------------------------ llama-cpp-python


#: Why a llama.cpp built with AMX loads every model without its weight repack (llama-perplexity's ``--no-repack``).
AMX_NOTE = ("weight repack off: this llama.cpp was built with AMX, whose kernels (ggml_backend_amx_mul_mat) were seen "
            "to crash on Q4_K models")


def repack_safe(system_info: bytes) -> bool:
    """Whether llama.cpp may repack weights into its CPU's extra buffer types: not where it was built with AMX
    (a native build on a CPU that has it), whose matrix kernels were seen to crash on Q4_K models. The generic
    builds (the prebuilt wheel, ``make``'s) have no AMX code; a user's native llama-cpp-python may."""
    return b"AMX_INT8 = 1" not in system_info


class _LlamaCppPythonModel:
    def __init__(self, lc: Any, path: Path, ctx: int, batch: int, threads: int, offload: _Offload, repack: bool = True) -> None:
        self._lc = lc
        self._path = path
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = offload.n_gpu_layers
        if not repack:
            mp.use_extra_bufts = False
        self._model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise RuntimeFailure(f"{path}: llama.cpp could not load the model")
        self.offloaded = offload.loaded()
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = ctx, batch, batch, 1
        cp.n_threads = cp.n_threads_batch = threads
        self._ctx = lc.llama_init_from_model(self._model, cp)
        if not self._ctx:
            lc.llama_model_free(self._model)
            self._model = None
            raise RuntimeFailure(f"{path}: llama.cpp could not create a context of {ctx} tokens")
        self._batch = lc.llama_batch_init(batch, 0, 1)
        self._cap = batch
        self._out = np.empty((batch, self.n_vocab), dtype=np.float32)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        while True:
            buf = (self._lc.llama_token * cap)()
            n = self._lc.llama_tokenize(self._vocab, raw, len(raw), buf, cap, True, False)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def piece(self, token: int) -> bytes:
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            toks = (self._lc.llama_token * 1)(token)
            n = self._lc.llama_detokenize(self._vocab, toks, 1, buf, size, False, True)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def meta(self, key: str) -> str | None:
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lc.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", "replace")
            size = n + 1

    def decode(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        n = len(tokens)
        if not 0 < n <= self._cap:
            raise ValueError(f"a batch of {n} tokens (1..{self._cap})")
        b = self._batch
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        rc = self._lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeFailure(f"{self._path}: llama.cpp refused a batch of {n} tokens at position {pos} (llama_decode {rc})")
        out = self._out[:n]
        # every position asked for its logits: llama.cpp keeps them as one block, in the batch's order
        np.copyto(out, np.ctypeslib.as_array(self._lc.llama_get_logits(self._ctx), shape=(n, self.n_vocab)))
        return out

    def clear(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self._ctx), True)

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            self._lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._lc.llama_model_free(self._model)
            self._model = None


class LlamaCppPythonRuntime:
    def __init__(self, threads: int, verbose: bool, gpu_layers: int | str | None = None) -> None:
        import llama_cpp as lc

        self._lc = lc
        self._offload: _Offload | None = None

        @lc.llama_log_callback  # type: ignore[misc]
        def _sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            if not text:
                return
            line = text.decode("utf-8", "replace")
            if self._offload is not None:
                self._offload.log(line)
            if verbose:
                sys.stderr.write(line)

        self._sink = _sink  # the C side keeps only the pointer: keep the callback alive
        lc.llama_log_set(self._sink, ctypes.c_void_p(0))
        lc.llama_backend_init()
        self._offload = _Offload("llama-cpp-python", gpu_layers, bool(lc.llama_supports_gpu_offload()), _ggml_devices())
        self._repack = repack_safe(lc.llama_print_system_info())
        o = self._offload
        note = "; ".join(n for n in (o.note, None if self._repack else AMX_NOTE) if n) or None
        self.info = RuntimeInfo("llama-cpp-python", _version("llama_cpp_python"), _llama_cpp_python_commit(lc), threads,
                                o.asked, o.device, None, note)

    def load(self, path: Path, *, ctx: int, batch: int) -> LoadedModel:
        assert self._offload is not None
        return _LlamaCppPythonModel(self._lc, path, ctx, batch, self.info.threads, self._offload, self._repack)

    def quantize(self, src: Path, dst: Path, ftype: int) -> None:
        lc = self._lc
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, self.info.threads
        rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
        if rc != 0:
            raise RuntimeFailure(f"{src}: llama.cpp could not quantize it to ftype {ftype} (code {rc})")


def _ggml_devices() -> list[tuple[str, str, int]]:
    """ggml's devices as llama-cpp-python's own libggml lists them: ``(name, description, type)``."""
    try:
        from llama_cpp._ggml import libggml as g
    except (ImportError, OSError, AttributeError):
        return []
    try:
        g.ggml_backend_dev_count.restype = ctypes.c_size_t
        g.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        g.ggml_backend_dev_get.restype = ctypes.c_void_p
        for fn in (g.ggml_backend_dev_name, g.ggml_backend_dev_description):
            fn.argtypes = [ctypes.c_void_p]
            fn.restype = ctypes.c_char_p
        g.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        g.ggml_backend_dev_type.restype = ctypes.c_int
        out = []
        for i in range(int(g.ggml_backend_dev_count())):
            d = g.ggml_backend_dev_get(i)
            out.append(((g.ggml_backend_dev_name(d) or b"").decode("utf-8", "replace"),
                        (g.ggml_backend_dev_description(d) or b"").decode("utf-8", "replace"), int(g.ggml_backend_dev_type(d))))
        return out
    except (AttributeError, OSError):
        return []


def _llama_cpp_python_commit(lc: Any) -> str:
    fn = getattr(lc, "llama_version", None)  # llama.h's build string, where the binding has it
    if fn is not None:
        with contextlib.suppress(Exception):
            v = fn()
            return v.decode() if isinstance(v, bytes) else str(v)
    return "unknown"


# ----------------------------------------------------------------------------------------- choosing

_FACTORIES: dict[str, tuple[str, Callable[[int, bool, int | str | None], Runtime]]] = {
    "llama-cpp-python": ("llama_cpp", LlamaCppPythonRuntime),
    "cyllama": ("cyllama", CyllamaRuntime),
}
_OPEN: dict[tuple[str, int, bool, int | str | None], Runtime] = {}


def _has_memory_clear(origin: str | None) -> bool:
    """Does the llama-cpp-python at ``origin`` (its package's ``__init__.py``) have ``llama_memory_clear``
    (0.3.10 and later)? Read from its source, so that choosing a binding loads no llama.cpp here."""
    if origin is None:
        return False
    try:
        return "def llama_memory_clear" in (Path(origin).parent / "llama_cpp.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def available() -> list[str]:
    """The bindings installed here, in the order they are preferred: llama-cpp-python (compiled for this
    machine, GPU-capable, logits as a buffer) where it is a version with ``llama_memory_clear``, then cyllama."""
    import importlib.util

    out = []
    for name, (module, _) in _FACTORIES.items():
        spec = importlib.util.find_spec(module)
        if spec is None or (name == "llama-cpp-python" and not _has_memory_clear(spec.origin)):
            continue
        out.append(name)
    return out


def resolve_name(name: str | None = None) -> str:
    """The binding to use: ``name``, else ``$MOSAIC_RUNTIME``, else the first installed (one line if none is)."""
    name = name or os.environ.get("MOSAIC_RUNTIME") or None
    if name is not None and name not in _FACTORIES:
        raise MosaicError(f"runtime {name!r}: unknown (one of {', '.join(NAMES)})")
    if name is None:
        found = available()
        if not found:
            raise MosaicError("running GGUF models needs a llama.cpp runtime: pip install 'mosaic[runtime]' "
                              "(cyllama, a prebuilt wheel), or llama-cpp-python 0.3.10 or later compiled for this machine")
        name = found[0]
    return name


def in_process_runtime(name: str | None = None, threads: int | None = None, verbose: bool = False,
                       gpu_layers: int | str | None = None) -> Runtime:
    """The binding loaded into this process, once per process and settings: what the llama.cpp worker runs
    (:mod:`mosaic._eval.worker_main`). mosaic's commands use :func:`mosaic._eval.worker.get_runtime`, which
    keeps llama.cpp out of their own process."""
    name = resolve_name(name)
    threads = threads or default_threads()
    key = (name, threads, verbose, gpu_layers)
    if key not in _OPEN:
        module, factory = _FACTORIES[name]
        if name == "llama-cpp-python":
            import importlib.util

            spec = importlib.util.find_spec(module)
            if spec is not None and not _has_memory_clear(spec.origin):
                raise MosaicError(f"runtime llama-cpp-python {_version('llama_cpp_python')}: too old (no llama_memory_clear); "
                                  "install 0.3.10 or later, or use cyllama (MOSAIC_RUNTIME=cyllama)")
        try:
            _OPEN[key] = factory(threads, verbose, gpu_layers)
        except ImportError as e:
            raise MosaicError(f"runtime {name}: cannot import {module} ({_one_line(e)}); pip install 'mosaic[runtime]'") from None
    return _OPEN[key]


@contextlib.contextmanager
def loaded(rt: Runtime, path: Path, *, ctx: int, batch: int) -> Iterator[LoadedModel]:
    m = rt.load(path, ctx=ctx, batch=batch)
    try:
        yield m
    finally:
        m.close()
