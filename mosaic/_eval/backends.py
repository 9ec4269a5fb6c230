"""The models the panel scores: GGUF through a llama.cpp runtime (:mod:`.runtime`) on the CPU, EXL3 through
exllamav3 (the optional ``exl3`` extra) on a CUDA GPU.

A backend tokenizes with the model's own tokenizer and hands back a window's next-token logits a batch of
positions at a time (:meth:`Backend.window`), each window from an empty context, so that memory does not
grow with the window or the text. A GGUF model is read by mosaic's strict GGUF reader before a runtime is
handed the file: a truncated or foreign file, a split set with a part missing, or a window longer than the
model's ``<arch>.context_length`` is one clear error, not a runtime's crash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from mosaic._base.errors import MosaicError, SourceError
from mosaic._checkpoint.gguf_model import GGUFModel, find_model_files, open_gguf_model
from mosaic._eval.runtime import LoadedModel, Runtime

#: Logit floats one batch hands back (the runtime's output buffer, and ours): bounds memory at any vocabulary
#: (170 positions at 49,152 tokens, 32 at 262,144: 32 MiB each). Measured on SmolLM2: batches three times
#: larger ran no faster on a CPU and held 0.5 GB more for two models.
BATCH_LOGITS = 1 << 23
MAX_BATCH = 512
MIN_BATCH = 16


def batch_size(ctx: int, n_vocab: int) -> int:
    """Positions decoded at once: at most :data:`MAX_BATCH`, fewer at large vocabularies, never above ``ctx``."""
    return max(1, min(ctx, MAX_BATCH, max(MIN_BATCH, BATCH_LOGITS // max(1, n_vocab))))


class Backend(Protocol):
    name: str
    n_vocab: int

    def tokenize(self, text: str) -> list[int]: ...

    def tokenizer_identity(self) -> dict: ...

    def window(self, tokens: list[int]) -> Iterator[np.ndarray]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class GGUFCheck:
    """What the strict reader says of a GGUF model before any runtime opens it."""

    model: GGUFModel
    first: Path
    n_vocab: int | None
    context_length: int | None


def check_gguf(path: str | Path) -> GGUFCheck:
    """Read every file of the model ``path`` names strictly (headers, split keys, sizes); no tensor data."""
    p = Path(path)
    try:
        root, files = find_model_files(p)
    except SourceError as e:
        raise SourceError(f"{e} (a GGUF model is a .gguf file, the first file of a split set, or a folder holding one)") from None
    model = open_gguf_model(root / files[0])
    arch = model.architecture
    ctx_len = model.first.value(f"{arch}.context_length")
    tokens = model.first.value("tokenizer.ggml.tokens")
    return GGUFCheck(model, root / files[0],
                     len(tokens) if isinstance(tokens, list) else None,
                     ctx_len if isinstance(ctx_len, int) and not isinstance(ctx_len, bool) else None)


def check_context(check: GGUFCheck, ctx: int, name: str) -> None:
    if check.context_length is not None and ctx > check.context_length:
        arch = check.model.architecture
        raise SourceError(f"{name}: --ctx {ctx} is above the model's {arch}.context_length, {check.context_length}")


#: Digests of a vocabulary, each made its own way: compared only where both identities have the same one (a
#: reference saved by an earlier mosaic has ``vocab_sha256``); the tokens of every row are compared anyway.
_DIGESTS = {"tokens_sha256": "token list (tokenizer.ggml.tokens, its SHA-256)", "vocab_sha256": "token pieces (their SHA-256)"}


def identity_difference(got: dict, want: dict) -> str | None:
    """In words, the first property in which two tokenizer identities differ (``None`` if they agree)."""
    words = {"n_vocab": "vocabulary size", "model": "tokenizer model (tokenizer.ggml.model)",
             "pre": "pre-tokenizer (tokenizer.ggml.pre)"}
    for key, what in [*words.items(), *_DIGESTS.items()]:
        if key in _DIGESTS and not (key in got and key in want):
            continue
        a, b = got.get(key), want.get(key)
        if a != b:
            return f"its {what} is {a!r}, the reference's {b!r}"
    return None


def _tokens_digest(tokens: object) -> str:
    """SHA-256 of a token list, each token length-prefixed (the file's own strings, as the strict reader read them)."""
    h = hashlib.sha256()
    for tok in tokens if isinstance(tokens, list) else ():
        b = str(tok).encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(4, "little") + b)
    return h.hexdigest()


