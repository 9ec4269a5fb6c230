"""What people and scripts read: names printed whole and literally, piped output unwrapped and uncoloured."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from rich.console import Console

from mosaic._base.literal import markup_literal, printable
from mosaic.cli import render
from mosaic.cli.commands import main

from .test_audit import SPLICED, built, flip, mosaic, tensor_pos  # noqa: F401  (fixtures)

#: Looks like rich markup (a tag rich knows, and one it does not), a link and an emoji code.
TRICKY = "model.layers.1.mlp.experts.[bold]3[/bold].down_proj[model.x][link=http://a]y[/link]:smile:.trellis"
LONG = "model.language_model.layers.44.mlp.experts.287.down_proj.trellis" + ".x" * 40


def terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=1000, highlight=False, emoji=False), buf


def plain() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    con = render.stdout_console()
    con.file = buf
    return con, buf


# --- the text helpers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("a\nb", "a\\nb"),
        ("tab\there", "tab\\there"),
        ("\x1b[31mred", "\\x1b[31mred"),
        ("lone \ud800 surrogate", "lone \\ud800 surrogate"),
        ("ünïcode ok", "ünïcode ok"),
        ("plain", "plain"),
    ],
)
def test_printable_keeps_one_encodable_line(raw: str, shown: str) -> None:
    out = printable(raw)
    assert out == shown
    assert "\n" not in out
    out.encode("utf-8")  # never raises


def test_markup_literal_round_trips_through_rich() -> None:
    con, buf = terminal()
    con.print(f"[bold]{markup_literal(TRICKY)}[/bold]")
    assert TRICKY in buf.getvalue().replace("\x1b[1m", "").replace("\x1b[0m", "")


# --- every renderer prints data literally ------------------------------------------------------


def census_doc(name: str) -> dict:
    return {
        "path": f"/models/{name}",
        "tensors": 3, "shards": 1, "bytes": {"files": 10}, "exl3_modules": 1,
        "codebooks": {name: 1},
        "rate": {"exact": 2.0, "config": name},
        "head_bits": [6],
        "bits_histogram": {"2": {"modules": 1, "weights": 10}},
        "layers": [],
        "notes": [f"note about {name}"],
        "problems": [f"{name}: problem"],
    }


def build_doc(name: str) -> dict:
    return {
        "output": f"/out/{name}", "size": {"shards": 10}, "shards": {}, "tensors": 1, "from_donors": 1,
        "rate": {"exact": 2.0, "config_bits": 2.0, "by_bytes": 2.0, "by_layer_mass": 2.0, "base": 2.0},
        "checks": [{"name": "tensors_equal_sources", "ok": True, "detail": f"{name} equal"}],
        "notes": [f"recipe names {name}"],
    }


def audit_doc(name: str) -> dict:
    fail = {"check": "tensors", "file": "model-00001-of-00002.safetensors", "tensor": name,
            "detail": "bytes do not match the SHA-256 in PROVENANCE.json"}
    return {"ok": False, "mosaics": [{"path": f"/m/{name}", "ok": False, "counts": {},
                                      "checks": [{"name": "folder", "ok": True, "failures": []},
                                                 {"name": "tensors", "ok": False, "failures": [fail]}]},
                                     {"path": "/m/signed", "ok": True, "counts": {}, "checks": [],
                                      "signature": {"file": "model.sig", "present": True, "verified": True,
                                                    "state": "verified", "method": "key", "files": 3,
                                                    "by": f"public key /keys/{name}.pub"}}]}


def plan_doc(name: str) -> dict:
    return {"chosen": [{"layer": 3, "donor": name}], "predicted_size": 5, "score": 1.0,
            "rate": {"exact": None}, "greedy": {"chosen": [{"layer": 3, "donor": name}], "predicted_size": 5, "score": 1.0}}


def export_doc(name: str) -> dict:
    return {"output": f"/gguf/{name}", "architecture": "qwen3moe", "tensors": 1, "exl3_tensors": 1, "size": 1,
            "files": [{"name": f"{name}.gguf", "size": 1}], "tokenizer": None,
            "omitted": {"mtp_tensors": 0, "vision_tensors": 0}}


RENDERERS = {
    "census": lambda con, n: render.render_census(con, census_doc(n)),
    "build": lambda con, n: render.render_build(con, build_doc(n)),
    "audit": lambda con, n: render.render_audit(con, audit_doc(n)),
    "plan": lambda con, n: render.render_plan(con, plan_doc(n), [f"note {n}"], f"/recipes/{n}.yaml"),
    "export": lambda con, n: render.render_export(con, export_doc(n)),
    "fetch": lambda con, n: render.render_fetch(con, [SimpleNamespace(repo="org/x", revision="a" * 40, files=1, bytes=1,
                                                                      hashed=1, unchanged=0, offline=False,
                                                                      folder=f"/cache/{n}")]),
    "publish": lambda con, n: render.render_publish(con, SimpleNamespace(
        files=[SimpleNamespace(size=1, name=n)], dry_run=True, repo="org/x", branch="main",
        commit_message=f"{n}: recipe", deleted=[], signature=None)),
}


@pytest.mark.parametrize("mode", ["terminal", "plain"])
@pytest.mark.parametrize("which", sorted(RENDERERS))
def test_every_renderer_prints_names_whole_and_literally(which: str, mode: str) -> None:
    con, buf = terminal() if mode == "terminal" else plain()
    RENDERERS[which](con, TRICKY)
    out = buf.getvalue()
    text = out if mode == "plain" else _strip_ansi(out)
    assert TRICKY in text, f"{which}: {text}"
    if mode == "plain":
        assert "\x1b[" not in out  # no colour, no style


@pytest.mark.parametrize("which", sorted(RENDERERS))
def test_plain_output_never_wraps(which: str) -> None:
    con, buf = plain()
    RENDERERS[which](con, LONG)
    assert any(LONG in line for line in buf.getvalue().splitlines()), which


def test_plain_audit_puts_each_failure_on_one_line_with_check_file_and_tensor() -> None:
    con, buf = plain()
    render.render_audit(con, audit_doc(LONG))
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("FAIL ")]
    assert lines == [f"FAIL tensors: model-00001-of-00002.safetensors: {LONG}: bytes do not match the SHA-256 in PROVENANCE.json"]


def test_plan_hint_is_one_line_when_piped() -> None:
    con, buf = plain()
    out = "/a/very/long/folder/name/that/goes/on/and/on/for/well/over/eighty/columns/planned-recipe.yaml"
    render.render_plan(con, plan_doc("q3"), [], out)
    assert f"build it with: mosaic build {out}" in buf.getvalue().splitlines()[-1]


def test_a_per_tensor_plan_lists_every_unit_once_the_embedding_first() -> None:
    """Units of one layer share a donor, the embedding has no layer, and the two solvers may give one unit two
    versions: each unit is one row, in the model's order, its exact and its greedy choice side by side."""
    chosen = [{"layer": 2, "group": "attn_v", "donor": "q5_k"}, {"layer": 2, "group": "ffn_down", "donor": "q5_k"},
              {"layer": None, "group": "token_embd", "donor": "q8_0"}, {"layer": 0, "group": "attn_v", "donor": "q6_k"}]
    greedy = [{"layer": 2, "group": "attn_v", "donor": "iq4_nl"}, chosen[1], {"layer": 5, "group": "ffn_up", "donor": "q4_k"}]
    doc = {**plan_doc("x"), "chosen": chosen, "greedy": {"chosen": greedy, "predicted_size": 5, "score": 1.0}}
    con, buf = plain()
    render.render_plan(con, doc, [], None)
    lines = buf.getvalue().splitlines()
    head = next(ln for ln in lines if "exact choice" in ln)
    rows = [[cell.strip() for cell in ln.split("│")] for ln in lines if "│" in ln]
    assert [cell.strip() for cell in head.split("┃")] == ["unit", "exact choice", "greedy choice"]
    assert rows == [["token_embd", "q8_0", ""], ["0 attn_v", "q6_k", ""], ["2 attn_v", "q5_k", "iq4_nl"],
                    ["2 ffn_down", "q5_k", "q5_k"], ["5 ffn_up", "", "q4_k"]]


