"""Exact costs, from the headers: tensor bytes for ``--max-size`` and bits × weights for
``--target-rate``. The output size of any chosen set is computed the way :mod:`mosaic._build.layout`
lays shards out (header growth and padding included), so the prediction is the built size to the byte.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from itertools import accumulate

from mosaic._checkpoint.census_exl3 import Analysis
from mosaic._checkpoint.exl3 import is_decoder_linear
from mosaic._plan.units import Unit

#: What json.dumps escapes in a string with ensure_ascii=False: quote, backslash, control characters.
_ESCAPED = re.compile(r'["\\\x00-\x1f]')

# --- exact costs --------------------------------------------------------------------------------


class SizeModel:
    """The exact size (Σ .safetensors file sizes) of the mosaic for any choice, as make_plan lays it out."""

    def __init__(self, base: Analysis, donors: dict[str, Analysis], units: list[Unit]) -> None:
        ck = base.ckpt
        self.base, self.donors, self.units = base, donors, units
        self.unit_tensors = {u.index: [f"{k}.{s}" for k in u.modules for s in base.modules[k].tensors] for u in units}
        self.shard_of = dict(ck.tensor_file)
        #: the shards each unit's tensors lie in (a unit is thousands of tensors, in one or two shards)
        self.unit_shards = {ui: sorted({self.shard_of[n] for n in ts}) for ui, ts in self.unit_tensors.items()}
        self.base_size = ck.shard_bytes
        self._cache: dict[tuple[str, tuple[tuple[int, str], ...]], int] = {}
        self._fixed: dict[str, tuple[int, list[int]]] = {}
        #: JSON text length of each distinct shape (a few dozen among 150,000 tensors), per separator
        self._shape_len: dict[tuple[tuple[int, ...], str], int] = {}
        self.delta: dict[tuple[int, str], int] = {}
        for u in units:
            for did, d in donors.items():
                self.delta[(u.index, did)] = sum(
                    d.ckpt.tensor(n).nbytes - ck.tensor(n).nbytes for n in self.unit_tensors[u.index]
                )
        self.header_low = self._header_lower_bound()

    def _json_len(self, shape: tuple[int, ...], sep: str = ",") -> int:
        """``len(json.dumps(list(shape)))`` with item separator ``sep``, worked out once per shape."""
        n = self._shape_len.get((shape, sep))
        if n is None:
            n = self._shape_len[(shape, sep)] = len(json.dumps(list(shape), separators=(sep, ":")))
        return n

    def _donor_tensor(self, did: str, name: str) -> tuple[str, tuple[int, ...], int]:
        t = self.donors[did].ckpt.tensor(name)
        return t.dtype, t.shape, t.nbytes

    def _header_lower_bound(self) -> int:
        """A lower bound on header growth over every possible choice (≤ 0): each shard's header with
        every tensor at its shortest shape and smallest size among the sources."""
        ck = self.base.ckpt
        in_unit = {n for ts in self.unit_tensors.values() for n in ts}
        low = 0
        for shard in ck.shards:
            h = ck.headers[shard]
            entries = []
            for t in h.tensors:
                shape, nbytes = t.shape, t.nbytes
                if t.name in in_unit:
                    for d in self.donors.values():
                        dt = d.ckpt.tensor(t.name)
                        if self._json_len(dt.shape, ", ") < self._json_len(shape, ", "):
                            shape = dt.shape
                        nbytes = min(nbytes, dt.nbytes)
                entries.append((shape, nbytes))
            low += min(0, self._header_size(shard, entries) - h.data_start)
        return low

    def _header_size(self, shard: str, entries: list[tuple[tuple[int, ...], int]]) -> int:
        """Length of the header :func:`encode_header` writes for the shard's tensors, in order, with
        these (shape, nbytes) (compact JSON, padded to 8, length prefix included), counted without
        building it: each entry's length is fixed text plus the digits of its shape and offsets,
        summed a column at a time (``map`` over 150,000 entries runs in C)."""
        h = self.base.ckpt.headers[shard]
        fixed = self._fixed.get(shard)
        if fixed is None:
            meta = len(json.dumps({"__metadata__": h.metadata}, separators=(",", ":"), ensure_ascii=False).encode()) - 1 if h.metadata is not None else 1
            names = [t.name for t in h.tensors]
            if _ESCAPED.search("".join(names)) is None:  # nothing to escape: the name's bytes and two quotes
                name_len = sum(map(len, map(str.encode, names))) + 2 * len(names)
            else:
                name_len = sum(len(json.dumps(n, ensure_ascii=False).encode()) for n in names)
            dtype_len = sum(len(json.dumps(t.dtype)) for t in h.tensors) if any(_ESCAPED.search(t.dtype) for t in h.tensors) else sum(len(t.dtype) + 2 for t in h.tensors)
            fixed = self._fixed[shard] = (meta, name_len + dtype_len + len(h.tensors) * len('{"dtype":,"shape":,"data_offsets":[,]}:'))
        commas = max(len(h.tensors) - 1, 0) + (1 if h.metadata is not None and h.tensors else 0)
        shapes = [e[0] for e in entries]
        ends = list(accumulate(e[1] for e in entries))
        json_len = self._json_len
        shape_len = {sh: json_len(sh) for sh in set(shapes)}
        digits = sum(map(len, map(str, ends))) + sum(map(len, map(str, [0, *ends[:-1]]))) if ends else 0
        n = fixed[0] + commas + 1 + fixed[1] + sum(map(shape_len.__getitem__, shapes)) + digits
        return 8 + n + (-n % 8)

    def _shard_size(self, shard: str, donor_of: dict[str, str]) -> int:
        """File size of a rewritten shard: the length of the header :func:`encode_header` writes
        (compact JSON, padded to 8), counted without building it — each entry's length is fixed
        text plus the digits of its shape and offsets — plus the tensor bytes."""
        entries = []
        for t in self.base.ckpt.headers[shard].tensors:
            did = donor_of.get(t.name)
            if did is not None:
                dt = self.donors[did].ckpt.tensor(t.name)
                entries.append((dt.shape, dt.nbytes))
            else:
                entries.append((t.shape, t.nbytes))
        return self._header_size(shard, entries) + sum(nbytes for _, nbytes in entries)

    def size(self, choice: dict[int, str]) -> int:
        """Exact output size when unit ``i`` comes from donor ``choice[i]``."""
        ck = self.base.ckpt
        per_shard: dict[str, list[tuple[int, str]]] = {}
        for ui, did in choice.items():
            for shard in self.unit_shards[ui]:
                per_shard.setdefault(shard, []).append((ui, did))
        total = 0
        for shard in ck.shards:
            h = ck.headers[shard]
            picks = per_shard.get(shard)
            if not picks:
                total += h.file_size
                continue
            key = (shard, tuple(sorted(set(picks))))
            if key not in self._cache:
                donor_of = {n: did for ui, did in key[1] for n in self.unit_tensors[ui]}
                self._cache[key] = self._shard_size(shard, donor_of)
            total += self._cache[key]
        return total


def bit_weight_deltas(base: Analysis, donors: dict[str, Analysis], units: list[Unit]) -> dict[tuple[int, str], int]:
    """Δ Σ bits × weights over decoder linears per (unit, donor): the rate's additive numerator."""
    n_layers = base.num_hidden_layers
    out = {}
    for u in units:
        for did, d in donors.items():
            delta = Fraction(0)
            for k in u.modules:
                bm = base.modules[k]
                if is_decoder_linear(bm, n_layers) and bm.bits is not None:
                    dm = d.modules[k]
                    delta += (Fraction(dm.bits or 0) - Fraction(bm.bits)) * bm.weights
            assert delta.denominator == 1
            out[(u.index, did)] = int(delta)
    return out


