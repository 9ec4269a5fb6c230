"""A GGUF model as mosaic sees it: one file or a ``llama-gguf-split`` set, its metadata and its tensors.

A model is named by a ``.gguf`` file, by the first file of a split set (``<stem>-00001-of-0000N.gguf``,
the other parts beside it), or by a folder holding exactly one model, optionally narrowed by a glob
over the file names inside it (``*Q4_K_M*.gguf``, ``Q4_K_M/*.gguf``): GGUF repositories hold many
quantizations. Every file's header is read strictly (:func:`mosaic._formats.gguf_container.read_gguf`);
tensor data is never read here. The split keys must agree (``split.no`` in order, one ``split.count``,
``split.tensors.count`` = the tensors of all parts), metadata is the first part's (llama.cpp reads it
from there), and each tensor knows its file and absolute byte range. This module opens files
read-only and writes nothing.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path, PurePosixPath

from mosaic._base.errors import SourceError
from mosaic._formats.gguf_container import KV, GGUFError, GGUFFile, TensorInfo, read_gguf, type_name

SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def split_name(stem: str, no: int, count: int) -> str:
    """``llama-gguf-split``'s name of part ``no`` (1-based) of ``count``."""
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def parse_name(name: str) -> tuple[int | None, str]:
    """``blk.12.ffn_down_exps.weight`` -> (12, ``ffn_down_exps.weight``); other names -> (None, name)."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a model: ``ne`` in ggml order (innermost first), its file and absolute byte range."""

    name: str
    ne: tuple[int, ...]
    type_id: int
    nbytes: int
    file: str
    start: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def layer(self) -> int | None:
        return parse_name(self.name)[0]


@dataclass(frozen=True)
class GGUFModel:
    """A model's files (split order), their headers, the model metadata and every tensor in file order."""

    root: Path
    files: tuple[str, ...]
    headers: dict[str, GGUFFile]
    tensors: tuple[GGUFTensor, ...]

    @property
    def first(self) -> GGUFFile:
        return self.headers[self.files[0]]

    @property
    def metadata(self) -> dict[str, KV]:
        """The model's key/value pairs (the first part's), without the ``split.*`` keys."""
        return {k: v for k, v in self.first.kvs.items() if k not in SPLIT_KEYS}

    @property
    def architecture(self) -> str | None:
        v = self.first.value("general.architecture")
        return v if isinstance(v, str) else None

    @property
    def alignment(self) -> int:
        return self.first.alignment

    def path(self, file: str) -> Path:
        return self.root / file

    def by_name(self) -> dict[str, GGUFTensor]:
        return {t.name: t for t in self.tensors}

    @property
    def size(self) -> int:
        return sum(h.file_size for h in self.headers.values())

    def describe(self) -> str:
        return str(self.root / self.files[0]) + (f" (+{len(self.files) - 1} parts)" if len(self.files) > 1 else "")


