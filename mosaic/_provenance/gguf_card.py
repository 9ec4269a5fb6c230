"""The model card (README.md) of a GGUF mosaic, rendered from its PROVENANCE.json alone.

A pure function of the record, like the EXL3 card (:mod:`mosaic._provenance.card`), so ``mosaic audit`` re-renders
and compares it. The bits per layer come from each tensor's ggml type (8 x type size / block size),
weighted by the tensor's weights; a layer's cell names the types and where they came from.
"""

from __future__ import annotations

import re
from collections import defaultdict

import yaml

from mosaic._recipe.document import layer_runs

BEGIN = "<!-- mosaic:begin (generated from PROVENANCE.json; `mosaic audit` checks this block) -->"
END = "<!-- mosaic:end -->"
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def _ranges(nums: list[int]) -> str:
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in layer_runs(nums))


def _label(s: dict) -> str:
    where = f"`{s['repo']}` @ `{s['revision']}`" if "repo" in s else f"`{s['path']}` (local)"
    return where + (f", file `{s['file']}`" if "file" in s else "")


def _rate(r: float | None) -> str:
    return "—" if r is None else f"{r:.4f}"


def _weights(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layer_rows(tensors: list[dict]) -> list[tuple[list[int], str, str]]:
    """Runs of consecutive layers with the same (bits, composition): (layers, bpw, 'source TYPE' list)."""
    bits: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    comp: dict[int, set[str]] = defaultdict(set)
    for t in tensors:
        m = _LAYER_RE.match(t["name"])
        if not m:
            continue
        layer = int(m.group(1))
        bits[layer][0] += 8 * t["nbytes"]
        bits[layer][1] += _weights(t["shape"])
        comp[layer].add(f"{t['source']} {t['dtype']}")
    rows: list[tuple[list[int], str, str]] = []
    for layer in sorted(bits):
        b, w = bits[layer]
        sig = (f"{b / w:.4f}" if w else "—", ", ".join(sorted(comp[layer])))
        if rows and rows[-1][1:] == sig and rows[-1][0][-1] == layer - 1:
            rows[-1][0].append(layer)
        else:
            rows.append(([layer], *sig))
    return rows


def render_block(doc: dict) -> str:
    rate, size, srcs, g = doc["rate"], doc["size"], doc["sources"], doc.get("gguf", {})
    n = len(doc["tensors"])
    n_donor = sum(1 for t in doc["tensors"] if t["source"] != "base")
    lines = [BEGIN, "", "## At a glance", "", "| | |", "|---|---|"]
    lines.append(f"| Architecture | `{g.get('architecture')}` (llama.cpp) |")
    lines.append(f"| Bits per weight | {_rate(rate['exact'])} over all tensors ({_rate(rate['by_layer_mass'])} over the `blk.N` layers) |")
    parts = g.get("parts", [])
    lines.append(f"| Size | {size['shards']:,} bytes in {len(parts)} file(s); base {size['base_shards']:,} bytes |")
    base_layers = f" ({_rate(rate['base_layer_mass'])} over the `blk.N` layers)" if "base_layer_mass" in rate else ""
    lines.append(f"| Base | {_label(srcs['base'])} — {_rate(rate['base'])} bpw{base_layers} |")
    for sid, s in srcs.items():
        if sid != "base":
            lines.append(f"| Donor `{sid}` | {_label(s)} — {_rate(rate['donors'].get(sid))} bpw |")
    lines.append(f"| Tensors | {n:,}: {n_donor:,} from donors, {n - n_donor:,} byte-for-byte from the base |")
    lines.append(f"| Recipe | `{doc['recipe']['file']}`, SHA-256 `{doc['recipe']['sha256']}` |")
    lines += ["", "## What comes from where", ""]
    for sel in doc.get("selection", []):
        what = ("keys " + ", ".join(f"`{k}`" for k in sel["keys"])) if sel.get("keys") else f"layers {_ranges(sel.get('layers', []))}"
        lines.append(f"- rule {sel['rule']}: from `{sel['from']}`, {what}: {sel['tensors']:,} tensors, {sel.get('bytes', 0):,} bytes")
    rows = layer_rows(doc["tensors"])
    if rows:
        lines += ["", "Bits per layer (from each tensor's type, weighted by its weights) and the types in it:", "",
                  "| Layers | bpw | source and type of its tensors |", "|---|---|---|"]
        for layers, bpw, comp in rows:
            lines.append(f"| {_ranges(layers)} | {bpw} | {comp} |")
    types: dict[str, int] = defaultdict(int)
    for t in doc["tensors"]:
        types[t["dtype"]] += 1
    lines += ["", "Tensor types: " + ", ".join(f"{k} × {v}" for k, v in sorted(types.items())) + "."]
    lines += ["", "## Metadata", "",
              f"The base's metadata, unchanged, including `general.file_type` = {g.get('file_type')} (the base's: a mosaic "
              "keeps the file type of the quantization it starts from, as `llama-quantize --tensor-type` does; each "
              "tensor's own type is in its tensor info). Added: " + ", ".join(f"`{k}`" for k in g.get("mosaic_keys", {})) + "."]
    lines += ["", "## Sources", ""]
    for sid, s in srcs.items():
        total = sum(f["size"] for f in s["files"])
        lines.append(f"- `{sid}`: {_label(s)}; {len(s['files'])} file(s) used, {total:,} bytes (digests in PROVENANCE.json)")
        partial = [f["name"] for f in s["files"] if f.get("sha256_verified") is False]
        if partial:
            lines.append(
                f"  - read from the hub by byte ranges: {', '.join(f'`{n}`' for n in partial)} only in part, so their "
                "whole-file SHA-256 is the hub's claim, not checked by the build; every tensor taken from them has its "
                "own SHA-256 of the bytes read (with the sources fetched, `mosaic audit . --sources` compares them again)")
    lines += ["", "## Verify", "", "```bash",
              "sha256sum -c sha256-manifest.txt      # every file, byte for byte",
              "mosaic audit .                         # GGUF structure, metadata, provenance, per-tensor digests",
              "mosaic audit . --sources               # and every tensor against the source it came from",
              "```", "", "Checks recorded by the build:", ""]
    for c in doc["checks"]:
        lines.append(f"- {'✓' if c['ok'] else '✗'} `{c['name']}`: {c['detail']}")
    lines += ["", END]
    return "\n".join(lines) + "\n"


def front_matter(doc: dict) -> str:
    meta: dict[str, object] = {}
    base = doc["sources"]["base"]
    if "repo" in base:
        meta["base_model"] = base["repo"]
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = "gguf"
    meta["tags"] = ["gguf", "mosaic"]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def render_gguf_card(doc: dict) -> bytes:
    head = [
        f"# {doc['name']}",
        "",
        "A mixed-precision GGUF mosaic for llama.cpp: chosen tensors of the base quantization are replaced, byte "
        "for byte, by the same tensors from another quantization of the same model. Nothing is re-quantized; "
        f"PROVENANCE.json records each tensor's SHA-256 and source. Built with mosaic {doc['tool']['version']}.",
        "",
        "",
    ]
    rebuild = "\n".join([
        "",
        "## Rebuild it instead of downloading it",
        "",
        "Every tensor of this mosaic is a byte range of one of its sources, and PROVENANCE.json names each one's source "
        "and SHA-256. mosaic rebuilds the `.gguf` files byte for byte from the sources — files you already have, the "
        "local Hugging Face cache, or only the byte ranges the mosaic holds, read from the hub — checking every tensor "
        "against PROVENANCE.json and every file against the manifest:",
        "",
        "```bash",
        "mosaic rebuild <this repo>@<commit>              # add --source ID=PATH for each source you have locally",
        "```",
        "",
    ])
    return (front_matter(doc) + "\n".join(head) + render_block(doc) + rebuild).encode("utf-8")


def generated_block(card: bytes) -> str | None:
    """The part of a card ``mosaic audit`` checks: between the mosaic markers (the rest is prose)."""
    text = card.decode("utf-8", "replace")
    a = text.find(BEGIN)
    b = text.find(END, a)
    if a < 0 or b < 0:
        return None
    return text[a : b + len(END)] + "\n"