class GGUFBackend:
    """A GGUF model on a llama.cpp runtime; checked strictly first (:func:`check_gguf`)."""

    def __init__(self, check: GGUFCheck, name: str, runtime: Runtime, ctx: int, batch: int,
                 model: LoadedModel | None = None) -> None:
        """``model``: ``check.first`` already loaded by ``runtime`` (a preload claimed), else it is loaded here."""
        self.name = name
        self.path = check.first
        self._tokens_sha256 = _tokens_digest(check.model.first.value("tokenizer.ggml.tokens"))  # not the list: memory
        self._model: LoadedModel = model if model is not None else runtime.load(check.first, ctx=ctx, batch=batch)
        self.n_vocab = self._model.n_vocab
        self.batch = batch

    @property
    def loaded(self) -> LoadedModel:
        """The runtime's model (in mosaic's llama.cpp worker: the panel is run there, where its logits are)."""
        return self._model

    def tokenize(self, text: str) -> list[int]:
        return self._model.tokenize(text)

    def tokenizer_identity(self) -> dict:
        """From the file's own token list (the strict reader's), not from a runtime's rendering of each token:
        two runtimes render the bytes of a partial UTF-8 token differently."""
        return {"n_vocab": self.n_vocab, "model": self._model.meta("tokenizer.ggml.model"),
                "pre": self._model.meta("tokenizer.ggml.pre"), "tokens_sha256": self._tokens_sha256}

    def window(self, tokens: list[int]) -> Iterator[np.ndarray]:
        """Logits of ``tokens``' positions, ``batch`` at a time; each array is valid until the next one."""
        self._model.clear()
        for s in range(0, len(tokens), self.batch):
            yield self._model.decode(tokens[s:s + self.batch], s)

    def close(self) -> None:
        self._model.close()


def require_exl3_gpu(what: str) -> None:
    """exllamav3 runs on a CUDA GPU through the ``exl3`` extra: without them, one line says which is missing."""
    try:
        import torch
    except ImportError:
        raise MosaicError(f"{what} of EXL3 folders needs the exl3 extra (torch, exllamav3): pip install 'mosaic[exl3]'") from None
    if not torch.cuda.is_available():
        raise MosaicError(f"{what} of EXL3 folders needs a CUDA GPU (exllamav3); none is available here")


class Exl3Backend:
    """exllamav3 on a CUDA GPU (the ``exl3`` extra). Imported only when an EXL3 folder is evaluated; a window
    is computed on the GPU at once and handed back ``batch`` positions at a time."""

    def __init__(self, path: Path, ctx: int, batch: int) -> None:
        require_exl3_gpu("mosaic eval")
        import torch

        try:
            from exllamav3 import Config, Model, Tokenizer
        except ImportError:
            raise MosaicError("mosaic eval of EXL3 folders needs exllamav3: pip install 'mosaic[exl3]'") from None
        self.name = str(path)
        self.batch = batch
        self._torch = torch
        config = Config.from_directory(str(path))
        self._model = Model.from_config(config)
        self._model.load()
        self._tok = Tokenizer.from_config(config)
        self.n_vocab = int(config.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_bos=True).flatten().tolist()

    def window(self, tokens: list[int]) -> Iterator[np.ndarray]:
        ids = self._torch.tensor([tokens], dtype=self._torch.long)
        with self._torch.inference_mode():
            out = self._model.forward(ids, {"attn_mode": "flash_attn_nc"})[0]
        for s in range(0, len(tokens), self.batch):
            yield out[s:s + self.batch].float().cpu().numpy()

    def tokenizer_identity(self) -> dict:
        pieces = self._tok.get_id_to_piece_list(True)
        h = hashlib.sha256()
        for p in pieces:
            b = p.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(4, "little") + b)
        return {"n_vocab": len(pieces), "vocab_sha256": h.hexdigest()}

    def close(self) -> None:
        self._model.unload()


def exllamav3_rows(shard: Path, key: str, rows: int) -> Iterator[np.ndarray]:
    """One EXL3 linear as exllamav3 reconstructs it on the GPU (its Hadamard rotations and sign vectors
    applied: the weight in the original basis), handed over ``rows`` output rows at a time."""
    require_exl3_gpu("the weight errors of EXL3 folders")
    import torch
    from exllamav3.modules.quant.exl3 import LinearEXL3
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt", device="cuda") as f:
        parts = {name.rsplit(".", 1)[1]: f.get_tensor(name) for name in f.keys() if name.rsplit(".", 1)[0] == key}  # noqa: SIM118
    trellis = parts["trellis"]
    lin = LinearEXL3(None, trellis.shape[0] * 16, trellis.shape[1] * 16, su=parts.get("su"), sv=parts.get("sv"),
                     suh=parts.get("suh"), svh=parts.get("svh"), trellis=trellis, mcg=parts.get("mcg"), mul1=parts.get("mul1"))
    with torch.inference_mode():
        w = lin.get_weight_tensor()  # [in, out]: exllamav3 stores linears transposed
        for a in range(0, w.shape[1], rows):
            yield w[:, a:a + rows].T.float().cpu().numpy()
    del w, lin


def is_exl3_folder(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))
