"""The model card (README.md) of a mosaic, rendered from its PROVENANCE.json alone.

Because the card is a pure function of the provenance record, ``mosaic audit`` re-renders it and
compares: the numbers a hub user reads (rates, sizes, which layers come from where) cannot drift
from what was verified. The generated part sits between two markers; a publisher may add text
outside them (the manifest still covers the file).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import yaml

from mosaic._checkpoint.exl3 import bits_from_trellis, parse_key
from mosaic._provenance.records import column
from mosaic._recipe.document import layer_runs

BEGIN = "<!-- mosaic:begin (generated from PROVENANCE.json; `mosaic audit` checks this block) -->"
END = "<!-- mosaic:end -->"
_GROUP_TITLES = {
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "attention": "attention",
    "dense_mlp": "dense MLP",
    "other": "other",
}


def ranges(nums: list[int]) -> str:
    """[3, 32, 33, 36, 37, 38] -> '3, 32–33, 36–38'."""
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in layer_runs(nums))


def _source_label(s: dict) -> str:
    if "repo" in s:
        return f"`{s['repo']}` @ `{s['revision']}`"
    return f"`{s['path']}` (local folder)"


def _fmt_rate(r: float | None, digits: int = 4) -> str:
    return "—" if r is None else f"{r:.{digits}f}"


def layer_table(tensors: Sequence[dict]) -> list[tuple[list[int], dict[str, str]]]:
    """Layers grouped by identical (group → 'source bits') signatures, in layer order."""
    per_layer: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, shape, source in zip(column(tensors, "name"), column(tensors, "shape"), column(tensors, "source")):
        if not name.endswith(".trellis"):
            continue
        info = parse_key(name[: -len(".trellis")])
        if info.layer is None:
            continue
        bits = bits_from_trellis(tuple(shape))
        per_layer[info.layer][info.group].add(f"{source} {bits:g}" if bits is not None else source)
    rows: list[tuple[list[int], dict[str, str]]] = []
    for layer in sorted(per_layer):
        sig = {g: " + ".join(sorted(v)) for g, v in per_layer[layer].items()}
        if rows and rows[-1][1] == sig and rows[-1][0][-1] == layer - 1:
            rows[-1][0].append(layer)
        else:
            rows.append(([layer], sig))
    return rows


def render_block(doc: dict) -> str:
    """The generated part of the card."""
    rate = doc["rate"]
    size = doc["size"]
    srcs = doc["sources"]
    n_tensors = len(doc["tensors"])
    n_donor = sum(1 for s in column(doc["tensors"], "source") if s != "base")
    shards = sorted(set(column(doc["tensors"], "file")))
    lines = [BEGIN, "", "## At a glance", "", "| | |", "|---|---|"]
    lines.append(f"| Exact trellis rate | {_fmt_rate(rate['exact'])} bpw (`config.json` bits: {rate['config_bits']}) |")
    lines.append(f"| Size | {size['shards']:,} bytes in {len(shards)} shard(s); base {size['base_shards']:,} bytes |")
    lines.append(f"| Base | {_source_label(srcs['base'])} — {_fmt_rate(rate['base'])} bpw |")
    for sid, s in srcs.items():
        if sid != "base":
            lines.append(f"| Donor `{sid}` | {_source_label(s)} — {_fmt_rate(rate['donors'].get(sid))} bpw |")
    lines.append(f"| Tensors | {n_tensors:,}: {n_donor:,} from donors, {n_tensors - n_donor:,} byte-for-byte from the base |")
    lines.append(f"| Recipe | `{doc['recipe']['file']}`, SHA-256 `{doc['recipe']['sha256']}` |")
    lines += ["", "## What comes from where", ""]
    for sel in doc.get("selection", []):
        if sel.get("keys"):
            what = "keys " + ", ".join(f"`{k}`" for k in sel["keys"])
        else:
            what = f"layers {ranges(sel.get('layers', [])) or '—'}"
        lines.append(
            f"- rule {sel['rule']}: from `{sel['from']}`, {what}: "
            f"{sel.get('modules', 0):,} module(s), {sel['tensors']:,} tensors, {sel.get('bytes', 0):,} bytes"
        )
    rows = layer_table(doc["tensors"])
    groups = [g for g in _GROUP_TITLES if any(g in sig for _, sig in rows)]
    if rows:
        lines += ["", "Bits per layer (source and bits of each EXL3 module group):", ""]
        lines.append("| Layers | " + " | ".join(_GROUP_TITLES[g] for g in groups) + " |")
        lines.append("|---|" + "---|" * len(groups))
        for layers, sig in rows:
            cells = []
            for g in groups:
                v = sig.get(g, "")
                cells.append(f"**{v}**" if v and not v.startswith("base") else v or "—")
            lines.append(f"| {ranges(layers)} | " + " | ".join(cells) + " |")
    lines += ["", "## Rate, three ways", ""]
    lines.append(
        f"- **Exact**: Σ bits × weights / Σ weights over the EXL3 linears of the decoder layers (0 to "
        f"num_hidden_layers − 1: attention, indexer, dense MLP, shared and routed experts), read from the headers: "
        f"**{_fmt_rate(rate['exact'])} bpw** (= {rate['exact_fraction']}). Multi-token-prediction layers, the vision "
        f"tower and the head are not part of it; their rates stand on their own below."
    )
    lines.append(
        f"- **By bytes**: base rate × mosaic size / base size = {_fmt_rate(rate['base'])} × "
        f"{size['shards']:,} / {size['base_shards']:,} = {_fmt_rate(rate['by_bytes'])} bpw."
    )
    lines.append(
        f"- **By layer mass**: each decoder layer at the rate of the source that supplies most of its "
        f"weights, averaged over layers: {_fmt_rate(rate['by_layer_mass'])} bpw."
    )
    outside = rate.get("outside") or {}
    titles = {"mtp": "Multi-token-prediction layers", "vision": "Vision tower", "head": "Head (`lm_head`)",
              "other": "Other EXL3 linears"}
    if outside:
        lines += ["", "Not in the exact rate:", ""]
        lines += [f"- {titles.get(k, k)}: {_fmt_rate(v)} bpw" for k, v in outside.items()]
    lines += ["", "## Sources", ""]
    for sid, s in srcs.items():
        total = sum(f["size"] for f in s["files"])
        lines.append(f"- `{sid}`: {_source_label(s)}; {len(s['files'])} files used, {total:,} bytes (digests in PROVENANCE.json)")
        partial = [f["name"] for f in s["files"] if f.get("sha256_verified") is False]
        if partial:
            lines.append(
                f"  - read from the hub by byte ranges: {len(partial)} file(s) only in part, so their whole-file SHA-256 "
                "is the hub's claim, not checked by the build; every tensor taken from them has its own SHA-256 of the "
                "bytes read (with the sources fetched, `mosaic audit . --sources` compares them again)"
            )
    lines += [
        "",
        "## Rebuild it instead of downloading it",
        "",
        "Every tensor of this mosaic is a byte range of one of its sources, and PROVENANCE.json names each one's "
        "source and SHA-256. mosaic rebuilds this folder byte for byte from the sources — folders you already have, "
        "the local Hugging Face cache, or only the needed byte ranges read from the hub — checking every tensor "
        "against PROVENANCE.json and every file against the manifest:",
        "",
        "```bash",
        "mosaic rebuild <this repo>@<commit>              # add --source ID=PATH for each source you have locally",
        "```",
        "",
        "## Verify",
        "",
        "```bash",
        "sha256sum -c sha256-manifest.txt      # every file, byte for byte",
        "mosaic audit .                         # headers, index, configs, provenance, per-tensor digests",
        "mosaic audit . --sources               # and every tensor against the source it came from",
        "```",
        "",
        "Checks recorded by the build:",
        "",
    ]
    for c in doc["checks"]:
        lines.append(f"- {'✓' if c['ok'] else '✗'} `{c['name']}`: {c['detail']}")
    lines += ["", END]
    return "\n".join(lines) + "\n"


def base_models(doc: dict) -> list[str]:
    """The lineage the card's front matter names: the base card's ``base_model``, else the base repo."""
    base = doc["sources"]["base"]
    names = list(base.get("base_model") or ([base["repo"]] if "repo" in base else []))
    return list(dict.fromkeys(names))


def front_matter(doc: dict) -> str:
    """The card's YAML front matter, which the hub reads to draw the model's lineage.

    A mosaic is a quantization of the original model (the hub accepts only ``adapter``, ``merge``,
    ``quantized`` and ``finetune`` as ``base_model_relation``); without a known original, no relation.
    """
    meta: dict[str, object] = {}
    names = base_models(doc)
    if names:
        meta["base_model"] = names[0] if len(names) == 1 else names
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = "exllamav3"
    meta["tags"] = ["exl3", "mosaic"]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def render_card(doc: dict) -> bytes:
    front = [front_matter(doc)]
    head = [
        f"# {doc['name']}",
        "",
        "A mixed-precision EXL3 mosaic: chosen tensors of the base are replaced, byte for byte, by the same "
        "tensors from a higher-bitrate quantization of the same model. Nothing is re-quantized; every tensor is "
        f"byte-identical to the tensor of its source, and PROVENANCE.json records each one's SHA-256. "
        f"Built with mosaic {doc['tool']['version']}.",
        "",
        "",
    ]
    return ("\n".join(front + head) + render_block(doc)).encode("utf-8")


def extract_block(card: str) -> str | None:
    a = card.find(BEGIN)
    b = card.find(END, a)
    if a < 0 or b < 0:
        return None
    return card[a : b + len(END)] + "\n"
