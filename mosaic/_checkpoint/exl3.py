"""What mosaic knows about EXL3 checkpoints (see shared/reference/exl3-format.md).

Tensors group into modules by their parent key; a module with a ``.trellis`` tensor is an EXL3
linear whose bits come from the trellis shape (``shape[-1] / 16``, whole or half rates) and whose
codebook comes from its marker tensor (``mul1`` / ``mcg`` / none = ``3inst``). Layers are read from
keys such as ``model.layers.N.`` and ``model.language_model.layers.N.``; routed experts are grouped
per layer and projection, because exllamav3 fuses them at load and they must share bits and codebook.

This module only interprets names and header entries (plus 4-byte marker values handed to it); it
never opens files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache

from mosaic._formats.safetensors_reader import TensorInfo

QUANT_SUFFIXES = frozenset({"trellis", "suh", "svh", "su", "sv", "mul1", "mcg", "bias"})
MARKERS = {"mul1": 0x83DCD12D, "mcg": 0xCBAC1FED}
WHOLE_BITS = frozenset(range(1, 9))
HALF_BITS = frozenset({1.5, 2.5, 3.5})

_LAYER_RE = re.compile(r"^(?P<prefix>(?:[A-Za-z0-9_]+\.)*?)layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
_EXPERT_RE = re.compile(r"^(?P<mlp>(?:mlp|block_sparse_moe|feed_forward)\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.vision_model.", "vision_model.")

#: The module groups the census reports bits for. ``attention`` is a layer's token mixer, whichever its
#: kind (softmax, MLA, or GLM-5.3's KDA linear attention); ``indexer`` is a DSA indexer (its own sub-module
#: of MLA layers, ``self_attn.indexer.*``); ``mtp`` the multi-token-prediction layer's own projection
#: (``eh_proj``); ``vision`` the vision tower.
GROUPS = ("routed_experts", "shared_experts", "attention", "indexer", "dense_mlp", "mtp", "head", "vision", "other")


def module_key(tensor_name: str) -> tuple[str, str]:
    """Split a tensor name into (module key, suffix)."""
    key, _, suffix = tensor_name.rpartition(".")
    return key, suffix


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """Where a module sits in the model, read from its key alone."""

    layer: int | None
    path: str  # the key inside its layer ("mlp.experts.3.down_proj"), or the whole key
    group: str
    expert: int | None = None
    proj: str | None = None  # routed experts: the projection ("mlp.experts.*.down_proj")


@lru_cache(maxsize=1 << 18)
def parse_key(key: str) -> KeyInfo:
    """Classify a module key: layer, group (routed experts, attention, ...), expert and projection."""
    if key.startswith(_VISION_PREFIXES):
        return KeyInfo(None, key, "vision")
    m = _LAYER_RE.match(key)
    if m is None or m.group("prefix").startswith(_VISION_PREFIXES):
        last = key.rsplit(".", 1)[-1]
        return KeyInfo(None, key, "head" if last == "lm_head" or key.endswith("lm_head") else "other")
    layer = int(m.group("layer"))
    rest = m.group("rest")
    e = _EXPERT_RE.match(rest)
    if e:
        return KeyInfo(layer, rest, "routed_experts", int(e.group("e")), f"{e.group('mlp')}.*.{e.group('proj')}")
    first = rest.split(".", 1)[0]
    if ".shared_expert" in f".{rest}" or rest.startswith(("mlp.shared_expert", "shared_expert")):
        return KeyInfo(layer, rest, "shared_experts")
    if first in ("self_attn", "attn", "attention", "linear_attn", "mixer"):
        return KeyInfo(layer, rest, "indexer" if ".indexer." in f".{rest}." else "attention")
    if rest in ("eh_proj", "enorm", "hnorm") or rest.startswith("shared_head."):
        return KeyInfo(layer, rest, "mtp")
    if first in ("mlp", "feed_forward") and rest.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"):
        return KeyInfo(layer, rest, "dense_mlp")
    return KeyInfo(layer, rest, "other")


def bits_from_trellis(shape: tuple[int, ...]) -> float | None:
    """Bits per weight of a trellis tensor, or None when the shape is not an EXL3 trellis."""
    if len(shape) != 3 or shape[-1] % 8:
        return None
    return shape[-1] // 16 if shape[-1] % 16 == 0 else shape[-1] / 16  # exact: a multiple of 1/2


@dataclass(slots=True)
class Module:
    """One module: its tensors (suffix → header entry) and, for EXL3 linears, bits and codebook.

    The shape-derived attributes (``is_exl3``, ``bits``, ``bits16``, ``in_features``,
    ``out_features``, ``weights``, ``marker_suffix``) are worked out once by :meth:`derive`, which
    :func:`group_modules` calls when a module's tensors are complete: the census, the plan and the
    rates read them hundreds of thousands of times at GLM-5.3's 52,000 modules, and slots keep each
    module small."""

    key: str
    info: KeyInfo
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    codebook: str | None = None  # set for EXL3 linears once markers are known
    marker_value: int | None = None
    is_exl3: bool = field(default=False, init=False, repr=False, compare=False)
    bits: float | None = field(default=None, init=False, repr=False, compare=False)
    #: 16 × bits: the trellis's last dimension, an exact integer
    bits16: int | None = field(default=None, init=False, repr=False, compare=False)
    in_features: int | None = field(default=None, init=False, repr=False, compare=False)
    out_features: int | None = field(default=None, init=False, repr=False, compare=False)
    weights: int = field(default=0, init=False, repr=False, compare=False)
    marker_suffix: str | None = field(default=None, init=False, repr=False, compare=False)

    def derive(self) -> Module:
        """Set the shape-derived attributes from the (complete) tensors; returns the module."""
        t = self.tensors.get("trellis")
        self.is_exl3 = t is not None
        self.bits = bits_from_trellis(t.shape) if t is not None else None
        three = t is not None and len(t.shape) == 3
        self.bits16 = t.shape[-1] if three else None  # type: ignore[union-attr]
        self.in_features = t.shape[0] * 16 if three else None  # type: ignore[union-attr]
        self.out_features = t.shape[1] * 16 if three else None  # type: ignore[union-attr]
        i, o = self.in_features, self.out_features
        self.weights = i * o if i is not None and o is not None else 0
        self.marker_suffix = "mul1" if "mul1" in self.tensors else "mcg" if "mcg" in self.tensors else None
        return self

    def structure(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """Suffixes, dtypes and shapes apart from the trellis's last dim and the codebook marker: what
        must match between sources (bits and codebook may differ; fusion rules decide about those)."""
        out = []
        for s, t in sorted(self.tensors.items()):
            if s in MARKERS:
                continue
            shape = t.shape[:-1] if s == "trellis" else t.shape
            out.append((s, t.dtype, shape))
        return tuple(out)


def group_modules(tensors: Iterable[TensorInfo]) -> dict[str, Module]:
    """Group header entries into modules by parent key, in first-seen order."""
    mods: dict[str, Module] = {}
    suffixes: dict[str, str] = {}  # one object per suffix ("trellis", "suh", ...), not one per tensor
    for t in tensors:
        key, _, suffix = t.name.rpartition(".")
        m = mods.get(key)
        if m is None:
            m = mods[key] = Module(key, parse_key(key))
        m.tensors[suffixes.setdefault(suffix, suffix)] = t
    for m in mods.values():
        m.derive()
    return mods


def marker_names(mods: Mapping[str, Module]) -> list[str]:
    """Names of every codebook marker tensor (their 4-byte values must be read to check them)."""
    return [f"{m.key}.{m.marker_suffix}" for m in mods.values() if m.is_exl3 and m.marker_suffix]


def assign_codebooks(mods: Mapping[str, Module], marker_values: Mapping[str, int]) -> None:
    """Set each EXL3 module's codebook from its marker (value as uint32)."""
    for m in mods.values():
        if not m.is_exl3:
            continue
        suf = m.marker_suffix
        if suf is None:
            m.codebook = "3inst"
        else:
            m.codebook = suf
            m.marker_value = marker_values.get(f"{m.key}.{suf}")


