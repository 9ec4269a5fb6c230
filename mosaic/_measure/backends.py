"""What scores a measurement's candidates: one small interface, one implementation per format.

A scorer is made once per measurement and scores models that are the base with some units at a donor's
version (``{unit index: donor id}``: ``{}`` is the base, one entry a one-unit swap, every unit the top
model) against the teacher's saved top-k, as ``mosaic eval`` scores a model against a saved reference (the
KL lower bound), handing back the panel (:func:`mosaic._eval.panel.summarize`). GGUF runs on llama.cpp on
the CPU, its candidates made of laid-out parts (:mod:`.parts`); EXL3 runs on exllamav3 on a CUDA GPU, each
candidate built as a mosaic of links.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

from mosaic._base.progress import SILENT, Reporter
from mosaic._checkpoint.gguf_model import GGUFModel
from mosaic._eval.backends import GGUFBackend, batch_size, check_gguf, require_exl3_gpu
from mosaic._eval.reference import Reference
from mosaic._eval.rows import Rows
from mosaic._eval.run import check_tokens, score_against
from mosaic._eval.worker import Preload, get_runtime
from mosaic._measure.parts import Parts, lay_out
from mosaic._plan.gguf_units import Unit

#: A candidate to come: its versions and its name (a scorer may load it while it scores the one before).
Next = tuple[Mapping[int, str], str]


class Scorer(Protocol):
    runtime: dict
    timing: dict[str, float]

    def score(self, versions: Mapping[int, str], name: str, then: Next | None = None) -> dict: ...

    def release(self, pairs: Iterable[tuple[int, str]]) -> None:
        """The (unit, donor) versions no candidate to come takes: what they hold on disk may go."""
        ...

    def close(self) -> None: ...


#: Where the kernel says what memory is left: the machine's, and a cgroup's limit (v2, else v1) and use.
MEMINFO = Path("/proc/meminfo")
CGROUP_MEMORY = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                 (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))


def memory_available() -> int | None:
    """Bytes this process could still take without swapping or its container's out-of-memory kill: the
    machine's ``MemAvailable``, less where a cgroup's limit leaves less; ``None`` where the kernel does not say.
    A container limited to 8 GB on a 256 GB host sees the host's ``MemAvailable``."""
    try:
        spare = next(int(line.split()[1]) * 1024 for line in MEMINFO.read_text().splitlines() if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    for limit_path, used_path in CGROUP_MEMORY:
        try:
            limit, used = limit_path.read_text().strip(), int(used_path.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # v1 says "no limit" with a huge number, v2 with "max"
            spare = min(spare, max(0, int(limit) - used))
        break
    return spare


def preload_allowed(runtime: dict, model_bytes: int) -> bool:
    """Whether a second candidate may load while one decodes: not when ``MOSAIC_PRELOAD=0``, not when layers
    are offloaded (a second copy of the weights on the device), and only while the memory to spare holds the
    model's bytes twice (its pages are the mapped files', shared but for the swapped unit; a CPU's repacked
    tensors and the context are its own)."""
    if os.environ.get("MOSAIC_PRELOAD", "1") == "0" or runtime.get("offloaded"):
        return False
    spare = memory_available()
    return spare is not None and spare >= 2 * model_bytes


class GGUFScorer:
    """Candidates as links to parts laid out once; each loaded by llama.cpp by its first part's name.

    While a candidate decodes, the next one (``then``) is loaded beside it in the worker, so the decode never
    waits on a load, where :func:`preload_allowed` says there is room for it."""

    def __init__(self, base: GGUFModel, donors: dict[str, GGUFModel], units: list[Unit],
                 ref: Reference, rows: Rows, workdir: Path, *, threads: int | None = None, verbose: bool = False,
                 gpu_layers: int | str | None = None, progress: Reporter = SILENT) -> None:
        self._rt = get_runtime(threads=threads, verbose=verbose, gpu_layers=gpu_layers)
        self._ref = ref
        #: this run's seconds loading candidates (waiting for a preloaded one), waiting for their logits, and in
        #: the panel; and how many candidates had been loaded while the one before decoded
        self.timing: dict[str, float] = {"load": 0.0, "decode": 0.0, "panel": 0.0, "preloaded": 0}
        self._parts: Parts = lay_out(workdir, base, units, donors, progress)
        first = self._parts.candidate({})
        self._check = check_gguf(first)  # the laid-out base, strictly, split keys and all
        self.batch = batch_size(ref.ctx, self._check.n_vocab or 1)
        b = self._open(first, base.describe())
        try:
            check_tokens(b, ref, rows)
        finally:
            b.close()
        self.runtime = self._rt.info.as_dict()  # after a load: the layers it offloaded
        self.preload = preload_allowed(self.runtime, base.size)
        self._ahead: tuple[frozenset, Preload] | None = None

    def _open(self, first: Path, name: str, ticket: Preload | None = None) -> GGUFBackend:
        t0 = time.perf_counter()
        try:
            model = self._rt.load(first, ctx=self._ref.ctx, batch=self.batch, name=name, ticket=ticket)
            return GGUFBackend(dataclasses.replace(self._check, first=first), name, self._rt, self._ref.ctx, self.batch, model)
        finally:
            self.timing["load"] += time.perf_counter() - t0

    def score(self, versions: Mapping[int, str], name: str, then: Next | None = None) -> dict:
        key = frozenset(versions.items())
        ahead, self._ahead = self._ahead, None
        ticket = ahead[1] if ahead is not None and ahead[0] == key else None
        if ahead is not None and ticket is None:
            self._rt.forget()  # not this candidate: its links are about to be re-pointed
        b = self._open(self._parts.candidate(versions), name, ticket)
        if ticket is not None:
            self.timing["preloaded"] += 1
        try:
            if then is not None and self.preload:
                # this model is loaded (mapped): its links can be re-pointed at the next one's parts
                path = self._parts.candidate(then[0])
                self._ahead = (frozenset(then[0].items()), self._rt.preload(path, ctx=self._ref.ctx, batch=self.batch,
                                                                            name=then[1]))
            return score_against(self._ref, [b], timing=self.timing)[0]
        finally:
            b.close()

    def release(self, pairs: Iterable[tuple[int, str]]) -> None:
        self._parts.release(pairs)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead = None
            self._rt.forget()


class Exl3Scorer:
    """exllamav3 on a CUDA GPU. A candidate is built as a mosaic with ``--link``: the shards that hold none of
    the unit's tensors are hard links, only those that do are written (of the order of the unit's shards, not
    of the model); it is loaded by exllamav3 and scored, then removed."""

    def __init__(self, base: object, donors: dict[str, object], units: list, ref: Reference,
                 rows: Rows, work: Path, progress: Reporter = SILENT) -> None:
        require_exl3_gpu("mosaic measure")
        import importlib.metadata

        self.runtime = {"name": "exllamav3", "version": importlib.metadata.version("exllamav3"), "threads": 1}
        self._base, self._donors, self._units, self._ref, self._rows = base, donors, units, ref, rows
        self._work = work
        self.timing: dict[str, float] = {"load": 0.0, "decode": 0.0, "panel": 0.0}
        work.mkdir(parents=True)
        self._checked = False

    def _score(self, folder: Path, name: str) -> dict:
        from mosaic._eval.backends import Exl3Backend

        t0 = time.perf_counter()
        b = Exl3Backend(folder, self._ref.ctx, batch_size(self._ref.ctx, 1 << 15))
        self.timing["load"] += time.perf_counter() - t0
        try:
            if not self._checked:
                check_tokens(b, self._ref, self._rows)
                self._checked = True
            return score_against(self._ref, [b], timing=self.timing)[0]
        finally:
            b.close()

    def score(self, versions: Mapping[int, str], name: str, then: Next | None = None) -> dict:
        """``then`` is not loaded ahead: on the GPU it would be a second copy of the weights."""
        import shutil

        import yaml

        from mosaic._build.run import build

        if not versions:
            return self._score(self._base.ckpt.root, name)  # type: ignore[attr-defined]
        rules: list[dict[str, object]] = []
        for ui, donor in sorted(versions.items()):
            u = self._units[ui]
            rule: dict[str, object] = {"from": donor, "layers": [u.layer]}
            if u.pattern:
                rule["modules"] = [u.pattern]
            rules.append(rule)
        recipe = self._work / "candidate.yaml"
        recipe.write_text(yaml.safe_dump({
            "name": "candidate", "base": {"path": str(self._base.ckpt.root.resolve())},  # type: ignore[attr-defined]
            "donors": {d: {"path": str(self._donors[d].ckpt.root.resolve())} for d in sorted(set(versions.values()))},  # type: ignore[attr-defined]
            "replace": rules}, sort_keys=False))
        out = self._work / "candidate"
        try:
            build(recipe, out=out, force=True, link=True, lock=False)  # inside the measurement's own work folder
            return self._score(out, name)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def release(self, pairs: Iterable[tuple[int, str]]) -> None:
        """Nothing is kept: each candidate is built, scored and removed."""

    def close(self) -> None:
        pass


def exl3_scorer(*args: object, **kwargs: object) -> Scorer:
    """exllamav3 on a CUDA GPU (the ``exl3`` extra): without one, one line says so."""
    return Exl3Scorer(*args, **kwargs)  # type: ignore[arg-type]
