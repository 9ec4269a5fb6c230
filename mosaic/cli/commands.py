"""The command line: a thin layer over the Python API (:mod:`mosaic._api.functions`, ``import mosaic``).

Each command turns its flags into one API call's arguments and prints the result: ``--json`` prints
``result.as_dict()`` on stdout alone, otherwise :mod:`mosaic.cli.render` draws it. Every
:class:`~mosaic.MosaicError` becomes one ``mosaic: error: ...`` line on stderr and its exit status
(2 bad input, 1 failed verification).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from mosaic._api import functions as api
from mosaic._base.errors import MosaicError, SigningError
from mosaic._base.literal import printable
from mosaic._base.version import __version__
from mosaic.cli.render import stdout_console


def _fail(message: str, code: int) -> None:
    click.echo(f"mosaic: error: {printable(message)}", err=True)
    sys.exit(code)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map mosaic's errors (and Ctrl-C, and full disks) to one line and an exit status."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MosaicError as e:
            _fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            click.echo("mosaic: interrupted", err=True)
            sys.exit(130)
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            _fail(f"{where}{e.strerror or e}", 2)

    return wrapper


def _emit_json(doc: object) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def _console() -> Console:
    return stdout_console()


def _bars(as_json: bool) -> bool:
    """Progress bars on stderr when it is a terminal, never with ``--json``."""
    return not as_json and sys.stderr.isatty()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mosaic")
def main() -> None:
    """Build mixed-precision mosaic checkpoints of quantized LLMs, byte for byte, and prove how."""
    from mosaic._base.hashing import return_freed_buffers

    return_freed_buffers()


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@_guarded
def census(directory: Path, as_json: bool) -> None:
    """Inspect one checkpoint: tensors, shards, codebook, bits per layer and module, problems.

    DIRECTORY is a folder, or org/name@<40-hex commit>: from the local cache if it is there, else only
    its configs and shard headers are read from the hub, by ranges (the bytes read are reported). It may
    also be a GGUF model: a .gguf file, a split set's first file, or a folder holding one GGUF model
    (tensor types, bits per layer from each tensor's type). Exit 0 with no problems, 1 with problems,
    2 when the checkpoint cannot be read.
    """
    from mosaic.cli.render import render_census, render_gguf_census

    res = api.census(directory)
    if as_json:
        _emit_json(res.as_dict())
    else:
        (render_gguf_census if res.format == "gguf" else render_census)(_console(), dict(res.report))
    sys.exit(0 if res.ok else 1)


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--out", "out", type=click.Path(path_type=Path), help="Output folder (default: the recipe's output.dir, else out/<name>).")
@click.option("--force", is_flag=True, help="Replace an existing output folder, after the new build succeeded.")
@click.option("--jobs", type=click.IntRange(1, 256), default=None, help="Files processed at once (default: number of cores).")
@click.option("--link", is_flag=True, help="Hard-link untouched shards instead of copying them (they then share the base's inode).")
@click.option("--stream", is_flag=True,
              help="Read repo sources missing from the local cache from the hub by byte ranges: only the bytes the mosaic takes.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@_guarded
def build(recipe: Path, out: Path | None, force: bool, jobs: int | None, link: bool, stream: bool, as_json: bool) -> None:
    """Build the mosaic described by the YAML RECIPE, byte for byte, with PROVENANCE.json.

    With --stream, a repo + revision source that is not in the local Hugging Face cache is not
    downloaded whole: its headers and configs, then exactly the tensors the mosaic takes, are read by
    HTTP ranges into a resumable cache ($HF_HOME/mosaic/ranges)."""
    from mosaic.cli.render import render_build

    res = api.build(recipe, out=out, force=force, jobs=jobs, link=link, stream=stream, progress=_bars(as_json))
    if as_json:
        _emit_json(res.as_dict())
    else:
        render_build(_console(), res.as_dict())


@main.command()
@click.option("--base", "base", default=None, metavar="SRC",
              help="The base: a folder or org/name@<40-hex commit>; for GGUF a .gguf file, a folder of one model, or org/name@<commit>:<file or glob>.")
@click.option("--donor", "donors", multiple=True, metavar="ID=SRC", help="A donor (repeatable; order = measurement alternatives).")
@click.option("--ladder", "ladder", default=None, type=click.Path(path_type=Path), metavar="DIR",
              help="A ladder made by mosaic ladder, in place of --base/--donor: its smallest rung the base, every other a donor.")
@click.option("--scores", "scores", required=True, type=click.Path(path_type=Path),
              help="A measurement from mosaic measure, per-layer scores (JSON or CSV), or exllamav3's measurement JSON.")
@click.option("--max-size", "max_size", metavar="SIZE", help="Budget: total .safetensors bytes (K/M/G/T = 10^3.., KiB/MiB/GiB/TiB = 1024^..).")
@click.option("--target-rate", "target_rate", metavar="BPW", help="Budget: the exact trellis rate stays at most BPW.")
@click.option("--layers", "layers", type=int, metavar="N", help="Take exactly N units (fewer if fewer exist).")
@click.option("--unit", "unit", type=click.Choice(["layer-experts", "layer", "module-group"]), default=None,
              help="What moves together: a layer's routed experts (the default), a whole layer, or each module group of a "
                   "layer; a measurement's own unit unless given.")
@click.option("--out", "out", type=click.Path(path_type=Path), help="Write the recipe here (sources relative to its folder).")
@click.option("--pin", "pins", multiple=True, metavar="PATTERN=TYPE",
              help="GGUF: hold the tensors PATTERN matches at TYPE (read as llama-quantize reads --tensor-type; repeatable, "
                   "the first match deciding); the plan honours every pin within the budget or is refused.")
@click.option("--tensor-type-file", "tensor_type_file", type=click.Path(path_type=Path), metavar="FILE",
              help="GGUF: also write the plan as llama-quantize --tensor-type-file reads it (every tensor it quantizes, "
                   "named alone), so that the stock tool makes the file from the ladder's source.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@_guarded
def plan(base: str | None, donors: tuple[str, ...], ladder: Path | None, scores: Path, max_size: str | None,
         target_rate: str | None, layers: int | None, unit: str, out: Path | None, pins: tuple[str, ...],
         tensor_type_file: Path | None, as_json: bool) -> None:
    """Choose each unit's version under a budget, exactly (not greedily), and write the recipe; for GGUF a unit
    may also go down to a donor of fewer bytes than the base's."""
    from mosaic.cli.render import render_plan

    res = api.plan(base=base, donors=list(donors), scores=scores, max_size=max_size,
                   target_rate=target_rate, layers=layers, unit=unit, out=out, ladder=ladder, pins=pins,
                   tensor_type_file=tensor_type_file)
    if as_json:
        _emit_json(res.as_dict())
    else:
        render_plan(_console(), dict(res.report), list(res.notes), str(out) if out else None)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--sources",
    "sources",
    is_flag=False,
    flag_value="-",
    default=None,
    metavar="[RECIPE]",
    help="Also compare every tensor with its source, resolved from RECIPE (the recipe file the build used) "
    "or, without RECIPE, from mosaic-recipe.yaml with paths relative to the current directory.",
)
@click.option("--key", "key", type=click.Path(path_type=Path), default=None, metavar="PUBLIC_KEY",
              help="Verify the signature (model.sig) with this PEM public key, besides every other check.")
