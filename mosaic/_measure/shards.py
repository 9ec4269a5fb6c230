"""One measurement across machines: ``--shard K/N`` runs every N-th candidate, ``--merge`` joins the parts.

A shard's candidates are those whose index in the measurement's sorted (layer, group) order is ≡ K−1
(mod N): every unit's donors go together (``swaps``), every unit is one drop from the top (``top-down``).
Every part holds what the whole needs apart from the other parts' candidates: the sources' digests, the
settings, the weight errors of every result, the top's versions, and the list of every candidate
(``settings.shard.units``), so that the merge needs nothing but the parts and can prove they are one
measurement: the same inputs and settings (where the runtime ran excepted: its threads, offload and device), every shard of 1..N once,
each holding exactly its candidates. The merged document is the one a single run would have written, its
seconds summed; a top-down one is calibrated only then, from every part's drops.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

from mosaic._base.errors import MosaicError, OutputError, VerificationError
from mosaic._base.lock import output_lock
from mosaic._measure.calibrate import BASE, complete, unit_key, worst_versions
from mosaic._measure.importance import imatrix_name
from mosaic._measure.journal import summed_stages
from mosaic._plan.measurement import SCHEMA_ID, dumps, load_measurement, validation_errors

_SHARD_RE = re.compile(r"^(\d+)/(\d+)$")


@dataclass(frozen=True)
class Shard:
    k: int  # 1..n
    n: int

    def __str__(self) -> str:
        return f"{self.k}/{self.n}"


def parse_shard(text: str) -> Shard:
    m = _SHARD_RE.match(text.strip())
    if m is None:
        raise MosaicError(f"--shard {text!r}: K/N, the K-th of N shards (1 ≤ K ≤ N), e.g. 2/8")
    k, n = int(m.group(1)), int(m.group(2))
    if not 1 <= k <= n:
        raise MosaicError(f"--shard {text}: K must be between 1 and N ({n})")
    return Shard(k, n)


def in_shard(index: int, shard: Shard) -> bool:
    """Does the candidate at ``index`` of the sorted (layer, group) order belong to ``shard``?"""
    return index % shard.n == shard.k - 1


def _inputs(doc: dict) -> dict:
    """What must be the same in every part: digests, settings, runtime (not its threads), tool, the top's
    versions and the results' weight errors. Names of places (paths given, a text's file name) may differ
    between machines; the digests decide."""
    d = copy.deepcopy(doc)
    for key in ("seconds", "seconds_per_candidate", "forward_passes", "measured", "notes", "timing"):
        d.pop(key, None)
    d["settings"].pop("shard")
    d["base"] = {k: v for k, v in d["base"].items() if k in ("files", "bytes")}
    d["donors"] = {k: v["files"] for k, v in d["donors"].items()}
    ref = d.get("reference")
    if isinstance(ref, dict):
        d["reference"] = {k: v for k, v in ref.items() if k not in ("source", "runtime") and not (k == "model" and ref.get("kind") == "model")}
    if isinstance(d.get("text"), dict):
        d["text"].pop("file", None)
    if isinstance(d.get("runtime"), dict):  # where it ran: threads, offload and device may differ between parts
        for k in ("threads", "gpu_layers", "offloaded", "device"):
            d["runtime"].pop(k, None)
    if "top" in d:
        d["top"] = {"versions": d["top"]["versions"]}
    if d["settings"]["method"] == "top-down":
        d["results"] = [{k: r[k] for k in ("layer", "group", "donor", "dbytes", "eps", "eps_base", "tensors")} for r in d["results"]]
    else:
        d.pop("results")
    return d


def _drop_versions(doc: dict) -> dict[str, str]:
    """Each unit's worst version, read from the results' weight errors as the run chose it (a unit whose
    top is its worst has no drop)."""
    index: dict[str, int] = {}
    versions: list[list[str]] = []
    eps: dict[tuple[int, str], float] = {}
    nbytes: dict[tuple[int, str], int] = {}
    for r in doc["results"]:
        k = unit_key(r["layer"], r["group"])
        if k not in index:
            i = index[k] = len(versions)
            versions.append([BASE])
            eps[(i, BASE)], nbytes[(i, BASE)] = r["eps_base"], 0
        i = index[k]
        versions[i].append(r["donor"])
        eps[(i, r["donor"])], nbytes[(i, r["donor"])] = r["eps"], r["dbytes"]
    return dict(zip(index, worst_versions(versions, eps, nbytes)))


def _first_difference(a: object, b: object, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{where}.{k}" if where else k)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}[{i}]")
    return where or "(the whole document)"


def merge(parts: list[Path], out: Path, *, force: bool = False) -> dict:
    """Join the parts of a sharded measurement into the document one run would have written, at ``out`` (its
    lock held: another command writing it is refused)."""
    if not parts:
        raise MosaicError("--merge: name the shards' documents (PART.json ...)")
    with output_lock(out, "mosaic measure --merge"):
        return _merge(parts, out, force)


def _merge(parts: list[Path], out: Path, force: bool) -> dict:
    from mosaic._build.run import fsync_dir
    from mosaic._hub.partial import atomic_write

    if out.exists() and not force:
        raise OutputError(f"{out}: exists; --force replaces it")
    docs = []
    for p in parts:
        d = load_measurement(p)
        shard = d["settings"].get("shard")
        if shard is None:
            raise MosaicError(f"{p}: a whole measurement, not a shard of one (no settings.shard)")
        docs.append(d)
    n = docs[0]["settings"]["shard"]["n"]
    by_k: dict[int, tuple[Path, dict]] = {}
    for p, d in zip(parts, docs):
        s = d["settings"]["shard"]
        if s["n"] != n:
            raise MosaicError(f"{p}: shard {s['k']}/{s['n']}, but {parts[0]} is one of {n}")
        if s["k"] in by_k:
            raise MosaicError(f"shard {s['k']}/{n} given twice: {by_k[s['k']][0]} and {p}")
        by_k[s["k"]] = (p, d)
    first_path, first = by_k[min(by_k)]
    for p, d in zip(parts, docs):
        if d["schema"] != first["schema"]:
            raise MosaicError(f"{p}: a {d['schema']} document, but {first_path} is {first['schema']}; "
                              "measure every shard with one version of mosaic")
    want = _inputs(first)
    for p, d in zip(parts, docs):
        mine, theirs = d["settings"].get("imatrix"), first["settings"].get("imatrix")
        if p != first_path and mine != theirs:
            raise MosaicError(f"{p}: measured with another importance matrix than {first_path} "
                              f"({imatrix_name(mine)}, not {imatrix_name(theirs)})")
        if p != first_path and _inputs(d) != want:
            raise MosaicError(f"{p}: measured with other inputs or settings than {first_path} "
                              f"({_first_difference(_inputs(d), want)} differs)")
    missing = [k for k in range(1, n + 1) if k not in by_k]
    if missing:
        raise MosaicError(f"shard {missing[0]}/{n} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    order = first["settings"]["shard"]["units"]
    top = first.get("top", {}).get("versions")
    to = _drop_versions(first) if top is not None and first["settings"].get("drop") == "worst" else {}
    for k, (p, d) in sorted(by_k.items()):
        mine = [u for i, u in enumerate(order) if i % n == k - 1]
        if top is not None:
            mine = [u for u in mine if top[u] != to.get(u, BASE)]
            got = [unit_key(m["layer"], m["group"]) for m in d["measured"]]
        else:
            got = list(dict.fromkeys(unit_key(r["layer"], r["group"]) for r in d["results"]))
        if sorted(got) != sorted(mine) or len(got) != len(set(got)):
            lacks = [u for u in mine if u not in got]
            extra = [u for u in got if u not in mine]
            what = f"lacks the candidate {lacks[0]}" if lacks else f"holds the candidate {extra[0]}, which is not its own"
            raise MosaicError(f"{p}: shard {k}/{n} {what}")
    position = {u: i for i, u in enumerate(order)}
    doc = copy.deepcopy(first)
    del doc["settings"]["shard"]
    ran = [(len(d["measured"]) + sum("mid" in m for m in d["measured"]) if top is not None
            else sum(not r.get("same_as_base") for r in d["results"]), d) for _, d in by_k.values()]
    total = sum(c for c, _ in ran)
    doc["seconds"] = round(sum(d["seconds"] for _, d in by_k.values()), 3)
    timed = [d["timing"] for _, d in by_k.values() if "timing" in d]
    if timed:
        doc["timing"] = {k: round(sum(t[k] for t in timed), 3) for k in ("load", "decode", "panel")}
        if any("preloaded" in t for t in timed):
            doc["timing"]["preloaded"] = sum(t.get("preloaded", 0) for t in timed)
        if any("stages" in t for t in timed):  # every shard's passes, the teacher's once per shard that ran it
            doc["timing"]["stages"] = summed_stages(t.get("stages", {}) for t in timed)
    decoded = [d["dequantizer"] for _, d in by_k.values() if "dequantizer" in d]
    if decoded:  # what decoded each type in any shard (a shard whose sums came from the cache decoded none)
        doc["dequantizer"] = {"mode": decoded[0]["mode"], "library": next((x["library"] for x in decoded if x["library"]), None),
                              "types": dict(sorted({t: h for x in decoded for t, h in x["types"].items()}.items()))}
    doc["seconds_per_candidate"] = (round(sum(c * (d["seconds_per_candidate"] or 0.0) for c, d in ran) / total, 3)
                                    if total else None)
    # one run: the teacher, the base (and the top) once, and every candidate
    doc["forward_passes"] = first["forward_passes"] - next(c for c, d in ran if d is first) + total
    if top is not None:
        doc["measured"] = sorted((m for _, d in by_k.values() for m in d["measured"]),
                                 key=lambda m: position[unit_key(m["layer"], m["group"])])
        doc = complete(doc)
    else:
        donors = list(doc["donors"])
        doc["results"] = sorted((r for _, d in by_k.values() for r in d["results"]),
                                key=lambda r: (position[unit_key(r["layer"], r["group"])], donors.index(r["donor"])))
    doc["schema"] = SCHEMA_ID
    errs = validation_errors(doc)
    if errs:
        raise VerificationError(f"the merged measurement does not match its schema: {errs[0]}")
    atomic_write(out, dumps(doc))
    fsync_dir(out.resolve().parent)
    return doc
