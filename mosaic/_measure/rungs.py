"""``mosaic ladder``: the donors made from the model's own source by llama.cpp's ``llama-quantize``, one GGUF per
ggml type with every quantizable tensor at that type (``--pure``: the embedding and the output too).

A ladder widens what a plan can choose: every tensor at every type, not only the mixes people publish, and
rungs below the base as well as above it. Each rung is what the tool writes, never re-made by mosaic: the tool
is run with the exact command the manifest records, its output read back by the strict GGUF reader (the same
tensors as the source, each at the rung's type or at llama.cpp's fallback, which the manifest lists), hashed,
and only then renamed into place. The importance matrix is handed to the tool under a name fixed by its SHA-256
(the tool writes that name into every rung), so equal inputs give equal bytes anywhere. A tensor the matrix does
not cover (the embedding: llama-imatrix never sees it) at a type that needs one would abort the tool; it gets
the nearest type that needs none instead. Resumable: a rung in the manifest whose file still has its SHA-256,
made from the same source, matrix and tool, is kept.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import FormatError, MosaicError, SourceError
from mosaic._base.hashing import digest_file
from mosaic._base.lock import output_lock
from mosaic._base.progress import SILENT, Reporter
from mosaic._checkpoint.gguf_model import GGUFModel, open_gguf_model
from mosaic._formats.gguf_container import type_name
from mosaic._formats.imatrix import read_imatrix
from mosaic._sources.rung_set import (
    FTYPE_OF,
    LADDER_FILE,
    NEEDS_IMATRIX,
    SCHEMA_ID,
    manifest_errors,
    parse_types,
    rung_intact,
)

TOOL_ENV = "MOSAIC_LLAMA_QUANTIZE"
#: The line a llama.cpp tool names its build by: ``version: 0.5.0-dev (build 1, commit 0c1e570)`` in newer builds,
#: ``main: build = 6123 (abcdef12)`` in older ones.
_BUILD_RE = re.compile(r"\b(version:\s*\S.*\bbuild\b.*|build\s*[=:]\s*\S.*)$")
#: ggml types that are never quantized (F32, F16, BF16 and the integer types stay as the tool leaves them).
_PLAIN = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}


@dataclass
class LadderRequest:
    source: str
    out: Path
    imatrix: str | None = None
    types: str | None = None
    llama_quantize: str | None = None
    threads: int | None = None
    notes: list[str] = field(default_factory=list)


def find_tool(given: str | None) -> Path:
    """``--llama-quantize``, else ``$MOSAIC_LLAMA_QUANTIZE``, else ``llama-quantize`` on ``PATH``."""
    how = "build llama.cpp's tools with `make llama-tools`, then give --llama-quantize PATH (or set MOSAIC_LLAMA_QUANTIZE)"
    for what, value in (("--llama-quantize", given), (TOOL_ENV, os.environ.get(TOOL_ENV))):
        if value:
            p = Path(value)
            if not p.is_file() or not os.access(p, os.X_OK):
                raise MosaicError(f"{what} {value}: not an executable file; {how}")
            return p.resolve()
    found = shutil.which("llama-quantize")
    if found is None:
        raise MosaicError(f"no llama-quantize found (not on PATH): {how}")
    return Path(found).resolve()


def _open_source(text: str) -> GGUFModel:
    p = Path(text)
    if not p.is_file():
        raise MosaicError(f"SOURCE {text}: no such file (a GGUF model: one file, or the first file of a split set)")
    try:
        model = open_gguf_model(p)
    except (SourceError, FormatError) as e:
        kind = _general_type(p)
        if kind == "imatrix":
            raise MosaicError(f"SOURCE {text}: an importance matrix, not a model (give it as --imatrix)") from None
        raise MosaicError(f"SOURCE {text}: not a GGUF model: {e}") from None
    if model.first.value("general.type") not in (None, "model"):
        raise MosaicError(f"SOURCE {text}: a GGUF of general.type {model.first.value('general.type')!r}, not a model")
    return model


def _general_type(path: Path) -> str | None:
    from mosaic._formats.gguf_container import read_gguf

    with contextlib.suppress(Exception):
        v = read_gguf(path).value("general.type")
        return v if isinstance(v, str) else None
    return None


#: llama.cpp's own fallback for a tensor whose rows a type's blocks do not divide (``tensor_type_fallback``):
#: the 256-wide types fall to a 32-wide one; where that does not divide either, F16.
FALLBACK = {
    "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
    "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL",
    "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
}


def _block(type_name_: str) -> int:
    from mosaic._formats.gguf_container import quant_types

    return next(bs for name, bs, _ in quant_types().values() if name == type_name_)


def planned_types(rows: dict[str, int], rung_type: str, uncovered: set[str]) -> dict[str, str]:
    """Each quantizable tensor's type in the rung (``rows``: name → row width, ggml ``ne[0]``): the rung's type;
    a tensor the importance matrix does not cover, at a type that needs one, the nearest type that needs none;
    then llama.cpp's fallback where the type's blocks do not divide the rows."""
    out = {}
    for name, width in rows.items():
        t = NEEDS_IMATRIX[rung_type] if rung_type in NEEDS_IMATRIX and name in uncovered else rung_type
        if width % _block(t):
            t = FALLBACK.get(t, "F16")
            if t != "F16" and width % _block(t):
                t = "F16"
        out[name] = t
    return out


def rung_command(tool: Path, source: Path, tmp_name: str, rung_type: str, threads: int, *,
                 imatrix_name: str | None, planned: dict[str, str], requantize: bool) -> list[str]:
    """The exact argv of one rung. ``--pure`` where every tensor but the embedding and the output takes the rung's
    type (those two by their own flags where they cannot); otherwise ``--pure`` cannot say it (llama.cpp applies
    neither its fallback nor ``--tensor-type`` under ``--pure``), and every tensor is named with its planned type
    by ``--tensor-type``, which llama.cpp applies before its own mix."""
    argv = [str(tool)]
    odd = {n: t for n, t in planned.items() if t != rung_type}
    pure = all(n in ("token_embd.weight", "output.weight") for n in odd)
    if pure:
        argv.append("--pure")
    if imatrix_name is not None:
        argv += ["--imatrix", imatrix_name]
    if requantize:
        argv.append("--allow-requantize")
    if "token_embd.weight" in odd:
        argv += ["--token-embedding-type", odd["token_embd.weight"].lower()]
    if "output.weight" in odd:
        argv += ["--output-tensor-type", odd["output.weight"].lower()]
    if not pure:
        for name, t in planned.items():
            if name not in ("token_embd.weight", "output.weight"):
                argv += ["--tensor-type", f"^{re.escape(name)}$={t.lower()}"]
    return [*argv, str(source), tmp_name, FTYPE_OF[rung_type], str(threads)]


def _quantizable(model: GGUFModel) -> dict[str, int]:
    """Tensors llama-quantize quantizes (2-D and wider weights; norms and biases stay F32), with their row width."""
    return {t.name: t.ne[0] for t in model.tensors if len(t.ne) >= 2 and t.name.endswith(".weight")}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(it printed nothing)"


def _read_back(path: Path, source: GGUFModel, rung_type: str) -> dict[str, str]:
    """The rung as the strict reader sees it: the source's tensors, each at the rung's type, F32, or a
    fallback (returned, by name); anything else is refused."""
    from mosaic._formats.gguf_container import GGUFError, read_gguf

    try:
        rung = read_gguf(path)  # the strict reader: magic, version, types, alignment, offsets tiling the data
    except (GGUFError, OSError) as e:
        raise MosaicError(f"the {rung_type} rung llama-quantize wrote does not read back: {e}") from None
    if rung.value("split.count") not in (None, 1):
        raise MosaicError(f"the {rung_type} rung llama-quantize wrote is a split set; a rung is one file")
    want = {t.name: t.ne for t in source.tensors}
    got = {t.name: t.ne for t in rung.tensors}
    if got != want:
        extra = sorted(set(got) - set(want)) or sorted(n for n in got if got[n] != want.get(n))
        missing = sorted(set(want) - set(got))
        which = f"lacks {missing[0]}" if missing else f"holds {extra[0]} unlike the source"
        raise MosaicError(f"the {rung_type} rung llama-quantize wrote is not the source's model: it {which}")
    fallbacks = {}
    for t in rung.tensors:
        name = type_name(t.type_id)
        if name not in (rung_type, "F32"):
            fallbacks[t.name] = name
    return fallbacks


def _write_manifest(folder: Path, doc: dict) -> None:
    from mosaic._hub.partial import atomic_write

    errs = manifest_errors(doc)
    if errs:
        raise MosaicError(f"the ladder's manifest does not match its schema: {errs[0]}")
    import json

    atomic_write(folder / LADDER_FILE, (json.dumps(doc, indent=2) + "\n").encode())


def _old_manifest(folder: Path) -> dict | None:
    import json

    path = folder / LADDER_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if not manifest_errors(doc) else None


def make_ladder(req: LadderRequest, progress: Reporter = SILENT) -> dict:
    """Make (or complete) the ladder ``req.out``; returns its manifest. Every input is checked before the
    folder is touched; the folder's lock (``DIR.lock``) is held throughout."""
    from mosaic._eval.runtime import default_threads
    from mosaic._measure.importance import local_path

    types = parse_types(req.types, req.imatrix is not None)
    tool = find_tool(req.llama_quantize)
    source_path = Path(req.source)
    source = _open_source(req.source)
    if len(source.files) > 1:
        raise MosaicError(f"SOURCE {req.source}: a split set; merge it first (llama-gguf-split --merge) so that one "
                          "file's SHA-256 names the source")
    out = Path(req.out)
    if out.exists() and not out.is_dir():
        raise MosaicError(f"--out {out}: exists and is not a folder")
    with contextlib.suppress(ValueError):
        if source_path.resolve().parent == out.resolve():
            raise MosaicError(f"--out {out}: the source lies in it; give the ladder a folder of its own")
    matrix = None
    uncovered: set[str] = set()
    if req.imatrix is not None:
        ipath = local_path(req.imatrix, progress)
        matrix = read_imatrix(ipath).for_model({t.name: t.ne for t in source.tensors})
        covered = {n for n, e in matrix.entries.items() if not e.empty}
        uncovered = {n for n in _quantizable(source) if n not in covered}
    threads = req.threads or default_threads()
    requantize = any(type_name(t.type_id) not in _PLAIN for t in source.tensors)
    with output_lock(out, "mosaic ladder"):
        out.mkdir(parents=True, exist_ok=True)
        src_digest = digest_file(source_path)
        tool_sha = digest_file(tool).sha256
        imatrix_rec = None
        if matrix is not None:
            isha = digest_file(matrix.path).sha256
            imatrix_rec = {"sha256": isha, "format": matrix.format, "file": f"imatrix-{isha[:16]}.{matrix.format}"}
            handed = out / imatrix_rec["file"]
            if not handed.is_file() or digest_file(handed).sha256 != isha:
                tmp = out / f".{imatrix_rec['file']}.partial-{os.getpid()}"
                shutil.copyfile(matrix.path, tmp)
                os.replace(tmp, handed)
        source_rec = {"file": str(source_path), "sha256": src_digest.sha256, "bytes": src_digest.size}
        old = _old_manifest(out)
        same_inputs = (old is not None and old["source"]["sha256"] == source_rec["sha256"]
                       and old["imatrix"] == imatrix_rec and old["tool"]["sha256"] == tool_sha)
        kept: dict[str, dict] = {}
        if old is not None and same_inputs:
            kept = {r["type"]: r for r in old["rungs"] if rung_intact(out, r)}
        elif old is not None:
            req.notes.append(f"{out / LADDER_FILE}: made from other inputs (source, importance matrix or tool); "
                             "every rung is made again")
        doc = {"schema": SCHEMA_ID,
               "tool": {"path": str(tool), "version": old["tool"]["version"] if same_inputs and old else "", "sha256": tool_sha},
               "source": source_rec, "imatrix": imatrix_rec, "rungs": []}
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", source_path.name.removesuffix(".gguf")).strip(".-") or "model"
        advance = progress.step(f"{len(types)} rungs ({len(kept)} kept)", len(types))
        for t in types:
            if t in kept:
                doc["rungs"].append(kept[t])
                advance(1)
                continue
            rec, version = _make_rung(tool, source, source_path, out, stem, t, threads, imatrix_rec, uncovered, requantize)
            if version:
                doc["tool"]["version"] = version
            doc["rungs"].append(rec)
            _write_manifest(out, {**doc, "rungs": sorted(doc["rungs"], key=lambda r: types.index(r["type"]))})
            advance(1)
        # the rungs of other types an earlier run made of the same inputs stay in the ladder
        doc["rungs"] += [r for t, r in kept.items() if t not in types]
        order = {t: i for i, t in enumerate(FTYPE_OF)}
        doc["rungs"].sort(key=lambda r: order.get(r["type"], len(order)))
        _write_manifest(out, doc)
    return doc


