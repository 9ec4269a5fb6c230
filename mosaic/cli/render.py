"""How results look: rich tables on a terminal, whole unwrapped lines in a pipe or a log. Only presentation here.

Every string that comes from data (names, paths, details, notes) goes through ``lit`` before rich
sees it, so a tensor name like ``[model.layers.1.mlp]`` is printed, not taken for markup. When
stdout is not a terminal nothing is wrapped or coloured, and each audit failure is one line naming
its check, file and tensor, so that ``grep`` and log readers find them whole (CONTRACT.md).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from mosaic._base.literal import markup_literal as lit

if TYPE_CHECKING:
    from mosaic._api.results import FetchedSource, PublishResult, RebuildResult

#: Lines are never wrapped when not on a terminal; tables are laid out as if the page were this wide.
PLAIN_WIDTH = 1 << 14


def stdout_console() -> Console:
    """The console for a command's report: rich on a terminal; plain, unwrapped, uncoloured otherwise."""
    if sys.stdout.isatty():
        return Console(highlight=False, emoji=False)
    return Console(highlight=False, emoji=False, color_system=None, no_color=True, soft_wrap=True,
                   width=PLAIN_WIDTH, force_terminal=False)

_GROUP_COLUMNS = (
    ("routed_experts", "routed experts"),
    ("shared_experts", "shared experts"),
    ("attention", "attention"),
    ("indexer", "indexer"),
    ("dense_mlp", "dense MLP"),
    ("mtp", "MTP proj"),
)
_KINDS = {"linear_attention": "KDA", "deepseek_sparse_attention": "MLA"}


def human_bytes(n: int) -> str:
    for unit, div in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _rate(r: float | None) -> str:
    """A rate for people; a checkpoint without decoder EXL3 linears has none."""
    return "-" if r is None else f"{r:.4f}"


def _bits(v: list) -> str:
    return "/".join(f"{b:g}" for b in v) if v else "-"


def _render_problems(console: Console, problems: list[str]) -> None:
    if problems:
        console.print(f"[red bold]{len(problems)} problem(s):[/red bold]")
        for p in problems:
            console.print(f"  [red]✗[/red] {lit(p)}")
    else:
        console.print("[green]no problems found[/green]")


def render_census(console: Console, rep: dict) -> None:
    books = ", ".join(f"{lit(k)} ({v})" for k, v in rep["codebooks"].items()) or "none"
    rate = rep["rate"]
    console.print(f"[bold]{lit(rep['path'])}[/bold]")
    console.print(
        f"{rep['tensors']:,} tensors in {rep['shards']} shard(s), {rep['bytes']['files']:,} bytes "
        f"({human_bytes(rep['bytes']['files'])}); {rep['exl3_modules']:,} EXL3 modules; codebook: {books}"
    )
    exact = f"{rate['exact']:.4f}" if rate["exact"] is not None else "-"
    console.print(f"exact trellis rate {exact} bpw (config.json says {lit(rate['config'])}); head bits {_bits(rep['head_bits'])}")
    for part in ("mtp", "vision", "head", "other"):
        if rate.get(part) is not None:
            console.print(f"  not in the exact rate: {part} {rate[part]:.4f} bpw")
    hist = Table(title="bits histogram", show_edge=False)
    hist.add_column("bits", justify="right")
    hist.add_column("modules", justify="right")
    hist.add_column("weights", justify="right")
    for b, h in rep["bits_histogram"].items():
        hist.add_row(lit(b), f"{h['modules']:,}", f"{h['weights']:,}")
    console.print(hist)
    t = Table(title="bits per layer and module group", show_edge=False)
    t.add_column("layer", justify="right")
    present = {k for row in rep["layers"] for k in row["groups"]}
    columns = [(key, title) for key, title in _GROUP_COLUMNS if key in present]  # a model without a group: no column
    for _, title in columns:
        t.add_column(title, justify="center")
    t.add_column("rate", justify="right")
    for row in rep["layers"]:
        g = row["groups"]
        label = f"{row['layer']}" + (" (MTP)" if row["mtp"] else f" ({_KINDS[row['kind']]})" if row.get("kind") in _KINDS else "")
        cells = []
        for key, _ in columns:
            if key in g:
                c = _bits(g[key]["bits"])
                if key == "routed_experts":
                    c += f" ×{g[key]['modules']}"
                if len(g[key]["bits"]) > 1:
                    c = f"[red]{c}[/red]"
                cells.append(c)
            else:
                cells.append("")
        t.add_row(label, *cells, f"{row['rate']:.3f}" if row["rate"] is not None else "-")
    console.print(t)
    for n in rep["notes"]:
        console.print(f"[yellow]note:[/yellow] {lit(n)}")
    if "hub_bytes_read" in rep:
        console.print(f"read {rep['hub_bytes_read']:,} bytes from the hub by ranges (configs and shard headers only)")
    _render_problems(console, rep["problems"])


