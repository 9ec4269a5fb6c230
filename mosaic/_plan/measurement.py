"""The ``mosaic.measurement`` documents: what was measured, with what, and what each unit buys.

``v3`` is what ``mosaic measure`` writes, whatever the method (``top-down``, ``weights``, ``swaps``): v2 with each
drop to the unit's worst version (``settings.drop``, per measured record ``to`` and ``eps_to``); ``v2`` and ``v1``
(the swaps measurement of earlier versions) are still read. Each is validated against its JSON Schema
(``mosaic/schema/measurement.schema.json``, ``measurement.v2.schema.json``) before it is written and when it
is read (``mosaic plan --scores``). Every measured KL in them is the top-k lower bound of ``mosaic eval``
against a saved reference, and ``settings.kl`` says so (kind and k).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

from mosaic._base.errors import FormatError
from mosaic._formats.safetensors_reader import strict_json_loads

SCHEMA_ID = "mosaic.measurement/v3"
SCHEMAS = {"mosaic.measurement/v1": "measurement.schema.json", "mosaic.measurement/v2": "measurement.v2.schema.json",
           "mosaic.measurement/v3": "measurement.v3.schema.json"}


@cache
def _validator(schema_id: str):  # type: ignore[no-untyped-def]
    import jsonschema

    schema = json.loads(resources.files("mosaic").joinpath(f"schema/{SCHEMAS[schema_id]}").read_text())
    return jsonschema.Draft202012Validator(schema)


def validation_errors(doc: object) -> list[str]:
    sid = doc.get("schema") if isinstance(doc, dict) else None
    if sid not in SCHEMAS:
        return [f"schema: {sid!r} is not one of {', '.join(SCHEMAS)}"]
    errs = sorted(_validator(sid).iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errs]


def is_measurement(doc: object) -> bool:
    return isinstance(doc, dict) and doc.get("schema") in SCHEMAS


def load_measurement(path: Path) -> dict:
    try:
        doc = strict_json_loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: cannot read the measurement: {e}") from None
    errs = validation_errors(doc)
    if errs:
        sid = doc.get("schema") if isinstance(doc, dict) else None
        raise FormatError(f"{path}: not a valid {sid if sid in SCHEMAS else 'mosaic.measurement'} document: {errs[0]}")
    return doc  # type: ignore[return-value]


def measurement_in(path: Path) -> dict | None:
    """The scores file as a measurement (validated), or ``None`` when it is another kind of scores file. A shard
    of a measurement is refused: its predictions need every shard (``mosaic measure --merge``)."""
    try:
        head = path.read_bytes()[:4096]
    except OSError as e:
        raise FormatError(f"{path}: cannot read scores: {e.strerror or e}") from None
    if not any(sid.encode() in head for sid in SCHEMAS):
        return None
    doc = load_measurement(path)
    shard = doc["settings"].get("shard")
    if shard is not None:
        raise FormatError(f"{path}: shard {shard['k']}/{shard['n']} of a measurement, not a whole one; join the shards first: "
                          "mosaic measure --merge --out FILE PART.json ...")
    return doc


def dumps(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()
