"""The census of one checkpoint: what it holds and what is wrong with it, before anything is built.

:func:`analyze` joins the strict headers with EXL3 knowledge: modules, bits per layer and group,
codebooks (marker values read and checked), the exact trellis rate, and every problem a user must
see before building or serving: mixed codebooks, routed experts that exllamav3 could not fuse,
incomplete tensor groups, wrong markers, index ↔ header and quantization_config.json ↔ header
mismatches. The build's preflight and the audit use the same analysis; the census only reports.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property

from mosaic._checkpoint.exl3 import (
    GROUPS,
    Module,
    assign_codebooks,
    exact_rate,
    expert_group_problems,
    fusion_problems,
    group_modules,
    marker_names,
    module_problems,
    part_rates,
)
from mosaic._checkpoint.folder import Checkpoint, bulk, read_small_tensors, text_config
from mosaic._checkpoint.qconfig import WHERE

#: What the exact rate counts (census, PROVENANCE ``rate.exact``, the card and the README say the same).
RATE_DEFINITION = (
    "Σ bits × weights / Σ weights over the EXL3 linears of the decoder layers 0 .. num_hidden_layers-1 "
    "(attention, indexer, dense MLP, shared and routed experts); the MTP layers, the vision tower and the head "
    "are reported on their own lines and are not part of it"
)



@dataclass
class Analysis:
    """A checkpoint with its modules interpreted and its problems listed."""

    ckpt: Checkpoint
    modules: dict[str, Module]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Several codebooks in one checkpoint: a census problem, but loadable when whole fusion groups
    #: share one (the build's preflight and the audit check that rule instead).
    codebook_mix: str | None = None

    @property
    def all_problems(self) -> list[str]:
        return self.problems + ([self.codebook_mix] if self.codebook_mix else [])

    @property
    def num_hidden_layers(self) -> int | None:
        return self.ckpt.num_hidden_layers

    @cached_property
    def rate(self) -> Fraction | None:
        """The exact trellis rate from the headers (None for a partially opened checkpoint)."""
        if self.ckpt.partial:
            return None
        return exact_rate(self.modules.values(), self.num_hidden_layers)

    @property
    def nominal_rate(self) -> float | None:
        """The rate the checkpoint is published at: config.json's ``quantization_config.bits`` (the
        number a model card quotes, e.g. 2.05), else the exact rate."""
        qc = (self.ckpt.config or {}).get("quantization_config")
        bits = qc.get("bits") if isinstance(qc, dict) else None
        if isinstance(bits, (int, float)) and not isinstance(bits, bool):
            return float(bits)
        return float(self.rate) if self.rate is not None else None

    def codebooks(self) -> Counter[str]:
        return Counter(m.codebook for m in self.modules.values() if m.is_exl3 and m.codebook)

    def layers(self) -> list[int]:
        return sorted({m.info.layer for m in self.modules.values() if m.info.layer is not None})

    def layer_modules(self, layer: int) -> list[Module]:
        return [m for m in self.modules.values() if m.info.layer == layer]


def check_qconfig(ckpt: Checkpoint, modules: dict[str, Module]) -> list[str]:
    """quantization_config.json ↔ headers: every stored tensor's shape, n_bytes and dtype (checked as
    the file was read, :func:`mosaic._checkpoint.qconfig.summarize`), bits, markers, coverage."""
    q = ckpt.qconfig
    if q is None:
        return []
    if ckpt.storage is None:
        return [f"{WHERE}: no tensor_storage object"]
    problems: list[str] = []
    described: set[str] = set()
    for e in ckpt.storage:
        problems.extend(e.problems)
        if e.names is None:
            continue
        described.update(e.names)
        m = modules.get(e.key)
        if m is not None and m.is_exl3:
            if e.bits_per_weight != m.bits:
                problems.append(f"{WHERE}: {e.key}: bits_per_weight {e.bits_per_weight} but the trellis holds {m.bits}")
            for suf, mult in (("mul1", e.mul1_multiplier), ("mcg", e.mcg_multiplier)):
                if suf == m.marker_suffix:
                    if m.marker_value is not None and mult != m.marker_value:
                        problems.append(f"{WHERE}: {e.key}: {suf}_multiplier {mult} but the marker tensor holds {m.marker_value}")
                elif mult is not None:
                    problems.append(f"{WHERE}: {e.key}: {suf}_multiplier given but the module has no {suf} tensor")
    undescribed = [] if ckpt.tensor_file.keys() <= described else [n for n in ckpt.tensor_file if n not in described]
    if undescribed:
        problems.append(f"{WHERE}: {len(undescribed)} tensor(s) in the shards have no tensor_storage entry, e.g. {undescribed[0]!r}")
    qbits = q.get("bits")
    cbits = (ckpt.config or {}).get("quantization_config", {}).get("bits") if isinstance((ckpt.config or {}).get("quantization_config"), dict) else None
    if cbits is not None and qbits is not None and qbits != cbits:
        problems.append(f"{WHERE}: bits {qbits} but config.json's quantization_config.bits is {cbits}")
    return problems


@bulk()
def analyze(ckpt: Checkpoint) -> Analysis:
    """Interpret a checkpoint's tensors as EXL3 modules and collect every problem."""
    modules = group_modules(t for s in ckpt.shards for t in ckpt.headers[s].tensors)
    markers = [n for n in marker_names(modules) if ckpt.tensor(n).nbytes == 4]
    # a checkpoint opened from its headers has no marker bytes: codebooks come from the marker names,
    # and the values are checked where the bytes are read (a streamed build reads every one it uses)
    raw = {} if ckpt.headers_only else read_small_tensors(ckpt, markers)
    assign_codebooks(modules, {n: int.from_bytes(b, "little") for n, b in raw.items()})
    a = Analysis(ckpt, modules, list(ckpt.problems))
    if ckpt.headers_only and markers:
        a.notes.append(f"opened from its headers: {len(markers):,} codebook marker values not read (codebooks from their names)")
    for m in modules.values():
        a.problems.extend(module_problems(m))
    a.problems.extend(expert_group_problems(modules.values()))
    a.problems.extend(
        f"{m.key} ({m.codebook}) and {o.key} ({o.codebook}) are fused by exllamav3 but use different codebooks"
        for m, o in fusion_problems(modules)
    )
    books = a.codebooks()
    if len(books) > 1:
        a.codebook_mix = "mixed codebooks: " + ", ".join(f"{c} ({n} modules)" for c, n in sorted(books.items()))
    if not ckpt.partial:
        a.problems.extend(check_qconfig(ckpt, modules))
    if ckpt.config is not None:
        qc = ckpt.config.get("quantization_config")
        rate = a.rate
        bits = qc.get("bits") if isinstance(qc, dict) else None
        if rate is not None and isinstance(bits, (int, float)) and round(float(rate), 2) != bits:
            a.notes.append(
                    f"config.json: quantization_config.bits is {qc['bits']}, the headers give {float(rate):.4f}"
                )
        if isinstance(qc, dict) and books and qc.get("codebook") not in (None, *books):
            a.problems.append(f"config.json: codebook {qc.get('codebook')!r} but the markers say {', '.join(books)}")
    else:
        a.notes.append("no config.json")
    return a


