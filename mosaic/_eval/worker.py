"""llama.cpp in a process of its own: what mosaic's commands see of a runtime.

A GGUF file can pass mosaic's strict reader and still trip a ``GGML_ASSERT`` in llama.cpp, and a model too
large for the machine is killed for memory; in mosaic's own process either would take the command down with
a crash. So llama.cpp runs in a worker (:mod:`.worker_main`), started with ``subprocess`` — spawned, never
forked, and never through :mod:`multiprocessing`, which re-imports a script's ``__main__`` and so would need a
guard in every script that calls the API. The worker holds every model of a command and runs the panel's loop
itself (:mod:`.scoring`): the logits never cross the pipe, only the per-position scores do. It is one
process, so decoding never uses more threads than the command's ``--threads``.

When the worker dies, the command gets one line naming the model and what llama.cpp was doing (``llama.cpp
aborted while loading <file>: <its message>``, ``... was killed by signal 9 (out of memory?)``), a
:class:`RuntimeFailure`: exit status 2. Its log lines and an assert's text go to a file read back for that
line, or to the terminal with ``verbose``. Ctrl-C stops the worker and reaches the command as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

import numpy as np

from mosaic._base import errors as _errors
from mosaic._base.errors import MosaicError
from mosaic._base.faults import point
from mosaic._eval.panel import Scores
from mosaic._eval.runtime import RuntimeFailure, RuntimeInfo, default_threads, parse_gpu_layers, resolve_name
from mosaic._eval.scoring import Job, Outcome
from mosaic._eval.wire import WireError, recv, send

#: How much of the worker's captured output is read back for the one line (its end holds the assert).
_TAIL = 1 << 16
_ASSERT = re.compile(r"GGML_ASSERT|GGML_ABORT|error|terminate called|what\(\)|Assertion", re.IGNORECASE)


def _message(tail: str) -> str:
    """The line of llama.cpp's output that says why it stopped: the last assert or error line, else the last."""
    lines = [" ".join(ln.split()) for ln in tail.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("#", "[New LWP", "warning:"))]  # backtrace noise
    hits = [ln for ln in lines if _ASSERT.search(ln)]
    line = (hits or lines or ["no message"])[-1]
    return line if len(line) <= 400 else line[:397] + "..."


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