def _make_rung(tool: Path, source: GGUFModel, source_path: Path, out: Path, stem: str, rung_type: str, threads: int,
               imatrix_rec: dict | None, uncovered: set[str], requantize: bool) -> tuple[dict, str]:
    """One rung: the tool run into a temporary name that does not end in ``.gguf``, read back, hashed, renamed;
    removed on any failure (Ctrl-C included)."""
    final = f"{stem}-{rung_type}.gguf"
    tmp = f".{final}.partial-{os.getpid()}"
    argv = rung_command(tool, source_path.resolve(), tmp, rung_type, threads,
                        imatrix_name=None if imatrix_rec is None else imatrix_rec["file"],
                        planned=planned_types(_quantizable(source), rung_type, uncovered), requantize=requantize)
    try:
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=out, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, errors="replace")
        except OSError as e:
            raise MosaicError(f"{tool}: cannot run it: {e.strerror or e}") from None
        if proc.returncode != 0 or not (out / tmp).is_file():
            why = f"exit {proc.returncode}" if proc.returncode >= 0 else f"signal {-proc.returncode}"
            raise MosaicError(f"llama-quantize failed making the {rung_type} rung ({why}): {_last_line(proc.stdout)}")
        seconds = round(time.monotonic() - t0, 3)
        fallbacks = _read_back(out / tmp, source, rung_type)
        d = digest_file(out / tmp)
        os.replace(out / tmp, out / final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            (out / tmp).unlink()
    version = next((m.group(1).strip() for ln in proc.stdout.splitlines() if (m := _BUILD_RE.search(ln))), "")
    rec = {"type": rung_type, "id": rung_type.lower(), "file": final, "sha256": d.sha256, "bytes": d.size,
           "command": argv, "fallbacks": fallbacks, "seconds": seconds}
    return rec, version
