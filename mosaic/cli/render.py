"""How results look on a terminal: rich tables for census, build and audit. Only presentation here."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

_GROUP_COLUMNS = (
    ("routed_experts", "routed experts"),
    ("shared_experts", "shared experts"),
    ("attention", "attention"),
    ("dense_mlp", "dense MLP"),
)


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


def render_census(console: Console, rep: dict) -> None:
    books = ", ".join(f"{k} ({v})" for k, v in rep["codebooks"].items()) or "none"
    rate = rep["rate"]
    console.print(f"[bold]{rep['path']}[/bold]")
    console.print(
        f"{rep['tensors']:,} tensors in {rep['shards']} shard(s), {rep['bytes']['files']:,} bytes "
        f"({human_bytes(rep['bytes']['files'])}); {rep['exl3_modules']:,} EXL3 modules; codebook: {books}"
    )
    exact = f"{rate['exact']:.4f}" if rate["exact"] is not None else "-"
    console.print(f"exact trellis rate {exact} bpw (config.json says {rate['config']}); head bits {_bits(rep['head_bits'])}")
    hist = Table(title="bits histogram", show_edge=False)
    hist.add_column("bits", justify="right")
    hist.add_column("modules", justify="right")
    hist.add_column("weights", justify="right")
    for b, h in rep["bits_histogram"].items():
        hist.add_row(b, f"{h['modules']:,}", f"{h['weights']:,}")
    console.print(hist)
    t = Table(title="bits per layer and module group", show_edge=False)
    t.add_column("layer", justify="right")
    for _, title in _GROUP_COLUMNS:
        t.add_column(title, justify="center")
    t.add_column("rate", justify="right")
    for row in rep["layers"]:
        g = row["groups"]
        label = f"{row['layer']}" + (" (MTP)" if row["mtp"] else "")
        cells = []
        for key, _ in _GROUP_COLUMNS:
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
        console.print(f"[yellow]note:[/yellow] {n}")
    if rep["problems"]:
        console.print(f"[red bold]{len(rep['problems'])} problem(s):[/red bold]")
        for p in rep["problems"]:
            console.print(f"  [red]✗[/red] {p}", markup=True, highlight=False)
    else:
        console.print("[green]no problems found[/green]")


def render_build(console: Console, s: dict) -> None:
    rate = s["rate"]
    console.print(f"[bold green]built[/bold green] {s['output']}")
    console.print(
        f"{s['size']['shards']:,} bytes ({human_bytes(s['size']['shards'])}) in {len(s['shards'])} shard(s); "
        f"{s['tensors']:,} tensors, {s['from_donors']:,} from donors"
    )
    console.print(
        f"rate: exact {_rate(rate['exact'])} bpw (config bits {rate['config_bits']}), by bytes {_rate(rate['by_bytes'])}, "
        f"by layer mass {_rate(rate['by_layer_mass'])}; base {_rate(rate['base'])}"
    )
    t = Table(show_edge=False)
    t.add_column("check")
    t.add_column("ok")
    t.add_column("detail")
    for c in s["checks"]:
        t.add_row(c["name"], "[green]✓[/green]" if c["ok"] else "[red]✗[/red]", c["detail"])
    console.print(t)


def render_audit(console: Console, doc: dict) -> None:
    for m in doc["mosaics"]:
        c = m["counts"]
        console.print(
            f"[bold]{m['path']}[/bold]: {c.get('files', 0)} files, {c.get('shards', 0)} shards, "
            f"{c.get('tensors', 0):,} tensors, {c.get('bytes', 0):,} bytes read once"
        )
        t = Table(show_edge=False)
        t.add_column("check")
        t.add_column("result")
        t.add_column("first failures")
        for ch in m["checks"]:
            fails = ch["failures"]
            shown = "; ".join(
                " ".join(x for x in (f.get("file") or "", f"[{f['tensor']}]" if f.get("tensor") else "", f["detail"]) if x)
                for f in fails[:3]
            )
            if len(fails) > 3:
                shown += f" (+{len(fails) - 3} more)"
            t.add_row(ch["name"], "[green]pass[/green]" if ch["ok"] else f"[red]FAIL ({len(fails)})[/red]", shown)
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
    state = sig["state"]
    if state == "verified":
        console.print(f"signature: [green]verified[/green] {sig['file']} ({sig['files']} files) with {escape(str(sig['by']))}",
                      soft_wrap=True)
    elif state == "unverified":
        console.print(f"signature: [yellow]{sig['file']} present, NOT verified[/yellow] "
                      "(give --key PUBLIC_KEY, or --identity and --issuer, to verify it)", soft_wrap=True)
    elif state == "failed":
        console.print(f"signature: [red]{sig['file']} FAILED verification[/red] (see the signature check)", soft_wrap=True)
    else:
        console.print("signature: none (the folder is not signed)")


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
    t.add_column("layer", justify="right")
    t.add_column("exact choice")
    t.add_column("greedy choice")
    opt = {(c["layer"], c["donor"]) for c in rep["chosen"]}
    gre = {(c["layer"], c["donor"]) for c in g["chosen"]}
    for layer, donor in sorted(opt | gre):
        t.add_row(str(layer), donor if (layer, donor) in opt else "", donor if (layer, donor) in gre else "")
    console.print(t)
    console.print(
        f"exact: score {rep['score']:.6g}, {rep['predicted_size']:,} bytes; "
        f"greedy (score per cost, take while it fits): score {g['score']:.6g}, {g['predicted_size']:,} bytes"
    )
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {n}")
    if out:
        console.print(f"recipe written to {out}; build it with: mosaic build {out}")
