"""`mosaic ladder`: the donors made from the model's own source by llama.cpp's quantizer, and `--ladder DIR`.

The suite compiles nothing, so the tool is a stand-in (`mosaic.testing.quantize_tool`): llama.cpp's own
`llama_model_quantize` through the runtime's binding, behind llama-quantize's command line. Every rung is held to
readers that are not mosaic's: gguf-py reads each rung, and the types gguf-py's own quantizer writes bit for bit
(Q8_0, Q4_0, Q5_0) are compared with gguf-py's quantization of the source's values, tensor by tensor.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mosaic
from mosaic._measure.rungs import planned_types, rung_command
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from mosaic.testing.quantize_tool import write_tool
from tests.conftest import needs_runtime, run_cli

#: every row a multiple of 256, so that the K-quants take every tensor as they are (no fallback under --pure)
WIDE = Geometry(n_layer=2, n_embd=256, n_ff=256, n_head=4, n_head_kv=2)
TYPES = "IQ4_NL,Q4_0,Q4_K,Q5_0,Q6_K,Q8_0"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    needs_runtime()
    d = tmp_path_factory.mktemp("ladder")
    src = write_llama_gguf(d / "wide-F16.gguf", qtype="F16", seed=11, geometry=WIDE)[0]
    tool = write_tool(d / "llama-quantize")
    mosaic.ladder(src, out=d / "rungs", types=TYPES, llama_quantize=tool)
    return {"dir": d, "src": src, "tool": tool, "rungs": d / "rungs"}


def _tensors(path: Path) -> dict[str, object]:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


def test_every_rung_is_what_llama_cpp_writes_tensor_by_tensor(made: dict[str, Path]) -> None:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    doc = json.loads((made["rungs"] / "ladder.json").read_text())
    assert doc["schema"] == "mosaic.ladder/v1" and doc["imatrix"] is None
    assert [r["type"] for r in doc["rungs"]] == TYPES.split(",")
    assert doc["tool"]["version"].startswith("build = ")
    src = _tensors(made["src"])
    for r in doc["rungs"]:
        path = made["rungs"] / r["file"]
        assert path.stat().st_size == r["bytes"] and r["id"] == r["type"].lower() and r["fallbacks"] == {}
        assert r["seconds"] > 0  # the tool's time for this type: the ladder's cost, per type
        rung = _tensors(path)
        assert set(rung) == set(src)
        for name, t in rung.items():
            s = src[name]
            if len(s.shape) < 2 or not name.endswith(".weight"):
                assert t.tensor_type.name == "F32"
                continue
            assert t.tensor_type.name == r["type"], (name, r["type"])
            if r["type"] in ("Q8_0", "Q4_0", "Q5_0"):  # gguf-py quantizes these exactly as ggml does
                floats = dequantize(s.data, s.tensor_type).astype(np.float32)
                want = quantize(floats, GGMLQuantizationType[r["type"]])
                assert np.array_equal(np.asarray(t.data).view(np.uint8).ravel(), want.view(np.uint8).ravel()), name
        assert r["command"][0] == str(made["tool"].resolve()) and "--pure" in r["command"]
        assert r["command"][-2] == {"Q4_K": "Q4_K_M", "Q6_K": "Q6_K"}.get(r["type"], r["type"])
    # no temporary, no half rung: the folder holds the rungs and the manifest alone
    assert sorted(p.name for p in made["rungs"].iterdir()) == sorted([r["file"] for r in doc["rungs"]] + ["ladder.json"])


def test_the_fallbacks_are_llama_cpps_own_and_pure_gives_way_where_it_cannot_say_them() -> None:
    """SmolLM2's rows are 576 wide: a 256-wide block divides none of them, so llama.cpp's fallback applies, and
    --pure (under which llama.cpp applies neither fallback nor --tensor-type) cannot express the rung."""
    rows = {"token_embd.weight": 576, "blk.0.attn_q.weight": 576, "blk.0.ffn_down.weight": 1536}
    assert planned_types(rows, "Q4_K", set()) == {"token_embd.weight": "Q5_0", "blk.0.attn_q.weight": "Q5_0",
                                                   "blk.0.ffn_down.weight": "Q4_K"}
    assert planned_types(rows, "Q6_K", set())["blk.0.attn_q.weight"] == "Q8_0"
    assert planned_types(rows, "Q2_K", set())["blk.0.attn_q.weight"] == "IQ4_NL"
    assert planned_types({"x.weight": 96}, "Q4_K", set()) == {"x.weight": "Q5_0"}  # 96: 32-wide blocks fit
    assert planned_types({"x.weight": 40}, "Q4_K", set()) == {"x.weight": "F16"}  # nothing 32 wide fits: F16
    # an uncovered embedding at a type that needs a matrix takes the nearest that needs none, then its fallback
    assert planned_types(rows, "IQ2_XXS", {"token_embd.weight"})["token_embd.weight"] == "IQ4_NL"
    assert planned_types({"token_embd.weight": 512}, "IQ2_XXS", {"token_embd.weight"}) == {"token_embd.weight": "Q2_K"}
    argv = rung_command(Path("/t/llama-quantize"), Path("/s.gguf"), ".tmp", "Q4_K", 2, imatrix_name=None,
                        planned=planned_types(rows, "Q4_K", set()), requantize=True)
    assert "--pure" not in argv and argv[-4:] == ["/s.gguf", ".tmp", "Q4_K_M", "2"]
    assert argv[argv.index("--token-embedding-type"):][:2] == ["--token-embedding-type", "q5_0"]
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--tensor-type"]
    assert pairs == [r"^blk\.0\.attn_q\.weight$=q5_0", r"^blk\.0\.ffn_down\.weight$=q4_k"]
    # where only the embedding (or the output) differs, --pure with its own flag says it all
    wide = {"token_embd.weight": 512, "blk.0.attn_q.weight": 512}
    argv = rung_command(Path("/t/q"), Path("/s.gguf"), ".tmp", "IQ2_XXS", 2, imatrix_name="imatrix-ab.gguf",
                        planned=planned_types(wide, "IQ2_XXS", {"token_embd.weight"}), requantize=False)
    assert argv[:6] == ["/t/q", "--pure", "--imatrix", "imatrix-ab.gguf", "--token-embedding-type", "q2_k"]


def test_a_type_that_needs_a_matrix_never_aborts_on_what_the_matrix_lacks(made: dict[str, Path], tmp_path: Path) -> None:
    """With a matrix that covers every weight but the embedding and the output, IQ2_XXS gets those two at Q2_K:
    the tool's own refusal ("Missing importance matrix") never comes. The stand-in writes no IQ2_XXS (it cannot
    apply a matrix) and says so; the failed rung leaves nothing, the matrix lies in the folder under its digest."""
    im = write_imatrix(tmp_path / "m.gguf", imatrix_values(imatrix_targets(WIDE), seed=5))
    out = tmp_path / "iq"
    r = run_cli(["ladder", str(made["src"]), "--out", str(out), "--imatrix", str(im), "--types", "Q8_0,IQ2_XXS",
                 "--llama-quantize", str(made["tool"])])
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "IQ2_XXS rung" in line and "applies no importance matrix" in line
    assert "Missing importance matrix" not in line
    names = sorted(p.name for p in out.iterdir())
    assert [n for n in names if n.endswith(".gguf") and not n.startswith("imatrix-")] == []
    assert not [n for n in names if "partial" in n]
    handed = [n for n in names if n.startswith("imatrix-")]
    assert len(handed) == 1 and (out / handed[0]).read_bytes() == im.read_bytes()
    # without the overrides the tool aborts, naming the tensor: what the ladder steers around
    import subprocess

    p = subprocess.run([str(made["tool"]), "--pure", "--imatrix", str(im), str(made["src"]), str(tmp_path / "x"),
                        "IQ2_XXS", "1"], capture_output=True, text=True)
    assert p.returncode == 1 and "Missing importance matrix for tensor token_embd.weight" in p.stderr


def test_a_rung_made_of_the_same_inputs_is_kept_and_a_changed_one_made_again(made: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "resume"
    shutil.copytree(made["rungs"], out)
    before = {p.name: p.stat().st_ino for p in out.glob("*.gguf")}
    log = tmp_path / "calls"
    counting = tmp_path / "counting-quantize"
    counting.write_text(f"#!/bin/sh\necho x >> {log}\nexec {made['tool']} \"$@\"\n")
    counting.chmod(0o755)
    # another tool file is another tool: first, the same tool kept every rung
    first = json.loads((out / "ladder.json").read_text())["rungs"]
    res = mosaic.ladder(made["src"], out=out, types=TYPES, llama_quantize=made["tool"])
    assert {p.name: p.stat().st_ino for p in out.glob("*.gguf")} == before and not res.notes
    assert res.rungs == first  # a kept rung keeps its record, the time it took to make included
    # a rung whose bytes changed is made again, the others kept
    victim = out / "wide-F16-Q5_0.gguf"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = mosaic.ladder(made["src"], out=out, types=TYPES, llama_quantize=made["tool"])
    assert victim.read_bytes() == (made["rungs"] / victim.name).read_bytes()
    assert {p.name: p.stat().st_ino for p in out.glob("*.gguf") if p.name != victim.name} == {
        k: v for k, v in before.items() if k != victim.name}
    # a rung asked for the first time is added; the others stay
    res = mosaic.ladder(made["src"], out=out, types="Q5_1", llama_quantize=made["tool"])
    assert [r["type"] for r in res.rungs] == ["IQ4_NL", "Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q6_K", "Q8_0"]
    # another tool: every rung is made again, and the note says why
    res = mosaic.ladder(made["src"], out=out, types="Q8_0", llama_quantize=counting)
    assert log.read_text().count("x") == 1 and [r["type"] for r in res.rungs] == ["Q8_0"]
    assert any("other inputs" in n for n in res.notes)


def test_bits_per_weight_are_llama_cpps_and_the_floor_leaves_out_the_types_under_it() -> None:
    from mosaic._sources.rung_set import TYPES, bits_per_weight, default_types

    # llama.cpp's own figures (its quantize tool's table, ggml's block sizes)
    assert {t: bits_per_weight(t) for t in ("IQ1_S", "IQ2_XS", "IQ2_S", "Q2_K", "Q4_0", "Q4_K", "Q6_K", "Q8_0")} == {
        "IQ1_S": 1.5625, "IQ2_XS": 2.3125, "IQ2_S": 2.5625, "Q2_K": 2.625, "Q4_0": 4.5, "Q4_K": 4.5, "Q6_K": 6.5625,
        "Q8_0": 8.5}
    assert default_types(True) == list(TYPES)
    assert default_types(True, 2.5) == [t for t in TYPES if t not in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS")]
    assert default_types(False, 2.5) == [t for t in default_types(False)]  # those four need a matrix anyway
    assert default_types(True, 6.5) == ["Q6_K", "Q8_0"]


def test_a_floor_makes_no_rung_under_it_and_takes_an_earlier_runs_out_of_the_manifest(made: dict[str, Path],
                                                                                      tmp_path: Path) -> None:
    out = tmp_path / "floor"
    shutil.copytree(made["rungs"], out)
    before = {p.name for p in out.glob("*.gguf")}
    r = run_cli(["ladder", str(made["src"]), "--out", str(out), "--min-bpw", "6", "--llama-quantize", str(made["tool"]), "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # the default types of 6 bits a weight or more (no matrix): Q5_1 made, Q6_K and Q8_0 kept from the earlier run
    assert [x["type"] for x in doc["rungs"]] == ["Q5_1", "Q6_K", "Q8_0"]
    assert json.loads((out / "ladder.json").read_text()) == doc
    assert {p.name for p in out.glob("*.gguf")} == before | {"wide-F16-Q5_1.gguf"}  # their files stay: nothing is lost
    res = mosaic.ladder(made["src"], out=out, min_bpw=6, llama_quantize=made["tool"])
    assert res.rungs == doc["rungs"] and not res.notes
    # the rungs left out are named, with their files; measure and plan read the manifest, so they no longer take them
    again = tmp_path / "again"
    shutil.copytree(made["rungs"], again)
    res = mosaic.ladder(made["src"], out=again, types="Q6_K,Q8_0", min_bpw=5, llama_quantize=made["tool"])
    assert [x["type"] for x in res.rungs] == ["Q5_0", "Q6_K", "Q8_0"]  # Q5_0 (5.5 bits) kept: over the floor
    assert list(res.notes) == [f"IQ4_NL, Q4_0, Q4_K: under --min-bpw 5, left out of ladder.json; their files stay in {again} "
                         "(wide-F16-IQ4_NL.gguf, wide-F16-Q4_0.gguf, wide-F16-Q4_K.gguf)"]


def test_a_failed_or_killed_tool_leaves_no_rung_it_did_not_finish(made: dict[str, Path], tmp_path: Path) -> None:
    out_arg = 'eval "o=\\${$(($#-2))}"; '  # the output is the third argument from the end
    for name, body in (("half", out_arg + 'printf GGUF > "$o"; echo "died half way" >&2; exit 1\n'),
                       ("killed", out_arg + 'printf GGUF > "$o"; kill -9 $$\n'),
                       ("garbage", out_arg + 'printf "not a gguf at all" > "$o"; exit 0\n')):
        tool = tmp_path / f"{name}-quantize"
        tool.write_text("#!/bin/sh\n" + body)
        tool.chmod(0o755)
        out = tmp_path / name
        r = run_cli(["ladder", str(made["src"]), "--out", str(out), "--types", "Q8_0", "--llama-quantize", str(tool)])
        assert r.returncode == 2, (name, r.stderr)
        line = r.stderr.strip()
        assert "\n" not in line and "Q8_0 rung" in line, line
        if name == "half":
            assert line.endswith("died half way")
        if name == "killed":
            assert "signal 9" in line
        assert sorted(p.name for p in out.iterdir()) == [], (name, list(out.iterdir()))
    assert not (tmp_path / "half.lock").exists()


def test_what_a_run_killed_outright_left_is_removed_by_the_next(made: dict[str, Path], tmp_path: Path) -> None:
    """SIGKILL skips the rung's own clean-up: the half-written file, as big as a rung, would stay for good."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    out = tmp_path / "rungs"
    out.mkdir()
    stale = out / f".wide-F16-Q8_0.gguf.partial-{gone.pid}"
    stale.write_bytes(b"GGUF" + bytes(4096))
    live = out / f".wide-F16-Q8_0.gguf.partial-{os.getppid()}"  # a process that is still there: not ours to remove
    live.write_bytes(b"GGUF")
    keep = out / "notes.txt"
    keep.write_text("mine")
    r = run_cli(["ladder", str(made["src"]), "--out", str(out), "--types", "Q8_0", "--llama-quantize", str(made["tool"])])
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and live.exists() and keep.read_text() == "mine"
    assert stale.name in r.stdout + r.stderr
    assert (out / "wide-F16-Q8_0.gguf").is_file()


