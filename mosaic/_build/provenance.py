"""PROVENANCE.json: what a mosaic claims about itself, assembled from a finished build.

Records are plain: relative POSIX names for everything inside a folder, one digest per item,
sources named exactly as the recipe named them (so an absolute path appears only where the recipe
itself names one: a source location is not a name inside a folder), and nothing that changes between
two builds of the same recipe (no time, no host). The document is validated against ``PROVENANCE.schema.json`` before it
is written. Serialization is deterministic and streams one tensor per line, so a 150,000-tensor
record is both fast to write and readable in a diff.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import chain, repeat
from operator import attrgetter
from pathlib import Path

from mosaic._base.version import __version__
from mosaic._build.layout import BuildPlan
from mosaic._build.splice import Flusher, SpliceResult
from mosaic._checkpoint.folder import bulk
from mosaic._base.errors import VerificationError
from mosaic._provenance.records import (
    CARD_NAME,
    PROVENANCE_NAME,
    RECIPE_NAME,
    SCHEMA_ID,
    FileRecord,
    TensorColumns,
    dump_chunks,
    validation_errors,
)

#: A base card larger than this is not read for its front matter (cards are a few kB).
MAX_CARD_BYTES = 1 << 20


def card_base_model(folder: Path) -> list[str]:
    """The original model(s) a source's own model card names as ``base_model`` in its front matter.

    A mosaic is a quantization of that original model, so its card names the same lineage for the hub
    to draw. Read with huggingface_hub's own front-matter parser; a card that is missing, too large
    or unreadable simply names nothing (the base's repo id is used instead, when there is one).
    """
    readme = folder / CARD_NAME
    try:
        if not readme.is_file() or readme.stat().st_size > MAX_CARD_BYTES:
            return []
        from huggingface_hub import metadata_load  # only when there is a card (its import takes 0.2 s)

        meta = metadata_load(readme) or {}
    except Exception:  # a malformed card is the base's business; the lineage falls back to the repo id
        return []
    value = meta.get("base_model")
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return list(dict.fromkeys(v.strip() for v in values if isinstance(v, str) and v.strip()))


def _rate(r: Fraction | float | None) -> float | None:
    return None if r is None else round(float(r), 6)


@bulk()
def build_provenance(plan: BuildPlan, res: SpliceResult, unverified: dict[str, set[str]] | None = None) -> dict:
    """The PROVENANCE document of a finished splice (everything but itself and the manifest).

    ``unverified`` names, per source, the files read only in part from the hub: their whole-file
    digest is the hub's claim, and the record says so."""
    recipe = plan.recipe
    unverified = unverified or {}
    sources: dict[str, dict] = {}
    for sid, a in plan.sources.items():
        spec = recipe.base if sid == "base" else recipe.donors[sid]
        files = [
            {**_file(res.sources[sid][n].record), **({"sha256_verified": False} if n in unverified.get(sid, ()) else {})}
            for n in plan.used_files.get(sid, [])
        ]
        sources[sid] = {**spec.as_record(), "rate": _rate(a.nominal_rate), "files": files}
        if sid == "base" and (lineage := card_base_model(a.ckpt.root)):
            sources[sid]["base_model"] = lineage
    planned = list(chain.from_iterable(s.tensors for s in plan.shards))
    names = list(map(attrgetter("name"), planned))
    tensors = TensorColumns(
        name=names,
        file=list(chain.from_iterable(repeat(s.name, len(s.tensors)) for s in plan.shards)),
        dtype=list(map(attrgetter("dtype"), planned)),
        shape=list(map(attrgetter("shape"), planned)),
        nbytes=list(map(attrgetter("nbytes"), planned)),
        sha256=list(map(res.tensors.__getitem__, names)),
        source=list(map(attrgetter("source"), planned)),
    )
    del planned
    selection = []
    nbytes = dict(zip(tensors.name, tensors.nbytes))
    for rule in recipe.rules:
        names = [n for n, i in plan.selection.rule_of.items() if i == rule.index]
        selection.append(
            {
                "rule": rule.index,
                "from": rule.donor,
                "layers": plan.selection.layers_of_rule(rule.index),
                **({"keys": list(rule.keys)} if rule.keys is not None else {}),
                "modules": len(plan.selection.modules_of_rule.get(rule.index, [])),
                "tensors": len(names),
                "bytes": sum(nbytes[n] for n in names),
            }
        )
    rates = plan.rates
    qc = (plan.sources["base"].ckpt.config or {}).get("quantization_config")
    doc = {
        "schema": SCHEMA_ID,
        "tool": {"name": "mosaic", "version": __version__},
        "name": recipe.name,
        "recipe": {"file": RECIPE_NAME, "sha256": recipe.sha256},
        "sources": sources,
        "selection": selection,
        "size": {"shards": plan.shard_bytes, "tensors": plan.tensor_bytes, "base_shards": plan.sources["base"].ckpt.shard_bytes},
        "rate": {
            "exact": _rate(rates.exact),
            "exact_fraction": f"{rates.exact.numerator}/{rates.exact.denominator}" if rates.exact is not None else None,
            "config_bits": round(float(rates.exact), 2) if rates.exact is not None and isinstance(qc, dict) else None,
            "by_bytes": _rate(rates.by_bytes),
            "by_layer_mass": _rate(rates.by_layer_mass),
            "base": _rate(rates.base),
            "donors": {k: _rate(v) for k, v in rates.donors.items()},
            **({"outside": {k: _rate(v) for k, v in sorted(rates.outside.items())}} if rates.outside else {}),
        },
        "files": [_file(r) for r in sorted(res.files.values(), key=lambda r: r.name)],
        "tensors": tensors,
        "checks": [c.as_dict() for c in res.checks],
    }
    return doc


def _file(r: FileRecord) -> dict[str, object]:
    return {"name": r.name, "size": r.size, "sha256": r.sha256}


@bulk()
def write_checked(doc: dict, path: Path, durable: Flusher) -> FileRecord:
    """Write after validating against the schema (a violation is a failed build verification),
    streamed and hashed as written and handed to ``durable`` to be fsynced; the record of the file written."""
    errors = validation_errors(doc)
    if errors:
        raise VerificationError(f"{PROVENANCE_NAME} does not match PROVENANCE.schema.json: {errors[0]}")
    size, sha = durable.write(path, dump_chunks(doc))
    return FileRecord(path.name, size, sha)


