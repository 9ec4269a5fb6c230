"""A stand-in for llama.cpp's ``llama-quantize`` command line, for the tests of ``mosaic ladder`` where the real
tool is not built (``make test`` compiles nothing).

It quantizes with llama.cpp's own quantizer, ``llama_model_quantize``, through the runtime extra's binding (the
same C function the real tool calls), and follows the tool's own rules for which type each tensor gets, as the
llama.cpp ``make llama-tools`` builds applies them (``llama_tensor_get_type`` and ``parse_tensor_type``):

- a tensor llama.cpp never quantizes (norms, routers, 1-D tensors: :func:`mosaic._formats.quantizable.quantizable`)
  keeps its type and bytes;
- ``--token-embedding-type`` and ``--output-tensor-type`` name those two first;
- then the first ``--tensor-type PATTERN=TYPE`` (also read from ``--tensor-type-file``: entries split on white
  space) whose pattern, lower-cased, is found anywhere in the name as a regular expression;
- then, under ``--pure``, the file type's own type;
- then the row-width fallback where the type's blocks do not divide a row (:data:`FALLBACK`);
- a tensor that comes out at the type it already has is copied as it is.

The binding takes neither ``--tensor-type`` nor an importance matrix's values, so where every tensor's type is
known (``--pure``, or every tensor named) the stand-in quantizes each type's tensors apart, as a file of those
tensors alone under ``--pure`` (llama.cpp writes a tensor alike whatever else the file holds: tests/test_cuts.py),
and writes the rung of those pieces with the metadata of a run at the file type asked. Where llama.cpp's own mix
would choose some tensors' types it runs the whole file without ``--pure``, and refuses a ``--tensor-type`` there,
rather than write what the real tool would not. It reads a matrix only to apply the tool's own refusal (a tensor at
a type that needs a matrix, which the matrix does not cover, aborts the run) and then refuses to write such a type
at all. It prints a ``build = ...`` line as the real tool does.

    python -m mosaic.testing.quantize_tool [--pure] [--imatrix F] [--allow-requantize] [--token-embedding-type T]
        [--output-tensor-type T] [--tensor-type PATTERN=T] [--tensor-type-file F] SOURCE OUT FTYPE [THREADS]
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

#: ftype name -> (llama_ftype number, the type --pure writes)
FTYPES = {
    "Q4_0": (2, "Q4_0"), "Q4_1": (3, "Q4_1"), "Q8_0": (7, "Q8_0"), "Q5_0": (8, "Q5_0"), "Q5_1": (9, "Q5_1"),
    "Q2_K": (10, "Q2_K"), "Q3_K_M": (12, "Q3_K"), "Q4_K_M": (15, "Q4_K"), "Q5_K_M": (17, "Q5_K"), "Q6_K": (18, "Q6_K"),
    "IQ2_XXS": (19, "IQ2_XXS"), "IQ2_XS": (20, "IQ2_XS"), "IQ3_XXS": (23, "IQ3_XXS"), "IQ1_S": (24, "IQ1_S"),
    "IQ4_NL": (25, "IQ4_NL"), "IQ3_S": (26, "IQ3_S"), "IQ2_M": (29, "IQ2_S"), "IQ4_XS": (30, "IQ4_XS"),
    "IQ1_M": (31, "IQ1_M"), "IQ2_S": (28, "IQ2_XS"), "F32": (0, "F32"), "F16": (1, "F16"),
}
#: a type -> the ftype whose --pure output holds it
FTYPE_OF_TYPE = {t: name for name, (_, t) in reversed(list(FTYPES.items()))}
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}
#: llama.cpp's ``tensor_type_fallback`` in the llama.cpp ``make llama-tools`` builds: the type a tensor gets where the
#: asked type's blocks do not divide its rows (F16 where that one's do not either)
FALLBACK = {
    "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
    "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0",
    "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
}
BUILD = "build = 0 (stand-in for llama-quantize)"


class _Refused(Exception):
    """What the real tool would refuse, or this stand-in cannot write as it would."""


def _fail(msg: str) -> int:
    print(f"main: {msg}", file=sys.stderr)
    return 1


def _ggml_type(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name.upper()])


def _block(type_name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def fallback(type_name: str, width: int) -> str:
    """llama.cpp's type for a row of ``width`` elements asked to be ``type_name``."""
    if width % _block(type_name) == 0:
        return type_name
    t = FALLBACK.get(type_name, type_name)
    return t if width % _block(t) == 0 else "F16"