def render_gguf_census(console: Console, rep: dict) -> None:
    """A GGUF model's census: files, types, bits per layer and module group (from each tensor's type)."""
    rate = rep["rate"]
    console.print(f"[bold]{lit(rep['path'])}[/bold]")
    console.print(
        f"GGUF {lit(rep['architecture'])}: {rep['tensors']:,} tensors in {len(rep['files'])} file(s), "
        f"{rep['bytes']['files']:,} bytes ({human_bytes(rep['bytes']['files'])}); {rep['metadata_keys']} metadata keys; "
        f"general.file_type {lit(rep['file_type'])}"
    )
    console.print(f"{_rate(rate['all'])} bits per weight over all tensors, {_rate(rate['layers'])} over the blk.N layers")
    if rep.get("hub_bytes_read") is not None:
        console.print(f"read {rep['hub_bytes_read']:,} bytes from the hub by ranges (headers only)")
    types = Table(title="tensor types", show_edge=False)
    for col in ("type", "bits", "tensors", "bytes"):
        types.add_column(col, justify="right")
    for k, v in rep["types"].items():
        types.add_row(lit(k), f"{v['bits']:g}", f"{v['tensors']:,}", f"{v['bytes']:,}")
    console.print(types)
    groups = sorted({g for row in rep["layers"] for g in row["groups"]})
    t = Table(title="bits per layer and module group", show_edge=False)
    t.add_column("layer", justify="right")
    for g in groups:
        t.add_column(g, justify="center")
    t.add_column("rate", justify="right")
    for row in rep["layers"]:
        cells = []
        for g in groups:
            c = row["groups"].get(g)
            cells.append("" if c is None else f"{_rate(c['bits'])} {lit('/'.join(c['types']))}")
        t.add_row(str(row["layer"]), *cells, _rate(row["rate"]))
    console.print(t)
    _render_problems(console, rep["problems"])


def _rate_line(rate: dict) -> str:
    """The build's rates, each beside the base's over the same tensors where the record has it."""
    if "base_layer_mass" in rate:  # a GGUF mosaic: bits per weight of llama.cpp's kind, like with like
        return (f"bits per weight (mosaic vs base): all tensors {_rate(rate['exact'])} vs {_rate(rate['base'])}; "
                f"files with headers {_rate(rate['by_bytes'])} vs {_rate(rate.get('base_by_bytes'))}; "
                f"blk.N layers {_rate(rate['by_layer_mass'])} vs {_rate(rate['base_layer_mass'])}")
    config = f" (config bits {rate['config_bits']})" if rate.get("config_bits") is not None else ""
    return (f"rate: exact {_rate(rate['exact'])} bpw{config}, by bytes {_rate(rate['by_bytes'])}, "
            f"by layer mass {_rate(rate['by_layer_mass'])}; base {_rate(rate['base'])}")


def render_build(console: Console, s: dict) -> None:
    rate = s["rate"]
    console.print(f"[bold green]built[/bold green] {lit(s['output'])}")
    console.print(
        f"{s['size']['shards']:,} bytes ({human_bytes(s['size']['shards'])}) in {len(s['shards'])} shard(s); "
        f"{s['tensors']:,} tensors, {s['from_donors']:,} from donors"
    )
    console.print(_rate_line(rate))
    t = Table(show_edge=False)
    t.add_column("check")
    t.add_column("ok")
    t.add_column("detail")
    for c in s["checks"]:
        t.add_row(lit(c["name"]), "[green]✓[/green]" if c["ok"] else "[red]✗[/red]", lit(c["detail"]))
    console.print(t)
    for sid, n in s.get("hub_bytes_read", {}).items():
        console.print(f"{lit(sid)}: read {n:,} bytes from the hub by ranges")
    for n in s.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {lit(n)}")


def _failure_parts(f: dict) -> list[str]:
    return [x for x in (f.get("file"), f.get("tensor")) if x]


