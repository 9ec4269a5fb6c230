"""A teacher's saved top-k: run a teacher too big to run twice once, and score candidates against it later.

One ``.npz`` file (numpy's own container, read without pickle): the tokens of every row, the teacher's
top-k token ids and log-probabilities at every position, and a JSON header naming the format, the
teacher, the SHA-256 of the rows file, the tokenizer's identity, the context length, k and the runtime
that computed it (name, version, llama.cpp build, threads; absent in references of earlier versions). A candidate
is scored against it only if its rows file and tokenizer are the same (the tokens are compared too).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mosaic._base.errors import FormatError
from mosaic._formats.safetensors_reader import strict_json_loadb

FORMAT = "mosaic.eval-reference/v1"


@dataclass
class Reference:
    model: str
    text_sha256: str
    tokenizer: dict
    ctx: int
    k: int
    row_tokens: list[np.ndarray]  # int32 tokens of each row
    top_ids: np.ndarray  # [positions, k] int32
    top_lp: np.ndarray  # [positions, k] float32
    runtime: dict | None = None

    def save(self, path: str | Path) -> None:
        meta = {"format": FORMAT, "model": self.model, "text_sha256": self.text_sha256, "tokenizer": self.tokenizer,
                "ctx": self.ctx, "top_k": self.k, "rows": len(self.row_tokens), "positions": int(self.top_ids.shape[0])}
        if self.runtime is not None:
            meta["runtime"] = self.runtime
        starts = np.cumsum([0, *(len(t) for t in self.row_tokens)]).astype(np.int64)
        tokens = np.concatenate(self.row_tokens).astype(np.int32) if self.row_tokens else np.zeros(0, np.int32)
        with open(path, "wb") as f:
            np.savez_compressed(f, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8),
                                tokens=tokens, row_starts=starts, top_ids=self.top_ids.astype(np.int32),
                                top_lp=self.top_lp.astype(np.float32))


def is_reference_file(path: str | Path) -> bool:
    p = Path(path)
    return p.is_file() and p.suffix == ".npz"


def load_reference(path: str | Path) -> Reference:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = strict_json_loadb(bytes(z["meta"]))
            tokens, starts, ids, lp = z["tokens"], z["row_starts"], z["top_ids"], z["top_lp"]
    except (OSError, ValueError, KeyError, UnicodeDecodeError, RecursionError, zipfile.BadZipFile, EOFError) as e:
        raise FormatError(f"{path}: not a saved reference ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FormatError(f"{path}: format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT}")
    fields = {"model": str, "text_sha256": str, "tokenizer": dict, "ctx": int, "top_k": int, "positions": int}
    bad = [k for k, t in fields.items() if not isinstance(meta.get(k), t) or isinstance(meta.get(k), bool)]
    if bad:
        raise FormatError(f"{path}: header field {bad[0]!r} missing or of the wrong type")
    runtime = meta.get("runtime")
    if runtime is not None and not isinstance(runtime, dict):
        raise FormatError(f"{path}: header field 'runtime' is not an object")
    if ids.ndim != 2 or ids.shape != lp.shape or ids.shape[0] != meta["positions"] or ids.shape[1] != meta["top_k"]:
        raise FormatError(f"{path}: top-k arrays do not match their header")
    if starts.ndim != 1 or len(starts) < 1 or starts[0] != 0 or starts[-1] != len(tokens) or np.any(np.diff(starts) < 0):
        raise FormatError(f"{path}: row offsets do not match the tokens")
    if ids.size and (ids.min() < 0 or not np.all(np.isfinite(lp))):
        raise FormatError(f"{path}: top-k ids or log-probabilities out of range")
    rows = [tokens[starts[i]:starts[i + 1]] for i in range(len(starts) - 1)]
    return Reference(meta["model"], meta["text_sha256"], meta["tokenizer"], meta["ctx"], meta["top_k"], rows, ids, lp, runtime)