def test_bad_input_is_one_line_and_touches_nothing(made: dict[str, Path], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MOSAIC_LLAMA_QUANTIZE"}
    env["PATH"] = str(tmp_path / "empty-path")
    env["HOME"] = str(tmp_path / "home")  # no tool where make llama-tools builds it either

    def one_line(args: list[str], *, environ: dict | None = None) -> str:
        import subprocess
        import sys

        r = subprocess.run([sys.executable, "-m", "mosaic.cli", *args], capture_output=True, text=True, env=environ)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("mosaic: error: "), r.stderr
        return r.stderr

    out = tmp_path / "never"
    assert "make llama-tools" in one_line(["ladder", str(made["src"]), "--out", str(out)], environ=env)
    tool = ["--llama-quantize", str(made["tool"])]
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    assert "not a GGUF model" in one_line(["ladder", str(text), "--out", str(out), *tool])
    im = write_imatrix(tmp_path / "m.gguf", imatrix_values(imatrix_targets(WIDE), seed=5))
    assert "an importance matrix, not a model" in one_line(["ladder", str(im), "--out", str(out), *tool])
    other = write_imatrix(tmp_path / "other.gguf", imatrix_values(imatrix_targets(Geometry(n_layer=3)), seed=5))
    assert "input width is 256" in one_line(["ladder", str(made["src"]), "--out", str(out), "--imatrix", str(other), *tool])
    assert "needs an importance matrix" in one_line(["ladder", str(made["src"]), "--out", str(out), "--types", "IQ1_S", *tool])
    assert "Q9_9 is not a type" in one_line(["ladder", str(made["src"]), "--out", str(out), "--types", "Q9_9", *tool])
    assert "Q4_0 has 4.5 bits per weight, under --min-bpw 5" in one_line(
        ["ladder", str(made["src"]), "--out", str(out), "--types", "Q8_0,Q4_0", "--min-bpw", "5", *tool])
    assert "no type a rung can hold has that many bits per weight (the most: 8.5, Q8_0)" in one_line(
        ["ladder", str(made["src"]), "--out", str(out), "--min-bpw", "9", *tool])
    for bad in ("-1", "nan", "inf"):
        assert "expected a number of bits per weight, 0 or more (0: no floor)" in one_line(
            ["ladder", str(made["src"]), "--out", str(out), "--min-bpw", bad, *tool])
    assert not out.exists()
    # the folder is locked while a ladder is made there
    from tests.test_lock import held_elsewhere

    with held_elsewhere(out, "mosaic ladder") as p:
        msg = one_line(["ladder", str(made["src"]), "--out", str(out), "--types", "Q8_0", *tool])
        assert f"pid {p.pid}" in msg and "mosaic ladder" in msg


def test_the_ladder_plans_builds_and_audits(made: dict[str, Path], tmp_path: Path) -> None:
    """--ladder DIR: the rung of fewest bytes is the base (a tie goes to the type earlier in the contract's list:
    IQ4_NL before Q4_0), every other rung a donor named by its type; the plan builds and audits."""
    m = mosaic.measure(ladder=made["rungs"], reference=made["src"], method="weights", unit="module-group",
                       out=tmp_path / "m.json")
    doc = m.document
    assert Path(doc["base"]["source"]).name == "wide-F16-IQ4_NL.gguf"
    assert list(doc["donors"]) == ["q4_0", "q4_k", "q5_0", "q6_k", "q8_0"]
    p = mosaic.plan(ladder=made["rungs"], scores=tmp_path / "m.json", max_size=made["rungs"].joinpath(
        "wide-F16-Q5_0.gguf").stat().st_size, out=tmp_path / "plan.yaml")
    assert p.chosen and {c["donor"] for c in p.chosen} <= {"q4_0", "q4_k", "q5_0", "q6_k", "q8_0"}
    built = mosaic.build(p.out, out=tmp_path / "built")
    assert sum(f.stat().st_size for f in built.out.glob("*.gguf")) == p.report["predicted_size"]
    assert mosaic.audit(built.out).ok
    # --ladder stands in for --base/--donor, never beside them
    r = CliRunner().invoke(main, ["plan", "--ladder", str(made["rungs"]), "--base", str(made["src"]), "--scores",
                                  str(tmp_path / "m.json"), "--layers", "1"])
    assert r.exit_code == 2 and "instead of --base/--donor" in r.output


def test_a_budget_under_the_ladders_floor_names_the_option_that_makes_the_types_under_it(made: dict[str, Path],
                                                                                        tmp_path: Path) -> None:
    mosaic.measure(ladder=made["rungs"], reference=made["src"], method="weights", unit="module-group", out=tmp_path / "m.json")
    tiny = 1000
    with pytest.raises(mosaic.MosaicError, match="no plan is that small") as e:
        mosaic.plan(ladder=made["rungs"], scores=tmp_path / "m.json", max_size=tiny)
    assert "--min-bpw" not in str(e.value)  # made with no floor: nothing was left out
    floored = tmp_path / "floored"
    shutil.copytree(made["rungs"], floored)
    doc = json.loads((floored / "ladder.json").read_text())
    doc["options"]["min_bpw"] = 2.5
    (floored / "ladder.json").write_text(json.dumps(doc))
    r = CliRunner().invoke(main, ["plan", "--ladder", str(floored), "--scores", str(tmp_path / "m.json"), "--max-size", str(tiny)])
    msg = r.output.strip()
    assert r.exit_code == 2 and msg.count("\n") == 0 and "no plan is that small" in msg and msg.endswith(
        "the ladder has no type under 2.5 bits a weight (its floor): mosaic ladder --min-bpw 0 makes them"), msg


def test_a_rung_that_changed_is_refused_and_alike_versions_are_one(made: dict[str, Path], tmp_path: Path) -> None:
    lad = tmp_path / "lad"
    shutil.copytree(made["rungs"], lad)
    doc = json.loads((lad / "ladder.json").read_text())
    # a rung recorded twice under two types (same bytes): each unit's version is measured once, under the first name
    q8 = next(r for r in doc["rungs"] if r["type"] == "Q8_0")
    shutil.copyfile(lad / q8["file"], lad / "copy-Q8_0.gguf")
    doc["rungs"].append({**q8, "type": "Q5_1", "id": "q5_1", "file": "copy-Q8_0.gguf"})
    (lad / "ladder.json").write_text(json.dumps(doc))
    m = mosaic.measure(ladder=lad, reference=made["src"], method="weights", unit="module-group", out=tmp_path / "m.json")
    donors = {r["donor"] for r in m.results}
    assert "q5_1" in donors or "q8_0" in donors
    assert not ("q5_1" in donors and "q8_0" in donors)
    # a changed rung is refused before anything runs, naming it
    data = bytearray((lad / "copy-Q8_0.gguf").read_bytes())
    data[-1] ^= 1
    (lad / "copy-Q8_0.gguf").write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["measure", "--ladder", str(lad), "--reference", str(made["src"]), "--method", "weights",
                                  "--out", str(tmp_path / "m2.json")])
    assert r.exit_code == 2 and "copy-Q8_0.gguf is not the Q5_1 rung" in r.output
    assert not (tmp_path / "m2.json").exists()


