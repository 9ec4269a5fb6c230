"""A GGUF mosaic's preflight and layout: every output byte position known before anything is written.

Preflight: the base and every donor must be the same model — one ``general.architecture``; every
metadata key that shapes the graph or the tokenizer present in both with equal values (all keys but
``general.*`` descriptions, ``split.*``, ``quantize.*`` and ``mosaic.*``; ``general.architecture``
and ``general.quantization_version`` are compared too); the same tensor names with the same shapes.
Per-tensor types may differ: llama.cpp reads each tensor's own type.

Layout: the base's tensors in the base's order, each selected one with the donor's type and bytes;
the base's metadata, kept as it is (``general.file_type`` included: like ``llama-quantize
--tensor-type``, a mosaic keeps the file type of the quantization it starts from, and the real type of
every tensor is in its tensor info, PROVENANCE.json and the card), plus a few ``mosaic.*`` keys; the
base's alignment. Split like ``llama-gguf-split --split-max-size``: a new part starts when the next
tensor (padded) would take the current part's tensor bytes past the limit; the first part holds the
metadata, every part the ``split.*`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from mosaic._base.version import __version__
from mosaic._checkpoint.gguf_model import SPLIT_KEYS, GGUFModel, GGUFTensor, bits_per_weight, split_name
from mosaic._base.errors import RecipeError, SourceError
from mosaic._formats.gguf_container import (
    ARRAY,
    INT32,
    KV,
    STRING,
    UINT16,
    UINT32,
    Layout,
    align,
    layout,
    type_name,
)
from mosaic._recipe.gguf_rules import SelectionProblem, assign
from mosaic._sources.gguf import open_gguf_source
from mosaic._recipe.document import Recipe

#: Metadata that describes a file rather than the model's graph or tokenizer: not compared.
UNCOMPARED_PREFIXES = ("general.", "split.", "quantize.", "mosaic.")
#: Keys under those prefixes that do change what the runtime computes: compared. (ranma.cpp's EXL3
#: types are decoded with the file's one codebook; imatrix and bit-rate keys describe a quantization.)
COMPARED_GENERAL = ("general.architecture", "general.quantization_version", "quantize.exl3.codebook")


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: where it goes (file, offset from the data start) and where it comes from."""

    name: str
    ne: tuple[int, ...]
    type_id: int
    nbytes: int
    file: str
    offset: int
    source: str
    src: GGUFTensor


@dataclass
class GGUFPlan:
    recipe: Recipe
    models: dict[str, GGUFModel]
    assignment: dict[str, tuple[str, int]]
    kvs: list[KV]
    files: list[tuple[str, Layout]]
    tensors: list[OutTensor] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(lay.size for _, lay in self.files)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bytes_to_write(self, link: bool = False) -> int:
        return self.size

    @property
    def source_roots(self) -> list[Path]:
        """The source files: an output may sit beside them (GGUF files share model folders), never
        be one of them or hold one (``--force`` replaces the output folder)."""
        return [m.path(f) for m in self.models.values() for f in m.files]

    def used_files(self) -> dict[str, list[str]]:
        """Source id -> the source files the mosaic takes tensors from (the base: all of its files)."""
        out: dict[str, list[str]] = {"base": list(self.models["base"].files)}
        for sid, m in self.models.items():
            if sid != "base":
                used = {t.src.file for t in self.tensors if t.source == sid}
                out[sid] = [f for f in m.files if f in used]
        return out

    def rates(self) -> dict[str, object]:
        """Bits per weight (8 x tensor bytes / weights, llama.cpp's BPW) of the mosaic and of each
        source, each beside the base's figure over the same tensors: ``exact`` and ``base`` over every
        tensor; ``by_bytes`` and ``base_by_bytes`` over the files, headers included; ``by_layer_mass``
        and ``base_layer_mass`` over the ``blk.N`` tensors only (what a layer choice moves: the
        embeddings and the output head, often at higher precision, are left out of both)."""
        outs = [_as_tensor(t) for t in self.tensors]
        exact = bits_per_weight(outs)
        weights = sum(t.elements for t in outs)
        base = self.models["base"]
        base_weights = sum(t.elements for t in base.tensors)
        return {
            "exact": exact,
            "by_bytes": Fraction(8 * self.size, weights) if weights else None,
            "by_layer_mass": bits_per_weight([t for t in outs if t.layer is not None]),
            "base": bits_per_weight(base.tensors),
            "base_by_bytes": Fraction(8 * base.size, base_weights) if base_weights else None,
            "base_layer_mass": bits_per_weight([t for t in base.tensors if t.layer is not None]),
            "donors": {sid: bits_per_weight(m.tensors) for sid, m in self.models.items() if sid != "base"},
        }


