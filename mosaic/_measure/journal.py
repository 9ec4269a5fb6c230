"""A measurement in progress: ``<out>.partial``, one JSON line per finished unit, each made durable before
the next candidate runs, so an interrupted measurement loses at most the candidate it was scoring.

The first line is the measurement's fingerprint (everything a result depends on: the sources' digests,
the text's, the reference's, the settings, the runtime). ``--resume`` continues only under the same
fingerprint and names the first input that changed otherwise.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

from mosaic._base.errors import FormatError, MosaicError
from mosaic._build.run import fsync_dir
from mosaic._formats.safetensors_reader import strict_json_loads
from mosaic._measure.importance import imatrix_name

FORMAT = "mosaic.measurement-journal/v1"


def journal_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _first_difference(a: object, b: object, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{where}.{k}" if where else k)
            if d:
                return d
        return None
    return None if a == b else where or "(the whole fingerprint)"


class Journal:
    """Append-only, fsynced per line."""

    def __init__(self, path: Path, fingerprint: dict, records: list[dict]) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.records = records
        self._fd: int | None = None

    @classmethod
    def start(cls, path: Path, fingerprint: dict) -> Journal:
        j = cls(path, fingerprint, [])
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps({"format": FORMAT, "fingerprint": fingerprint}, sort_keys=True).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return j

    @classmethod
    def resume(cls, path: Path, fingerprint: dict) -> Journal:
        try:
            lines = path.read_bytes().split(b"\n")
        except OSError as e:
            raise MosaicError(f"--resume: cannot read {path}: {e.strerror or e}") from None
        try:
            head = strict_json_loads(lines[0].decode())
        except (UnicodeDecodeError, ValueError, FormatError):
            raise FormatError(f"{path}: not a measurement journal") from None
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            raise FormatError(f"{path}: not a measurement journal (format {head.get('format') if isinstance(head, dict) else None!r})")
        diff = _first_difference(head.get("fingerprint"), fingerprint)
        if diff is not None and diff.startswith("settings.imatrix"):
            was = ((head.get("fingerprint") or {}).get("settings") or {}).get("imatrix") or {}
            now = (fingerprint.get("settings") or {}).get("imatrix") or {}
            raise MosaicError(f"--resume: {path} was measured with another importance matrix "
                              f"({imatrix_name(was)}, not {imatrix_name(now)}); measure again without --resume "
                              "(--force replaces the journal)")
        if diff is not None:
            raise MosaicError(f"--resume: {path} was measured with other inputs ({diff} changed); "
                              "measure again without --resume (--force replaces the journal)")
        records = []
        for i, raw in enumerate(lines[1:], 2):
            if not raw.strip():
                continue
            try:
                rec = strict_json_loads(raw.decode())
            except (UnicodeDecodeError, ValueError, FormatError):
                if i == len(lines):  # a last line cut short by the interruption: dropped
                    break
                raise FormatError(f"{path}: line {i} is not JSON") from None
            if not isinstance(rec, dict) or "kind" not in rec:
                raise FormatError(f"{path}: line {i} is not a journal record")
            records.append(rec)
        j = cls(path, fingerprint, records)
        # rewrite without a torn last line, so that appends start on a line of their own
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(lines[0] + b"\n" + b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return j

    def add(self, record: dict) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
        os.write(self._fd, json.dumps(record, sort_keys=True).encode() + b"\n")
        os.fsync(self._fd)
        self.records.append(record)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: The records that are one forward pass each (a result with the base's own bytes is not run).
PASS_KINDS = ("teacher", "base", "top", "result", "drop", "drop-mid", "pooled", "group", "round", "move")


def _tally(items: Iterable[tuple[str, int, float]]) -> dict[str, dict[str, float]]:
    """``{stage: {passes, seconds}}`` summed over ``(stage, passes, seconds)``."""
    out: dict[str, dict[str, float]] = {}
    for k, n, sec in items:
        s = out.setdefault(k, {"passes": 0, "seconds": 0.0})
        s["passes"] += n
        s["seconds"] += sec
    return {k: {"passes": v["passes"], "seconds": round(v["seconds"], 3)} for k, v in out.items()}


def stages(records: list[dict], weights_seconds: float) -> dict[str, dict[str, float]]:
    """``timing.stages``: the weight errors' seconds (this run's), and per kind of forward pass its count and
    seconds, from the journal, so a resumed measurement counts every pass it holds, whichever run made it: what
    the method costs, stage by stage, not what one process did."""
    return _tally([("weights", 0, weights_seconds),
                   *((r["kind"], 1, r.get("seconds", 0.0)) for r in records
                     if r["kind"] in PASS_KINDS and not r.get("same_as_base"))])


def summed_stages(parts: Iterable[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Shards' ``timing.stages`` summed: the cost of every shard's passes (each shard's own base and top too)."""
    return _tally([(k, v["passes"], v["seconds"]) for st in parts for k, v in st.items()])


def paired_se(a: list[float], b: list[float]) -> float:
    """The paired standard error of the mean difference over rows (rows are the independent units)."""
    d = [x - y for x, y in zip(a, b)]
    return statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0


def panel_record(kind: str, p: dict, t0: float, **extra: object) -> dict:
    """The journal's record of one pass: its panel's mean KL, top-1 and NLL, each row's, and its seconds since
    ``t0``."""
    return {"kind": kind, **extra, "kl": p["kl"]["mean"], "top1": p["top1"], "nll": p["nll"],
            "rows": [[r["kl"], r["top1"], r["nll"]] for r in p["rows"]], "seconds": time.monotonic() - t0}