def test_a_saved_teacher_made_of_the_ladders_source_is_what_the_weights_are_compared_with(tmp_path: Path) -> None:
    """A ladder made from a quantization holds the source's own type: against the most-bits rung (Q8_0) that lossless
    rung would look worse than Q8_0. With a saved reference made of the ladder's source (the same bytes), every
    weight error is measured against the source itself, as with a live teacher."""
    from gguf.quants import dequantize

    from mosaic._eval.run import EvalRequest, evaluate

    needs_runtime()
    src = write_llama_gguf(tmp_path / "wide-Q4_1.gguf", qtype="Q4_1", seed=11, geometry=WIDE)[0]
    mosaic.ladder(src, out=tmp_path / "rungs", types="Q4_0,Q4_1,Q8_0", llama_quantize=write_tool(tmp_path / "llama-quantize"),
                  lean=False)  # the Q4_1 rung holds the source's bytes, made by the tool
    rows = tmp_path / "rows.txt"
    rows.write_text("the model of a mosaic\nbytes and the bytes of a model\n")
    saved = tmp_path / "teacher.npz"
    evaluate(EvalRequest([], str(src), rows, ctx=16, top_k=16, save_reference=saved))
    doc = mosaic.measure(ladder=tmp_path / "rungs", reference=saved, method="weights", unit="module-group",
                         out=tmp_path / "m.json").document
    assert doc["settings"]["weights_reference"] == "teacher"
    assert doc["notes"] == [f"weights compared with {src}, the model the saved reference was made of and the ladder's "
                            f"source (sha256 {json.loads((tmp_path / 'rungs' / 'ladder.json').read_text())['source']['sha256']})"]

    def values(path: Path) -> dict[str, np.ndarray]:
        return {n: dequantize(t.data, t.tensor_type).astype(np.float64) for n, t in _tensors(path).items()}

    ref = values(src)
    rungs = {r.split("-")[-1].removesuffix(".gguf").lower(): values(tmp_path / "rungs" / r)
             for r in os.listdir(tmp_path / "rungs") if r.endswith(".gguf")}
    base = next(r for r in rungs if r not in {d for d in (x["donor"] for x in doc["results"])})
    checked = 0
    for r in doc["results"]:
        name = r["tensors"][0]
        for version, eps in ((r["donor"], r["eps"]), (base, r["eps_base"])):
            want = float(((rungs[version][name] - ref[name]) ** 2).sum() / (ref[name] ** 2).sum())
            assert eps == pytest.approx(want, rel=1e-9, abs=1e-18)
            checked += 1
    assert checked and any(r["eps"] > 0 for r in doc["results"] if r["donor"] == "q8_0")  # Q8_0 is not the teacher
    # a saved reference made of another model: the rungs are compared with their most-bits one, as before
    other = write_llama_gguf(tmp_path / "other-F16.gguf", qtype="F16", seed=12, geometry=WIDE)[0]
    evaluate(EvalRequest([], str(other), rows, ctx=16, top_k=16, save_reference=tmp_path / "other.npz"))
    doc = mosaic.measure(ladder=tmp_path / "rungs", reference=tmp_path / "other.npz", method="weights",
                         unit="module-group", out=tmp_path / "m2.json").document
    assert doc["settings"]["weights_reference"] == "most-bits" and "notes" not in doc
    assert all(r["eps"] == 0 for r in doc["results"] if r["donor"] == "q8_0")