class _Launcher:
    """Starts every worker from one thread that lives as long as this process. Linux sends a child its
    parent-death signal (the worker asks for one, to die with mosaic) when the *thread* that started it ends:
    a worker started from an API caller's short-lived thread would die with that thread, and the models
    loaded in it with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._todo: queue.SimpleQueue[tuple[Future[subprocess.Popen[bytes]], Callable[[], subprocess.Popen[bytes]]]] = \
            queue.SimpleQueue()

    def _run(self) -> None:
        while True:
            done, start = self._todo.get()
            try:
                done.set_result(start())
            except BaseException as e:  # handed to the caller, whatever it is
                done.set_exception(e)

    def popen(self, start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mosaic-llama-launcher", daemon=True)
                self._thread.start()
        done: Future[subprocess.Popen[bytes]] = Future()
        self._todo.put((done, start))
        return done.result()


_LAUNCHER = _Launcher()


class Worker:
    """One llama.cpp worker process, started on first use; one request at a time."""

    def __init__(self, runtime: str, threads: int, verbose: bool, gpu_layers: int | str | None = None) -> None:
        self._args = (runtime, threads, verbose, gpu_layers)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._lock = threading.Lock()
        self.info: RuntimeInfo | None = None
        self.doing = ""
        self.preloading = ""  # the model a preload is loading, until it is claimed or forgotten
        self.generation = 0  # which process: a model loaded in an earlier one is gone with it

    # ------------------------------------------------------------------------------------ process

    def _start(self) -> None:
        runtime, threads, verbose, gpu_layers = self._args
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        self._log = None if verbose else tempfile.TemporaryFile(prefix="mosaic-llama-")  # noqa: SIM115  (closed in close())
        # with verbose, llama.cpp's lines reach the terminal's stderr (never stdout: --json owns it)
        out: Any = 2 if verbose else self._log
        err: Any = None if verbose else self._log
        try:
            self._proc = _LAUNCHER.popen(lambda: subprocess.Popen(
                [sys.executable, "-m", "mosaic._eval.worker_main", str(to_child), str(from_child)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=(to_child, from_child),
                start_new_session=True, close_fds=True))
        finally:
            os.close(to_child)
            os.close(from_child)
        self._w = os.fdopen(from_parent, "wb")
        self._r = os.fdopen(to_parent, "rb")
        self.generation += 1
        self.doing, self.preloading = "starting", ""
        head, _ = self._call({"op": "init", "runtime": runtime, "threads": threads, "verbose": verbose,
                              "gpu_layers": gpu_layers})
        self.info = RuntimeInfo(**head["ok"], note=head.get("note"))

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Ends the worker (its models with it); a later request starts a new one."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for f in (getattr(self, "_w", None), getattr(self, "_r", None)):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        try:
            proc.wait(timeout=5)  # the worker ends when its input closes
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.kill()
        self.close()

    def _died(self) -> RuntimeFailure:
        """The worker is gone: one line saying how, and what it was doing."""
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        tail = ""
        if self._log is not None:
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(0, size - _TAIL))
            tail = self._log.read().decode("utf-8", "replace")
        doing = self.doing or "running"
        if self.preloading:
            doing += f" (and loading {self.preloading} beside it)"
        self.close()
        if code == -signal.SIGABRT:
            return RuntimeFailure(f"llama.cpp aborted while {doing}: {_message(tail)}")
        if code == -signal.SIGKILL:
            return RuntimeFailure(f"llama.cpp was killed by signal 9 while {doing} (out of memory?)")
        if code < 0:
            return RuntimeFailure(f"llama.cpp was killed by signal {-code} ({_signal_name(-code)}) while {doing}"
                                  + (f": {_message(tail)}" if tail.strip() else ""))
        return RuntimeFailure(f"the llama.cpp worker exited with status {code} while {doing}"
                              + (f": {_message(tail)}" if tail.strip() else ""))

    # ------------------------------------------------------------------------------------ requests

    def _call(self, head: dict, arrays: dict[str, np.ndarray] | None = None,
              advance: Callable[[int], None] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
        try:
            send(self._w, head, arrays)
            while True:
                reply, data = recv(self._r)
                if "doing" in reply:
                    self.doing = reply["doing"]
                elif "advance" in reply:
                    if advance is not None:
                        advance(reply["advance"])
                else:
                    break
        except (WireError, OSError) as e:
            if isinstance(e, WireError) and str(e) != "the stream ended":
                self._kill()  # a stream that is not ours to trust
                raise MosaicError(f"the llama.cpp worker sent something that is not a message ({e})") from None
            raise self._died() from None  # the stream ended or the pipe broke: the worker is gone
        except BaseException:
            self._kill()  # Ctrl-C, or a defect here: nothing is left running
            raise
        if "error" in reply:
            kind, message = reply["error"], reply["message"]
            if kind == "internal":
                raise RuntimeError(f"the llama.cpp worker failed:\n{message}")
            cls = RuntimeFailure if kind == "RuntimeFailure" else getattr(_errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, MosaicError)):
                cls = MosaicError
            err = cls.__new__(cls)  # the same class (its exit status), whatever its constructor takes
            Exception.__init__(err, message)
            raise err
        return reply, data

    def call(self, doing: str, head: dict, arrays: dict[str, np.ndarray] | None = None,
             advance: Callable[[int], None] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
        with self._lock:
            if self._proc is not None and not self.alive() and self.preloading:
                self.doing, self.preloading = f"loading {self.preloading} ahead", ""
                raise self._died()  # between requests: only the preload was running
            if not self.alive():
                self._proc = None
                self._start()
            self.doing = doing
            return self._call(head, arrays, advance)


@dataclasses.dataclass(frozen=True)
class Preload:
    """A model the worker is loading beside its other work: ``load(..., ticket=)`` with the same path claims it."""

    ticket: int
    generation: int


class RemoteModel:
    """A model loaded in the worker (the :class:`~mosaic._eval.runtime.LoadedModel` interface)."""

    def __init__(self, worker: Worker, path: Path, ctx: int, batch: int, name: str | None = None,
                 ticket: Preload | None = None) -> None:
        self.worker = worker
        self.name = name or str(path)
        head = {"op": "load", "path": str(path), "ctx": ctx, "batch": batch, "name": self.name}
        if ticket is not None and ticket.generation == worker.generation:
            head["ticket"] = ticket.ticket
        try:
            head, _ = worker.call(f"loading {path}", head)
        finally:
            worker.preloading = ""  # claimed or forgotten: a load ends any preload
        self.handle: int | None = head["ok"]
        self._generation = worker.generation
        self.n_vocab = int(head["n_vocab"])
        self.offloaded: int | None = head.get("offloaded")
        if worker.info is not None:  # the runtime's record names what the last load offloaded
            worker.info = dataclasses.replace(worker.info, offloaded=self.offloaded)

    def _req(self, doing: str, head: dict) -> tuple[dict, dict[str, np.ndarray]]:
        if self.handle is None or self._generation != self.worker.generation:
            raise MosaicError(f"{self.name}: the model is closed (or its llama.cpp worker has stopped)")
        return self.worker.call(f"{doing} {self.name}", {**head, "handle": self.handle})

    def tokenize(self, text: str) -> list[int]:
        return list(self._req("tokenizing with", {"op": "tokenize", "texts": [text]})[0]["ok"][0])

    def piece(self, token: int) -> bytes:
        return self._req("reading a token of", {"op": "piece", "token": int(token)})[1]["piece"].tobytes()

    def meta(self, key: str) -> str | None:
        return self._req("reading the metadata of", {"op": "meta", "key": key})[0]["ok"]

    def decode(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        """One batch's logits, copied across (the panel itself never does this: see :meth:`Worker.score`)."""
        return self._req("decoding", {"op": "decode", "tokens": [int(t) for t in tokens], "pos": pos})[1]["logits"]

    def clear(self) -> None:
        self._req("clearing", {"op": "clear"})

    def close(self) -> None:
        h, self.handle = self.handle, None
        if h is not None and self.worker.alive() and self._generation == self.worker.generation:
            self.worker.call(f"closing {self.name}", {"op": "close", "handle": h})


