"""What a measurement needs of its sources, per format: the units, each unit's versions and their exact
``dbytes``, the files' digests, the weight errors, the runtime, and the scorer that runs the candidates.

GGUF: the plan's GGUF units (:mod:`mosaic._plan.gguf_units`), weight errors from gguf-py's dequantization,
parts laid out once and candidates as links, llama.cpp on the CPU. EXL3: the plan's units (``mosaic plan
--unit``'s layer, layer-experts and module-group), ``dbytes`` from the plan's exact size model (headers
included), weight errors from exllamav3's reconstruction and exllamav3 on a CUDA GPU. The orchestration
(:mod:`.run`) and the document are the same for both.

``units`` are every unit of the measured kind in every layer — the top model of ``--method top-down`` holds
all of them at their best version — and ``selected`` the ones ``--only-layers`` measures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mosaic._base.errors import MosaicError, SourceError
from mosaic._base.progress import Reporter
from mosaic._build.digest_cache import file_records, folder_records
from mosaic._build.gguf_plan import check_same_model
from mosaic._checkpoint.gguf_model import GGUFModel
from mosaic._eval.reference import Reference, is_reference_file
from mosaic._eval.rows import Rows
from mosaic._formats.gguf_container import type_name
from mosaic._measure.backends import GGUFScorer, Scorer, exl3_scorer
from mosaic._measure.importance import Importance
from mosaic._measure.parts import part_bytes
from mosaic._measure.weights import Errors, exl3_errors, gguf_errors
from mosaic._plan.gguf_units import Unit, dbytes, default_unit, donor_has, gguf_units
from mosaic._sources.gguf import gguf_source, is_gguf_src, open_gguf_source


@dataclass
class Side:
    format: str
    unit: str
    layers: set[int] | None
    units: list[Unit]  # every unit of the kind, in (layer, group) order, the ones outside the layers last
    selected: list[int]  # the units measured (--only-layers), in the same order
    versions: list[list[str]]  # per unit: "base", then each donor that has it, in --donor order
    dbytes: dict[tuple[int, str], int]  # (unit, version) -> growth of the built mosaic ("base": 0)
    base_bytes: int
    base_files: list[dict]
    donor_files: dict[str, list[dict]]
    runtime: Callable[[], dict]
    same_bytes: Callable[[int, str], bool]
    space_needed: Callable[[Iterable[tuple[int, str]]], int]
    scorer: Callable[[Reference, Rows, Path, object, Reporter], Scorer]
    reference_files: Callable[[str, Reporter], list[dict]]
    weight_errors: Callable[[str | None, int, Reporter, Importance | None], Errors]
    tensors: dict[str, tuple[int, ...]]  # the base's tensors' ggml ne (GGUF; what an importance matrix is checked against)


def parse_layer_list(text: str) -> set[int]:
    """``0-5,9,12`` -> {0, 1, 2, 3, 4, 5, 9, 12}."""
    out: set[int] = set()
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise MosaicError(f"--only-layers {text!r}: not a list of layers and ranges like 0-5,9,12") from None
        if lo < 0 or hi < lo:
            raise MosaicError(f"--only-layers {text!r}: {part.strip()!r} is not a range")
        out.update(range(lo, hi + 1))
    return out


def _same_gguf_bytes(unit: Unit, base: GGUFModel, donor: GGUFModel) -> bool:
    """Does the donor hold exactly the base's bytes for every tensor of the unit?"""
    bt, dt = base.by_name(), donor.by_name()
    if any(bt[n].type_id != dt[n].type_id or bt[n].nbytes != dt[n].nbytes for n in unit.tensors):
        return False
    for n in unit.tensors:
        a, b = bt[n], dt[n]
        with open(base.path(a.file), "rb") as fa, open(donor.path(b.file), "rb") as fb:
            pos = 0
            while pos < a.nbytes:
                k = min(a.nbytes - pos, 8 << 20)
                fa.seek(a.start + pos)
                fb.seek(b.start + pos)
                if fa.read(k) != fb.read(k):
                    return False
                pos += k
    return True