def test_a_lean_rung_keeps_the_sources_bytes_where_its_type_has_no_fewer(tmp_path: Path) -> None:
    """A published mix (llama.cpp's Q4_K_M: Q4_K, with Q6_K in some tensors) as the source. A tensor at a type of no
    fewer bytes than its own is never worth taking, so with ``--lean`` each rung copies it as it is (llama.cpp copies a tensor named
    at the type it has), a rung where no tensor takes its type is not made, and the measurement sees each tensor's
    own bytes once, under its own type's name. A rung made by an older command is made again."""
    import subprocess

    from mosaic._measure.rungs import _bytes_per_weight

    needs_runtime()
    f16 = write_llama_gguf(tmp_path / "wide-F16.gguf", qtype="F16", seed=11, geometry=WIDE)[0]
    tool = write_tool(tmp_path / "llama-quantize")
    src = tmp_path / "wide-Q4_K_M.gguf"
    subprocess.run([str(tool), str(f16), str(src), "Q4_K_M"], check=True, capture_output=True)
    srct = _tensors(src)
    own = {n: t.tensor_type.name for n, t in srct.items() if n.endswith(".weight") and len(t.shape) >= 2}
    assert set(own.values()) == {"Q4_K", "Q6_K"}  # a mix, as published files are
    res = mosaic.ladder(src, out=tmp_path / "rungs", types="Q3_K,Q4_0,Q4_K,Q5_K,Q6_K,Q8_0", llama_quantize=tool, lean=True,
                        no_superseded=False)
    assert [r["type"] for r in res.rungs] == ["Q3_K", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]
    assert list(res.notes) == ["Q8_0: not made: no tensor of the source has fewer bytes at that type than at its own"]
    copied = quantized = 0
    for r in res.rungs:
        got = _tensors(tmp_path / "rungs" / r["file"])
        assert set(got) == set(srct)
        for n, t in own.items():
            if _bytes_per_weight(r["type"]) >= _bytes_per_weight(t):
                assert got[n].tensor_type.name == t and np.array_equal(np.asarray(got[n].data), np.asarray(srct[n].data))
                copied += 1
            else:
                assert got[n].tensor_type.name == r["type"]
                quantized += 1
    assert copied and quantized
    # every tensor's own bytes are one version, named by its own type; no other version of it has eps 0
    m = mosaic.measure(ladder=tmp_path / "rungs", reference=src, method="weights", unit="module-group",
                       out=tmp_path / "m.json")
    lossless: dict[str, set[str]] = {}
    for x in m.results:
        if x["eps"] == 0:
            lossless.setdefault(x["tensors"][0], set()).add(x["donor"])
    assert lossless and all(vs == {own[n].lower()} for n, vs in lossless.items())
    assert set(lossless) == set(own)
    # without the source's own types asked for, a rung holding only copies is made where it holds some tensor's
    # source bytes that no other rung holds (the Q6_K tensors' here): every tensor keeps its lossless version
    res = mosaic.ladder(src, out=tmp_path / "rungs-2", types="Q3_K,Q4_0,Q5_K,Q8_0", llama_quantize=tool, lean=True)
    assert [r["type"] for r in res.rungs] == ["Q3_K", "Q4_0", "Q5_K", "Q8_0"] and not res.notes
    q8 = _tensors(tmp_path / "rungs-2" / res.rungs[-1]["file"])
    assert all(q8[n].tensor_type.name == t for n, t in own.items())
    # without --lean: every rung every tensor at its type, as llama-quantize --pure writes it; Q8_0 made too
    res = mosaic.ladder(src, out=tmp_path / "rungs-whole", types="Q5_K,Q8_0", llama_quantize=tool, lean=False)
    assert [r["type"] for r in res.rungs] == ["Q5_K", "Q8_0"] and not res.notes
    for r in res.rungs:
        assert {t.tensor_type.name for n, t in _tensors(tmp_path / "rungs-whole" / r["file"]).items() if n in own} == {r["type"]}
        assert "--pure" in r["command"]
    # a rung made by an older command (every tensor at the rung's type) is made again; the others are kept
    doc = json.loads((tmp_path / "rungs" / "ladder.json").read_text())
    q5 = next(r for r in doc["rungs"] if r["type"] == "Q5_K")
    q5["command"] = [a for a in q5["command"] if not a.startswith("^") and a != "--tensor-type"]
    (tmp_path / "rungs" / "ladder.json").write_text(json.dumps(doc))
    before = {p.name: p.stat().st_ino for p in (tmp_path / "rungs").glob("*.gguf")}
    res = mosaic.ladder(src, out=tmp_path / "rungs", types="Q3_K,Q4_0,Q4_K,Q5_K,Q6_K,Q8_0", llama_quantize=tool, lean=True,
                        no_superseded=False)
    after = {p.name: p.stat().st_ino for p in (tmp_path / "rungs").glob("*.gguf")}
    changed = {n for n in after if after[n] != before.get(n)}
    assert changed == {q5["file"]} and next(r for r in res.rungs if r["type"] == "Q5_K")["command"] != q5["command"]


