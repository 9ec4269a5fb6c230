"""PROVENANCE.json: what a mosaic claims about itself, assembled from a finished build.

Records are plain: relative POSIX names, one digest per item, sources named as the recipe named
them (never a path of the build machine), and nothing that changes between two builds of the same
recipe (no time, no host). The document is validated against ``PROVENANCE.schema.json`` before it
is written. Serialization is deterministic and streams one tensor per line, so a 150,000-tensor
record is both fast to write and readable in a diff.
"""

from __future__ import annotations

from fractions import Fraction

from mosaic import __version__
from mosaic.build.layout import BuildPlan
from mosaic.build.splice import SpliceResult
from mosaic.errors import VerificationError
from mosaic.records import PROVENANCE_NAME, RECIPE_NAME, SCHEMA_ID, FileRecord, dumps, validation_errors


def _rate(r: Fraction | float | None) -> float | None:
    return None if r is None else round(float(r), 6)


def build_provenance(plan: BuildPlan, res: SpliceResult) -> dict:
    """The PROVENANCE document of a finished splice (everything but itself and the manifest)."""
    recipe = plan.recipe
    sources: dict[str, dict] = {}
    for sid, a in plan.sources.items():
        spec = recipe.base if sid == "base" else recipe.donors[sid]
        files = [_file(res.sources[sid][n].record) for n in plan.used_files.get(sid, [])]
        sources[sid] = {**spec.as_record(), "rate": _rate(a.nominal_rate), "files": files}
    tensors = [
        {
            "name": t.name,
            "file": s.name,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "nbytes": t.nbytes,
            "sha256": res.tensors[t.name],
            "source": t.source,
        }
        for s in plan.shards
        for t in s.tensors
    ]
    selection = []
    nbytes = {t["name"]: t["nbytes"] for t in tensors}
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
        },
        "files": [_file(r) for r in sorted(res.files.values(), key=lambda r: r.name)],
        "tensors": tensors,
        "checks": [c.as_dict() for c in res.checks],
    }
    return doc


def _file(r: FileRecord) -> dict[str, object]:
    return {"name": r.name, "size": r.size, "sha256": r.sha256}


def checked_dumps(doc: dict) -> bytes:
    """Serialize after validating against the schema; a violation is a failed build verification."""
    errors = validation_errors(doc)
    if errors:
        raise VerificationError(f"{PROVENANCE_NAME} does not match PROVENANCE.schema.json: {errors[0]}")
    return dumps(doc)