def score_in_worker(job: Job, live: RemoteModel | None, cands: Sequence[RemoteModel],
                    advance: Callable[[int], None]) -> Outcome:
    """:func:`mosaic._eval.scoring.score` run in the worker that holds the models."""
    worker = (live or cands[0]).worker
    if any(m.worker is not worker for m in cands):
        raise MosaicError("the models of one panel are in different llama.cpp workers")
    head = {"op": "score", "row_tokens": job.row_tokens, "ctx": job.ctx, "k": job.k, "chunk": job.chunk,
            "keep": job.keep, "live": live.handle if live else None, "cands": [c.handle for c in cands]}
    arrays = {}
    if job.saved_ids is not None and job.saved_lp is not None:
        arrays = {"saved_ids": job.saved_ids.astype(np.int32), "saved_lp": job.saved_lp.astype(np.float32)}
    what = (live or cands[0]).name

    def batch_done(n: int) -> None:
        point("panel-batch")
        advance(n)

    reply, data = worker.call(f"decoding {what}", head, arrays, batch_done)
    scores = []
    for ci, lengths in enumerate(reply["lengths"]):
        bounds = np.cumsum([0, *lengths])
        s = Scores([], [], [])
        for key, target in (("top1", s.top1), ("kl", s.kl), ("nll", s.nll)):
            flat = data[f"{key}{ci}"]
            target.extend(flat[a:b] for a, b in itertools.pairwise(bounds))
        scores.append(s)
    out = Outcome(scores, decode_seconds=float(reply.get("decode_seconds", 0.0)),
                  panel_seconds=float(reply.get("panel_seconds", 0.0)))
    if job.keep:
        out.kept_ids, out.kept_lp = [data["kept_ids"]], [data["kept_lp"]]
    return out


class WorkerRuntime:
    """The :class:`~mosaic._eval.runtime.Runtime` interface, with llama.cpp in a worker process."""

    def __init__(self, name: str, threads: int, verbose: bool, gpu_layers: int | str | None = None) -> None:
        self.worker = Worker(name, threads, verbose, gpu_layers)
        self._name = name

    @property
    def info(self) -> RuntimeInfo:
        if self.worker.info is None:
            self.worker.call("starting", {"op": "ping"})
        assert self.worker.info is not None
        return self.worker.info

    def load(self, path: Path, *, ctx: int, batch: int, name: str | None = None, ticket: Preload | None = None) -> RemoteModel:
        """``path`` loaded; with ``ticket``, the preload's model when it is ``path``'s (waiting for it to finish
        loading), else a load of its own."""
        return RemoteModel(self.worker, path, ctx, batch, name, ticket)

    def preload(self, path: Path, *, ctx: int, batch: int, name: str | None = None) -> Preload:
        """Starts loading ``path`` in the worker while it goes on with other requests; an earlier preload not
        claimed is closed. The model's pages are extra memory until it is claimed: the caller decides there is
        room for them."""
        # the load may start before the reply: a worker that dies at once dies "loading" the model, by its name
        head, _ = self.worker.call(f"loading {name or path} ahead",
                                   {"op": "preload", "path": str(path), "ctx": ctx, "batch": batch})
        self.worker.preloading = name or str(path)
        return Preload(int(head["ok"]), self.worker.generation)

    def forget(self) -> None:
        """The preload not claimed, if any, finished and closed."""
        if self.worker.alive():
            self.worker.call("closing a preloaded model", {"op": "forget"})
        self.worker.preloading = ""

    def quantize(self, src: Path, dst: Path, ftype: int) -> None:
        self.worker.call(f"quantizing {src}", {"op": "quantize", "src": str(src), "dst": str(dst), "ftype": ftype})

    def close(self) -> None:
        self.worker.close()


_OPEN: dict[tuple[str, int, bool, int | str | None], WorkerRuntime] = {}


def get_runtime(name: str | None = None, *, threads: int | None = None, verbose: bool = False,
                gpu_layers: int | str | None = None) -> WorkerRuntime:
    """The runtime ``name`` (default: ``$MOSAIC_RUNTIME``, else the first installed) in a worker process, one per
    name, thread count, verbosity and GPU offload (``gpu_layers``: ``"all"``, a count, ``None`` for the
    default) in this process; its worker starts on first use and is restarted after a crash. Nothing of
    llama.cpp is loaded into this process."""
    key = (resolve_name(name), threads or default_threads(), verbose, parse_gpu_layers(gpu_layers))
    if key not in _OPEN:
        _OPEN[key] = WorkerRuntime(*key)
    return _OPEN[key]


def close_all() -> None:
    """Ends every worker (their models with them)."""
    for rt in _OPEN.values():
        rt.close()


atexit.register(close_all)