def module_problems(m: Module) -> list[str]:
    """Everything wrong with one EXL3 module's tensor group, as messages naming the module."""
    if not m.is_exl3:
        return []
    out: list[str] = []
    t = m.tensors
    unknown = sorted(set(t) - QUANT_SUFFIXES)
    if unknown:
        out.append(f"{m.key}: unexpected tensor(s) in an EXL3 module: {', '.join(unknown)}")
    tr = t["trellis"]
    bits = m.bits
    if tr.dtype != "I16" or bits is None:
        out.append(f"{m.key}.trellis: {tr.dtype} {list(tr.shape)} is not an I16 [in/16, out/16, 16*bits] trellis")
        return out
    if bits not in WHOLE_BITS and bits not in HALF_BITS:
        out.append(f"{m.key}.trellis: {bits} bits per weight is not a valid EXL3 rate")
    if bits in HALF_BITS and m.codebook not in (None, "mul1"):
        out.append(f"{m.key}: half rate {bits} needs the mul1 codebook, not {m.codebook}")
    i, o = m.in_features, m.out_features
    for sign, legacy, n in (("suh", "su", i), ("svh", "sv", o)):
        if sign in t:
            if t[sign].shape != (n,):
                out.append(f"{m.key}.{sign}: shape {list(t[sign].shape)} does not match {n} features")
        elif legacy not in t:
            out.append(f"{m.key}: missing {sign} (its tensor group is incomplete)")
    if "mul1" in t and "mcg" in t:
        out.append(f"{m.key}: has both mul1 and mcg markers")
    suf = m.marker_suffix
    if suf:
        mt = t[suf]
        if mt.dtype != "I32" or mt.shape != ():
            out.append(f"{m.key}.{suf}: marker must be an I32 scalar, is {mt.dtype} {list(mt.shape)}")
        elif m.marker_value is not None and m.marker_value != MARKERS[suf]:
            out.append(f"{m.key}.{suf}: marker value {m.marker_value:#010x}, expected {MARKERS[suf]:#010x}")
    return out