def test_progress_descriptions_are_literal(capsys: pytest.CaptureFixture[str]) -> None:
    from mosaic._base.progress import reporter

    name = "[bold]3[/bold][m.x]:smile:"
    with reporter(True) as rep:
        rep.step(f"auditing {name}", 10)(10)
    assert f"auditing {name}" in _strip_ansi(capsys.readouterr().err)


def test_error_line_is_one_literal_line(tmp_path: Path) -> None:
    name = "a[bold]b[/bold]\nsecond line"
    r = CliRunner().invoke(main, ["census", str(tmp_path / name)])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("mosaic: error: ")
    assert "a[bold]b[/bold]\\nsecond line" in r.stderr


# --- end to end: a tampered tensor in a piped audit ----------------------------------------------


def test_piped_audit_names_the_tampered_tensor_whole(mosaic: Path, tmp_path: Path) -> None:  # noqa: F811
    shard, a, _ = tensor_pos(mosaic, SPLICED)
    flip(shard, a + 10)
    report = tmp_path / "report.txt"
    with open(report, "w") as f:
        p = subprocess.run([sys.executable, "-m", "mosaic.cli", "audit", str(mosaic)], stdout=f, stderr=subprocess.PIPE)
    assert p.returncode == 1
    lines = report.read_text().splitlines()
    hit = [ln for ln in lines if SPLICED in ln]
    assert hit == [f"FAIL tensors: {shard.name}: {SPLICED}: bytes do not match the SHA-256 in PROVENANCE.json"]
    assert "\x1b[" not in report.read_text()
    assert any(ln.startswith(f"FAIL manifest: {shard.name}") for ln in lines)


def _strip_ansi(s: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m|\x1b\]8;[^\x1b]*\x1b\\", "", s)
