"""The ``mosaic.measurement/v1`` document: what was measured, with what, and what each unit bought.

Validated against ``mosaic/schema/measurement.schema.json`` before it is written and when it is read
(``mosaic plan --scores``). Every KL in it is the top-k lower bound of ``mosaic eval`` against a saved
reference, and ``settings.kl`` says so (kind and k).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

from mosaic._base.errors import FormatError
from mosaic._formats.safetensors_reader import strict_json_loads

SCHEMA_ID = "mosaic.measurement/v1"


@cache
def _validator():  # type: ignore[no-untyped-def]
    import jsonschema

    schema = json.loads(resources.files("mosaic").joinpath("schema/measurement.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def validation_errors(doc: object) -> list[str]:
    errs = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errs]


def is_measurement(doc: object) -> bool:
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA_ID


def load_measurement(path: Path) -> dict:
    try:
        doc = strict_json_loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: cannot read the measurement: {e}") from None
    errs = validation_errors(doc)
    if errs:
        raise FormatError(f"{path}: not a valid {SCHEMA_ID} document: {errs[0]}")
    return doc  # type: ignore[return-value]


def measurement_in(path: Path) -> dict | None:
    """The scores file as a measurement (validated), or ``None`` when it is another kind of scores file."""
    try:
        head = path.read_bytes()[:4096]
    except OSError as e:
        raise FormatError(f"{path}: cannot read scores: {e.strerror or e}") from None
    return load_measurement(path) if SCHEMA_ID.encode() in head else None


def dumps(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()
