"""A stand-in for llama.cpp's ``llama-quantize`` command line, for the tests of ``mosaic ladder`` where the real
tool is not built (``make test`` compiles nothing).

It quantizes with llama.cpp's own quantizer, ``llama_model_quantize``, through the runtime extra's binding (the
same C function the real tool calls, with the same parameters: ``--pure``, ``--allow-requantize``,
``--token-embedding-type``, ``--output-tensor-type``), so a rung it writes holds what llama.cpp writes for that
type, tensor by tensor. What the bindings cannot hand over is an importance matrix's values: it reads the matrix
only to apply the tool's own refusal (a tensor at a type that needs a matrix, which the matrix does not cover,
aborts the run, as llama-quantize aborts it) and then refuses to write such a type at all, rather than write one
the real tool would not. Nor can they hand over ``--tensor-type``: where every tensor is named (as ``mosaic
ladder`` names them) the binding quantizes as under ``--pure``, llama.cpp's own mix applying to none, and a
tensor named at the type it already has in the source is then given the source's bytes, as llama.cpp copies
such a tensor. It prints a ``build = ...`` line as the real tool does.

    python -m mosaic.testing.quantize_tool [--pure] [--imatrix F] [--allow-requantize]
        [--token-embedding-type T] [--output-tensor-type T] [--tensor-type NAME=T] SOURCE OUT FTYPE [THREADS]
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

#: ftype name -> (llama_ftype number, the type --pure writes)
FTYPES = {
    "Q4_0": (2, "Q4_0"), "Q4_1": (3, "Q4_1"), "Q8_0": (7, "Q8_0"), "Q5_0": (8, "Q5_0"), "Q5_1": (9, "Q5_1"),
    "Q2_K": (10, "Q2_K"), "Q3_K_M": (12, "Q3_K"), "Q4_K_M": (15, "Q4_K"), "Q5_K_M": (17, "Q5_K"), "Q6_K": (18, "Q6_K"),
    "IQ2_XXS": (19, "IQ2_XXS"), "IQ2_XS": (20, "IQ2_XS"), "IQ3_XXS": (23, "IQ3_XXS"), "IQ1_S": (24, "IQ1_S"),
    "IQ4_NL": (25, "IQ4_NL"), "IQ3_S": (26, "IQ3_S"), "IQ2_M": (29, "IQ2_S"), "IQ4_XS": (30, "IQ4_XS"),
    "IQ1_M": (31, "IQ1_M"), "IQ2_S": (28, "IQ2_XS"), "F32": (0, "F32"), "F16": (1, "F16"),
}
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}
BUILD = "build = 0 (stand-in for llama-quantize)"


def _fail(msg: str) -> int:
    print(f"main: {msg}", file=sys.stderr)
    return 1


def _ggml_type(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name.upper()])


def main(argv: list[str]) -> int:
    print(f"main: {BUILD}", file=sys.stderr)
    opts: dict[str, str] = {}
    flags: set[str] = set()
    overrides: list[tuple[str, str]] = []
    pos: list[str] = []
    it = iter(argv)
    for a in it:
        if a in ("--pure", "--allow-requantize"):
            flags.add(a)
        elif a in ("--imatrix", "--token-embedding-type", "--output-tensor-type"):
            opts[a] = next(it, "")
        elif a == "--tensor-type":
            pat, _, t = next(it, "").partition("=")
            overrides.append((pat, t))
        elif a.startswith("--"):
            return _fail(f"unknown argument: {a}")
        else:
            pos.append(a)
    if len(pos) not in (3, 4) or pos[2].upper() not in FTYPES:
        return _fail("usage: quantize_tool [options] SOURCE OUT FTYPE [THREADS]")
    src, dst, ftype_name = pos[0], pos[1], pos[2].upper()
    threads = int(pos[3]) if len(pos) == 4 else 1
    ftype, rung_type = FTYPES[ftype_name]

    from mosaic._checkpoint.gguf_model import open_gguf_model

    model = open_gguf_model(src)
    names = [t.name for t in model.tensors if len(t.ne) >= 2 and t.name.endswith(".weight")]

    def target(name: str) -> str:
        if name == "token_embd.weight" and "--token-embedding-type" in opts:
            return opts["--token-embedding-type"].upper()
        if name == "output.weight" and "--output-tensor-type" in opts:
            return opts["--output-tensor-type"].upper()
        for pat, t in overrides:
            if re.search(pat, name):
                return t.upper()
        return rung_type

    if "--imatrix" in opts:
        from mosaic._formats.imatrix import read_imatrix

        covered = {n for n, e in read_imatrix(opts["--imatrix"]).entries.items() if not e.empty}
    else:
        covered = set()
    for n in names:
        if target(n) in NEEDS_IMATRIX and n not in covered:
            print(f"llama_model_quantize: failed to quantize: Missing importance matrix for tensor {n} in a very "
                  "low-bit quantization", file=sys.stderr)
            return 1
    if any(target(n) in NEEDS_IMATRIX for n in names):
        return _fail(f"this stand-in applies no importance matrix and does not write {rung_type}; "
                     "the real llama-quantize does (make llama-tools)")
    named = {n for n in names if any(re.search(p, n) for p, _ in overrides)}
    named |= {n for n, o in (("token_embd.weight", "--token-embedding-type"), ("output.weight", "--output-tensor-type"))
              if o in opts}
    everything_named = bool(overrides) and set(names) <= named
    try:
        _quantize(src, dst, ftype, threads, pure="--pure" in flags or everything_named,
                  requantize="--allow-requantize" in flags, token_embd=opts.get("--token-embedding-type"),
                  output=opts.get("--output-tensor-type"))
        own = {t.name: t.type_name for t in model.tensors}
        copies = {n for n in names if n in named and target(n) == own[n]}
        if copies:
            _copy_from_source(model, Path(dst), copies)
    except Exception as e:  # the binding's own error, as the tool prints it
        return _fail(f"failed to quantize: {e}")
    print(f"main: quantize time = 0 ms, wrote {Path(dst).name}", file=sys.stderr)
    return 0


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


def _copy_from_source(source: object, dst: Path, names: set[str]) -> None:
    """``dst`` written again with each of ``names`` at the source's own type and bytes (what llama.cpp writes for a
    tensor named at the type it has), every other tensor and the metadata as the binding wrote them."""
    from mosaic._checkpoint.gguf_model import open_gguf_model
    from mosaic._checkpoint.gguf_pieces import whole, write_gguf_pieces

    seen = dst.with_name(dst.name + ".written.gguf")  # the model reader takes a .gguf name; the tool's may not be one
    os.link(dst, seen)
    try:
        rung = open_gguf_model(seen)
        src = source.by_name()  # type: ignore[attr-defined]
        if all(src[t.name].type_id == t.type_id for t in rung.tensors if t.name in names):
            return  # the binding copied them itself (the rung's own type)
        pieces = [whole(source, src[t.name]) if t.name in names else whole(rung, t) for t in rung.tensors]  # type: ignore[arg-type]
        tmp = dst.with_name(dst.name + ".copying.gguf")
        write_gguf_pieces(tmp, rung, pieces)
        tmp.replace(dst)
    finally:
        seen.unlink()


def write_tool(path: str | Path) -> Path:
    """An executable file at ``path`` that runs this stand-in with this Python (what ``--llama-quantize`` takes)."""
    path = Path(path)
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m mosaic.testing.quantize_tool \"$@\"\n")
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