def test_no_superseded_keeps_a_32_wide_type_only_where_no_256_wide_type_can_go() -> None:
    """Q4_0, Q4_1, IQ4_NL, Q5_0 and Q5_1 each have a 256-wide type of no more bytes (Q4_K, IQ4_XS, Q5_K): with
    ``--no-superseded`` a tensor whose rows that type divides keeps its source bytes in their rungs; a 576-wide
    one (SmolLM2's) still takes them, and so does the fallback a 256-wide rung gives it."""
    from mosaic._measure.rungs import SUPERSEDED

    rows = {"blk.0.ffn_down.weight": 1536, "blk.0.attn_q.weight": 576}
    src = dict.fromkeys(rows, "F16")
    for t, successor in SUPERSEDED.items():
        got = planned_types(rows, t, set(), src, {t: successor})
        assert got == {"blk.0.ffn_down.weight": "F16", "blk.0.attn_q.weight": t}, t
        assert planned_types(rows, t, set(), src) == dict.fromkeys(rows, t)  # without it: every tensor at the type
        assert planned_types(rows, t, set(), src, {})["blk.0.ffn_down.weight"] == t  # its successor not made
    # Q2_K cannot take a 576-wide row: llama.cpp's fallback IQ4_NL stays, IQ4_XS cannot take it either
    assert planned_types(rows, "Q2_K", set(), src, {"IQ4_NL": "IQ4_XS"}) == {"blk.0.ffn_down.weight": "Q2_K",
                                                                           "blk.0.attn_q.weight": "IQ4_NL"}