def _distinct(unit: Unit, versions: list[str], base: GGUFModel, donors: dict[str, GGUFModel]) -> list[str]:
    """A ladder's versions of a unit with each distinct one once: a donor whose tensors are the same type and
    bytes as the base's or an earlier donor's is that version (narrow rows fall back to the same few types in
    many rungs; a rung keeps the source's bytes where its type has no fewer), measured once, under its first
    name, or the name of the rung whose own type it is, where one is (a Q4_K tensor copied into every rung of
    more bytes is the Q4_K rung's)."""
    def own(v: str) -> bool:
        by = donors[v].by_name()
        return all(type_name(by[n].type_id).lower() == v for n in unit.tensors)

    kept = ["base"]
    for v in versions[1:]:
        alike = next((i for i, k in enumerate(kept) if _same_gguf_bytes(unit, base if k == "base" else donors[k], donors[v])), None)
        if alike is None:
            kept.append(v)
        elif kept[alike] != "base" and own(v) and not own(kept[alike]):
            kept[alike] = v
    return kept


def _digests(records: list[dict]) -> dict[str, str]:
    return {r["name"]: r["sha256"] for r in records}


def gguf_side(req: object, progress: Reporter) -> Side:
    from mosaic._eval.worker import get_runtime

    r = req
    base_spec = gguf_source(r.base, "--base", "base")  # type: ignore[attr-defined]
    base = open_gguf_source(base_spec, Path.cwd())
    donors: dict[str, GGUFModel] = {}
    files: dict[str, list[dict]] = {}
    for did, src in r.donors:  # type: ignore[attr-defined]
        if not is_gguf_src(src):
            raise SourceError(f"--donor {did}: {src} is not a GGUF model, but the base is")
        spec = gguf_source(src, f"--donor {did}", did)
        donors[did] = open_gguf_source(spec, Path.cwd())
        check_same_model(base, did, donors[did])
        files[did] = file_records(donors[did], spec, progress)
    kind = r.unit or default_unit(base)  # type: ignore[attr-defined]
    only = parse_layer_list(r.only_layers) if r.only_layers else None  # type: ignore[attr-defined]
    chosen = {(u.layer, u.group) for u in gguf_units(base, kind, only)}  # checks the layers given
    units = gguf_units(base, kind, None)
    selected = [i for i, u in enumerate(units) if (u.layer, u.group) in chosen]
    versions = [["base", *(d for d in donors if donor_has(u, base, donors[d]))] for u in units]
    if r.ladder:  # type: ignore[attr-defined]
        versions = [_distinct(u, vs, base, donors) for u, vs in zip(units, versions)]
    sizes = {(ui, v): 0 if v == "base" else dbytes(units[ui], base, donors[v]) for ui, vs in enumerate(versions) for v in vs}
    base_files = file_records(base, base_spec, progress)

    def open_reference(src: str) -> tuple[GGUFModel, list[dict]]:
        spec = gguf_source(src, "--reference", "reference")
        model = open_gguf_source(spec, Path.cwd())
        return model, file_records(model, spec, progress)

    def reference_files(src: str, progress: Reporter) -> list[dict]:
        return open_reference(src)[1]

    def weight_errors(teacher: str | None, threads: int, progress: Reporter, importance: Importance | None) -> Errors:
        t = None
        if teacher is not None and not is_reference_file(teacher) and is_gguf_src(teacher):
            model, recs = open_reference(teacher)
            t = (model, _digests(recs))
        models: dict[str, object] = {"base": base, **donors}
        digests = {"base": _digests(base_files), **{d: _digests(files[d]) for d in donors}}
        return gguf_errors(units, models, digests, t, threads, progress, importance)

    def scorer(ref: Reference, rows: Rows, work: Path, req: object, progress: Reporter) -> Scorer:
        return GGUFScorer(base, donors, units, ref, rows, work, threads=req.threads,  # type: ignore[attr-defined]
                          verbose=req.verbose, gpu_layers=req.gpu_layers, progress=progress)  # type: ignore[attr-defined]

    return Side(
        "gguf", kind, only, units, selected, versions, sizes, base.size, base_files, files,
        lambda: get_runtime(threads=r.threads, verbose=r.verbose, gpu_layers=r.gpu_layers).info.as_dict(),  # type: ignore[attr-defined]
        lambda ui, d: _same_gguf_bytes(units[ui], base, donors[d]),
        lambda pairs: part_bytes(base, units, donors, pairs),
        scorer, reference_files, weight_errors, {t.name: t.ne for t in base.tensors},
    )


