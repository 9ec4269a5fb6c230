"""The runtime's own work for a ``mosaic eval``: the same models, windows and batches, timed inside llama.cpp.

    python bench/decode_only.py TEACHER CANDIDATE TEXT CTX THREADS

Loads both models in this process (the binding mosaic's worker uses: ``MOSAIC_RUNTIME`` picks), tokenizes each row of TEXT as
``mosaic eval`` does, and decodes every window a batch at a time, the models in lock step, exactly the batches
mosaic decodes. Prints one JSON line: the seconds spent inside ``llama_decode`` (the floor no caller of this
binding can go under), the seconds the binding takes to hand the logits over (cyllama's per-position lists, llama-cpp-python's one
buffer), and
the positions decoded. mosaic's overhead is its wall time over ``decode_s``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mosaic._eval.backends import batch_size, check_gguf  # noqa: E402
from mosaic._eval.rows import load_rows  # noqa: E402
from mosaic._eval.runtime import in_process_runtime  # noqa: E402
from mosaic._eval.scoring import windows  # noqa: E402


class _Timed:
    """A binding's object whose decoding call (``name``: cyllama's context ``decode``, llama-cpp-python's module
    ``llama_decode``) is timed; everything else passes through."""

    def __init__(self, inner: Any, name: str, clock: list[float]) -> None:
        self._inner, self._name, self._clock = inner, name, clock

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        if name != self._name:
            return fn

        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._clock[0] += time.perf_counter() - t

        return timed


def main(teacher: str, cand: str, text: str, ctx: int, threads: int) -> dict[str, float]:
    rt = in_process_runtime(None, threads, False)
    check = check_gguf(teacher)
    batch = batch_size(ctx, check.n_vocab or 1)
    clock = [0.0]
    models = [rt.load(Path(p), ctx=ctx, batch=batch) for p in (teacher, cand)]
    for m in models:  # the binding's own call into llama_decode, timed
        if rt.info.name == "cyllama":
            m._ctx = _Timed(m._ctx, "decode", clock)  # type: ignore[attr-defined]
        else:
            m._lc = _Timed(m._lc, "llama_decode", clock)  # type: ignore[attr-defined]
    rows = load_rows(Path(text))
    total = 0.0
    positions = 0
    for row in rows.texts:
        toks = models[0].tokenize(row)
        for w in windows(toks, ctx):
            body = w[:-1]
            for m in models:
                m.clear()
            for s in range(0, len(body), batch):
                for m in models:
                    t = time.perf_counter()
                    m.decode(body[s:s + batch], s)
                    total += time.perf_counter() - t
            positions += len(body)
    for m in models:
        m.close()
    return {"decode_s": clock[0], "handover_s": total - clock[0], "positions": positions, "batch": batch}


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], a[1], a[2], int(a[3]), int(a[4]))))
