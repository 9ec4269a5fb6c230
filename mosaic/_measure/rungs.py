"""``mosaic ladder``: the donors made from the model's own source by llama.cpp's ``llama-quantize``, one GGUF per
ggml type with every quantizable tensor at that type (``--pure``: the embedding and the output too).

A ladder widens what a plan can choose: every tensor at every type, not only the mixes people publish, and
rungs below the base as well as above it. Each rung is what the tool writes, never re-made by mosaic: the tool
is run with the exact command the manifest records, its output read back by the strict GGUF reader (the same
tensors as the source, each at the rung's type or at llama.cpp's fallback, which the manifest lists), hashed,
and only then renamed into place. The importance matrix is handed to the tool under a name fixed by its SHA-256
(the tool writes that name into every rung), so equal inputs give equal bytes anywhere. A tensor the matrix does
not cover (the embedding: llama-imatrix never sees it) at a type that needs one would abort the tool; it gets
the nearest type that needs none instead.

A tensor at a type of no fewer bytes than its own in the source is never worth taking: its source bytes have less
error for fewer bytes. Made at such a type it would only cost the tool's time and the disk's bytes, and measured
it would stand for the type where no plan takes it. So with ``--lean`` each rung keeps such a tensor at its source type (named by
``--tensor-type``, which the tool honours by copying the tensor as it is: the rung then holds the source's bytes,
checked on read-back), and a rung in which no tensor takes the rung's type is not made at all. On a Q4_K_M
source that leaves out Q8_0 and makes Q4_0 … Q6_K only for the Q6_K tensors; a tensor a rung would hold at a
substitute type (the matrix's, the fallback) that the rung of that type holds anyway keeps its source bytes too,
so that no tensor is quantized to the same bytes twice.

With ``--no-superseded`` as well, a 32-wide type (Q4_0, Q4_1, IQ4_NL, Q5_0, Q5_1, whose blocks fit rows a 256-wide
block does not divide: llama.cpp falls back to three of them there) is made only for the tensors the 256-wide type
of no more bytes that supersedes it cannot take; the others keep their source bytes. On a model whose rows all
divide 256 those rungs are not made at all, nor the passes that would price them. It needs ``--lean``: without it
such a type can be the version nearest the source (Q5_1 of a Q4_1 source), the top a measurement starts from.

Resumable: a rung in the manifest whose file still has its SHA-256, made from the same source, matrix and tool by
the same command, is kept.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from mosaic._base.errors import FormatError, MosaicError, SourceError
from mosaic._base.hashing import digest_file
from mosaic._base.lock import output_lock, pid_alive
from mosaic._base.progress import SILENT, Reporter
from mosaic._checkpoint.gguf_model import GGUFModel, open_gguf_model
from mosaic._formats.gguf_container import type_name
from mosaic._formats.imatrix import read_imatrix
from mosaic._formats.quantizable import quantizable
from mosaic._sources.rung_set import (
    DEFAULT_MIN_BPW,
    FTYPE_OF,
    LADDER_FILE,
    NEEDS_IMATRIX,
    SCHEMA_ID,
    bits_per_weight,
    default_types,
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
    #: a tensor whose source type has no more bytes than the rung's kept at it; types none takes not made
    #: (None: the default, :func:`options`)
    lean: bool | None = None
    min_bpw: float | None = None  # the types of fewer bits per weight are not made (None: the default; 0: no floor)
    #: with lean: a 32-wide type made only for tensors the 256-wide type superseding it cannot take (None: as lean)
    no_superseded: bool | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    """What a ladder is made with, each given or by default."""

    lean: bool
    min_bpw: float | None
    no_superseded: bool

    def as_dict(self) -> dict:
        return {"lean": self.lean, "min_bpw": self.min_bpw, "no_superseded": self.no_superseded}


def floor(req: LadderRequest) -> float | None:
    """``--min-bpw``: as given (0: none), else :data:`DEFAULT_MIN_BPW` under the default types (a list of types
    given is made as given)."""
    if req.min_bpw is not None:
        return None if req.min_bpw == 0 else req.min_bpw
    return DEFAULT_MIN_BPW if req.types is None else None


def options(req: LadderRequest, types: list[str], own: dict[str, str], notes: list[str]) -> Options:
    """The ladder's choices where ``req`` leaves them open, decided by the source (``own``: each quantizable
    tensor's type in it), each default that leaves something out said in one line of ``notes``, with the option
    that brings it back.

    ``--lean`` and ``--no-superseded`` (the bench's Qwen2.5-Coder-1.5B ladder, over its Q4_K_M) are the default
    over a quantization whose every type the ladder holds: a rung keeping a tensor's source bytes then keeps a
    version the ladder has anyway, and those bytes, lossless, are the top every pass is measured from. Where a type
    of the source is not among the types asked (SmolLM2's Q4_1 under a list without it), keeping its bytes would
    hold a type left out, so neither is the default (the bench's SmolLM2 ladder); nor over an unquantized source
    (F16, BF16, F32), where no rung's type has as many bytes as a tensor's own: there is nothing to keep."""
    quantized = sorted({t for t in own.values() if t not in _PLAIN})
    if not quantized and req.no_superseded:
        raise MosaicError(f"--no-superseded keeps a tensor's source bytes where a 256-wide type supersedes the rung's, and "
                          f"no rung holds this source's ({', '.join(sorted(set(own.values())))}): not over an unquantized source")
    lean = req.lean
    if lean is None:
        missing = [t for t in quantized if t not in types]
        lean = bool(quantized) and not missing
        if missing:
            notes.append(f"not --lean: the source holds {', '.join(missing)}, which the types asked leave out, and a rung "
                         "keeping a tensor's source bytes would hold it (--lean keeps them all the same)")
        elif (not quantized and req.no_superseded is None and req.types is None
              and any(SUPERSEDED.get(t) in types for t in types)):
            notes.append(f"the source is unquantized ({', '.join(sorted(set(own.values())))}): no rung holds its bytes, so "
                         "--lean and --no-superseded, the defaults over a quantization, are off, and the 32-wide types are "
                         "made for every tensor")
    no_superseded = req.no_superseded if req.no_superseded is not None else lean
    low = floor(req)
    if req.min_bpw is None and low is not None:
        under = [t for t in default_types(True) if bits_per_weight(t) < low and (t not in NEEDS_IMATRIX or req.imatrix)]
        if under:
            notes.append(f"{', '.join(under)}: not made, under {low:g} bits a weight, the default floor (--min-bpw 0 "
                         "makes them, for plans below it)")
    return Options(lean, low, no_superseded)


def made_tool() -> Path:
    """Where ``make llama-tools`` builds llama-quantize (``~/.cache/mosaic/llama.cpp/build/bin``)."""
    return Path.home() / ".cache" / "mosaic" / "llama.cpp" / "build" / "bin" / "llama-quantize"


def find_tool(given: str | None) -> Path:
    """``--llama-quantize``, else ``$MOSAIC_LLAMA_QUANTIZE``, else ``llama-quantize`` on ``PATH``, else the one
    ``make llama-tools`` built."""
    how = "build llama.cpp's tools with `make llama-tools` (or give --llama-quantize PATH, or set MOSAIC_LLAMA_QUANTIZE)"
    for what, value in (("--llama-quantize", given), (TOOL_ENV, os.environ.get(TOOL_ENV))):
        if value:
            p = Path(value)
            if not p.is_file() or not os.access(p, os.X_OK):
                raise MosaicError(f"{what} {value}: not an executable file; {how}")
            return p.resolve()
    found = shutil.which("llama-quantize")
    if found is not None:
        return Path(found).resolve()
    made = made_tool()
    if made.is_file() and os.access(made, os.X_OK):
        return made.resolve()
    raise MosaicError(f"no llama-quantize found (none on PATH, none at {made}): {how}")


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


def _bytes_per_weight(type_name_: str) -> float:
    from mosaic._formats.gguf_container import PLAIN_TYPES, quant_types

    _, bs, ts = next(v for v in (*PLAIN_TYPES.values(), *quant_types().values()) if v[0] == type_name_)
    return ts / bs


#: ``--no-superseded``: each 32-wide type and the 256-wide type of no more bytes that supersedes it wherever its
#: blocks divide the rows (llama.cpp itself falls back to IQ4_NL, Q5_0 and Q5_1 where they do not: :data:`FALLBACK`).
#: On the bench's two models no plan took one where the 256-wide types apply (bench/RESULTS.md, "Types a 256-wide
#: type supersedes").
SUPERSEDED = {"Q4_0": "Q4_K", "Q4_1": "Q4_K", "IQ4_NL": "IQ4_XS", "Q5_0": "Q5_K", "Q5_1": "Q5_K"}


def planned_types(rows: dict[str, int], rung_type: str, uncovered: set[str],
                  source: dict[str, str] | None = None, superseded: dict[str, str] | None = None) -> dict[str, str]:
    """Each quantizable tensor's type in the rung (``rows``: name → row width, ggml ``ne[0]``): the rung's type;
    a tensor the importance matrix does not cover, at a type that needs one, the nearest type that needs none;
    then llama.cpp's fallback where the type's blocks do not divide the rows; and where that type has no fewer
    bytes than the tensor's own in the source (``source``: name → type), the source's type: a copy. So is a type
    of ``superseded`` (a 32-wide type → the 256-wide type that supersedes it, made too) where its successor's
    blocks divide the rows (``source`` given: ``--no-superseded`` needs ``--lean``)."""
    out = {}
    for name, width in rows.items():
        t = NEEDS_IMATRIX[rung_type] if rung_type in NEEDS_IMATRIX and name in uncovered else rung_type
        if width % _block(t):
            t = FALLBACK.get(t, "F16")
            if t != "F16" and width % _block(t):
                t = "F16"
        own = (source or {}).get(name)
        successor = (superseded or {}).get(t)
        if own is not None and (_bytes_per_weight(t) >= _bytes_per_weight(own)
                                or (successor is not None and width % _block(successor) == 0)):
            t = own
        out[name] = t
    return out


def copy_substitutes(planned: dict[str, dict[str, str]], own: dict[str, str], made: list[str]) -> None:
    """``--lean``: a tensor a rung holds at a substitute type (the matrix's, llama.cpp's fallback) that the rung of
    that very type holds too keeps its source bytes instead. The substitute's bytes are that rung's already (the
    tool quantizes a tensor alike whatever else the file holds), so the versions a measurement sees are the same;
    the tool's time for them is not spent twice (Qwen2.5-Coder-1.5B's output at IQ3_S in the IQ3_XXS rung: a
    sixth of the rung's time)."""
    for t in made:
        for name, typ in planned[t].items():
            if typ not in (t, own[name]) and typ in made and planned[typ][name] == typ:
                planned[t][name] = own[name]


def _unmade(types: list[str], planned: dict[str, dict[str, str]], own: dict[str, str]) -> list[str]:
    """The types not worth a rung: every tensor keeps its source bytes there, and each tensor's source bytes
    (its lossless version, the top a plan may keep) lie in some rung made anyway; where they lie in none, the
    rung of such types that holds most of them is made too."""
    made = [t for t in types if t in planned[t].values()]

    def copies(t: str, names: set[str]) -> set[str]:
        return {n for n in names if planned[t][n] == own[n]}

    missing = {n for n in own if not any(planned[t][n] == own[n] for t in made)}
    while missing:
        holds = {t: copies(t, missing) for t in types if t not in made}
        best = max(holds, key=lambda t: len(holds[t]), default=None)
        if best is None or not holds[best]:
            break  # no type asked for can hold them: the source's own type is not among --types
        made.append(best)
        missing -= holds[best]
    return [t for t in types if t not in made]


def same_command(a: list[str], b: list[str]) -> bool:
    """Do two rung commands make the same bytes? Everything but the tool's and the source's paths (both
    compared by SHA-256), the temporary output name and the thread count."""
    return len(a) == len(b) and a[1:-4] == b[1:-4] and a[-2] == b[-2]


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
    # under --pure only an odd type needs saying; otherwise llama.cpp's own mix would choose these two
    for name, flag in (("token_embd.weight", "--token-embedding-type"), ("output.weight", "--output-tensor-type")):
        if name in odd or (not pure and name in planned):
            argv += [flag, planned[name].lower()]
    if not pure:
        for name, t in planned.items():
            if name not in ("token_embd.weight", "output.weight"):
                argv += ["--tensor-type", f"^{re.escape(name)}$={t.lower()}"]
    return [*argv, str(source), tmp_name, FTYPE_OF[rung_type], str(threads)]


def _quantizable(model: GGUFModel) -> dict[str, int]:
    """Tensors llama-quantize quantizes (:func:`quantizable`), with their row width."""
    return {t.name: t.ne[0] for t in model.tensors if quantizable(t.name, t.ne)}


def _source_types(model: GGUFModel) -> dict[str, str]:
    return {t.name: type_name(t.type_id) for t in model.tensors if quantizable(t.name, t.ne)}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(it printed nothing)"


def _read_back(path: Path, source: GGUFModel, rung_type: str, planned: dict[str, str],
               copies: set[str] = frozenset()) -> dict[str, str]:  # type: ignore[assignment]
    """The rung as the strict reader sees it: the source's tensors, each quantizable one at the type it was asked
    for (``planned``: the rung's type, a substitute, llama.cpp's row-width fallback or, with ``--lean``, the
    source's own), every other one at its source type, and each of ``copies`` the source's own bytes; anything
    else is refused. Returns the tensors at a type other than the rung's (and F32), by name: the manifest's
    fallbacks."""
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
    src = source.by_name()
    for t in rung.tensors:
        name, own = type_name(t.type_id), type_name(src[t.name].type_id)
        asked = planned.get(t.name)
        if name != (asked or own):
            what = (f"at {asked}, the type it was asked for" if asked is not None else
                    f"at the source's {own}: llama-quantize does not quantize such a tensor")
            raise MosaicError(f"the {rung_type} rung llama-quantize wrote holds {t.name} at {name}, not {what}; "
                              "the tool's own rules differ from this mosaic's (a llama.cpp of another version?)")
        if name not in (rung_type, "F32"):
            fallbacks[t.name] = name
        if t.name in copies:
            s = src[t.name]
            if not _same_bytes(path, rung.data_start + t.offset, source.path(s.file), s.start, s.nbytes):
                raise MosaicError(f"the {rung_type} rung llama-quantize wrote changed {t.name}, which it was told to keep "
                                  f"at the source's {own}: it is not the source's bytes")
    return fallbacks


def _same_bytes(a: Path, at_a: int, b: Path, at_b: int, n: int, step: int = 1 << 22) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(at_a)
        fb.seek(at_b)
        while n > 0:
            k = min(step, n)
            if fa.read(k) != fb.read(k):
                return False
            n -= k
    return True


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

    if req.no_superseded and req.lean is False:
        # without --lean a superseded type can be the version nearest the source, the top every pass is measured
        # from (Q5_1 of a Q4_1 source: SmolLM2's ffn_down); with it the source's own bytes are that top
        raise MosaicError("--no-superseded needs --lean: without it a type it leaves out can be a tensor's version "
                          "nearest the source (Q5_1 of a Q4_1 source), the top a measurement starts from")
    if req.min_bpw is not None and not (math.isfinite(req.min_bpw) and req.min_bpw >= 0):
        raise MosaicError(f"--min-bpw {req.min_bpw}: expected a number of bits per weight, 0 or more (0: no floor)")
    types = parse_types(req.types, req.imatrix is not None, floor(req))
    tool = find_tool(req.llama_quantize)
    source_path = Path(req.source)
    source = _open_source(req.source)
    opts = options(req, types, _source_types(source), req.notes)
    if req.no_superseded and not opts.lean:
        raise MosaicError("--no-superseded needs --lean, which is not the default for this source (its types are not all "
                          "among the types asked, or it is not a quantization): give --lean too")
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
        stale = _remove_stale_partials(out)
        if stale:
            req.notes.append(f"{out}: removed what a killed run left half written: {', '.join(stale)}")
        src_digest = digest_file(source_path)
        tool_sha = digest_file(tool).sha256
        imatrix_rec = None
        if matrix is not None:
            isha = digest_file(matrix.path).sha256
            imatrix_rec = {"sha256": isha, "format": matrix.format, "file": f"imatrix-{isha[:16]}.{matrix.format}"}
            handed = out / imatrix_rec["file"]
            if not handed.is_file() or digest_file(handed).sha256 != isha:
                tmp = out / _partial(imatrix_rec["file"])
                shutil.copyfile(matrix.path, tmp)
                os.replace(tmp, handed)
        source_rec = {"file": str(source_path), "sha256": src_digest.sha256, "bytes": src_digest.size}
        old = _old_manifest(out)
        same_inputs = (old is not None and old["source"]["sha256"] == source_rec["sha256"]
                       and old["imatrix"] == imatrix_rec and old["tool"]["sha256"] == tool_sha)
        quantizable, own = _quantizable(source), _source_types(source)
        superseded = {a: b for a, b in SUPERSEDED.items() if b in types} if opts.no_superseded else {}
        planned = {t: planned_types(quantizable, t, uncovered, own if opts.lean else None, superseded) for t in types}
        unmade = _unmade(types, planned, own) if opts.lean else []
        # a type left out by --no-superseded (which comes with --lean): one some tensor would have taken without it
        gone = [t for t in unmade if t in superseded and t in planned_types(quantizable, t, uncovered, own).values()]
        cheaper = [t for t in unmade if t not in gone]
        if opts.lean:
            copy_substitutes(planned, own, [t for t in types if t not in unmade])
        if cheaper:
            req.notes.append(f"{', '.join(cheaper)}: not made: no tensor of the source has fewer bytes at "
                             f"{'that type' if len(cheaper) == 1 else 'those types'} than at its own")
        if gone:
            req.notes.append(f"{', '.join(gone)}: not made (--no-superseded): the 256-wide type that supersedes "
                             f"{'it' if len(gone) == 1 else 'each'} ({', '.join(superseded[t] for t in gone)}) can "
                             f"take every tensor {'it' if len(gone) == 1 else 'they'} could")
        kept: dict[str, dict] = {}
        if old is not None and same_inputs:
            def now(t: str) -> list[str]:
                return rung_command(tool, source_path.resolve(), "", t, threads, planned=planned[t], requantize=requantize,
                                    imatrix_name=None if imatrix_rec is None else imatrix_rec["file"])

            kept = {r["type"]: r for r in old["rungs"]
                    if r["type"] not in unmade and (r["type"] not in planned or same_command(r["command"], now(r["type"])))
                    and rung_intact(out, r)}
            for r in old["rungs"]:  # a rung no longer made (its type now leaves every tensor as it is) goes
                if r["type"] in unmade:
                    (out / r["file"]).unlink(missing_ok=True)
        elif old is not None:
            req.notes.append(f"{out / LADDER_FILE}: made from other inputs (source, importance matrix or tool); "
                             "every rung is made again")
        doc = {"schema": SCHEMA_ID, "options": opts.as_dict(),
               "tool": {"path": str(tool), "version": old["tool"]["version"] if same_inputs and old else "", "sha256": tool_sha},
               "source": source_rec, "imatrix": imatrix_rec, "rungs": []}
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", source_path.name.removesuffix(".gguf")).strip(".-") or "model"
        made = [t for t in types if t not in unmade]
        advance = progress.step(f"{len(made)} rungs ({len([t for t in made if t in kept])} kept)", len(made))
        for t in made:
            if t in kept:
                doc["rungs"].append(kept[t])
                advance(1)
                continue
            copies = {n for n, typ in planned[t].items() if typ == own[n]}
            rec, version = _make_rung(tool, source, source_path, out, stem, t, threads, imatrix_rec, planned[t], copies, requantize)
            if version:
                doc["tool"]["version"] = version
            doc["rungs"].append(rec)
            _write_manifest(out, {**doc, "rungs": sorted(doc["rungs"], key=lambda r: types.index(r["type"]))})
            advance(1)
        # the rungs of other types an earlier run made of the same inputs stay in the ladder, but for those under
        # --min-bpw: the floor is asked of the ladder measure and plan read, not only of the rungs made now
        others = [r for t, r in kept.items() if t not in types]
        under = [r for r in others if opts.min_bpw is not None and bits_per_weight(r["type"]) < opts.min_bpw]
        if under:
            req.notes.append(f"{', '.join(r['type'] for r in under)}: under --min-bpw {opts.min_bpw:g}, left out of "
                             f"{LADDER_FILE}; their files stay in {out} ({', '.join(r['file'] for r in under)})")
        doc["rungs"] += [r for r in others if r not in under]
        order = {t: i for i, t in enumerate(FTYPE_OF)}
        doc["rungs"].sort(key=lambda r: order.get(r["type"], len(order)))
        _write_manifest(out, doc)
    return doc


_PARTIAL = re.compile(r"^\..+\.partial-(\d+)$")


def _partial(name: str) -> str:
    """The temporary name a file of the folder is written under until it is whole: hidden, never ``.gguf``, and
    naming its writer's process, so that :func:`_remove_stale_partials` can tell a dead run's from a live one's."""
    return f".{name}.partial-{os.getpid()}"


def _remove_stale_partials(out: Path) -> list[str]:
    """A run killed outright (SIGKILL, a lost machine) never reaches its ``finally``: its half-written rung stays
    as ``.<file>.partial-<pid>``, as big as the file it was becoming. The folder's lock is ours, so no other ladder
    writes here; a partial whose process is gone is removed before the rungs are made again."""
    removed = []
    for p in sorted(out.iterdir()):
        m = _PARTIAL.match(p.name)
        if m and p.is_file() and not p.is_symlink() and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            p.unlink()
            removed.append(p.name)
    return removed


def _make_rung(tool: Path, source: GGUFModel, source_path: Path, out: Path, stem: str, rung_type: str, threads: int,
               imatrix_rec: dict | None, planned: dict[str, str], copies: set[str], requantize: bool) -> tuple[dict, str]:
    """One rung: the tool run into a temporary name that does not end in ``.gguf``, read back, hashed, renamed;
    removed on any failure (Ctrl-C included)."""
    final = f"{stem}-{rung_type}.gguf"
    tmp = _partial(final)
    argv = rung_command(tool, source_path.resolve(), tmp, rung_type, threads,
                        imatrix_name=None if imatrix_rec is None else imatrix_rec["file"], planned=planned,
                        requantize=requantize)
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
        fallbacks = _read_back(out / tmp, source, rung_type, planned, copies)
        d = digest_file(out / tmp)
        os.replace(out / tmp, out / final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            (out / tmp).unlink()
    version = next((m.group(1).strip() for ln in proc.stdout.splitlines() if (m := _BUILD_RE.search(ln))), "")
    rec = {"type": rung_type, "id": rung_type.lower(), "file": final, "sha256": d.sha256, "bytes": d.size,
           "command": argv, "fallbacks": fallbacks, "seconds": seconds}
    return rec, version
