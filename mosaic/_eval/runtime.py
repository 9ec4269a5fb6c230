"""The llama.cpp runtimes behind ``mosaic eval`` and ``mosaic measure``: one small interface, two bindings.

- **cyllama** (the ``runtime`` extra): a prebuilt manylinux2014 wheel bundling llama.cpp, so
  ``pip install 'mosaic[runtime]'`` needs no compiler. Chosen by measurement: it is the wheel on PyPI that
  loads on glibc 2.17+ and gives what eval, measure and the tests need (tokenize, a batch decode with every
  position's logits, model metadata, a split set loaded by its first part, ``llama_model_quantize``).
  ``llama-cpp-py-sync`` needs glibc 2.38 although tagged manylinux2014; ``xllamacpp`` exposes a server, not
  per-position logits, and no quantizer.
- **llama-cpp-python**, where a user already has it (it compiles llama.cpp on install), through its
  low-level C API: its high-level ``Llama`` keeps ``n_ctx × vocabulary`` scores, which the memory bound
  below forbids.

A model decodes a window a batch at a time and hands back that batch's logits, so memory is the model, its
KV cache and ``batch × vocabulary`` floats, whatever the window or the text. The runtime's log lines go to
a sink that drops them unless ``verbose``; a load or decode the runtime refuses is a :class:`RuntimeFailure`
(one line), never a traceback. ``MOSAIC_RUNTIME`` (``cyllama`` or ``llama-cpp-python``) picks one binding;
by default the first installed, in that order.

These bindings load llama.cpp into the process that calls them: mosaic's commands call them only inside
their llama.cpp worker (:mod:`.worker`), a process of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mosaic._base.errors import MosaicError

NAMES = ("cyllama", "llama-cpp-python")


class RuntimeFailure(MosaicError):
    """The runtime refused a model, a context or a batch (its reason in one line)."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What ran: recorded in eval's JSON, a saved reference and a measurement."""

    name: str
    version: str
    llama_cpp: str
    threads: int

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "version": self.version, "llama_cpp": self.llama_cpp, "threads": self.threads}

    def describe(self) -> str:
        return f"{self.name} {self.version} (llama.cpp {self.llama_cpp}, {self.threads} threads)"


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
    def __init__(self, cy: Any, path: Path, ctx: int, batch: int, threads: int) -> None:
        class _Model(cy.LlamaModel):  # type: ignore[misc, name-defined]
            # cyllama 0.2.18's get_logits_ith reads ``model.n_vocab``, which its LlamaModel lacks
            @property
            def n_vocab(self) -> int:
                return int(self.get_vocab().n_vocab)

        mp = cy.LlamaModelParams()
        mp.n_gpu_layers = 0
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
    def __init__(self, threads: int, verbose: bool) -> None:
        import cyllama.llama.llama_cpp as cy

        self._cy = cy
        if verbose:
            cy.set_log_callback(lambda level, text: sys.stderr.write(text))
        else:
            cy.disable_logging()
        cy.llama_backend_init()
        self.info = RuntimeInfo("cyllama", _version("cyllama"), _cyllama_llama_cpp(), threads)

    def load(self, path: Path, *, ctx: int, batch: int) -> LoadedModel:
        return _CyllamaModel(self._cy, path, ctx, batch, self.info.threads)

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


class _LlamaCppPythonModel:
    def __init__(self, lc: Any, path: Path, ctx: int, batch: int, threads: int) -> None:
        self._lc = lc
        self._path = path
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self._model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise RuntimeFailure(f"{path}: llama.cpp could not load the model")
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
        for i in range(n):
            ptr = self._lc.llama_get_logits_ith(self._ctx, i)
            out[i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
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
    def __init__(self, threads: int, verbose: bool) -> None:
        import llama_cpp as lc

        self._lc = lc

        @lc.llama_log_callback  # type: ignore[misc]
        def _sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            if verbose and text:
                sys.stderr.write(text.decode("utf-8", "replace"))

        self._sink = _sink  # the C side keeps only the pointer: keep the callback alive
        lc.llama_log_set(self._sink, ctypes.c_void_p(0))
        lc.llama_backend_init()
        self.info = RuntimeInfo("llama-cpp-python", _version("llama_cpp_python"), _llama_cpp_python_commit(lc), threads)

    def load(self, path: Path, *, ctx: int, batch: int) -> LoadedModel:
        return _LlamaCppPythonModel(self._lc, path, ctx, batch, self.info.threads)

    def quantize(self, src: Path, dst: Path, ftype: int) -> None:
        lc = self._lc
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, self.info.threads
        rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
        if rc != 0:
            raise RuntimeFailure(f"{src}: llama.cpp could not quantize it to ftype {ftype} (code {rc})")


def _llama_cpp_python_commit(lc: Any) -> str:
    fn = getattr(lc, "llama_version", None)  # llama.h's build string, where the binding has it
    if fn is not None:
        with contextlib.suppress(Exception):
            v = fn()
            return v.decode() if isinstance(v, bytes) else str(v)
    return "unknown"


# ----------------------------------------------------------------------------------------- choosing

_FACTORIES: dict[str, tuple[str, Callable[[int, bool], Runtime]]] = {
    "cyllama": ("cyllama", CyllamaRuntime),
    "llama-cpp-python": ("llama_cpp", LlamaCppPythonRuntime),
}
_OPEN: dict[tuple[str, int, bool], Runtime] = {}


def available() -> list[str]:
    """The bindings installed here, in the order they are preferred."""
    import importlib.util

    return [name for name, (module, _) in _FACTORIES.items() if importlib.util.find_spec(module) is not None]


def resolve_name(name: str | None = None) -> str:
    """The binding to use: ``name``, else ``$MOSAIC_RUNTIME``, else the first installed (one line if none is)."""
    name = name or os.environ.get("MOSAIC_RUNTIME") or None
    if name is not None and name not in _FACTORIES:
        raise MosaicError(f"runtime {name!r}: unknown (one of {', '.join(NAMES)})")
    if name is None:
        found = available()
        if not found:
            raise MosaicError("running GGUF models needs a llama.cpp runtime: pip install 'mosaic[runtime]' "
                              "(cyllama, a prebuilt wheel; llama-cpp-python works too where it is installed)")
        name = found[0]
    return name


def in_process_runtime(name: str | None = None, threads: int | None = None, verbose: bool = False) -> Runtime:
    """The binding loaded into this process, once per process: what the llama.cpp worker runs
    (:mod:`mosaic._eval.worker_main`). mosaic's commands use :func:`mosaic._eval.worker.get_runtime`, which
    keeps llama.cpp out of their own process."""
    name = resolve_name(name)
    threads = threads or default_threads()
    key = (name, threads, verbose)
    if key not in _OPEN:
        module, factory = _FACTORIES[name]
        try:
            _OPEN[key] = factory(threads, verbose)
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