def tensor_type_option(text: str) -> tuple[str, str]:
    """One ``--tensor-type`` entry as the tool reads it: ``PATTERN=TYPE``, the pattern lower-cased."""
    pat, sep, t = text.partition("=")
    if not sep or not pat or not t:
        raise _Refused(f"malformed tensor type '{text}'")
    return pat.lower(), t.upper()


def target_types(names: dict[str, int], rung_type: str, *, pure: bool, token_embd: str | None, output: str | None,
                 overrides: list[tuple[str, str]]) -> dict[str, str | None]:
    """Each quantizable tensor's type (``names``: name -> row width), by the tool's precedence; ``None`` where
    llama.cpp's own mix would choose it (no ``--pure``, not named)."""
    out: dict[str, str | None] = {}
    for name, width in names.items():
        if name == "token_embd.weight" and token_embd:
            out[name] = token_embd.upper()  # the tool's own flags apply as given, no fallback
            continue
        if name == "output.weight" and output:
            out[name] = output.upper()
            continue
        t = next((typ for pat, typ in overrides if re.search(pat, name)), None)
        if t is None and pure:
            t = rung_type
        out[name] = None if t is None else fallback(t, width)
    return out


def main(argv: list[str]) -> int:
    print(f"main: {BUILD}", file=sys.stderr)
    opts: dict[str, str] = {}
    flags: set[str] = set()
    overrides: list[tuple[str, str]] = []
    pos: list[str] = []
    it = iter(argv)
    try:
        for a in it:
            if a in ("--pure", "--allow-requantize"):
                flags.add(a)
            elif a in ("--imatrix", "--token-embedding-type", "--output-tensor-type"):
                opts[a] = next(it, "")
            elif a == "--tensor-type":
                overrides.append(tensor_type_option(next(it, "")))
            elif a == "--tensor-type-file":
                overrides += [tensor_type_option(x) for x in Path(next(it, "")).read_text().split()]
            elif a.startswith("--"):
                return _fail(f"unknown argument: {a}")
            else:
                pos.append(a)
    except (_Refused, OSError) as e:
        return _fail(str(e))
    if len(pos) not in (3, 4) or pos[2].upper() not in FTYPES:
        return _fail("usage: quantize_tool [options] SOURCE OUT FTYPE [THREADS]")
    src, dst, ftype_name = pos[0], pos[1], pos[2].upper()
    threads = int(pos[3]) if len(pos) == 4 else 1
    rung_type = FTYPES[ftype_name][1]

    from mosaic._checkpoint.gguf_model import open_gguf_model
    from mosaic._formats.quantizable import quantizable

    model = open_gguf_model(src)
    widths = {t.name: t.ne[0] for t in model.tensors if quantizable(t.name, t.ne)}
    targets = target_types(widths, rung_type, pure="--pure" in flags, token_embd=opts.get("--token-embedding-type"),
                           output=opts.get("--output-tensor-type"), overrides=overrides)
    covered: set[str] = set()
    if "--imatrix" in opts:
        from mosaic._formats.imatrix import read_imatrix

        covered = {n for n, e in read_imatrix(opts["--imatrix"]).entries.items() if not e.empty}
    asked = {n: t or rung_type for n, t in targets.items()}
    for n, t in asked.items():
        if t in NEEDS_IMATRIX and n not in covered:
            print(f"llama_model_quantize: failed to quantize: Missing importance matrix for tensor {n} in a very "
                  "low-bit quantization", file=sys.stderr)
            return 1
    if any(t in NEEDS_IMATRIX for t in asked.values()):
        return _fail(f"this stand-in applies no importance matrix and does not write {rung_type}; "
                     "the real llama-quantize does (make llama-tools)")
    try:
        if all(t is not None for t in targets.values()):
            _by_type(model, Path(dst), ftype_name, {n: t for n, t in targets.items() if t is not None}, threads,
                     "--allow-requantize" in flags)
        else:
            if any(t is not None for n, t in targets.items() if n not in ("token_embd.weight", "output.weight")):
                raise _Refused("this stand-in cannot pass --tensor-type to llama.cpp's own mix: name every tensor, or "
                               "give --pure")
            _quantize(src, dst, FTYPES[ftype_name][0], threads, pure=False, requantize="--allow-requantize" in flags,
                      token_embd=opts.get("--token-embedding-type"), output=opts.get("--output-tensor-type"))
    except _Refused as e:
        return _fail(str(e))
    except Exception as e:  # the binding's own error, as the tool prints it
        return _fail(f"failed to quantize: {e}")
    print(f"main: quantize time = 0 ms, wrote {Path(dst).name}", file=sys.stderr)
    return 0


