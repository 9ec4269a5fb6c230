"""The base and the donors laid out once as split parts, so that a candidate costs a link, not a model.

llama.cpp loads a split set by its first file and finds the other parts by name beside it
(``<stem>-0000k-of-0000N.gguf``; each part's ``split.no`` must be its place). So the base is laid out once
as N parts: the first holds the metadata and every tensor that is no unit's, each other part one unit's
tensors. Each donor's version of a unit is laid out as a part with the same ``split.no`` when the first
candidate that takes it comes, and removed once the last has run (:meth:`Parts.release`): over a ladder of 19
types, every version of every unit laid out at once would be the ladder's bytes again. A candidate — "base +
unit u from donor d", the top model (every unit at its best version), the top with one unit back at the base's —
is a folder of links to the base's parts with some linked to a donor's instead: its disk writes are a few links
and the parts no candidate before it took, whatever the model's size.

Every part is read back by the strict GGUF reader once it is written, and its tensors' bytes compared
with their source ranges as they are copied (a copy that differs from its source is refused).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import MosaicError, OutputError
from mosaic._base.hashing import scratch
from mosaic._base.progress import SILENT, Reporter
from mosaic._build.gguf_plan import _split_keys
from mosaic._checkpoint.gguf_model import GGUFModel, split_name
from mosaic._formats.gguf_container import layout, read_gguf
from mosaic._formats.safetensors_writer import copy_in_steps
from mosaic._plan.gguf_units import Unit

STEM = "candidate"
#: Room kept free beyond the parts' bytes (file-system metadata, the journal).
SPACE_MARGIN = 64 << 20


@dataclass
class Parts:
    """Where the laid-out parts are: the base's (by index, 0 = metadata + non-unit tensors) and each donor's
    version of a unit (by (unit index, donor)) that is laid out now; ``make`` lays one out."""

    root: Path
    count: int
    base: list[Path] = field(default_factory=list)
    donor: dict[tuple[int, str], Path] = field(default_factory=dict)
    candidate_dir: Path | None = None
    make: Callable[[int, str], Path] | None = None

    def name(self, i: int) -> str:
        return split_name(STEM, i + 1, self.count)

    def candidate(self, versions: Mapping[int, str]) -> Path:
        """The first file of the model that holds unit ``u`` at donor ``versions[u]``'s version and every other
        unit at the base's (``{}``: the base itself): one folder of links, re-pointed where they differ; a
        version not laid out yet is laid out first."""
        d = self.candidate_dir
        assert d is not None and self.make is not None
        for pair in sorted(versions.items()):
            if pair not in self.donor:
                self.donor[pair] = self.make(*pair)
        for i, target in enumerate(self.base):
            want = self.donor[(i - 1, versions[i - 1])] if i and (i - 1) in versions else target
            link = d / self.name(i)
            if not link.is_symlink() or os.readlink(link) != str(want):
                tmp = d / f".{self.name(i)}.tmp"
                tmp.unlink(missing_ok=True)
                os.symlink(want, tmp)
                os.replace(tmp, link)
        return d / self.name(0)


    def release(self, pairs: Iterable[tuple[int, str]]) -> None:
        """Remove the parts of ``pairs`` that are laid out: no candidate to come takes them (a link still
        pointing at one is re-pointed before its folder is loaded again)."""
        for pair in pairs:
            path = self.donor.pop(pair, None)
            if path is not None:
                path.unlink(missing_ok=True)


def part_bytes(base: GGUFModel, units: list[Unit], donors: dict[str, GGUFModel], pairs: Iterable[tuple[int, str]]) -> int:
    """Bytes a layout holds at once: the base, and each (unit, donor) version in ``pairs``."""
    pairs = sorted(set(pairs))
    names = {sid: donors[sid].by_name() for sid in {sid for _, sid in pairs}}
    return base.size + sum(sum(names[sid][n].nbytes for n in units[ui].tensors) + 4096 for ui, sid in pairs)


def check_space(folder: Path, need: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need + SPACE_MARGIN:
        raise OutputError(f"{folder}: {free:,} bytes free, laying out the base and the donors' units needs "
                          f"{need + SPACE_MARGIN:,} (their bytes, plus margin); give --workdir on a larger disk")


def lay_out(root: Path, base: GGUFModel, units: list[Unit], donors: dict[str, GGUFModel],
            progress: Reporter = SILENT) -> Parts:
    """Write the base's parts into the new folder ``root``; the donors' versions are laid out as candidates
    take them (:meth:`Parts.candidate`)."""
    in_unit = {n for u in units for n in u.tensors}
    count = len(units) + 1
    total = len(base.tensors)
    parts = Parts(root, count)
    root = root.resolve()  # the candidates' links point here: absolute, whatever the working folder
    root.mkdir(parents=True)
    parts.root = root
    advance = progress.step("laying out the base's parts", base.size)
    meta = [kv for kv in base.metadata.values()]
    first = [t for t in base.tensors if t.name not in in_unit]
    parts.base.append(_write(root / "base" / parts.name(0), meta + _split_keys(0, count, total), base, first, advance))
    by_name = base.by_name()
    for i, u in enumerate(units):
        ts = [by_name[n] for n in u.tensors]
        parts.base.append(_write(root / "base" / parts.name(i + 1), _split_keys(i + 1, count, total), base, ts, advance))
    names = {sid: d.by_name() for sid, d in donors.items()}

    def make(ui: int, sid: str) -> Path:
        ts = [names[sid][n] for n in units[ui].tensors]
        return _write(root / "donors" / sid / parts.name(ui + 1), _split_keys(ui + 1, count, total), donors[sid], ts, None)

    parts.make = make
    parts.candidate_dir = root / "candidate"
    parts.candidate_dir.mkdir()
    return parts


def _write(path: Path, kvs: list, model: GGUFModel, tensors: list, advance: object) -> Path:
    """One part: the header laid out first, then each tensor's range copied from its source file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lay = layout(kvs, [(t.name, t.ne, t.type_id, t.nbytes) for t in tensors], model.alignment)
    buf = scratch("copy")[0]
    fds: dict[Path, int] = {}
    dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.pwrite(dst, lay.header, 0)
        for t, info in zip(tensors, lay.tensors):
            src = model.path(t.file)
            if src not in fds:
                fds[src] = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            copy_in_steps(fds[src], dst, t.nbytes, t.start, lay.data_start + info.offset, buf=buf, on_bytes=advance)  # type: ignore[arg-type]
        os.ftruncate(dst, lay.size)
    finally:
        os.close(dst)
        for fd in fds.values():
            os.close(fd)
    _check_copy(path, lay, model, tensors)
    return path


def _check_copy(path: Path, lay: object, model: GGUFModel, tensors: list) -> None:
    """The part parses strictly and each tensor's bytes equal its source range."""
    h = read_gguf(path)
    if [t.name for t in h.tensors] != [t.name for t in tensors]:
        raise MosaicError(f"{path}: the laid-out part does not hold the tensors planned")
    with open(path, "rb") as fo:
        for t, info in zip(tensors, h.tensors):
            with open(model.path(t.file), "rb") as fs:
                pos = 0
                while pos < t.nbytes:
                    n = min(t.nbytes - pos, 8 << 20)
                    fs.seek(t.start + pos)
                    fo.seek(h.data_start + info.offset + pos)
                    if fs.read(n) != fo.read(n):
                        raise MosaicError(f"{path}: tensor {t.name!r} differs from its source after copying")
                    pos += n
