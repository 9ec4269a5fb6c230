"""The build plan: every output file's name, header bytes, tensor offsets and exact size, and the
bytes of every metadata file, fixed before a single data byte is written.

From the recipe, the analysed sources and the selection, the plan lays out the base's shards (same
names, same tensor order, selected tensors from their donors), decides which shards are untouched
(copied whole, byte-identical), derives the index, config.json and quantization_config.json, checks
that those agree with the planned headers, and computes the mosaic's rates. Nothing here writes.
"""

from __future__ import annotations

import fnmatch
import operator
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import repeat
from pathlib import Path
from typing import NamedTuple

from mosaic._build import metadata
from mosaic._build.metadata import cut_members
from mosaic._recipe.exl3_rules import Selection
from mosaic._checkpoint.census_exl3 import Analysis
from mosaic._checkpoint.exl3 import Module, exact_rate, is_decoder_linear, part_rates
from mosaic._checkpoint.folder import CONFIG_NAME, INDEX_NAME, QCONFIG_NAME, Checkpoint, bulk
from mosaic._checkpoint.qconfig import entries_of, is_top_member, parse_span
from mosaic._base.errors import SourceError
from mosaic._formats.safetensors_reader import strict_json_loadb
from mosaic._formats.safetensors_writer import OutTensor, ShardLayout, layout_shard
from mosaic._recipe.document import Recipe
from mosaic._provenance.records import CARD_NAME, MANIFEST_NAME, PROVENANCE_NAME, RECIPE_NAME

#: Files a mosaic writes itself; the base's own copies describe the base, not the mosaic.
OWN_FILES = frozenset({RECIPE_NAME, PROVENANCE_NAME, MANIFEST_NAME, CARD_NAME, INDEX_NAME, CONFIG_NAME, QCONFIG_NAME})


_NAME, _DTYPE, _SHAPE, _BEGIN, _END = (operator.attrgetter(f) for f in ("name", "dtype", "shape", "begin", "end"))


class PlannedTensor(NamedTuple):
    """One output tensor and where its bytes come from (a named tuple: 151,000 per GLM-5.3 plan)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute position in the output file
    source: str  # "base" or a donor id
    source_file: str  # logical name inside the source folder
    source_offset: int  # absolute position in the source file


@dataclass
class ShardPlan:
    name: str
    tensors: list[PlannedTensor]
    size: int
    copy_of: Path | None = None  # untouched: the base file, copied whole
    layout: ShardLayout | None = None

    @property
    def untouched(self) -> bool:
        return self.copy_of is not None


@dataclass(frozen=True)
class CarriedFile:
    name: str
    path: Path
    size: int


@dataclass(frozen=True)
class Rates:
    """The mosaic's exact rate from its headers, and the two derivations a model card quotes, which
    start from the sources' published (nominal) rates."""

    exact: Fraction | None
    base: float | None
    donors: dict[str, float | None]
    by_bytes: float | None
    by_layer_mass: float | None
    #: MTP layers, vision tower, head: the EXL3 linears the exact rate leaves out, each on its own line
    outside: dict[str, Fraction] = field(default_factory=dict)


@dataclass
class BuildPlan:
    recipe: Recipe
    sources: dict[str, Analysis]  # "base" first, then donors in recipe order
    selection: Selection
    shards: list[ShardPlan]
    carried: list[CarriedFile]
    generated: dict[str, bytes | metadata.SplicedText]  # name -> exact bytes (index, configs, recipe copy)
    rates: Rates
    used_files: dict[str, list[str]] = field(default_factory=dict)  # source id -> logical names read

    @property
    def shard_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for s in self.shards for t in s.tensors)

    def bytes_to_write(self, link: bool = False) -> int:
        shards = sum(s.size for s in self.shards if not (link and s.untouched))
        return shards + sum(f.size for f in self.carried) + sum(len(b) for b in self.generated.values())


def _excluded(name: str, globs: tuple[str, ...]) -> bool:
    base = name.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(base, g) for g in globs)


def carried_files(base: Analysis, exclude: tuple[str, ...]) -> list[CarriedFile]:
    """The base's other files that go into the mosaic unchanged."""
    ck = base.ckpt
    shard_set = set(ck.shards)
    out = []
    for name in ck.files:
        if name in shard_set or name in OWN_FILES or name.lower() == "readme.md" or _excluded(name, exclude):
            continue
        if name.endswith(".safetensors"):
            continue  # a stray shard: the census reports it, the preflight refuses it
        p = ck.root / name
        out.append(CarriedFile(name, p, p.stat().st_size))
    return out