def render_audit(console: Console, doc: dict) -> None:
    table = console.is_terminal
    for m in doc["mosaics"]:
        c = m["counts"]
        console.print(
            f"[bold]{lit(m['path'])}[/bold]: {c.get('files', 0)} files, {c.get('shards', 0)} shards, "
            f"{c.get('tensors', 0):,} tensors, {c.get('bytes', 0):,} bytes read once"
        )
        if not table:
            # one line per check, then one line per failure: check, file, tensor and detail whole
            for ch in m["checks"]:
                fails = ch["failures"]
                console.print(f"{lit(ch['name'])}: " + ("pass" if ch["ok"] else f"FAIL ({len(fails)})"))
            for ch in m["checks"]:
                for f in ch["failures"]:
                    console.print("FAIL " + ": ".join(lit(x) for x in (ch["name"], *_failure_parts(f), f["detail"])))
            render_signature(console, m.get("signature"))
            continue
        t = Table(show_edge=False)
        t.add_column("check")
        t.add_column("result")
        t.add_column("first failures")
        for ch in m["checks"]:
            fails = ch["failures"]
            shown = "; ".join(": ".join(lit(x) for x in (*_failure_parts(f), f["detail"])) for f in fails[:3])
            if len(fails) > 3:
                shown += f" (+{len(fails) - 3} more)"
            t.add_row(lit(ch["name"]), "[green]pass[/green]" if ch["ok"] else f"[red]FAIL ({len(fails)})[/red]", shown)
        console.print(t)
        render_signature(console, m.get("signature"))
    n_fail = sum(1 for m in doc["mosaics"] if not m["ok"])
    if n_fail:
        console.print(f"[red bold]audit failed[/red bold]: {n_fail} of {len(doc['mosaics'])} mosaic(s) have problems")
    else:
        console.print(f"[green bold]audit passed[/green bold]: {len(doc['mosaics'])} mosaic(s), every check")


def render_signature(console: Console, sig: dict | None) -> None:
    """One line on the folder's signature; a signature nobody checked is never called verified."""
    if sig is None:
        return
    state, name = sig["state"], lit(sig["file"])
    if state == "verified":
        console.print(f"signature: [green]verified[/green] {name} ({sig['files']} files) with {lit(sig['by'])}")
    elif state == "unverified":
        console.print(f"signature: [yellow]{name} present, NOT verified[/yellow] "
                      "(give --key PUBLIC_KEY, or --identity and --issuer, to verify it)")
    elif state == "failed":
        console.print(f"signature: [red]{name} FAILED verification[/red] (see the signature check)")
    else:
        console.print("signature: none (the folder is not signed)")


def _plan_unit(c: dict) -> tuple[int | None, str | None]:
    """A chosen unit as (layer, group): per-tensor units share a layer, and a unit's two choices share a row."""
    return c["layer"], c.get("group")


def _plan_order(unit: tuple[int | None, str | None]) -> tuple:
    """The model's own order: the units outside the layers (token_embd, output) first, then layer by layer."""
    layer, group = unit
    return (layer is not None, layer or 0, group or "")


def render_plan(console: Console, rep: dict, notes: list[str], out: str | None) -> None:
    rate = rep["rate"]
    console.print(
        f"[bold]plan[/bold]: {len(rep['chosen'])} unit(s), predicted size {rep['predicted_size']:,} bytes "
        f"({human_bytes(rep['predicted_size'])}), score {rep['score']:.6g}"
    )
    if rate["exact"] is not None:
        console.print(
            f"rate: exact {rate['exact']:.4f} bpw, by bytes {rate['by_bytes']:.4f}, by layer mass {rate['by_layer_mass']:.4f}"
        )
    g = rep["greedy"]
    t = Table(show_edge=False)
    opt = {_plan_unit(c): c["donor"] for c in rep["chosen"]}
    gre = {_plan_unit(c): c["donor"] for c in g["chosen"]}
    units = sorted(opt.keys() | gre.keys(), key=_plan_order)
    t.add_column("unit" if any(group is not None for _, group in units) else "layer", justify="right")
    t.add_column("exact choice")
    t.add_column("greedy choice")
    for unit in units:
        name = " ".join(str(x) for x in unit if x is not None)
        t.add_row(lit(name), lit(opt.get(unit, "")), lit(gre.get(unit, "")))
    console.print(t)
    console.print(
        f"exact: score {rep['score']:.6g}, {rep['predicted_size']:,} bytes; "
        f"greedy (score per cost, take while it fits): score {g['score']:.6g}, {g['predicted_size']:,} bytes"
    )
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {lit(n)}")
    if out:
        console.print(f"recipe written to {lit(out)}; build it with: mosaic build {lit(out)}")
    tt = rep.get("tensor_type_file")
    if tt:
        console.print(f"tensor types written to {lit(tt['path'])} ({tt['entries']} entries); the stock tool makes the file "
                      f"with: llama-quantize --allow-requantize --imatrix MATRIX --tensor-type-file {lit(tt['path'])} "
                      "SOURCE OUT.gguf TYPE")


