"""A checkpoint folder seen as shards, headers, index, configs and other files.

Opening a checkpoint reads every shard's header (strictly), the index, ``config.json`` and
``quantization_config.json``, and lists the remaining files; it never reads tensor data. Names that
come from files (index entries) are checked before they are joined to a path: absolute names and
names with ``..`` are refused. Symbolic links are followed for reading (the Hugging Face cache is
made of them); only logical names, relative to the folder, are ever recorded.

Inconsistencies a user should see but that do not stop reading (an index entry that disagrees with a
header) are collected as ``problems``; anything that makes the folder unreadable raises.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath

from mosaic._base.errors import CheckpointError
from mosaic._checkpoint.jsonfile import load_json, load_json_digest
from mosaic._checkpoint.qconfig import EntrySummary, read_partial, read_qconfig
from mosaic._formats.safetensors_reader import ShardHeader, TensorInfo, read_header, tensor_shards

__all__ = ["Checkpoint", "bulk", "check_relative_name", "list_files", "load_json", "open_checkpoint",
           "read_small_tensors", "text_config"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
QCONFIG_NAME = "quantization_config.json"
_SHARD_RE = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


@contextmanager
def bulk() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a checkpoint's metadata is turned into objects.

    At 150,000 tensors a command allocates millions of small, acyclic objects (header entries,
    modules, records); each allocation burst triggers collections that walk the whole, growing heap
    again, which cost about a third of a GLM-5.3 build's CPU time. Nothing here makes reference
    cycles worth collecting early; the collector resumes (once) on leaving. Nests; also a decorator."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def check_relative_name(name: object, what: str, where: str) -> str:
    """Refuse a name read from a file unless it is a plain relative POSIX path inside the folder."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: {what} {name!r} is not a file name")
    # Components are split by hand: PurePosixPath drops "." and empty components ("./a", "a/."), which
    # would let a name that is not the one written through.
    parts = name.split("/")
    if (
        PurePosixPath(name).is_absolute()
        or name.startswith(("/", "\\"))
        or "\\" in name
        or any(c in ("", ".", "..") for c in parts)
        or "\x00" in name
        or re.match(r"^[A-Za-z]:", name)
    ):
        raise CheckpointError(f"{where}: {what} {name!r} is absolute or leaves the folder; refused")
    return name


def text_config(config: dict) -> dict:
    """The language model's part of a config.json (multimodal configs nest it in ``text_config``)."""
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