@click.option("--identity", default=None, help="Verify a Sigstore signature: the signer's identity (e.g. an e-mail address).")
@click.option("--issuer", default=None, help="Verify a Sigstore signature: the identity's OpenID Connect issuer.")
@click.option("--require-signature", "require_signature", is_flag=True,
              help="Fail when the folder has no signature, or one not verified with --key or --identity/--issuer.")
@click.option("--jobs", type=click.IntRange(1, 256), default=None, help="Files read at once (default: number of cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@_guarded
def audit(directory: Path, sources: str | None, key: Path | None, identity: str | None, issuer: str | None,
          require_signature: bool, jobs: int | None, as_json: bool) -> None:
    """Verify a built mosaic from its files alone (or every mosaic below DIRECTORY).

    A signature (model.sig, from `mosaic sign`) is verified with --key or --identity/--issuer;
    without them the audit reports it present but unverified. Exit 0 when every check passes, 1 when
    any fails, 2 when DIRECTORY is not a mosaic or a key cannot be used.
    """
    from mosaic.cli.render import render_audit

    src: bool | str | None = None if sources is None else (True if sources == "-" else sources)
    res = api.audit(directory, sources=src, key=key, identity=identity, issuer=issuer,
                    require_signature=require_signature, jobs=jobs, progress=_bars(as_json))
    doc = res.as_dict()
    if as_json:
        _emit_json(doc)
    else:
        render_audit(_console(), doc)
    sys.exit(0 if res.ok else 1)


def _passphrase(key: Path, password_file: Path | None) -> str | None:
    """A private key's passphrase: from --password-file, MOSAIC_KEY_PASSWORD, or typed on a terminal."""
    import os

    if password_file is not None:
        try:
            return password_file.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise SigningError(f"{password_file}: --password-file: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if os.environ.get("MOSAIC_KEY_PASSWORD"):
        return os.environ["MOSAIC_KEY_PASSWORD"]
    if sys.stdin.isatty():
        return click.prompt(f"passphrase for {key}", hide_input=True, default="", show_default=False, err=True)
    return None


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--key", "key", type=click.Path(path_type=Path), default=None, metavar="PRIVATE_KEY",
              help="PEM elliptic-curve private key (P-256, P-384 or P-521). An encrypted key's passphrase comes from "
              "--password-file, MOSAIC_KEY_PASSWORD, or the terminal.")
@click.option("--password-file", "password_file", type=click.Path(path_type=Path), default=None,
              help="File holding the private key's passphrase (its first line).")
@click.option("--sigstore", is_flag=True,
              help="Sign keylessly with Sigstore instead (network, and an OpenID Connect identity: ambient "
              "credentials in CI, else a browser sign-in).")
@click.option(
    "--sources",
    "sources",
    is_flag=False,
    flag_value="-",
    default=None,
    metavar="[RECIPE]",
    help="Audit every tensor against its source too before signing (as `mosaic audit --sources`).",
)
@click.option("--force", is_flag=True, help="Replace an existing model.sig.")
@click.option("--jobs", type=click.IntRange(1, 256), default=None, help="Files read at once (default: number of cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@_guarded
def sign(directory: Path, key: Path | None, password_file: Path | None, sigstore: bool, sources: str | None,
         force: bool, jobs: int | None, as_json: bool) -> None:
    """Sign a mosaic folder (or GGUF export) with OpenSSF model signing: DIRECTORY/model.sig.

    The folder is audited first (every byte read once) and signed only if every check passes, over the
    digests of that read: every file but model.sig and the hub's .cache/huggingface/ records. Exit 0
    when signed, 1 when the audit fails, 2 on a key, passphrase or option problem.
    """
    src: bool | str | None = None if sources is None else (True if sources == "-" else sources)
    ask = (lambda: _passphrase(key, password_file)) if key is not None or password_file is not None else None
    res = api.sign(directory, key=key, password=ask, sigstore=sigstore, sources=src, force=force, jobs=jobs,
                   progress=_bars(as_json))
    if as_json:
        _emit_json(res.as_dict())
        return
    c = res.audit.counts
    click.echo(f"audit passed: {printable(directory)} ({c.get('files', 0)} files, {c.get('bytes', 0):,} bytes read once)")
    click.echo(f"signed {printable(res.signature)}: {res.files} files, with {printable(res.by)}")
    how = "--key PUBLIC_KEY" if key else "--identity IDENTITY --issuer ISSUER"
    click.echo(f"verify with: mosaic audit {printable(directory)} {how}")


@main.group()
def export() -> None:
    """Repackage a mosaic (or any EXL3 checkpoint) for another runtime."""


@export.command("gguf")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="New output folder.")
@click.option("--split-max-size", default="50G", show_default=True,
              help="Largest tensor bytes per shard: bytes, or K/M/G = 10^3/10^6/10^9 (as llama-gguf-split counts).")
@click.option("--no-tensor-first-split/--tensor-first-split", default=True, show_default=True,
              help="Keep the first shard metadata-only.")
@click.option("--name", default=None, help="File name stem (default: the source folder's name).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@_guarded
def export_gguf_cmd(directory: Path, out: Path, split_max_size: str, no_tensor_first_split: bool,
                    name: str | None, as_json: bool) -> None:
    """Repackage DIRECTORY for ranma.cpp: EXL3 tensors bit for bit in GGUF shards, with manifest.json."""
    res = api.export_gguf(directory, out, split_max_size=split_max_size, tensor_first_split=not no_tensor_first_split,
                          name=name, progress=_bars(as_json))
    if as_json:
        _emit_json(res.as_dict())
        return
    from mosaic.cli.render import render_export

    render_export(_console(), res.as_dict())


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--local-dir", "local_dir", type=click.Path(path_type=Path), default=None,
              help="Download into DIR/<org>/<name>@<revision> instead of the Hugging Face cache.")
@click.option("--jobs", type=click.IntRange(1, 256), default=None, help="Files verified at once (default: number of cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@_guarded
def fetch(recipe: Path, local_dir: Path | None, jobs: int | None, as_json: bool) -> None:
    """Download every repo + revision source of RECIPE at its pinned commit and verify every file.

    Files are checked against the hub's own digests (LFS SHA-256, git blob id); the digests are kept
    so that a build need not hash an unchanged file again. With HF_HUB_OFFLINE=1 the cache is
    checked instead. Exit 1 when a file differs from the hub's digest (it is removed: fetch again).
    """
    res = api.fetch(recipe, local_dir=local_dir, jobs=jobs, progress=_bars(as_json))
    if as_json:
        _emit_json(res.as_dict())
        return
    from mosaic.cli.render import render_fetch

    render_fetch(_console(), res.sources)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--repo", required=True, metavar="ORG/NAME", help="Hub model repository (created if missing).")
@click.option("--branch", default=None, help="Branch to commit to (default: main; created if missing).")
@click.option("--private", is_flag=True, help="Create the repository as private (an existing one keeps its visibility).")
@click.option("--dry-run", "dry_run", is_flag=True, help="Audit and list what would be uploaded; no network at all.")
@click.option("--recipe-only", "recipe_only", is_flag=True,
              help="Upload all but the shards: users rebuild them from the sources with `mosaic rebuild`.")
@click.option("--jobs", type=click.IntRange(1, 256), default=None, help="Files audited at once (default: number of cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@_guarded
def publish(directory: Path, repo: str, branch: str | None, private: bool, dry_run: bool, recipe_only: bool,
            jobs: int | None, as_json: bool) -> None:
    """Upload a mosaic folder to the hub in one commit, after `mosaic audit DIRECTORY` passes.

    The commit message names the recipe's SHA-256 and mosaic's version; afterwards the hub's digest
    of every uploaded file is compared with sha256-manifest.txt (exit 1 on any difference) and the
    commit id is printed. The token comes from huggingface_hub's usual places (HF_TOKEN, `hf auth login`).
    """
    res = api.publish(directory, repo, branch=branch, private=private, dry_run=dry_run, recipe_only=recipe_only,
                      jobs=jobs, progress=_bars(as_json))
    if as_json:
        _emit_json(res.as_dict())
        return
    from mosaic.cli.render import render_publish

    render_publish(_console(), res)
    if not dry_run:
        click.echo(res.commit)


@main.command()
@click.argument("ref", metavar="ORG/NAME@COMMIT")
@click.option("--source", "overrides", multiple=True, metavar="ID=PATH",
              help="Read this source of the recipe from a local folder (repeatable); required for the recipe's path sources.")
@click.option("--out", "out", type=click.Path(path_type=Path), help="Output folder (default: ./NAME).")
@click.option("--jobs", type=click.IntRange(1, 256), default=None, help="Files processed at once (default: number of cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@_guarded
def rebuild(ref: str, overrides: tuple[str, ...], out: Path | None, jobs: int | None, as_json: bool) -> None:
    """Rebuild a published mosaic from its sources, byte for byte, instead of downloading its shards.

    Reads the published repository's small files only (recipe, PROVENANCE.json, manifest, card,
    configs), then builds the shards from the sources: --source folders, the local cache, or only the
    needed byte ranges read from the hub. Every tensor is checked against PROVENANCE.json and every file
    against the manifest; on any mismatch nothing is kept (exit 1).
    """
    from mosaic.cli.render import render_rebuild

    res = api.rebuild(ref, out=out, sources=list(overrides), jobs=jobs, progress=_bars(as_json))
    if as_json:
        _emit_json(res.as_dict())
    else:
        render_rebuild(_console(), res)


@main.command("eval")
@click.argument("candidates", nargs=-1, metavar="[CANDIDATE...]")
@click.option("--reference", "reference", required=True, metavar="REF",
              help="The teacher: a model (GGUF file or folder, EXL3 folder), or a reference saved with --save-reference (.npz).")
@click.option("--text", "text", required=True, type=click.Path(path_type=Path),
              help="The pre-registered rows: one text per non-empty line, or JSONL with a \"text\" field.")
@click.option("--ctx", type=click.IntRange(2, 1 << 20), default=None, help="Tokens per window (default 512, or the saved reference's).")
@click.option("--top-k", "top_k", type=click.IntRange(1, 1 << 16), default=None,
              help="Teacher log-probabilities kept per position (default 32, or the saved reference's).")
@click.option("--save-reference", "save_reference", type=click.Path(path_type=Path), default=None,
              help="Keep the live teacher's top-k (with the text's digest, the tokenizer's identity and the runtime) in this "
                   ".npz file; with no CANDIDATE, the teacher alone runs.")
@click.option("--plot", "plot", type=click.Path(path_type=Path), default=None, metavar="FILE.svg|FILE.png",
              help="Draw each candidate's KL and top-1 against its size on disk (the teacher at KL 0); the plot extra.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None, help="Runtime threads (default: every core).")
@click.option("--gpu-layers", "gpu_layers", default=None, metavar="N|all",
              help="Layers llama.cpp offloads to the GPU (default: all where the runtime can offload, else 0).")
@click.option("--per-position", "per_position", is_flag=True,
              help="With --json: each row's KL at every position too (kl_positions), to resample the tail by rows.")
@click.option("--verbose", is_flag=True, help="Show the runtime's own log lines on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@_guarded
def eval_cmd(candidates: tuple[str, ...], reference: str, text: Path, ctx: int | None, top_k: int | None,
             save_reference: Path | None, plot: Path | None, threads: int | None, gpu_layers: str | None,
             per_position: bool, verbose: bool, as_json: bool) -> None:
    """Score CANDIDATEs against a teacher on the same tokens: the quality panel of a mosaic.

    Per candidate: top-1 agreement with the teacher, KL(teacher || candidate) (exact with a live teacher,
    the KL lower bound from a saved top-k) with mean/p50/p95/p99/max, the text's own NLL, the same per row;
    and from the first candidate to each later one, rows improved / regressed on top-1, KL and NLL.
    GGUF models run on llama.cpp (on the GPU where the runtime can offload); EXL3 folders on exllamav3 (the exl3
    extra and a CUDA GPU).
    """
    from mosaic.cli.render import render_eval

    res = api.evaluate(list(candidates), reference=reference, text=text, ctx=ctx, top_k=top_k,
                       save_reference=save_reference, plot=plot, threads=threads, gpu_layers=gpu_layers,
                       per_position=per_position, verbose=verbose, progress=_bars(as_json))
    doc = res.as_dict()
    if as_json:
        _emit_json(doc)
    else:
        render_eval(_console(), doc)


def _retired(option: str) -> Callable[[click.Context, click.Parameter, object], object]:
    """A hidden option that is refused in one line where given: retired, with where its evidence is."""

    def refuse(ctx: click.Context, param: click.Parameter, value: object) -> object:
        if value is not None:
            _fail(api.retired_option(option), 2)
        return value

    return refuse


@main.command("measure")
@click.argument("parts", nargs=-1, metavar="[PART.json...]", type=click.Path(path_type=Path))
@click.option("--ladder", "ladder", default=None, type=click.Path(path_type=Path), metavar="DIR",
              help="A ladder made by mosaic ladder: its smallest rung the base, every other a donor (in place of "
                   "--base/--donor).")
@click.option("--reference", "reference", default=None, metavar="REF",
              help="The teacher: a model (run once here), or a reference saved by mosaic eval --save-reference (.npz); "
                   "optional with --method weights (its tensors are the weights' reference when it is a model).")
@click.option("--text", "text", default=None, type=click.Path(path_type=Path), help="The rows to measure on (as for mosaic eval).")
@click.option("--imatrix", "imatrix", default=None, metavar="SRC",
              help="An importance matrix (llama-imatrix's .gguf or .dat; a file or org/name@<commit>:<file>) weighting "
                   "every weight error by how much each input channel matters (GGUF bases).")
@click.option("--out", "out", type=click.Path(path_type=Path), default=Path("measurement.json"), show_default=True,
              help="The measurement document, written when every candidate has run.")
@click.option("--base", "base", default=None, metavar="SRC", help="The base: a .gguf file, a split set's first file, a folder, or org/name@<commit>:<file>.")
@click.option("--donor", "donors", multiple=True, metavar="ID=SRC", help="A donor quantization of the same model (repeatable).")
@click.option("--unit", type=click.Choice(["layer", "layer-experts", "module-group"]), default=None,
              help="What a candidate takes from a donor. [default: module-group over --ladder; else layer-experts where "
                   "the base has routed experts, else layer]")
@click.option("--method", type=click.Choice(["top-down", "weights", "swaps"]), default="top-down", show_default=True,
              help="top-down: weight errors from the files, calibrated from the top model (over --ladder by each kind's "
                   "units moved together to each version; else one drop per unit); weights: the weight errors alone (no "
                   "model runs); swaps: every base + one unit from one donor, run.")
@click.option("--calibrate", default=None, metavar="[units|kinds|pooled]",
              help="top-down: each unit's own sensitivity from its drop, or one per kind of unit pooled over "
                   "--only-layers (default every layer) and given to every layer; pooled: one per kind read from its "
                   "pooled pass at its drop version (--curve versions), no drop per unit. "
                   "[default: pooled over --ladder (kinds with --curve line), units otherwise]")
@click.option("--curve", default=None, metavar="[line|versions]",
              help="top-down: each unit's loss as the line through its drop to its worst version; versions: the line "
                   "times its kind's factor at each version, measured by moving the kind's units there together (one "
                   "forward pass per kind and version). [default: versions over --ladder, line otherwise]")
@click.option("--imatrix-cap/--no-imatrix-cap", "imatrix_cap", default=None,
              help="Hold each channel's importance under a robust ceiling (its row's median × e^(3.5 robust SDs of the "
                   "logs)), so that one channel of massive activations cannot hide every other channel's error. "
                   "[default with --imatrix: on over --ladder, off otherwise]")
@click.option("--only-layers", "only_layers", default=None, metavar="LIST", help="Measure only these layers, e.g. 0-5,9,12.")
@click.option("--ctx", type=click.IntRange(2, 1 << 20), default=None, help="Tokens per window (default 512, or the saved reference's).")
@click.option("--top-k", "top_k", type=click.IntRange(1, 1 << 16), default=None, help="Teacher log-probabilities kept per position (default 32).")
@click.option("--shard", default=None, metavar="K/N", help="Run only the K-th of N shares of the candidates (join the parts with --merge).")
@click.option("--merge", is_flag=True, help="Join the documents PART.json... of a sharded measurement into --out (no other input).")
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="Where the base and the donors' units are laid out once (default: beside --out); removed at the end.")
@click.option("--resume", is_flag=True, help="Continue an interrupted measurement (<out>.partial) with the same inputs.")
@click.option("--force", is_flag=True, help="Replace an existing --out (or an interrupted measurement's journal).")
@click.option("--threads", type=click.IntRange(1, 1024), default=None, help="Runtime threads (default: every core).")
@click.option("--gpu-layers", "gpu_layers", default=None, metavar="N|all",
              help="Layers llama.cpp offloads to the GPU (default: all where the runtime can offload, else 0).")
@click.option("--verbose", is_flag=True, help="Show the runtime's own log lines on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the measurement document on stdout.")
@click.option("--sample-layers", hidden=True, default=None, expose_value=False, callback=_retired("--sample-layers"))
@click.option("--refine", type=click.IntRange(1, 100), default=None, hidden=True,
              help="Retired; with MOSAIC_EXPERIMENTS=1: up to N rounds measured where the plan of --max-size lands.")
@click.option("--max-size", "max_size", default=None, hidden=True, help="With --refine: the budget it plans at.")
@_guarded
def measure_cmd(parts: tuple[Path, ...], ladder: Path | None, reference: str | None, text: Path | None, imatrix: str | None,
                out: Path, base: str | None, donors: tuple[str, ...], unit: str | None, method: str, calibrate: str | None,
                curve: str | None, imatrix_cap: bool | None, only_layers: str | None, ctx: int | None, top_k: int | None,
                shard: str | None, merge: bool, workdir: Path | None, resume: bool, force: bool, threads: int | None,
                gpu_layers: str | None, verbose: bool, as_json: bool, refine: int | None, max_size: str | None) -> None:
    """Measure what each unit buys from each donor, for mosaic plan: the weight errors in the files, calibrated
    from the model itself. Over a ladder, with no method flag: mosaic measure --ladder DIR --reference TEACHER
    --text ROWS --imatrix MATRIX. --merge joins a sharded measurement."""
    from mosaic.cli.render import render_measurement

    if parts and not merge:
        raise MosaicError(f"{parts[0]}: a PART is a shard's document, joined with --merge")
    if merge and not parts:
        raise MosaicError("--merge: name the shards' documents (PART.json ...)")
    if merge:
        res = api.measure(merge=list(parts), out=out, force=force, base=base, donors=list(donors) or None,
                          reference=reference, text=text, shard=shard, only_layers=only_layers, imatrix=imatrix,
                          imatrix_cap=imatrix_cap, ladder=ladder, refine=refine or 0, max_size=max_size)
    else:
        if ladder is None and (base is None or not donors):
            raise MosaicError("give --base SRC and at least one --donor ID=SRC, or --ladder DIR (or --merge PART.json ...)")
        res = api.measure(base=base, donors=list(donors) or None, ladder=ladder, reference=reference, text=text,
                          method=method, calibrate=calibrate, curve=curve, unit=unit, only_layers=only_layers, ctx=ctx,
                          top_k=top_k, shard=shard, imatrix=imatrix, imatrix_cap=imatrix_cap, out=out, workdir=workdir,
                          resume=resume, force=force, threads=threads, gpu_layers=gpu_layers, verbose=verbose,
                          progress=_bars(as_json), refine=refine or 0, max_size=max_size)
    doc = res.as_dict()
    if as_json:
        _emit_json(doc)
    else:
        render_measurement(_console(), doc, out)


@main.command("ladder")
@click.argument("source", metavar="SOURCE")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="The ladder's folder: one GGUF per type and ladder.json.")
@click.option("--imatrix", "imatrix", default=None, metavar="SRC",
              help="An importance matrix (llama-imatrix's .gguf or .dat; a file or org/name@<commit>:<file>) handed to the tool.")
@click.option("--types", "types", default=None, metavar="LIST",
              help="ggml types, comma-separated (default: every type llama.cpp's own mixer considers, IQ1_S ... Q8_0; "
                   "those that need an importance matrix only with --imatrix).")
@click.option("--llama-quantize", "llama_quantize", default=None, metavar="PATH",
              help="llama.cpp's llama-quantize (default: $MOSAIC_LLAMA_QUANTIZE, else the one on PATH; make llama-tools builds it).")
@click.option("--threads", type=click.IntRange(1, 1024), default=None, help="The tool's threads (default: every core).")
@click.option("--lean/--no-lean", "lean", default=None,
              help="A tensor at a rung's type of no fewer bytes than its own in the source keeps its source bytes "
                   "there (no plan would take that version), and a type no tensor takes is not made. [default: on over "
                   "a quantization whose every type the ladder holds; off otherwise, with a note]")
@click.option("--min-bpw", "min_bpw", type=float, default=None, metavar="BITS",
              help="Make no type of fewer bits per weight; 0: no floor. Rungs of them an earlier run made leave "
                   "ladder.json. [default: 2.5 with the default types (IQ1_S, IQ1_M, IQ2_XXS and IQ2_XS not made), "
                   "none with --types]")
@click.option("--no-superseded/--superseded", "no_superseded", default=None,
              help="With --lean: a 32-wide type (Q4_0, Q4_1, IQ4_NL, Q5_0, Q5_1) is made only for the tensors whose rows "
                   "the 256-wide type of no more bytes that supersedes it (Q4_K, Q4_K, IQ4_XS, Q5_K, Q5_K), made too, "
                   "cannot take (the others keep their source bytes). [default: as --lean]")
@click.option("--json", "as_json", is_flag=True, help="Print ladder.json on stdout.")
@_guarded
def ladder_cmd(source: str, out: Path, imatrix: str | None, types: str | None, llama_quantize: str | None,
               threads: int | None, lean: bool | None, min_bpw: float | None, no_superseded: bool | None, as_json: bool) -> None:
    """Make the donors from the model's own source with llama.cpp's llama-quantize: one GGUF per type, every
    quantizable tensor at that type, and ladder.json; measure and plan take the folder as --ladder DIR.

    The defaults are the ladder the bench measured, decided by the source: over a quantization whose types the
    ladder holds, --lean --no-superseded --min-bpw 2.5; otherwise --min-bpw 2.5 alone. A default that leaves
    something out says so in one line, with the option that brings it back."""
    from mosaic.cli.render import render_ladder

    res = api.ladder(source, out=out, imatrix=imatrix, types=types, llama_quantize=llama_quantize, threads=threads,
                     lean=lean, min_bpw=min_bpw, no_superseded=no_superseded, progress=_bars(as_json))
    if as_json:
        _emit_json(res.as_dict())
    else:
        render_ladder(_console(), res.as_dict(), list(res.notes), out)


if __name__ == "__main__":
    main()