def render_export(console: Console, summary: dict) -> None:
    console.print(f"[bold]{lit(summary['output'])}[/bold]: {lit(summary['architecture'])}, {summary['tensors']} tensors "
                  f"({summary['exl3_tensors']} EXL3), {summary['size']:,} bytes in {len(summary['files'])} files")
    for f in summary["files"]:
        console.print(f"  {lit(f['name'])}  {f['size']:,}")
    tok = summary["tokenizer"]
    if tok:
        console.print(f"tokenizer: {lit(tok['model'])} ({lit(tok['pre'])} pre-tokenizer), {tok['tokens']:,} tokens")
    om = summary["omitted"]
    if om["mtp_tensors"] or om["vision_tensors"]:
        console.print(f"left out (not converted; listed in manifest.json): {om['mtp_tensors']} MTP-layer tensors, "
                      f"{om['vision_tensors']} vision-tower tensors")


def render_fetch(console: Console, sources: tuple[FetchedSource, ...]) -> None:
    if not sources:
        console.print("no repo + revision sources in this recipe: nothing to fetch")
    for s in sources:
        how = f"{s.hashed} hashed, {s.unchanged} unchanged since verified" + (" (offline, from the cache)" if s.offline else "")
        console.print(f"{lit(s.repo)}@{lit(s.revision)}: {s.files} files, {s.bytes:,} bytes verified against the hub's digests ({how})")
        console.print(f"  {lit(s.folder)}")


def render_publish(console: Console, res: PublishResult) -> None:
    files = res.files
    total = sum(f.size for f in files)
    verb = "would upload" if res.dry_run else "uploaded"
    console.print(f"{verb} {len(files)} files, {total:,} bytes, to {lit(res.repo)} branch {lit(res.branch)} in one commit:")
    console.print(f"  {lit(res.commit_message)}")
    for f in files:
        console.print(f"  {f.size:>16,}  {lit(f.name)}")
    for n in res.deleted:
        console.print(f"  {'deleted':>16}  {lit(n)}")
    if res.signature:
        console.print(f"signed ({lit(res.signature)}): verify a download with `mosaic audit DIR --key PUBLIC_KEY` "
                      "(or --identity/--issuer for a Sigstore signature), or with model_signing alone: "
                      f"`model_signing verify key DIR --signature DIR/{lit(res.signature)} --public_key PUBLIC_KEY`")
    else:
        console.print("not signed: `mosaic sign DIRECTORY --key PRIVATE_KEY` before publishing adds model.sig")
    if not res.dry_run:
        console.print("hub digests of every uploaded file match sha256-manifest.txt")


def render_rebuild(console: Console, res: RebuildResult) -> None:
    console.print(f"[bold green]rebuilt[/bold green] {lit(res.repo)}@{lit(res.revision)} in {lit(res.out)}: "
                  f"{res.files} files, {res.tensors:,} tensors, every one equal to the published PROVENANCE.json and manifest")
    for sid, n in res.hub_bytes.items():
        what = "the published small files" if sid == "published" else f"source {lit(sid)} by ranges"
        console.print(f"  read {n:,} bytes from the hub: {what}")
    for sid, path in res.local_sources.items():
        console.print(f"  source {lit(sid)} from {lit(path)}")