@dataclass
class Checkpoint:
    """One checkpoint folder, headers validated. Tensor data is never read here."""

    root: Path
    shards: list[str]
    headers: dict[str, ShardHeader]
    tensor_file: dict[str, str]
    index: dict | None
    config: dict | None
    qconfig: dict | None
    files: list[str]  # every regular file (after following links), relative POSIX names, sorted
    problems: list[str] = field(default_factory=list)
    #: Opened for some modules only (a donor): only the shards holding them were read, and
    #: ``qconfig`` holds only their tensor_storage entries.
    partial: bool = False
    #: Only the headers and small files are present (a hub commit read by ranges): tensor bytes,
    #: codebook markers included, are not there to be read.
    headers_only: bool = False
    #: SHA-256 of the JSON files exactly as they were parsed (index, configs), by name
    digests: dict[str, str] = field(default_factory=dict)
    #: Every quantization_config.json tensor_storage entry, summarized and checked against the
    #: headers (mosaic._checkpoint.qconfig); None when opened partially or without a tensor_storage.
    #: A full opening keeps no entry itself: ``qconfig`` holds the other members only.
    storage: list[EntrySummary] | None = None
    #: Where each entry lies in the file's text, when proved as it was read: (start, end) of each
    #: entry of ``storage``, flattened (a full opening), or of each entry held (a partial one).
    storage_offsets: array | None = None
    partial_spans: dict[str, tuple[int, int]] | None = None

    def entry_spans(self, keys: Iterable[str]) -> dict[str, tuple[int, int]] | None:
        """The proved spans of these quantization_config.json entries in the text the census read
        (those it has), or None when its spans were not proved (the text must be parsed whole)."""
        if self.partial_spans is not None:
            return {k: self.partial_spans[k] for k in keys if k in self.partial_spans}
        if self.storage_offsets is None or self.storage is None:
            return None
        wanted = set(keys)
        off = self.storage_offsets
        return {e.key: (off[2 * i], off[2 * i + 1]) for i, e in enumerate(self.storage) if e.key in wanted}

    def read_again(self, name: str) -> bytes:
        """The bytes of a JSON file parsed at opening, read again for a writer that splices its text,
        refused unless they are exactly the bytes that were parsed and checked then."""
        path = self.root / name
        want = self.digests.get(name)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read it again: {e.strerror or e}") from None
        if want is None or hashlib.sha256(raw).hexdigest() != want:
            raise CheckpointError(f"{path}: changed since it was read (or was not read); nothing was written from it")
        return raw

    @property
    def other_files(self) -> list[str]:
        """Files that are neither shards nor the index."""
        shard_set = set(self.shards)
        return [f for f in self.files if f not in shard_set and f != INDEX_NAME]

    @cached_property
    def by_name(self) -> dict[str, TensorInfo]:
        """Every tensor's header entry by name, made once: the plan's size model and the checks look
        tensors up hundreds of thousands of times (the headers are never changed after opening)."""
        return {t.name: t for s in self.shards for t in self.headers[s].tensors}

    def tensor(self, name: str) -> TensorInfo:
        return self.by_name[name]

    def tensor_names(self) -> list[str]:
        """All tensor names, shard by shard in file order, tensors in data order."""
        return [t.name for s in self.shards for t in self.headers[s].tensors]

    def path(self, name: str) -> Path:
        return self.root / name

    def file_range(self, name: str) -> tuple[str, int, int]:
        shard = self.tensor_file[name]
        a, b = self.headers[shard].file_range(name)
        return shard, a, b

    @property
    def tensor_bytes(self) -> int:
        return sum(h.data_size for h in self.headers.values())

    @property
    def shard_bytes(self) -> int:
        return sum(h.file_size for h in self.headers.values())

    @property
    def num_hidden_layers(self) -> int | None:
        if not self.config:
            return None
        n = text_config(self.config).get("num_hidden_layers")
        return n if isinstance(n, int) and not isinstance(n, bool) else None


def list_files(root: Path) -> list[str]:
    """Regular files below ``root`` (links followed, loops skipped), minus hidden files and folders."""
    out: list[str] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        for fn in filenames:
            if fn.startswith("."):
                continue
            full = Path(dirpath) / fn
            if full.is_file():
                out.append((rel / fn).as_posix())
    return sorted(out)


def _shard_sort_key(name: str) -> tuple[int, str]:
    m = _SHARD_RE.match(name)
    return (int(m.group(1)) if m else 1 << 30, name)


