"""``mosaic build --stream``: read from the hub exactly the bytes a plan takes from each source.

A streamed source is a :class:`~mosaic._hub.partial.PartialSnapshot` whose headers and small files
were read to plan the build. This stage, between the layout and the splice, reads the rest the layout
needs: every byte of the base that goes into the output (an untouched shard whole, so it is checked
against its LFS SHA-256; a spliced shard's kept tensors), and only the selected tensors of a donor.
Ranges already in the cache are hashed again and reused; parallel requests, retries and resume are
the partial snapshot's. The splice then runs unchanged on the local copies.
"""

from __future__ import annotations

from mosaic._build.layout import BuildPlan
from mosaic._checkpoint.exl3 import MARKERS
from mosaic._checkpoint.folder import read_small_tensors
from mosaic._base.errors import VerificationError
from mosaic._hub.partial import PartialSnapshot
from mosaic._base.progress import SILENT, Reporter


def wanted_ranges(plan: BuildPlan, sid: str) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of each file of source ``sid`` that the output is made of."""
    out: dict[str, list[tuple[int, int]]] = {}
    for shard in plan.shards:
        if shard.untouched and sid == "base":
            size = plan.sources["base"].ckpt.root.joinpath(shard.name).stat().st_size
            out.setdefault(shard.name, []).append((0, size))
            continue
        for t in shard.tensors:
            if t.source == sid and t.nbytes:
                out.setdefault(t.source_file, []).append((t.source_offset, t.source_offset + t.nbytes))
    for name in plan.used_files.get(sid, []):
        if name not in plan.sources[sid].ckpt.headers:  # configs, index, tokenizer: whole (read when opened)
            size = plan.sources[sid].ckpt.root.joinpath(name).stat().st_size
            if size:
                out.setdefault(name, []).append((0, size))
    return out


def read_plan_ranges(plan: BuildPlan, partial: dict[str, PartialSnapshot], *, jobs: int = 8,
                     progress: Reporter = SILENT) -> dict[str, int]:
    """Make every range the plan reads from a streamed source present locally; bytes read per source."""
    return {sid: snap.ensure(wanted_ranges(plan, sid), jobs=jobs, progress=progress) for sid, snap in partial.items()}


def check_markers(plan: BuildPlan, streamed: dict[str, PartialSnapshot]) -> int:
    """Read and check every codebook marker a streamed source gives the mosaic (the plan took the
    codebooks from the markers' names, since only headers were present then). Returns markers checked."""
    n = 0
    for sid in streamed:
        ckpt = plan.sources[sid].ckpt
        names = [t.name for s in plan.shards for t in s.tensors
                 if t.source == sid and t.nbytes == 4 and t.name.rsplit(".", 1)[-1] in MARKERS]
        for name, raw in read_small_tensors(ckpt, names).items():
            want = MARKERS[name.rsplit(".", 1)[-1]]
            got = int.from_bytes(raw, "little")
            if got != want:
                raise VerificationError(
                    f"{streamed[sid].repo}@{streamed[sid].revision}: {ckpt.tensor_file[name]}: tensor {name!r}: "
                    f"marker value {got:#010x} read from the hub, expected {want:#010x}"
                )
            n += 1
    return n