def render_eval(console: Console, doc: dict) -> None:
    console.print(f"[bold]reference[/bold] {lit(doc['reference'])} ({lit(doc['reference_kind'])}); "
                  f"{doc['rows']} rows, {doc['tokens']:,} tokens, {doc['positions']:,} positions"
                  + (f" ({doc['repeated']:,} more repeat an earlier context: counted once)" if doc.get("repeated") else "")
                  + f", windows of {doc['ctx']}")
    rt = doc.get("runtime")
    if rt:
        console.print(f"runtime {lit(rt['name'])} {lit(rt['version'])} (llama.cpp {lit(rt['llama_cpp'])}), "
                      f"{rt['threads']} threads, batches of {doc['batch']}")
    for note in doc.get("notes", []):
        console.print(f"note: {lit(note)}")
    if doc["candidates"]:
        kind = "KL" if doc["candidates"][0]["kl"]["exact"] else "KL lower bound"
        t = Table(show_edge=False)
        for col in ("candidate", "top-1", f"{kind} mean", "p50", "p95", "p99", "max", "NLL"):
            t.add_column(col, justify="left" if col == "candidate" else "right")
        for c in doc["candidates"]:
            k = c["kl"]
            t.add_row(lit(c["model"]), f"{c['top1']:.5f}", f"{k['mean']:.5f}", f"{k['p50']:.4g}", f"{k['p95']:.4g}",
                      f"{k['p99']:.4g}", f"{k['max']:.4g}", f"{c['nll']:.5f}")
        console.print(t)
    for cmp in doc["comparisons"]:
        parts = [f"{name}: {cmp[key]['improved']} improve, {cmp[key]['regressed']} regress"
                 for key, name in (("top1", "top-1"), ("kl", "KL"), ("nll", "NLL"))]
        console.print(f"{lit(cmp['from'])} → {lit(cmp['to'])} over {doc['rows']} rows: " + "; ".join(parts))
    if doc.get("saved_reference"):
        console.print(f"saved the teacher's top-{doc['top_k']} to {lit(doc['saved_reference'])}")
    if doc.get("plot"):
        console.print(f"drew KL and top-1 against size to {lit(doc['plot'])}")