def _as_tensor(t: OutTensor) -> GGUFTensor:
    return GGUFTensor(t.name, t.ne, t.type_id, t.nbytes, t.file, t.offset)


def _show(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _kv_difference(a: KV, b: KV) -> str | None:
    """How the donor's value differs from the base's, or None when they are equal."""
    if (a.vtype, a.item) != (b.vtype, b.item):
        return "has another value type"
    if a.value == b.value:
        return None
    if a.vtype == ARRAY and isinstance(a.value, list) and isinstance(b.value, list):
        if len(a.value) != len(b.value):
            return f"has {len(b.value)} entries, the base {len(a.value)}"
        i = next(i for i, (x, y) in enumerate(zip(a.value, b.value)) if x != y)
        return f"differs at index {i}: {_show(b.value[i])}, the base has {_show(a.value[i])}"
    return f"is {_show(b.value)}, the base has {_show(a.value)}"


def compared_keys(kvs: dict[str, KV]) -> dict[str, KV]:
    return {k: v for k, v in kvs.items() if k in COMPARED_GENERAL or not k.startswith(UNCOMPARED_PREFIXES)}


def check_same_model(base: GGUFModel, sid: str, donor: GGUFModel) -> None:
    """Refuse a donor that is not the base's model, naming the key or tensor (SourceError, exit 2)."""
    where = f"donor {sid!r} ({donor.describe()})"
    a, b = compared_keys(base.metadata), compared_keys(donor.metadata)
    for k in a:
        if k not in b:
            raise SourceError(f"{where}: key {k!r} is missing (the base has it): not the same model")
        diff = _kv_difference(a[k], b[k])
        if diff:
            raise SourceError(f"{where}: key {k!r} {diff}: not the same model")
    for k in b:
        if k not in a:
            raise SourceError(f"{where}: key {k!r} is not in the base: not the same model")
    bt, dt = base.by_name(), donor.by_name()
    for name, t in bt.items():
        d = dt.get(name)
        if d is None:
            raise SourceError(f"{where}: tensor {name!r} is missing: not the same model")
        if d.ne != t.ne:
            raise SourceError(f"{where}: tensor {name!r} has shape {list(d.ne)}, the base {list(t.ne)}")
    extra = [n for n in dt if n not in bt]
    if extra:
        raise SourceError(f"{where}: tensor {extra[0]!r} is not in the base: not the same model")


def mosaic_keys(recipe: Recipe, n_donor: int) -> list[KV]:
    """What the file itself says about how it was made."""
    return [
        KV("mosaic.version", STRING, __version__),
        KV("mosaic.recipe.name", STRING, recipe.name),
        KV("mosaic.recipe.sha256", STRING, recipe.sha256),
        KV("mosaic.tensors.from_donors", UINT32, n_donor),
    ]


def _split_keys(no: int, count: int, total: int) -> list[KV]:
    return [KV("split.no", UINT16, no), KV("split.count", UINT16, count), KV("split.tensors.count", INT32, total)]


def _parts(tensors: list[tuple[str, tuple[int, ...], int, int]], max_size: int | None, alignment: int) -> list[list]:
    """Tensors grouped into parts as ``llama-gguf-split --split-max-size`` groups them."""
    parts: list[list] = [[]]
    used = 0
    for t in tensors:
        n = align(t[3], alignment)
        if max_size is not None and parts[-1] and used + n > max_size:
            parts.append([])
            used = 0
        parts[-1].append(t)
        used += n
    return parts


def plan_gguf(recipe: Recipe, *, ranges: dict | None = None, keys: dict[str, object] | None = None) -> GGUFPlan:
    """Open the sources, run the preflight, select and lay out every output file. With ``ranges`` (a dict
    of partial snapshots by source id), hub sources missing from the cache are opened from their headers
    read by HTTP ranges, and their snapshots put there. ``keys``: the ``mosaic.*`` keys to write instead of
    this version's (a rebuild writes the published mosaic's own, so that its bytes are the published ones)."""
    used = {r.donor for r in recipe.rules}
    unused = [d for d in recipe.donors if d not in used]
    if unused:
        raise SourceError(f"{recipe.file}: donors: {', '.join(unused)} is used by no replace rule")
    models = {sid: open_gguf_source(spec, recipe.folder, ranges=ranges) for sid, spec in recipe.sources.items()}
    base = models["base"]
    for sid, m in models.items():
        if sid != "base":
            check_same_model(base, sid, m)
    names = [t.name for t in base.tensors]
    try:
        assignment = assign(recipe, names)
    except SelectionProblem as e:
        raise RecipeError(f"{recipe.file}: {e}") from None
    by_source = {sid: m.by_name() for sid, m in models.items()}
    picked = [by_source[assignment[n][0] if n in assignment else "base"][n] for n in names]
    sources = [assignment[n][0] if n in assignment else "base" for n in names]
    alignment = base.alignment
    kvs = [kv for kv in base.metadata.values() if not kv.key.startswith("mosaic.")]
    kvs += mosaic_keys(recipe, len(assignment)) if keys is None else [
        KV(k, STRING, v) if isinstance(v, str) else KV(k, UINT32, v) for k, v in keys.items()]
    specs = [(t.name, t.ne, t.type_id, t.nbytes) for t in picked]
    parts = _parts(specs, recipe.split_max_size, alignment)
    count = len(parts)
    files: list[tuple[str, Layout]] = []
    for i, part in enumerate(parts):
        fname = f"{recipe.name}.gguf" if count == 1 else split_name(recipe.name, i + 1, count)
        part_kvs = (kvs if i == 0 else []) + (_split_keys(i, count, len(specs)) if count > 1 else [])
        try:
            files.append((fname, layout(part_kvs, part, alignment)))
        except ValueError as e:
            raise SourceError(f"{base.describe()}: {e}") from None
    plan = GGUFPlan(recipe, models, assignment, kvs, files)
    k = 0
    for fname, lay in files:
        for info in lay.tensors:
            src = picked[k]
            plan.tensors.append(OutTensor(info.name, info.ne, info.type_id, info.nbytes, fname,
                                          lay.data_start + info.offset, sources[k], src))
            k += 1
    return plan


def selection_summary(plan: GGUFPlan) -> list[dict[str, object]]:
    """Per rule: what it took (for PROVENANCE ``selection`` and the card)."""
    out = []
    for rule in plan.recipe.rules:
        taken = [t for t in plan.tensors if plan.assignment.get(t.name, (None, -1))[1] == rule.index]
        item: dict[str, object] = {"rule": rule.index, "from": rule.donor}
        if rule.layers is not None:
            item["layers"] = list(rule.layers)
        if rule.keys is not None:
            item["keys"] = list(rule.keys)
        item["tensors"] = len(taken)
        item["bytes"] = sum(t.nbytes for t in taken)
        out.append(item)
    return out


def type_counts(tensors: list[OutTensor]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in tensors:
        counts[type_name(t.type_id)] = counts.get(type_name(t.type_id), 0) + 1
    return dict(sorted(counts.items()))


__all__ = ["SPLIT_KEYS", "GGUFPlan", "OutTensor", "check_same_model", "plan_gguf", "selection_summary"]