def layer_mass_rate(result: dict[str, Module], selection: Selection, rates: dict[str, float | None], n_layers: int | None) -> float | None:
    """Equal-layer average: each decoder layer counts at the rate of the source that supplies most of
    its quantized weights (the seed card's (33 × 2.05 + 12 × 3.05) / 45)."""
    weights: dict[int, dict[str, int]] = {}
    for m in result.values():
        if not is_decoder_linear(m, n_layers):
            continue
        trellis = f"{m.key}.trellis"
        src = selection.donor_of.get(trellis, "base")
        layer = m.info.layer
        assert layer is not None
        w = weights.setdefault(layer, {})
        w[src] = w.get(src, 0) + m.weights
    if not weights:
        return None
    total = 0.0
    for per_src in weights.values():
        src = max(sorted(per_src), key=lambda s: (per_src[s], s == "base"))
        r = rates.get(src)
        if r is None:
            return None
        total += r
    return total / len(weights)


def _from_file(data: bytes | metadata.SplicedText, ck: Checkpoint, name: str) -> bytes | metadata.SplicedText:
    """A spliced base text (one :meth:`Checkpoint.read_again` proved to be the bytes its census
    read), to be read again from the base's file when written: the plan holds its cuts, not 64 MB of
    base text, through the splice."""
    return data.from_file(ck.root / name, ck.digests[name]) if isinstance(data, metadata.SplicedText) else data


def _qconfig(
    bck: Checkpoint, sources: dict[str, Analysis], selection: Selection, plan_tensors: dict[str, PlannedTensor], rate: Fraction | None
) -> tuple[bytes | metadata.SplicedText, set[str]]:
    """The mosaic's quantization_config.json (and the donors it takes entries from): the base's text
    with the entries that hold a donor's tensors spliced in from that donor's text, checked against
    the planned headers.

    Only those entries are parsed, from texts proved (by digest) to be the ones the censuses read,
    one text at a time; every other entry was checked against the base's headers by its census and
    is written as the base's own bytes, for tensors whose planned header entries are the base's."""
    replaced: dict[str, str] = {}
    donor_of = selection.donor_of
    for e in bck.storage or ():
        for name in e.names or ():
            if name in donor_of:
                replaced[e.key] = donor_of[name]
    donors_used = sorted(set(replaced.values()))
    # what each replaced entry becomes: its member text cut from the donor's text (the entry itself
    # is checked, then let go: the text is all the writer needs), or, for a donor whose text cannot
    # be cut, the entry (the document is then written anew)
    cuts: dict[str, bytes] = {}
    uncut: dict[str, object] = {}
    for did in donors_used:
        ck = sources[did].ckpt
        keys = [k for k, d in replaced.items() if d == did]
        entries: dict[str, object] = {}
        if ck.qconfig is not None:
            text = ck.read_again(QCONFIG_NAME)
            held = ck.qconfig.get("tensor_storage")
            # the donor's entries are cut out by the spans its census proved (a donor opened for
            # some modules holds them too: the cuts must be those), else parsed from the whole text
            spans = ck.entry_spans(keys)
            if spans is not None and len(spans) == len(keys) and ck.partial_spans is not None and isinstance(held, dict):
                # held entries were parsed from exactly these proved spans of this very text
                # (read_again proved the bytes): cut the members without parsing them again
                cut = {k: (text[a:e], held[k]) for k, (a, e) in spans.items() if k in held} if all(k in held for k in keys) else None
            else:
                cut = cut_members(text, spans) if spans is not None and len(spans) == len(keys) else None
            if cut is not None and (not isinstance(held, dict) or all(held.get(k) == cut[k][1] for k in keys)):
                for k in keys:
                    cuts[k], entries[k] = cut[k]
            else:
                entries = {k: held[k] for k in keys if k in held} if isinstance(held, dict) else entries_of(text, keys, None, ck.root / QCONFIG_NAME)
                uncut.update(entries)
            del text, cut
        for k in keys:
            if k not in entries:
                raise SourceError(
                    f"donor {did!r}: quantization_config.json has no tensor_storage entry for {k}, "
                    "so the mosaic's entry cannot be taken from it"
                )
        bad = metadata.storage_mismatches({"tensor_storage": entries}, plan_tensors)
        if bad:
            raise SourceError(f"quantization_config.json would disagree with the output headers: {bad[0]}")
        del entries
    members = cuts if not uncut else None
    top = bck.qconfig or {}
    new_bits = metadata.exl3_bits(rate) if rate is not None and "bits" in top else None
    base_text = bck.read_again(QCONFIG_NAME)

    def whole() -> dict:
        full = strict_json_loadb(base_text)
        assert isinstance(full, dict)
        entries = dict(uncut)
        for k, m in cuts.items():
            kv = parse_span(m, (0, len(m)))
            if kv is None or kv[0] != k:  # every cut was checked to be its member when it was made
                raise SourceError(f"quantization_config.json: the entry cut for {k} is not one member")
            entries[k] = kv[1]
        return metadata.expected_qconfig(full, {did: {"tensor_storage": entries} for did in donors_used}, replaced, rate)

    spans = bck.entry_spans(replaced)
    bits = (top["bits"], new_bits) if new_bits is not None else None
    off = bck.storage_offsets

    def top_level(span: tuple[int, int]) -> bool:
        return off is not None and is_top_member(base_text, zip(off[0::2], off[1::2]), span, "bits")

    return metadata.new_qconfig(base_text, spans, members, bits, whole, top_level), set(donors_used)