def render_measurement(console: Console, doc: dict, out: object) -> None:
    b = doc["base"]
    s = doc["settings"]
    shard = s.get("shard")
    what = f"shard {shard['k']}/{shard['n']} of a measurement" if shard else "measured"
    each = f" ({doc['seconds_per_candidate']:.2f} s per candidate)" if doc.get("seconds_per_candidate") else ""
    console.print(f"[bold]{what}[/bold]: {len(doc['results'])} results ({s['unit']} units, method {s['method']}"
                  f"{', calibrated by ' + s['calibrate'] if s['method'] == 'top-down' else ''}"
                  f"{', each kind measured at its versions' if s.get('curve') == 'versions' else ''}), {doc['forward_passes']} forward "
                  f"passes in {doc['seconds']:.0f} s{each}; wrote {lit(str(out))}")
    console.print(f"weights compared with: {lit(s['weights_reference'])}")
    rt, dq = doc.get("runtime"), doc.get("dequantizer")
    if rt or dq:
        by: dict[str, list[str]] = {}
        for t, how in ((dq or {}).get("types") or {}).items():
            by.setdefault(how, []).append(t)
        decoded = "; ".join(f"{'ggml' if how == 'ggml' else 'gguf-py'}: {', '.join(ts)}" for how, ts in sorted(by.items()))
        console.print(f"ran on: {lit(rt['name'] + ' ' + rt['version']) if rt else 'no runtime'}"
                      + (f"; weights decoded by {decoded}" if decoded else "; weight errors from mosaic's cache" if dq else ""))
    im = s.get("imatrix")
    if im is not None:
        console.print(f"weighted by the importance matrix sha256 {im['sha256']} ({im['format']}, {len(im['weighted'])} tensors; "
                      f"made from {lit(', '.join(im['datasets']) or 'an unnamed text')}, {im['chunk_count']} chunks)"
                      + (f", each value held under its row's median × e^({im['cap']:g} robust SDs)" if "cap" in im else ""))
    for note in doc.get("notes") or ():
        console.print(f"note: {lit(note)}")
    if b["kl"] is not None:
        console.print(f"base {lit(b['source'])}: KL {b['kl']:.5f} (top-{s['kl']['k']} lower bound), top-1 {b['top1']:.4f}, "
                      f"NLL {b['nll']:.4f}; {doc['text']['rows']} rows, {doc['text']['positions']:,} positions"
                      + (f" (and {t['repeated']:,} whose context an earlier row had, counted once)"
                         if (t := doc["text"]).get("repeated") else ""))
    top = doc.get("top")
    if top is not None:
        moved = sum(v != "base" for v in top["versions"].values())
        console.print(f"top: KL {top['kl']:.5f}, top-1 {top['top1']:.4f}, NLL {top['nll']:.4f} "
                      f"({moved} of {len(top['versions'])} units at a donor's version); {len(doc['measured'])} drops measured")
        quiet = sum(abs(r["dkl_drop"]) < 2 * r["dkl_drop_se"] for r in doc["measured"])
        if quiet:  # a plan orders units by their drops: those inside their noise are ordered by chance
            console.print(f"{quiet} of {len(doc['measured'])} drops are within two standard errors of none: the rows "
                          "measured cannot tell them apart (more rows can)")
    for kind, c in (doc.get("calibration") or {}).items():
        console.print(f"kind {lit(kind)}: alpha {c['alpha']:.4g} ± {c['alpha_se']:.2g} from {c['units']} units")
    pooled: dict[str, list[str]] = {}
    for p in doc.get("pooled") or ():  # each kind's factors, where its units moved together measured the line wrong
        if p.get("factor") is not None and p["factor"] != 1.0:
            pooled.setdefault(p["kind"], []).append(f"{lit(p['to'])} {p['factor']:.2f}")
    if doc.get("pooled") is not None:
        console.print(f"{len(doc['pooled'])} versions of kinds measured with their units together; "
                      + ("factors on the line: " + "; ".join(f"{lit(k)}: {', '.join(v)}" for k, v in pooled.items())
                         if pooled else "every one within two standard errors of its line"))
    ref = doc.get("refinement")
    if ref is not None:
        for rd in ref["rounds"]:
            ratios = ", ".join(f"{lit(k)} {v['ratio']:.2f}" for k, v in rd["ratios"].items())
            console.print(f"refinement round {rd['round']}: the plan at {ref['max_size']:,} bytes ({rd['bytes']:,}) has KL "
                          f"{rd['kl']:.5f} (predicted {rd['predicted_kl']:.5f}); {len(rd['moves'])} moves; measured / predicted: {ratios}")
        console.print("the plan of the refined predictions " + ("is the last round's (converged)" if ref["converged"]
                                                                   else "differs from the last round's (not converged)"))
    if shard:
        console.print("its predictions need every shard: mosaic measure --merge --out FILE PART.json ...")
        return
    unit = "weight error" if s["dkl"] == "weight error" else "nats"
    best = sorted(doc["results"], key=lambda r: (r["dkl"], r["dbytes"]))[:15]
    t = Table(show_edge=False, title=f"what buys the most (dkl lowest first, in {unit})")
    for col in ("layer", "group", "donor", "dbytes", "dkl", "± se", "eps base → donor", "how"):
        t.add_column(col, justify="left" if col in ("group", "donor", "how") else "right")
    for r in best:
        se = "-" if r["dkl_se"] is None else f"{r['dkl_se']:.5f}"
        t.add_row("-" if r["layer"] is None else str(r["layer"]), lit(r["group"] or "-"), lit(r["donor"]), f"{r['dbytes']:,}",
                  f"{r['dkl']:+.5f}", se, f"{r['eps_base']:.2e} → {r['eps']:.2e}", "predicted" if r["predicted"] else "measured")
    console.print(t)


def render_ladder(console: Console, doc: dict, notes: list[str], out: object) -> None:
    tool = doc["tool"]
    src = doc["source"]
    im = doc.get("imatrix")
    console.print(f"[bold]ladder[/bold] {lit(str(out))}: {len(doc['rungs'])} rungs of {lit(src['file'])} "
                  f"({human_bytes(src['bytes'])}, sha256 {src['sha256']})")
    console.print(f"made by {lit(tool['path'])} ({lit(tool['version'] or 'no build line printed')})"
                  + (f", importance matrix sha256 {im['sha256']} ({im['format']})" if im else ", no importance matrix"))
    for note in notes:
        console.print(f"note: {lit(note)}")
    table = Table(show_header=True, header_style="bold")
    for col in ("type", "id", "file", "bytes", "fallbacks"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for r in doc["rungs"]:
        kinds: dict[str, int] = {}
        for t in r["fallbacks"].values():
            kinds[t] = kinds.get(t, 0) + 1
        fb = ", ".join(f"{n} at {lit(t)}" for t, n in sorted(kinds.items())) or "none"
        table.add_row(lit(r["type"]), lit(r["id"]), lit(r["file"]), f"{r['bytes']:,}", fb)
    console.print(table)
