"""PROVENANCE.json and sha256-manifest.txt: what a mosaic claims about itself.

Records are plain: relative POSIX names, one digest per item, sources named as the recipe named
them (never a path of the build machine), and nothing that changes between two builds of the same
recipe (no time, no host). The document is validated against ``PROVENANCE.schema.json`` before it
is written. Serialization is deterministic and streams one tensor per line, so a 150,000-tensor
record is both fast to write and readable in a diff.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from fractions import Fraction
from functools import lru_cache
from importlib import resources

import jsonschema

from . import __version__
from .errors import VerificationError
from .plan import MANIFEST_NAME, PROVENANCE_NAME, RECIPE_NAME, BuildPlan
from .splice import FileRecord, SpliceResult

SCHEMA_ID = "mosaic.provenance/v1"


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(resources.files("mosaic").joinpath("schema/provenance.schema.json").read_text("utf-8"))


def validation_errors(doc: object) -> list[str]:
    """Schema violations of a PROVENANCE document, as '<json path>: <message>' lines."""
    v = jsonschema.Draft202012Validator(schema())
    out = []
    for e in sorted(v.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        path = "/".join(map(str, e.absolute_path)) or "(root)"
        out.append(f"{path}: {e.message[:300]}")
    return out


def _rate(r: Fraction | float | None) -> float | None:
    return None if r is None else round(float(r), 6)


def build_provenance(plan: BuildPlan, res: SpliceResult) -> dict:
    """The PROVENANCE document of a finished splice (everything but itself and the manifest)."""
    recipe = plan.recipe
    sources: dict[str, dict] = {}
    for sid, a in plan.sources.items():
        spec = recipe.base if sid == "base" else recipe.donors[sid]
        files = [_file(res.sources[sid][n].record) for n in plan.used_files.get(sid, [])]
        sources[sid] = {**spec.as_record(), "rate": _rate(a.rate), "files": files}
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


def _dump_list(items: Iterable[object], indent: str) -> str:
    lines = [indent + json.dumps(i, separators=(", ", ": "), ensure_ascii=False) for i in items]
    return "[\n" + ",\n".join(lines) + "\n" + indent[:-2] + "]" if lines else "[]"


def dumps(doc: dict) -> bytes:
    """Deterministic JSON: top-level keys in order, each list item on its own line."""
    parts = []
    for k, v in doc.items():
        if isinstance(v, list):
            body = _dump_list(v, "    ")
        elif k == "sources":
            inner = []
            for sid, s in v.items():
                fields = [f'      {json.dumps(fk)}: {json.dumps(fv, ensure_ascii=False)}' for fk, fv in s.items() if fk != "files"]
                fields.append(f'      "files": {_dump_list(s["files"], "        ")}')
                inner.append(f"    {json.dumps(sid)}: {{\n" + ",\n".join(fields) + "\n    }")
            body = "{\n" + ",\n".join(inner) + "\n  }"
        else:
            body = json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
        parts.append(f"  {json.dumps(k)}: {body}")
    return ("{\n" + ",\n".join(parts) + "\n}\n").encode("utf-8")


def checked_dumps(doc: dict) -> bytes:
    """Serialize after validating against the schema; a violation is a failed build verification."""
    errors = validation_errors(doc)
    if errors:
        raise VerificationError(f"{PROVENANCE_NAME} does not match PROVENANCE.schema.json: {errors[0]}")
    data = dumps(doc)
    if json.loads(data) != doc:
        raise VerificationError(f"{PROVENANCE_NAME}: serialization does not round-trip")
    return data


def manifest(records: Iterable[FileRecord]) -> bytes:
    """``sha256sum -c`` lines for every file but the manifest itself, sorted by name."""
    lines = [f"{r.sha256}  {r.name}\n" for r in sorted(records, key=lambda r: r.name) if r.name != MANIFEST_NAME]
    return "".join(lines).encode("utf-8")


def parse_manifest(data: bytes, where: str) -> dict[str, str]:
    """Read a manifest strictly: ``<64 hex>  <name>`` lines, no duplicates."""
    out: dict[str, str] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not UTF-8") from None
    for i, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not name:
            raise ValueError(f"{where}: line {i} is not '<sha256>  <name>'")
        if name in out:
            raise ValueError(f"{where}: {name} listed twice")
        out[name] = digest
    return out