def _kv_int(h: GGUFFile, key: str) -> int | None:
    v = h.value(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _model_files(root: Path, names: list[str], where: str) -> list[list[str]]:
    """Group file names (relative POSIX) into models: split sets (all parts named) and single files."""
    sets: set[tuple[str, int]] = set()
    singles: list[list[str]] = []
    for n in sorted(names):
        m = SPLIT_RE.match(PurePosixPath(n).name)
        if m:
            stem = str(PurePosixPath(n).parent / m.group("stem"))
            sets.add((stem, int(m.group("count"))))
        else:
            singles.append([n])
    models = list(singles)
    for stem, count in sorted(sets):
        want = [split_name(PurePosixPath(stem).name, i, count) for i in range(1, count + 1)]
        folder = PurePosixPath(stem).parent
        rel = [str(folder / w) if str(folder) != "." else w for w in want]
        missing = [r for r in rel if not (root / r).is_file()]
        if missing:
            raise SourceError(f"{where}: split set {rel[0]} is incomplete: {', '.join(missing)} missing")
        models.append(rel)
    return models


def find_model_files(path: Path, pattern: str | None = None) -> tuple[Path, list[str]]:
    """The folder and the file names (split order) of the one model ``path`` (+ ``pattern``) names."""
    if path.is_file():
        if pattern is not None:
            raise SourceError(f"{path}: is a file; `file` narrows a folder, not a file")
        m = SPLIT_RE.match(path.name)
        if m and int(m.group("no")) != 1:
            first = split_name(m.group("stem"), 1, int(m.group("count")))
            raise SourceError(f"{path}: is part {int(m.group('no'))} of a split set; name its first file, {first}")
        if not path.name.endswith(".gguf"):
            raise SourceError(f"{path}: not a .gguf file")
        models = _model_files(path.parent, [path.name], str(path))
        return path.parent, models[0]
    if not path.is_dir():
        raise SourceError(f"{path}: no such file or folder")
    if pattern is not None:
        if pattern.startswith("/") or ".." in PurePosixPath(pattern).parts:
            raise SourceError(f"{path}: file {pattern!r} must be a name inside the folder (no '/' start, no '..')")
        names = [p.relative_to(path).as_posix() for p in path.rglob("*.gguf") if p.is_file()]
        direct = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not direct and not any(c in pattern for c in "*?["):
            direct = [n for n in names if n.startswith(pattern.rstrip("/") + "/")]
        names = direct
        where = f"{path}: file {pattern!r}"
    else:
        names = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
        where = str(path)
    if not names:
        raise SourceError(f"{where}: no .gguf file here")
    firsts = [n for n in names if not (m := SPLIT_RE.match(PurePosixPath(n).name)) or int(m.group("no")) == 1]
    models = _model_files(path, firsts, where) if firsts else []
    if len(models) != 1:
        listed = ", ".join(m[0] for m in models) or ", ".join(names[:5])
        raise SourceError(f"{where}: holds {len(models)} models ({listed}); name one with `file:` (a name or glob)")
    return path, models[0]


def open_gguf_model(path: str | Path, pattern: str | None = None, *,
                    read: Callable[[Path], GGUFFile] = read_gguf) -> GGUFModel:
    """Open the model ``path`` names (a file, a split set's first file, or a folder + ``pattern``); ``read``
    parses one file's header (by default from the file; a hub source read by ranges gives its own)."""
    root, files = find_model_files(Path(path), pattern)
    headers: dict[str, GGUFFile] = {}
    tensors: list[GGUFTensor] = []
    for i, name in enumerate(files):
        try:
            h = read(root / name)
        except GGUFError as e:
            raise SourceError(str(e)) from None
        except OSError as e:
            raise SourceError(f"{root / name}: cannot read: {e.strerror or e}") from None
        no, count, total = _kv_int(h, "split.no"), _kv_int(h, "split.count"), _kv_int(h, "split.tensors.count")
        if len(files) > 1 or (count is not None and count > 1):
            if (no, count) != (i, len(files)):
                raise SourceError(f"{root / name}: key 'split.no'/'split.count' is {no}/{count}, expected {i}/{len(files)}")
            if total is None:
                raise SourceError(f"{root / name}: key 'split.tensors.count' is missing")
        headers[name] = h
        tensors += [_tensor(name, h, t) for t in h.tensors]
    total = _kv_int(headers[files[0]], "split.tensors.count")
    if total is not None and total != len(tensors):
        raise SourceError(f"{root / files[0]}: key 'split.tensors.count' says {total} tensors, the parts hold {len(tensors)}")
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise SourceError(f"{root / t.file}: tensor {t.name!r} appears in two parts")
        seen.add(t.name)
    if not isinstance(headers[files[0]].value("general.architecture"), str):
        raise SourceError(f"{root / files[0]}: key 'general.architecture' is missing")
    return GGUFModel(root, tuple(files), headers, tuple(tensors))


def _tensor(file: str, h: GGUFFile, t: TensorInfo) -> GGUFTensor:
    return GGUFTensor(t.name, t.ne, t.type_id, t.nbytes, file, h.data_start + t.offset)


def is_gguf_location(path: Path, pattern: str | None = None) -> bool:
    """Does ``path`` (+ ``pattern``) name a GGUF model rather than an EXL3 safetensors folder?"""
    if pattern is not None:
        return True
    if path.is_file():
        return path.name.endswith(".gguf")
    if path.is_dir():
        has_gguf = any(path.glob("*.gguf"))
        return has_gguf and not any(path.glob("*.safetensors"))
    return path.name.endswith(".gguf")


def bits_per_weight(tensors: list[GGUFTensor] | tuple[GGUFTensor, ...]) -> Fraction | None:
    """Bits per weight of a set of tensors: 8 x their bytes / their elements (llama.cpp's BPW)."""
    n = sum(t.elements for t in tensors)
    return Fraction(8 * sum(t.nbytes for t in tensors), n) if n else None