@bulk()
def make_plan(recipe: Recipe, sources: dict[str, Analysis], selection: Selection) -> BuildPlan:
    """Lay out every output file of the mosaic. Raises if the derived metadata would disagree."""
    base = sources["base"]
    bck = base.ckpt
    shards: list[ShardPlan] = []
    used: dict[str, set[str]] = {sid: set() for sid in sources}
    paths: dict[tuple[str, str], str] = {}
    for shard in bck.shards:
        h = bck.headers[shard]
        used["base"].add(shard)
        names = list(map(_NAME, h.tensors))
        if not any(map(selection.donor_of.__contains__, names)):
            # an untouched shard: its tensors as they are, built a column at a time (most of the model)
            n = len(names)
            starts = [h.data_start + b for b in map(_BEGIN, h.tensors)]
            sizes = list(map(operator.sub, map(_END, h.tensors), map(_BEGIN, h.tensors)))
            columns = zip(names, map(_DTYPE, h.tensors), map(_SHAPE, h.tensors), sizes, starts,
                          repeat("base", n), repeat(shard, n), starts)
            tensors = list(map(tuple.__new__, repeat(PlannedTensor), columns))
            shards.append(ShardPlan(shard, tensors, h.file_size, copy_of=bck.root / shard))
            continue
        outs: list[OutTensor] = []
        origin: list[tuple[str, str, int]] = []
        for t in h.tensors:
            sid = selection.donor_of.get(t.name, "base")
            ck = sources[sid].ckpt
            sfile = ck.tensor_file[t.name]
            sh = ck.headers[sfile]
            st = sh[t.name]
            a = sh.data_start + st.begin
            used[sid].add(sfile)
            path = paths.get((sid, sfile))
            if path is None:
                path = paths[(sid, sfile)] = str(ck.root / sfile)
            outs.append(OutTensor(t.name, st.dtype, st.shape, st.nbytes, path, a))
            origin.append((sid, sfile, a))
        layout = layout_shard(outs, h.metadata)
        tensors = [
            PlannedTensor(o.name, o.dtype, o.shape, o.nbytes, off, sid, sfile, soff)
            for o, off, (sid, sfile, soff) in zip(outs, layout.offsets, origin)
        ]
        shards.append(ShardPlan(shard, tensors, layout.size, layout=layout))

    result = selection.result
    n_layers = base.num_hidden_layers
    rate = exact_rate(result.values(), n_layers)
    src_rates = {sid: a.nominal_rate for sid, a in sources.items()}
    plan_tensors = {t.name: t for s in shards for t in s.tensors}
    tensor_bytes = sum(t.nbytes for t in plan_tensors.values())
    shard_bytes = sum(s.size for s in shards)

    generated: dict[str, bytes | metadata.SplicedText] = {RECIPE_NAME: recipe.raw}
    if bck.index is not None:
        generated[INDEX_NAME] = _from_file(metadata.new_index(bck.read_again(INDEX_NAME), bck.index, tensor_bytes), bck, INDEX_NAME)
        used["base"].add(INDEX_NAME)
    if bck.config is not None:
        generated[CONFIG_NAME] = metadata.new_config(bck.config, rate)
        used["base"].add(CONFIG_NAME)
    if bck.qconfig is not None:
        qconfig, donors_used = _qconfig(bck, sources, selection, plan_tensors, rate)
        generated[QCONFIG_NAME] = _from_file(qconfig, bck, QCONFIG_NAME)
        used["base"].add(QCONFIG_NAME)
        for did in donors_used:
            used[did].add(QCONFIG_NAME)
    del plan_tensors

    carried = carried_files(base, recipe.exclude)
    used["base"].update(f.name for f in carried)
    base_rate = src_rates["base"]
    by_bytes = base_rate * shard_bytes / bck.shard_bytes if base_rate is not None and bck.shard_bytes else None
    rates = Rates(
        exact=rate,
        base=base_rate,
        donors={sid: r for sid, r in src_rates.items() if sid != "base"},
        by_bytes=by_bytes,
        by_layer_mass=layer_mass_rate(result, selection, src_rates, n_layers),
        outside={k: v for k, v in part_rates(result.values(), n_layers).items() if k != "decoder"},
    )
    used_sorted = {sid: sorted(v) for sid, v in used.items()}
    return BuildPlan(recipe, sources, selection, shards, carried, generated, rates, used_sorted)