def expert_groups(mods: Iterable[Module]) -> dict[tuple[int, str], list[Module]]:
    """Routed experts grouped per (layer, projection): the units exllamav3 fuses at load."""
    out: dict[tuple[int, str], list[Module]] = {}
    for m in mods:
        if m.is_exl3 and m.info.group == "routed_experts" and m.info.layer is not None and m.info.proj:
            out.setdefault((m.info.layer, m.info.proj), []).append(m)
    return out


def expert_group_problems(mods: Iterable[Module]) -> list[str]:
    """Routed experts of one layer and projection must share bits and codebook (exllamav3 fuses them)."""
    out = []
    for (layer, proj), ms in sorted(expert_groups(mods).items()):
        kinds = {(m.bits, m.codebook) for m in ms}
        if len(kinds) > 1:
            desc = ", ".join(f"{b} bits/{c}" for b, c in sorted(kinds, key=str))
            out.append(f"layer {layer} {proj}: routed experts mix {desc}; exllamav3 cannot fuse them")
    return out


#: Sibling modules exllamav3 may fuse at load; they must share a codebook.
FUSION_PAIRS = (("k_proj", "v_proj"), ("q_proj", "g_proj"), ("gate_proj", "up_proj"))


def fusion_problems(mods: Mapping[str, Module]) -> list[tuple[Module, Module]]:
    """Pairs of sibling EXL3 modules that exllamav3 may fuse but that use different codebooks."""
    out = []
    for m in mods.values():
        if not m.is_exl3:
            continue
        parent, _, leaf = m.key.rpartition(".")
        for a, b in FUSION_PAIRS:
            other = mods.get(f"{parent}.{b}") if leaf == a else None
            if other is not None and other.is_exl3 and other.codebook != m.codebook:
                out.append((m, other))
    return out


def is_decoder_linear(m: Module, num_hidden_layers: int | None) -> bool:
    """Counted in the trellis rate: EXL3 linears of decoder layers (head, MTP and vision excluded)."""
    if not m.is_exl3 or m.info.layer is None:
        return False
    return num_hidden_layers is None or m.info.layer < num_hidden_layers


def part_of(m: Module, num_hidden_layers: int | None) -> str:
    """Which part of the model an EXL3 linear belongs to, for the rate lines: ``decoder`` (the exact rate:
    layers below num_hidden_layers), ``mtp`` (layers at or above it), ``head``, ``vision``, ``other``."""
    if is_decoder_linear(m, num_hidden_layers):
        return "decoder"
    if m.info.layer is not None:
        return "mtp"
    return m.info.group if m.info.group in ("head", "vision") else "other"


def part_rates(mods: Iterable[Module], num_hidden_layers: int | None) -> dict[str, Fraction]:
    """Σ bits × weights / Σ weights of each part (:func:`part_of`) that has EXL3 linears."""
    acc: dict[str, list[int]] = {}
    for m in mods:
        b16 = m.bits16
        if b16 is None or not m.is_exl3:
            continue
        a = acc.setdefault(part_of(m, num_hidden_layers), [0, 0])
        a[0] += b16 * m.weights
        a[1] += m.weights
    return {k: Fraction(n, 16 * d) for k, (n, d) in acc.items() if d}


def exact_rate(mods: Iterable[Module], num_hidden_layers: int | None) -> Fraction | None:
    """Σ bits × weights / Σ weights over the decoder's EXL3 linears, as an exact fraction."""
    num = den = 0
    for m in mods:
        b16 = m.bits16
        if b16 is not None and is_decoder_linear(m, num_hidden_layers):
            w = m.weights
            num += b16 * w
            den += w
    return Fraction(num, 16 * den) if den else None
