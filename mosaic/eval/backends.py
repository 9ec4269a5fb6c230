"""The runtimes that give the panel its logits: llama.cpp (``llama-cpp-python``) for GGUF, on the CPU;
exllamav3 for EXL3 folders, through the optional ``exl3`` extra, on a CUDA GPU.

A backend tokenizes with the model's own tokenizer and returns, for a window of tokens, the
logits of the next token at every position (the panel takes their log-softmax in float64). Each window starts from an empty context.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from mosaic.errors import MosaicError, SourceError


class Backend(Protocol):
    name: str

    def tokenize(self, text: str) -> list[int]: ...

    def logits(self, tokens: list[int]) -> np.ndarray: ...

    def tokenizer_identity(self) -> dict: ...


def gguf_file(path: Path) -> Path | None:
    """The model file llama.cpp opens: a ``.gguf`` (the first of a split set), or the one model in a folder."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        files = sorted(p for p in path.glob("*.gguf"))
        firsts = [p for p in files if "-00001-of-" in p.name] or files
        if len(firsts) == 1:
            return firsts[0]
    return None


class LlamaCppBackend:
    def __init__(self, path: Path, ctx: int) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise MosaicError(
                "mosaic eval of GGUF models needs llama-cpp-python: pip install 'mosaic[runtime]' (it compiles llama.cpp)"
            ) from None
        f = gguf_file(path)
        if f is None:
            raise SourceError(f"{path}: not a .gguf file nor a folder holding one GGUF model")
        self.name = str(path)
        self.path = f
        self._llm = Llama(model_path=str(f), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False,
                          n_threads=os.cpu_count() or 1, seed=0)

    def tokenize(self, text: str) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))

    def logits(self, tokens: list[int]) -> np.ndarray:
        self._llm.reset()
        self._llm.eval(tokens)
        return np.array(self._llm.scores[: len(tokens)], dtype=np.float32)

    def tokenizer_identity(self) -> dict:
        n = self._llm.n_vocab()
        h = hashlib.sha256()
        for i in range(n):
            piece = self._llm.detokenize([i], special=True)
            h.update(len(piece).to_bytes(4, "little") + piece)
        meta = self._llm.metadata
        return {"n_vocab": n, "model": meta.get("tokenizer.ggml.model"), "pre": meta.get("tokenizer.ggml.pre"),
                "vocab_sha256": h.hexdigest()}


class Exl3Backend:
    """exllamav3 on a CUDA GPU (the ``exl3`` extra). Imported only when an EXL3 folder is evaluated."""

    def __init__(self, path: Path, ctx: int) -> None:
        try:
            import torch
        except ImportError:
            raise MosaicError("mosaic eval of EXL3 folders needs the exl3 extra (torch, exllamav3): pip install 'mosaic[exl3]'") from None
        if not torch.cuda.is_available():
            raise MosaicError("mosaic eval of EXL3 folders needs a CUDA GPU (exllamav3); none is available here")
        try:
            from exllamav3 import Config, Model, Tokenizer
        except ImportError:
            raise MosaicError("mosaic eval of EXL3 folders needs exllamav3: pip install 'mosaic[exl3]'") from None
        self.name = str(path)
        self._torch = torch
        config = Config.from_directory(str(path))
        self._model = Model.from_config(config)
        self._model.load()
        self._tok = Tokenizer.from_config(config)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_bos=True).flatten().tolist()

    def logits(self, tokens: list[int]) -> np.ndarray:
        ids = self._torch.tensor([tokens], dtype=self._torch.long)
        with self._torch.inference_mode():
            out = self._model.forward(ids, {"attn_mode": "flash_attn_nc"})
        return out[0].float().cpu().numpy()

    def tokenizer_identity(self) -> dict:
        pieces = self._tok.get_id_to_piece_list(True)
        h = hashlib.sha256()
        for p in pieces:
            b = p.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(4, "little") + b)
        return {"n_vocab": len(pieces), "vocab_sha256": h.hexdigest()}


def open_backend(path: str | Path, ctx: int) -> Backend:
    p = Path(path)
    if gguf_file(p) is not None:
        return LlamaCppBackend(p, ctx)
    if p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return Exl3Backend(p, ctx)
    raise SourceError(f"{p}: neither a GGUF model (a .gguf file or a folder holding one) nor an EXL3 folder")