def test_no_superseded_rungs_are_not_made_where_every_row_divides_256(tmp_path: Path) -> None:
    """Every row of WIDE divides 256. From a Q4_K_M source with ``--lean --no-superseded``, the Q4_0, Q5_0 and Q5_1
    rungs would hold only copies of the source, so they are not made, and the note says which type supersedes
    each; where Q5_K is not asked for, Q5_0 is made as before. Without ``--lean`` the option is refused before anything
    is made: a type it leaves out could be a tensor's version nearest the source (Q5_1 of a Q4_1 source), the top
    a measurement starts from, where with ``--lean`` the source's own bytes are."""
    import subprocess

    needs_runtime()
    f16 = write_llama_gguf(tmp_path / "wide-F16.gguf", qtype="F16", seed=11, geometry=WIDE)[0]
    tool = write_tool(tmp_path / "llama-quantize")
    src = tmp_path / "wide-Q4_K_M.gguf"
    subprocess.run([str(tool), str(f16), str(src), "Q4_K_M"], check=True, capture_output=True)
    res = mosaic.ladder(src, out=tmp_path / "rungs", types="Q4_0,Q4_K,Q5_0,Q5_1,Q5_K,Q6_K", llama_quantize=tool,
                        lean=True, no_superseded=True)
    assert [r["type"] for r in res.rungs] == ["Q4_K", "Q5_K", "Q6_K"]
    assert list(res.notes) == ["Q4_0, Q5_0, Q5_1: not made (--no-superseded): the 256-wide type that supersedes each "
                               "(Q4_K, Q5_K, Q5_K) can take every tensor they could"]
    assert sorted(p.name for p in (tmp_path / "rungs").glob("*.gguf") if "imatrix" not in p.name) == [
        "wide-Q4_K_M-Q4_K.gguf", "wide-Q4_K_M-Q5_K.gguf", "wide-Q4_K_M-Q6_K.gguf"]
    res = mosaic.ladder(src, out=tmp_path / "rungs-2", types="Q4_0,Q4_K,Q5_0,Q6_K", llama_quantize=tool, lean=True,
                        no_superseded=True)
    assert [r["type"] for r in res.rungs] == ["Q4_K", "Q5_0", "Q6_K"]
    q50 = _tensors(tmp_path / "rungs-2" / res.rungs[1]["file"])
    assert {t.tensor_type.name for t in q50.values() if len(t.shape) >= 2} == {"Q4_K", "Q5_0"}  # copies, and Q5_0
    for source, flags, why in ((src, ["--no-lean"], "needs --lean"), (f16, [], "not over an unquantized source")):
        r = run_cli(["ladder", str(source), "--out", str(tmp_path / "refused"), "--types", "Q4_0,Q4_K", "--no-superseded",
                     *flags, "--llama-quantize", str(tool)])
        assert r.returncode == 2 and why in r.stderr and "\n" not in r.stderr.strip(), r.stderr
        assert not (tmp_path / "refused").exists()