@bulk()
def open_checkpoint(
    root: str | os.PathLike[str],
    *,
    modules: set[str] | None = None,
    headers: dict[str, ShardHeader] | None = None,
    headers_only: bool = False,
    index: object = None,
) -> Checkpoint:
    """Open a checkpoint folder: shards from the index (or the single ``model.safetensors``).

    With ``modules`` (module keys), only the shards that hold tensors of those modules are read and
    only their quantization_config.json entries are kept: a donor needs no more, and at 150,000
    tensors reading the rest costs seconds. ``headers`` hands over shard headers already read
    (strictly) by the caller, and ``index`` the index document it already read with
    :func:`load_json`, so that neither is parsed twice (16 MB of index at GLM-5.3's size)."""
    rootp = Path(root)
    if not rootp.is_dir():
        raise CheckpointError(f"{rootp}: not a folder")
    files = list_files(rootp)
    problems: list[str] = []
    known_index, index = index, None
    weight_map: dict[str, str] | None = None
    digests: dict[str, str] = {}
    if INDEX_NAME in files:
        if known_index is not None:
            index = known_index
        else:
            index, digests[INDEX_NAME] = load_json_digest(rootp / INDEX_NAME, "index")
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{rootp / INDEX_NAME}: no 'weight_map' object")
        weight_map = index["weight_map"]
        for shard in set(weight_map.values()) if all(isinstance(v, str) for v in weight_map.values()) else [None]:
            check_relative_name(shard, "weight_map file name", str(rootp / INDEX_NAME))
        shards = sorted(set(weight_map.values()), key=_shard_sort_key)
        missing = [s for s in shards if s not in files]
        if missing:
            raise CheckpointError(f"{rootp / INDEX_NAME}: names shard(s) not in the folder: {', '.join(missing)}")
    else:
        shards = sorted((f for f in files if f.endswith(".safetensors") and "/" not in f), key=_shard_sort_key)
        if not shards:
            raise CheckpointError(f"{rootp}: no {INDEX_NAME} and no *.safetensors files")
    stray = [f for f in files if f.endswith(".safetensors") and "/" not in f and f not in shards]
    if stray:
        problems.append(
            f"shard file(s) not in the index (exllamav3 loads every *.safetensors): {', '.join(stray)}"
        )

    partial = modules is not None and weight_map is not None
    if partial:
        assert modules is not None and weight_map is not None
        wanted = {shard for name, shard in weight_map.items() if name.rpartition(".")[0] in modules}
        shards = [s for s in shards if s in wanted]
        weight_map = {k: v for k, v in weight_map.items() if v in wanted}
    known_headers = headers or {}
    headers = {s: known_headers[s] if s in known_headers else read_header(rootp / s) for s in shards}
    tensor_file = tensor_shards(headers)
    if tensor_file is None:  # a tensor in two shards: name the first
        seen: dict[str, str] = {}
        for s in shards:
            for t in headers[s].tensors:
                if t.name in seen:
                    raise CheckpointError(f"{rootp}: tensor {t.name!r} appears in both {seen[t.name]} and {s}")
                seen[t.name] = s

    if index is not None and weight_map is not None and weight_map != tensor_file:  # equal: nothing to report
        for key, shard in weight_map.items():
            where = tensor_file.get(key)
            if where is None:
                problems.append(f"index: {key!r} is mapped to {shard} but no shard holds it")
            elif where != shard:
                problems.append(f"index: {key!r} is mapped to {shard} but is in {where}")
        unlisted = [k for k in tensor_file if k not in weight_map]
        if unlisted:
            problems.append(f"index: {len(unlisted)} tensor(s) in the shards are not in weight_map, e.g. {unlisted[0]!r}")
    if index is not None and weight_map is not None:
        meta = index.get("metadata")
        total = meta.get("total_size") if isinstance(meta, dict) else None
        actual = sum(h.data_size for h in headers.values())
        if total is not None and total != actual and not partial:
            problems.append(f"index: metadata.total_size is {total} but the shards hold {actual} tensor bytes")
        # The weight map (a name and a string per tensor: ~30 MB as objects at GLM-5.3's size) has
        # been checked against the headers; no reader needs it again.
        index = {k: v for k, v in index.items() if k != "weight_map"}

    config = None
    if CONFIG_NAME in files:
        c, digests[CONFIG_NAME] = load_json_digest(rootp / CONFIG_NAME, "config")
        if not isinstance(c, dict):
            raise CheckpointError(f"{rootp / CONFIG_NAME}: not a JSON object")
        config = c
    ck = Checkpoint(rootp, shards, headers, tensor_file, index, config, None, files, problems, partial, headers_only, digests)
    if QCONFIG_NAME in files and partial:
        assert modules is not None
        ck.qconfig, digests[QCONFIG_NAME], ck.partial_spans = read_partial(rootp / QCONFIG_NAME, modules)
    elif QCONFIG_NAME in files:
        q = read_qconfig(rootp / QCONFIG_NAME, ck.by_name)
        ck.qconfig, ck.storage, digests[QCONFIG_NAME], ck.storage_offsets = q.top, q.entries, q.digest, q.offsets
    return ck


def read_small_tensors(ckpt: Checkpoint, names: list[str]) -> dict[str, bytes]:
    """Read the bytes of a few small tensors (codebook markers), one open file per shard."""
    by_shard: dict[str, list[str]] = {}
    for n in names:
        by_shard.setdefault(ckpt.tensor_file[n], []).append(n)
    out: dict[str, bytes] = {}
    for shard, ns in by_shard.items():
        h = ckpt.headers[shard]
        fd = os.open(ckpt.root / shard, os.O_RDONLY)
        try:
            for n in ns:
                a, b = h.file_range(n)
                data = os.pread(fd, b - a, a)
                if len(data) != b - a:
                    raise CheckpointError(f"{ckpt.root / shard}: tensor {n!r}: file ended while reading it")
                out[n] = data
        finally:
            os.close(fd)
    return out
