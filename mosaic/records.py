"""The records a mosaic folder carries and their formats: file names, the PROVENANCE.json schema,
its deterministic serialization, and the ``sha256sum`` manifest.

Shared by the builder (which writes them) and the audit (which reads them); this module knows
nothing of plans or splicing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import jsonschema

SCHEMA_ID = "mosaic.provenance/v1"
RECIPE_NAME = "mosaic-recipe.yaml"
PROVENANCE_NAME = "PROVENANCE.json"
MANIFEST_NAME = "sha256-manifest.txt"
CARD_NAME = "README.md"


@dataclass
class FileRecord:
    name: str
    size: int
    sha256: str


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
