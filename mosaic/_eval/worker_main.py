"""The llama.cpp worker: a process of its own that loads GGUF models and runs the panel where the logits are.

Started by :mod:`.worker` as ``python -m mosaic._eval.worker_main IN_FD OUT_FD`` (spawned, never forked from a
process that has llama.cpp loaded), it reads requests from ``IN_FD`` and answers on ``OUT_FD``
(:mod:`.wire`); its stdout and stderr are its parent's choice (a file it reads back when llama.cpp dies, or the
terminal with ``--verbose``), never the protocol. It writes no core file, ignores the terminal's Ctrl-C (its
parent stops it) and dies with its parent. A refusal (:class:`~mosaic.MosaicError`) is answered as one; a
``GGML_ASSERT`` or an out-of-memory kill ends the process, and the parent says so in one line. The panel's
threads (:mod:`.rowpool`) are made once, at ``init``, as many as the runtime decodes with, and ended on exit.

A ``preload`` loads the next model on a thread of its own while this one decodes and scores (a measurement's
next candidate), so that the decode never waits on a load. One model is loading at a time, at most one is
preloaded and unclaimed, and a ``load`` naming its ticket takes it over; any other request goes on meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from mosaic._base.errors import MosaicError
from mosaic._base.faults import point
from mosaic._eval.rowpool import RowPool
from mosaic._eval.runtime import LoadedModel, Runtime, in_process_runtime
from mosaic._eval.scoring import Job, score
from mosaic._eval.wire import WireError, recv, send


def _contain() -> None:
    """No core file; the terminal's Ctrl-C is for the parent (it stops this process); die with the parent."""
    import resource

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the line above
            sys.exit(1)


class _Model:
    """A loaded model that says which model decodes before each batch (so a crash names it)."""

    def __init__(self, m: LoadedModel, name: str, batch: int, note: Callable[[str], None]) -> None:
        self.m, self.name, self.batch, self.n_vocab, self._note = m, name, batch, m.n_vocab, note

    def window(self, tokens: list[int]) -> Iterator[np.ndarray]:
        self.m.clear()
        for s in range(0, len(tokens), self.batch):
            self._note(f"decoding {self.name}")
            point("llama-decode")
            yield self.m.decode(tokens[s:s + self.batch], s)