#: The scorer EXL3 measurements use (exllamav3 on a GPU); tests put a stand-in here.
EXL3_SCORER: Callable[..., Scorer] = exl3_scorer
EXL3_RUNTIME: Callable[[], dict] = lambda: _exllamav3_runtime()  # noqa: E731


def _exllamav3_runtime() -> dict:
    from mosaic._eval.backends import require_exl3_gpu

    require_exl3_gpu("mosaic measure")
    import importlib.metadata

    return {"name": "exllamav3", "version": importlib.metadata.version("exllamav3"), "threads": 1}


def exl3_side(req: object, progress: Reporter) -> Side:
    from mosaic._plan.costs import SizeModel
    from mosaic._plan.planner import _check_candidates, _load, parse_source
    from mosaic._plan.units import find_units

    r = req
    runtime = EXL3_RUNTIME() if r.method != "weights" else None  # type: ignore[attr-defined]  # one line without a GPU
    base_spec, base_dir = parse_source(r.base, "--base", "base")  # type: ignore[attr-defined]
    base = _load(base_spec, base_dir, "base")
    donors = {}
    for did, src in r.donors:  # type: ignore[attr-defined]
        if is_gguf_src(src):
            raise SourceError(f"--donor {did}: {src} is a GGUF model, but the base is an EXL3 folder")
        spec, folder = parse_source(src, f"--donor {did}", did)
        donors[did] = _load(spec, folder, did)
    kind = r.unit or ("layer-experts" if any(m.info.group == "routed_experts" for m in base.modules.values())  # type: ignore[attr-defined]
                      else "layer")
    only = parse_layer_list(r.only_layers) if r.only_layers else None  # type: ignore[attr-defined]
    all_units = find_units(base, kind)
    if only is not None:
        missing = sorted(only - {u.layer for u in all_units})
        if missing:
            raise MosaicError(f"--only-layers: the base has no layer {missing[0]} with units of kind {kind}")
    _check_candidates(base, donors, all_units)
    model = SizeModel(base, donors, all_units)
    plain = model.size({})
    units = [Unit(u.layer, u.pattern, u.modules) for u in all_units]
    selected = [i for i, u in enumerate(all_units) if only is None or u.layer in only]
    versions = [["base", *donors] for _ in all_units]
    sizes = {(i, d): 0 if d == "base" else model.size({all_units[i].index: d}) - plain for i, vs in enumerate(versions) for d in vs}
    base_files = folder_records(base, progress)
    donor_files = {d: folder_records(a, progress) for d, a in donors.items()}

    def reference_files(src: str, progress: Reporter) -> list[dict]:
        spec, folder = parse_source(src, "--reference", "reference")
        return folder_records(_load(spec, folder, "reference"), progress)

    def weight_errors(teacher: str | None, threads: int, progress: Reporter, importance: Importance | None) -> Errors:
        digests = {"base": _digests(base_files), **{d: _digests(donor_files[d]) for d in donors}}
        t = None
        if teacher is not None and not is_reference_file(teacher) and Path(teacher).is_dir():
            t = Path(teacher)
        return exl3_errors(units, {"base": base, **donors}, digests, t, threads, progress)

    def scorer(ref: Reference, rows: Rows, work: Path, req: object, progress: Reporter) -> Scorer:
        return EXL3_SCORER(base, donors, all_units, ref, rows, work, progress=progress)

    return Side("exl3", kind, only, units, selected, versions, sizes, base.ckpt.shard_bytes, base_files, donor_files,
                lambda: runtime if runtime is not None else EXL3_RUNTIME(), lambda ui, d: False, lambda pairs: 0,
                scorer, reference_files, weight_errors, {})