def test_a_lean_rung_copies_a_substitute_the_rung_of_its_type_holds() -> None:
    """The IQ3_XXS rung would quantize the uncovered output at IQ3_S, the IQ2_S rung the embedding at Q2_K: the
    IQ3_S and Q2_K rungs hold those very bytes, so under ``--lean`` the two keep the source's bytes instead. A
    substitute whose own rung is not made (Q2_K not asked for) is still quantized where it is."""
    from mosaic._measure.rungs import copy_substitutes

    rows = {"token_embd.weight": 1536, "output.weight": 1536, "blk.0.ffn_down.weight": 8960}
    own = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K"}
    uncovered = {"token_embd.weight", "output.weight"}
    types = ["IQ2_S", "Q2_K", "IQ3_XXS", "IQ3_S"]
    planned = {t: planned_types(rows, t, uncovered, own) for t in types}
    assert planned["IQ3_XXS"]["output.weight"] == "IQ3_S" and planned["IQ2_S"]["token_embd.weight"] == "Q2_K"
    copy_substitutes(planned, own, types)
    assert planned["IQ3_XXS"] == {"token_embd.weight": "Q4_K", "output.weight": "Q6_K", "blk.0.ffn_down.weight": "IQ3_XXS"}
    assert planned["IQ2_S"] == {"token_embd.weight": "Q4_K", "output.weight": "Q6_K", "blk.0.ffn_down.weight": "IQ2_S"}
    assert planned["IQ3_S"]["output.weight"] == "IQ3_S" and planned["Q2_K"]["output.weight"] == "Q2_K"  # the holders
    alone = {t: planned_types(rows, t, uncovered, own) for t in ("IQ2_S", "IQ3_S")}
    copy_substitutes(alone, own, ["IQ2_S", "IQ3_S"])
    assert alone["IQ2_S"]["output.weight"] == "Q2_K"  # no Q2_K rung: the IQ2_S rung's is the only one