class _Server:
    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.rt: Runtime | None = None
        self.pool: RowPool | None = None  # the panel's threads, as many as the runtime decodes with
        self.models: dict[int, _Model] = {}
        self.next = 1
        self._loading = threading.Lock()  # one load at a time: llama.cpp's log says what the load offloaded
        self._loader: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, str, Future[LoadedModel]] | None = None  # (ticket, path, the load) of a preload

    def close(self) -> None:
        """Ends the panel's threads and the preload's (the models end with the process)."""
        self._forget()
        if self._loader is not None:
            self._loader.shutdown()
            self._loader = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _load(self, path: Path, ctx: int, batch: int) -> LoadedModel:
        assert self.rt is not None
        with self._loading:
            point("llama-load")
            return self.rt.load(path, ctx=ctx, batch=batch)

    def _preload(self, head: dict) -> int:
        """Starts loading ``head``'s model beside whatever runs next; its ticket claims it."""
        self._forget()
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="mosaic-preload")
        ticket = self.next
        self.next += 1
        self._ahead = (ticket, head["path"], self._loader.submit(self._load, Path(head["path"]), head["ctx"], head["batch"]))
        return ticket

    def _claim(self, ticket: int | None, path: str) -> LoadedModel | None:
        """The preloaded model of ``ticket`` when it is ``path``'s (a load that failed raises here, as a load
        would); ``None`` when there is none, the unclaimed one closed."""
        ahead = self._ahead
        if ahead is None or ticket is None or ahead[0] != ticket or ahead[1] != path:
            self._forget()
            return None
        self._ahead = None
        return ahead[2].result()

    def _forget(self) -> None:
        """The unclaimed preload, if any, waited for and closed."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            with contextlib.suppress(Exception):
                ahead[2].result().close()

    def note(self, doing: str) -> None:
        send(self.out, {"doing": doing})

    def handle(self, head: dict, arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray] | None]:
        op = head["op"]
        if op == "init":
            self.rt = in_process_runtime(head["runtime"], head["threads"], head["verbose"], head.get("gpu_layers"))
            if self.pool is None:
                self.pool = RowPool(self.rt.info.threads)
            return {"ok": self.rt.info.as_dict(), "note": self.rt.info.note}, None
        assert self.rt is not None, "init first"
        if op == "ping":
            return {"ok": None}, None
        if op == "preload":
            return {"ok": self._preload(head)}, None
        if op == "forget":
            self._forget()
            return {"ok": None}, None
        if op == "load":
            m = self._claim(head.get("ticket"), head["path"]) or self._load(Path(head["path"]), head["ctx"], head["batch"])
            h = self.next
            self.next += 1
            self.models[h] = _Model(m, head["name"], head["batch"], self.note)
            return {"ok": h, "n_vocab": m.n_vocab, "offloaded": getattr(m, "offloaded", None)}, None
        if op == "close":
            m_ = self.models.pop(head["handle"], None)
            if m_ is not None:
                m_.m.close()
            return {"ok": None}, None
        if op == "tokenize":
            return {"ok": [self.models[head["handle"]].m.tokenize(t) for t in head["texts"]]}, None
        if op == "piece":
            return {"ok": None}, {"piece": np.frombuffer(self.models[head["handle"]].m.piece(head["token"]), np.uint8)}
        if op == "meta":
            return {"ok": self.models[head["handle"]].m.meta(head["key"])}, None
        if op == "decode":
            m_ = self.models[head["handle"]]
            self.note(f"decoding {m_.name}")
            point("llama-decode")
            return {"ok": None}, {"logits": m_.m.decode(head["tokens"], head["pos"])}
        if op == "clear":
            self.models[head["handle"]].m.clear()
            return {"ok": None}, None
        if op == "quantize":
            self.rt.quantize(Path(head["src"]), Path(head["dst"]), head["ftype"])
            return {"ok": None}, None
        if op == "score":
            return self.score(head, arrays)
        raise MosaicError(f"the llama.cpp worker has no operation {op!r}")

    def score(self, head: dict, arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
        job = Job(head["row_tokens"], head["ctx"], head["k"], head["chunk"], head["keep"],
                  arrays.get("saved_ids"), arrays.get("saved_lp"))
        live = self.models[head["live"]] if head.get("live") is not None else None
        cands = [self.models[h] for h in head["cands"]]
        got = score(job, live, cands, lambda n: send(self.out, {"advance": n}), self.pool)
        out: dict[str, np.ndarray] = {}
        lengths = []
        for ci, s in enumerate(got.scores):
            lengths.append([int(x.size) for x in s.top1])
            for key, parts in (("top1", s.top1), ("kl", s.kl), ("nll", s.nll)):
                out[f"{key}{ci}"] = np.concatenate(parts) if parts else np.zeros(0)
        if job.keep:
            out["kept_ids"] = np.concatenate(got.kept_ids) if got.kept_ids else np.zeros((0, job.k), np.int32)
            out["kept_lp"] = np.concatenate(got.kept_lp) if got.kept_lp else np.zeros((0, job.k), np.float32)
        return {"ok": None, "lengths": lengths, "decode_seconds": got.decode_seconds, "panel_seconds": got.panel_seconds}, out


def main(argv: list[str]) -> int:
    _contain()
    inp = os.fdopen(int(argv[0]), "rb")
    out = os.fdopen(int(argv[1]), "wb")
    server = _Server(out)
    try:
        return _serve(server, inp, out)
    finally:
        server.close()


def _serve(server: _Server, inp: BinaryIO, out: BinaryIO) -> int:
    while True:
        try:
            head, arrays = recv(inp)
        except WireError:
            return 0  # the parent is gone or done
        try:
            reply, data = server.handle(head, arrays)
        except MosaicError as e:
            reply, data = {"error": type(e).__name__, "message": str(e)}, None
        except Exception:  # a defect: the parent raises it with this traceback
            reply, data = {"error": "internal", "message": traceback.format_exc()}, None
        try:
            send(out, reply, data)
        except (BrokenPipeError, OSError):
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