def _by_type(model: object, dst: Path, ftype_name: str, targets: dict[str, str], threads: int, requantize: bool) -> None:
    """The rung written from pieces: each tensor at its target type, quantized with the others of that type in a
    file of those tensors alone under ``--pure`` (copied where that is its own type), every tensor llama.cpp does
    not quantize as it is, and the metadata of a run at ``ftype_name``."""
    from mosaic._checkpoint.gguf_model import open_gguf_model
    from mosaic._checkpoint.gguf_pieces import whole, write_gguf_pieces
    from mosaic._formats.gguf_container import type_name

    own = {t.name: type_name(t.type_id) for t in model.tensors}  # type: ignore[attr-defined]
    if not requantize and any(own[n] not in ("F32", "F16", "BF16") and t != own[n] for n, t in targets.items()):
        raise _Refused("requantizing a quantized tensor needs --allow-requantize")
    groups: dict[str, list[str]] = {}
    for n, t in targets.items():
        if t != own[n]:
            groups.setdefault(t, []).append(n)
    rung_type = FTYPES[ftype_name][1]
    if not groups.get(rung_type):  # the metadata's run: one small tensor the rung's type takes, or none
        fits = [n for n, w in ((t.name, t.ne[0]) for t in model.tensors) if n in targets and w % _block(rung_type) == 0]  # type: ignore[attr-defined]
        groups[rung_type] = sorted(fits, key=lambda n: model.by_name()[n].nbytes)[:1]  # type: ignore[attr-defined]
    made: dict[str, object] = {}
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        runs = {}
        for t, names in groups.items():
            if not names:
                continue
            part = Path(tmp) / f"part-{t}.gguf"  # the source holding these tensors alone, each whole
            by = model.by_name()  # type: ignore[attr-defined]
            write_gguf_pieces(part, model, [whole(model, by[n]) for n in names])  # type: ignore[arg-type]
            out = Path(tmp) / f"out-{t}.gguf"
            _quantize(str(part), str(out), FTYPES[FTYPE_OF_TYPE[t]][0], threads, pure=True, requantize=requantize,
                      token_embd=None, output=None)
            runs[t] = open_gguf_model(out)
            for x in runs[t].tensors:
                if targets.get(x.name) == t:
                    made[x.name] = (runs[t], x)
        meta = runs.get(rung_type) or next(iter(runs.values()), model)
        src_by = model.by_name()  # type: ignore[attr-defined]
        pieces = [whole(*made[t.name]) if t.name in made else whole(model, src_by[t.name])  # type: ignore[arg-type]
                  for t in model.tensors]  # type: ignore[attr-defined]
        write_gguf_pieces(dst, meta, pieces)  # type: ignore[arg-type]


def _quantize(src: str, dst: str, ftype: int, threads: int, *, pure: bool, requantize: bool,
              token_embd: str | None, output: str | None) -> None:
    def fill(params: object) -> object:  # the same fields in either binding's parameter struct
        params.ftype, params.allow_requantize, params.nthread, params.pure = ftype, requantize, threads, pure  # type: ignore[attr-defined]
        if token_embd:
            params.token_embedding_type = _ggml_type(token_embd)  # type: ignore[attr-defined]
        if output:
            params.output_tensor_type = _ggml_type(output)  # type: ignore[attr-defined]
        return params

    try:
        from cyllama.llama import llama_cpp as cy
    except ImportError:
        import llama_cpp  # llama-cpp-python

        if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), fill(llama_cpp.llama_model_quantize_default_params())) != 0:
            raise RuntimeError("llama_model_quantize returned an error") from None
        return
    cy.model_quantize(src, dst, fill(cy.LlamaModelQuantizeParams()))


def write_tool(path: str | Path) -> Path:
    """An executable file at ``path`` that runs this stand-in with this Python (what ``--llama-quantize`` takes)."""
    path = Path(path)
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m mosaic.testing.quantize_tool \"$@\"\n")
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