def test_the_defaults_follow_the_source(tmp_path: Path) -> None:
    """Left open, ``--lean`` and ``--no-superseded`` are on over a quantization whose every type the ladder holds (the
    bench's Qwen2.5-Coder-1.5B ladder, over its Q4_K_M), off where a type of the source is not among the types asked
    (SmolLM2's Q4_1 under a list without it) or the source is unquantized; the floor of 2.5 bits a weight holds under
    the default types only. Each default that leaves something out says so in one line, naming the option that
    brings it back, and ladder.json records what the ladder was made with."""
    import subprocess

    from mosaic._measure.rungs import DEFAULT_MIN_BPW, LadderRequest, options

    needs_runtime()
    f16 = write_llama_gguf(tmp_path / "wide-F16.gguf", qtype="F16", seed=11, geometry=WIDE)[0]
    tool = write_tool(tmp_path / "llama-quantize")
    src = tmp_path / "wide-Q4_K_M.gguf"
    subprocess.run([str(tool), str(f16), str(src), "Q4_K_M"], check=True, capture_output=True)
    res = mosaic.ladder(src, out=tmp_path / "rungs", types="Q4_0,Q4_K,Q5_K,Q6_K", llama_quantize=tool)
    assert res.manifest["options"] == {"lean": True, "min_bpw": None, "no_superseded": True}
    assert [r["type"] for r in res.rungs] == ["Q4_K", "Q5_K", "Q6_K"]  # Q4_0: superseded by Q4_K
    res = mosaic.ladder(src, out=tmp_path / "rungs-2", types="Q4_0,Q8_0", llama_quantize=tool)
    assert res.manifest["options"] == {"lean": False, "min_bpw": None, "no_superseded": False}
    assert list(res.notes) == ["not --lean: the source holds Q4_K, Q6_K, which the types asked leave out, and a rung keeping "
                               "a tensor's source bytes would hold it (--lean keeps them all the same)"]
    notes: list[str] = []
    f16_own = {"blk.0.ffn_down.weight": "F16"}
    got = options(LadderRequest(str(f16), tmp_path), ["Q4_0", "Q4_K"], f16_own, notes)  # the default types
    assert (got.lean, got.no_superseded) == (False, False) and notes[0].startswith("the source is unquantized (F16)")
    notes.clear()
    res = mosaic.ladder(f16, out=tmp_path / "rungs-3", types="Q4_0,Q4_K", llama_quantize=tool)  # types given: no note
    assert res.manifest["options"] == {"lean": False, "min_bpw": None, "no_superseded": False} and not res.notes
    # the floor: under the default types only, and said where it leaves a type out; 0 is no floor
    own = {"blk.0.ffn_down.weight": "Q4_K"}
    got = options(LadderRequest(str(src), tmp_path, imatrix="m.gguf"), ["Q4_K"], own, notes)
    assert got.min_bpw == DEFAULT_MIN_BPW and notes == [
        "IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS: not made, under 2.5 bits a weight, the default floor (--min-bpw 0 makes them, "
        "for plans below it)"]
    notes.clear()
    assert options(LadderRequest(str(src), tmp_path, min_bpw=0), ["Q4_K"], own, notes).min_bpw is None and not notes
    assert options(LadderRequest(str(src), tmp_path, types="Q4_K"), ["Q4_K"], own, notes).min_bpw is None and not notes


def test_a_plan_the_stock_tool_replays_tensor_by_tensor_and_pins_it_honours(made: dict[str, Path], tmp_path: Path) -> None:
    """--tensor-type-file: the source through the tool with the plan's file is mosaic's build, every tensor's type
    and bytes; --pin holds its tensors, or the plan is refused in one line."""
    import subprocess

    mosaic.measure(ladder=made["rungs"], reference=made["src"], method="weights", unit="module-group", out=tmp_path / "m.json")
    size = made["rungs"].joinpath("wide-F16-Q5_0.gguf").stat().st_size
    tt = tmp_path / "types.txt"
    p = mosaic.plan(ladder=made["rungs"], scores=tmp_path / "m.json", max_size=size, out=tmp_path / "plan.yaml",
                    tensor_type_file=tt)
    assert len({c["donor"] for c in p.chosen}) > 1  # a mix, not one rung
    built = next(mosaic.build(p.out, out=tmp_path / "built").out.glob("*.gguf"))
    replay = tmp_path / "replay.gguf"
    subprocess.run([str(made["tool"]), "--allow-requantize", "--tensor-type-file", str(tt), str(made["src"]), str(replay),
                    "Q8_0"], check=True, capture_output=True)
    mine, theirs = _tensors(built), _tensors(replay)
    assert list(mine) == list(theirs)
    for name, t in mine.items():
        assert t.tensor_type == theirs[name].tensor_type, name
        assert np.asarray(t.data).tobytes() == np.asarray(theirs[name].data).tobytes(), name
    named = [t for t in mine.values() if len(t.shape) >= 2]
    assert p.report["tensor_type_file"]["entries"] == len(named) == len(tt.read_text().splitlines())

    # pins: every ffn_down at Q8_0, the rest chosen around them
    held = mosaic.plan(ladder=made["rungs"], scores=tmp_path / "m.json", max_size=size, pins=["FFN_DOWN=q8_0"],
                       out=tmp_path / "pinned.yaml")
    got = _tensors(next(mosaic.build(held.out, out=tmp_path / "pinned").out.glob("*.gguf")))
    downs = [n for n in got if "ffn_down" in n]
    assert downs and all(got[n].tensor_type.name == "Q8_0" for n in downs)
    assert held.report["predicted_size"] <= size

    def refused(*pins: str, max_size: int = size) -> str:
        r = CliRunner().invoke(main, ["plan", "--ladder", str(made["rungs"]), "--scores", str(tmp_path / "m.json"),
                                      "--max-size", str(max_size), *(a for pin in pins for a in ("--pin", pin))])
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        return r.output

    assert "no version of blk.0.attn_k.weight is Q2_K" in refused("attn_k=q2_k") and "mosaic ladder --types ...,Q2_K" in refused("attn_k=q2_k")
    assert "matches no tensor the plan chooses a type for" in refused("attn_norm=q8_0")
    assert "not a ggml type" in refused("attn_k=q9_k") and "expected PATTERN=TYPE" in refused("attn_k")
    small = made["rungs"].joinpath("wide-F16-Q4_0.gguf").stat().st_size
    msg = refused("blk=q8_0", max_size=small)
    assert "no plan is that small" in msg and "with the pins held (blk=q8_0 on" in msg