def _bits_label(bits: set[float | None]) -> str:
    vals = sorted(b for b in bits if b is not None)
    return "/".join(f"{b:g}" for b in vals) if vals else "-"


@bulk()
def census_report(a: Analysis) -> dict[str, object]:
    """The census as a JSON-ready dict (what ``mosaic census --json`` prints)."""
    ck = a.ckpt
    hist: dict[str, dict[str, int]] = {}
    for m in a.modules.values():
        if m.is_exl3 and m.bits is not None:
            h = hist.setdefault(f"{m.bits:g}", {"modules": 0, "weights": 0})
            h["modules"] += 1
            h["weights"] += m.weights
    n_layers = a.num_hidden_layers
    layers = []
    by_layer: dict[int, list[Module]] = {}  # one pass, not one per layer (52,000 modules × 46 layers)
    for m in a.modules.values():
        if m.info.layer is not None:
            by_layer.setdefault(m.info.layer, []).append(m)
    for layer in sorted(by_layer):
        groups: dict[str, dict[str, object]] = {}
        for m in by_layer[layer]:
            if not m.is_exl3:
                continue
            g = groups.setdefault(m.info.group, {"bits": set(), "modules": 0, "codebooks": set()})
            g["bits"].add(m.bits)  # type: ignore[union-attr]
            g["codebooks"].add(m.codebook)  # type: ignore[union-attr]
            g["modules"] += 1  # type: ignore[operator]
        rate = exact_rate(by_layer[layer], None)
        kinds = text_config(ck.config or {}).get("layer_types")
        mtp = n_layers is not None and layer >= n_layers
        kind = kinds[layer] if isinstance(kinds, list) and layer < len(kinds) and isinstance(kinds[layer], str) else None
        layers.append(
            {
                "layer": layer,
                "mtp": mtp,
                "kind": kind,
                "rate": float(rate) if rate is not None else None,
                "groups": {
                    k: {"bits": sorted(v["bits"]), "modules": v["modules"], "codebooks": sorted(v["codebooks"])}  # type: ignore[arg-type]
                    for k, v in sorted(groups.items(), key=lambda kv: GROUPS.index(kv[0]) if kv[0] in GROUPS else 99)
                },
            }
        )
    head = [m for m in a.modules.values() if m.is_exl3 and m.info.group == "head"]
    rate = a.rate
    qc = (ck.config or {}).get("quantization_config") if ck.config else None
    return {
        "path": str(ck.root),
        "shards": len(ck.shards),
        "tensors": len(ck.tensor_file),
        "modules": len(a.modules),
        "exl3_modules": sum(1 for m in a.modules.values() if m.is_exl3),
        "bytes": {"files": ck.shard_bytes, "tensors": ck.tensor_bytes},
        "codebooks": dict(sorted(a.codebooks().items())),
        "bits_histogram": dict(sorted(hist.items(), key=lambda kv: float(kv[0]))),
        "num_hidden_layers": n_layers,
        "layers": layers,
        "head_bits": sorted({m.bits for m in head if m.bits is not None}),
        "rate": {
            "exact": float(rate) if rate is not None else None,
            "exact_fraction": f"{rate.numerator}/{rate.denominator}" if rate is not None else None,
            "config": qc.get("bits") if isinstance(qc, dict) else None,
            "definition": RATE_DEFINITION,
            # the parts the exact rate leaves out, each on its own line
            **{part: float(r) for part, r in sorted(part_rates(a.modules.values(), n_layers).items()) if part != "decoder"},
        },
        "problems": a.all_problems,
        "notes": a.notes,
    }
