"""`mosaic measure --imatrix`: importance matrices read strictly, every weight error weighted by them.

The synthetic matrices are written independently of mosaic's reader (gguf-py's writer for the GGUF format,
`struct` for the legacy `.dat`, in llama-imatrix's layout); the real one is SmolLM2-135M's, made by llama.cpp's
own `llama-imatrix` (`tests/data/README.md`). Every weighted error is checked against NumPy over gguf-py's
`GGUFReader` and `dequantize`, weighted by the values gguf-py reads from the matrix, nothing of mosaic's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mosaic
from mosaic._formats.imatrix import ImatrixError, read_imatrix
from mosaic.cli.commands import main
from mosaic.testing.exl3 import Geometry as Exl3Geometry
from mosaic.testing.gguf import Geometry, imatrix_targets, imatrix_values, write_imatrix, write_llama_gguf
from tests.conftest import needs_runtime
from tests.test_hub import hub  # noqa: F401  (the fake hub fixture)

DATA = Path(__file__).parent / "data"
SMOL_IMATRIX = {"gguf": DATA / "SmolLM2-135M-Instruct.imatrix.gguf", "dat": DATA / "SmolLM2-135M-Instruct.imatrix.dat"}
MOE = Geometry(n_layer=2, n_embd=64, n_ff=64, n_expert=4, n_expert_used=2)
DENSE = Geometry(n_layer=2)


def _ladder(tmp: Path, geo: Geometry, seed: int) -> dict[str, Path]:
    """Four quantizations of one synthetic model and an importance matrix of it, in both formats."""
    paths = {q: write_llama_gguf(tmp / f"{q}.gguf", qtype=q, seed=7, geometry=geo)[0] for q in ("Q4_0", "Q5_0", "Q8_0", "F16")}
    values = imatrix_values(imatrix_targets(geo), seed=seed)
    paths["gguf"] = write_imatrix(tmp / "imatrix.gguf", values)
    paths["dat"] = write_imatrix(tmp / "imatrix.dat", values, fmt="dat")
    return paths


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _ladder(tmp_path_factory.mktemp("imatrix-moe"), MOE, 3)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _ladder(tmp_path_factory.mktemp("imatrix-dense"), DENSE, 4)


def _floats(path: Path, name: str) -> np.ndarray:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    t = next(x for x in GGUFReader(str(path)).tensors if x.name == name)
    return dequantize(t.data, t.tensor_type).astype(np.float64)


def _in_sum2(imatrix: Path, name: str) -> np.ndarray:
    """The matrix's raw Σx² of one weight, read by gguf-py: ``(experts, n_in)``."""
    from gguf import GGUFReader

    t = next(x for x in GGUFReader(str(imatrix)).tensors if x.name == name + ".in_sum2")
    return np.asarray(t.data, dtype=np.float64).reshape(-1, int(t.shape[0]))


def _numpy_eps(model: Path, teacher: Path, imatrix: Path, name: str) -> float:
    """The contract's NumPy reference: ``W`` reshaped ``(E, n_out, n_in)``, ``s`` the sums over their mean."""
    s = _in_sum2(imatrix, name)
    s = s / s.mean()
    w, r = _floats(model, name), _floats(teacher, name)
    e, n_in = s.shape
    w, r = w.reshape(e, -1, n_in), r.reshape(e, -1, n_in)
    return float((s[:, None, :] * (w - r) ** 2).sum() / (s[:, None, :] * r**2).sum())


def _weights(paths: dict[str, Path], out: Path, imatrix: Path | None, **kw: object) -> dict:
    return mosaic.measure(base=paths["Q4_0"], donors={"q5": paths["Q5_0"], "q8": paths["Q8_0"]}, reference=paths["F16"],
                          method="weights", unit="module-group", imatrix=imatrix, out=out, **kw).document


def test_weighted_errors_equal_numpy_for_dense_and_expert_tensors(moe: dict[str, Path], tmp_path: Path) -> None:
    doc = _weights(moe, tmp_path / "m.json", moe["gguf"])
    im = doc["settings"]["imatrix"]
    assert im["format"] == "gguf" and im["datasets"] == ["calibration.txt"] and im["chunk_count"] == 8
    assert "blk.0.ffn_down_exps.weight" in im["weighted"] and "token_embd.weight" not in im["weighted"]
    rows = {(r["layer"], r["group"], r["donor"]): r for r in doc["results"]}
    checked = 0
    for layer in (0, 1):
        for group in ("attn_q", "attn_output", "ffn_up_exps", "ffn_down_exps"):
            name = f"blk.{layer}.{group}.weight"
            for donor, q in (("q5", "Q5_0"), ("q8", "Q8_0")):
                r = rows[(layer, group, donor)]
                assert r["eps"] == pytest.approx(_numpy_eps(moe[q], moe["F16"], moe["gguf"], name), rel=1e-9)
                assert r["eps_base"] == pytest.approx(_numpy_eps(moe["Q4_0"], moe["F16"], moe["gguf"], name), rel=1e-9)
                checked += 1
    assert checked == 16
    # the weighting changes the figures (an expert never routed to weighs nothing), and token_embd keeps its own
    plain = {(r["layer"], r["group"], r["donor"]): r for r in _weights(moe, tmp_path / "p.json", None)["results"]}
    assert "imatrix" not in _weights(moe, tmp_path / "p2.json", None)["settings"]
    assert plain[(0, "ffn_down_exps", "q5")]["eps"] != pytest.approx(rows[(0, "ffn_down_exps", "q5")]["eps"], rel=1e-3)
    assert plain[(None, "token_embd", "q5")]["eps"] == rows[(None, "token_embd", "q5")]["eps"]


def test_dat_and_gguf_agree_on_dense_tensors_and_not_on_experts(moe: dict[str, Path], dense: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """A `.dat` keeps per-token means per row: the same weights as the GGUF's sums for a dense tensor, not for
    experts (their token counts are lost)."""
    for paths, name in ((dense, "d"), (moe, "m")):
        g = {(r["layer"], r["group"], r["donor"]): r["eps"] for r in _weights(paths, tmp_path / f"{name}g.json", paths["gguf"])["results"]}
        d_doc = _weights(paths, tmp_path / f"{name}d.json", paths["dat"])
        assert d_doc["settings"]["imatrix"]["format"] == "dat"
        d = {(r["layer"], r["group"], r["donor"]): r["eps"] for r in d_doc["results"]}
        for key, eps in g.items():
            if key[1] is not None and key[1].endswith("_exps"):
                assert d[key] != pytest.approx(eps, rel=1e-3), key
            else:
                assert d[key] == pytest.approx(eps, rel=1e-6), key


def test_the_real_imatrix_in_both_formats(tmp_path: Path) -> None:
    """SmolLM2-135M's matrix from llama-imatrix (GGUF) and converted by it to `.dat`: the same weights."""
    g, d = read_imatrix(SMOL_IMATRIX["gguf"]), read_imatrix(SMOL_IMATRIX["dat"])
    assert (g.format, d.format) == ("gguf", "dat")
    assert g.datasets == d.datasets == ("tests/data/calibration.txt",)  # relative, as the bench's target runs it
    assert g.chunk_size == 128 and g.chunk_count and g.chunk_count > 200
    assert set(g.entries) == set(d.entries) and len(g.entries) == 30 * 7  # every matrix multiplication, no output
    for name in ("blk.0.attn_k.weight", "blk.29.ffn_down.weight"):
        assert g.weights(name) == pytest.approx(d.weights(name), rel=1e-5)
    from mosaic.testing.gguf import smollm2_gguf

    smol = smollm2_gguf()
    if smol is not None:  # every entry is a tensor of the model it was made from, at its input width
        from mosaic._checkpoint.gguf_model import open_gguf_model

        shapes = {t.name: t.ne for t in open_gguf_model(smol).tensors}
        for m in (g, d):
            checked = m.for_model(shapes)
            assert checked.entries["blk.3.ffn_down.weight"].n_in == 1536


# --------------------------------------------------------------------------------------- refusals


def _one_line(args: list[str]) -> str:
    r = CliRunner().invoke(main, ["measure", *args])
    assert r.exit_code == 2 and r.stderr.startswith("mosaic: error: ") and r.stderr.count("\n") == 1, (args, r.output)
    return r.stderr


def _gguf_with(tmp: Path, name: str, sums: np.ndarray, counts: np.ndarray) -> Path:
    values = imatrix_values(imatrix_targets(DENSE), seed=4)
    values[name] = (sums, counts)
    return write_imatrix(tmp / f"bad-{len(list(tmp.glob('bad-*')))}.gguf", values)


def test_bad_matrices_are_one_line_and_nothing_is_written(dense: dict[str, Path], ckpt_factory, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    common = ["--base", str(dense["Q4_0"]), "--donor", f"q8={dense['Q8_0']}", "--method", "weights", "--out", str(out)]
    good = dense["gguf"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[: len(good) - 100])
    assert "truncated" in _one_line([*common, "--imatrix", str(cut)])
    dat = dense["dat"].read_bytes()
    cut_dat = tmp_path / "cut.dat"
    cut_dat.write_bytes(dat[: len(dat) - 50])
    assert "truncated" in _one_line([*common, "--imatrix", str(cut_dat)])
    assert "a GGUF model (general.architecture llama), not an importance matrix" in _one_line([*common, "--imatrix", str(dense["Q8_0"])])
    text = tmp_path / "notes.txt"
    text.write_text("an importance matrix? no: a text\n")
    assert "not an importance matrix" in _one_line([*common, "--imatrix", str(text)])
    n_in = 64
    ones = np.ones((1, n_in), np.float32)
    for bad, what in ((np.float32("nan"), "NaN"), (np.float32("inf"), "infinite"), (np.float32(-1.0), "negative")):
        sums = ones.copy()
        sums[0, 5] = bad
        assert what in _one_line([*common, "--imatrix", str(_gguf_with(tmp_path, "blk.0.attn_q.weight", sums, np.ones(1, np.float32)))])
    values = imatrix_values(imatrix_targets(DENSE), seed=4)
    values["blk.7.attn_q.weight"] = (ones, np.ones(1, np.float32))  # the model has two layers
    other = write_imatrix(tmp_path / "other.gguf", values)
    assert "'blk.7.attn_q.weight' is not a tensor of the model" in _one_line([*common, "--imatrix", str(other)])
    wide = _gguf_with(tmp_path, "blk.1.ffn_down.weight", np.ones((1, 64), np.float32), np.ones(1, np.float32))
    assert "input width is 128" in _one_line([*common, "--imatrix", str(wide)])
    # a .dat's value count that is not the input width
    values = imatrix_values(imatrix_targets(DENSE), seed=4)
    values["blk.0.attn_k.weight"] = (np.ones((1, 32), np.float32), np.ones(1, np.float32))
    short = write_imatrix(tmp_path / "short.dat", values, fmt="dat")
    assert "holds 32 values" in _one_line([*common, "--imatrix", str(short)])
    assert "no such file" in _one_line([*common, "--imatrix", str(tmp_path / "absent.gguf")])
    assert "full 40-hex commit" in _one_line([*common, "--imatrix", "org/name@main:imatrix.gguf"])
    # with an EXL3 base: one line, before anything is opened
    exl3 = ckpt_factory(Exl3Geometry())
    assert "is an EXL3 checkpoint" in _one_line(["--base", str(exl3), "--donor", f"q={exl3}", "--method", "weights",
                                                 "--imatrix", str(dense["gguf"]), "--out", str(out)])
    assert not out.exists() and not (tmp_path / "m.json.partial").exists()


def test_dat_lengths_are_checked_before_they_are_trusted(tmp_path: Path) -> None:
    def dat(*parts: bytes) -> Path:
        p = tmp_path / f"x{len(list(tmp_path.iterdir()))}.dat"
        p.write_bytes(b"".join(parts))
        return p

    i32 = lambda v: struct.pack("<i", v)  # noqa: E731
    f32 = np.ones(4, "<f4").tobytes()
    name = b"blk.0.attn_q.weight"
    with pytest.raises(ImatrixError, match="not a possible entry count"):
        read_imatrix(dat(i32(1 << 30), b"\0" * 64))
    with pytest.raises(ImatrixError, match="name of 100000"):
        read_imatrix(dat(i32(1), i32(100000), name))
    with pytest.raises(ImatrixError, match="claims 1000000 values"):
        read_imatrix(dat(i32(1), i32(len(name)), name, i32(1), i32(1_000_000), f32))
    with pytest.raises(ImatrixError, match="appears twice"):
        entry = i32(len(name)) + name + i32(1) + i32(4) + f32
        read_imatrix(dat(i32(2), entry, entry))
    with pytest.raises(ImatrixError, match="bytes after the dataset name"):
        read_imatrix(dat(i32(1), i32(len(name)), name, i32(1), i32(4), f32, i32(3), i32(1), b"x", b"junk"))
    ok = read_imatrix(dat(i32(1), i32(len(name)), name, i32(1), i32(4), f32, i32(3), i32(5), b"a.txt"))
    assert ok.format == "dat" and ok.chunk_count == 3 and ok.datasets == ("a.txt",)
    bare = read_imatrix(dat(i32(1), i32(len(name)), name, i32(1), i32(4), f32))  # the trailer is optional
    assert bare.chunk_count is None and bare.datasets == ()


def test_the_imatrix_is_part_of_a_measurement_s_identity(dense: dict[str, Path], tmp_path: Path) -> None:
    """`--resume` and `--merge` refuse a different importance matrix, naming it; the weighted sums are cached
    under the matrix's digest (another matrix is another entry)."""
    values = imatrix_values(imatrix_targets(DENSE), seed=99)
    other = write_imatrix(tmp_path / "other.gguf", values)
    a = _weights(dense, tmp_path / "a.json", dense["gguf"])
    b = _weights(dense, tmp_path / "b.json", other)
    assert a["settings"]["imatrix"]["sha256"] != b["settings"]["imatrix"]["sha256"]
    assert [r["eps"] for r in a["results"]] != [r["eps"] for r in b["results"]]
    again = _weights(dense, tmp_path / "c.json", dense["gguf"])  # from the cache: the same figures
    assert [r["eps"] for r in again["results"]] == [r["eps"] for r in a["results"]]
    # a journal started with one matrix, resumed with another
    from mosaic._measure.journal import Journal, journal_path

    out = tmp_path / "r.json"
    fp = {"settings": {"imatrix": a["settings"]["imatrix"]}}
    Journal.start(journal_path(out), fp).close()
    with pytest.raises(mosaic.MosaicError, match=r"another importance matrix .*" + b["settings"]["imatrix"]["sha256"][:12]):
        Journal.resume(journal_path(out), {"settings": {"imatrix": b["settings"]["imatrix"]}})


def test_merge_refuses_shards_weighted_by_another_matrix(dense: dict[str, Path], tmp_path: Path) -> None:
    needs_runtime()
    rows = tmp_path / "rows.txt"
    rows.write_text("the model of a mosaic\nbytes and the bytes of a model\n")
    other = write_imatrix(tmp_path / "other.gguf", imatrix_values(imatrix_targets(DENSE), seed=98))
    parts = []
    for k, im in ((1, dense["gguf"]), (2, other)):
        parts.append(tmp_path / f"part{k}.json")
        mosaic.measure(base=dense["Q4_0"], donors={"q8": dense["Q8_0"]}, reference=dense["F16"], text=rows, ctx=16,
                       unit="module-group", only_layers="0", shard=f"{k}/2", imatrix=im, out=parts[-1])
    r = CliRunner().invoke(main, ["measure", "--merge", *map(str, parts), "--out", str(tmp_path / "m.json")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert "another importance matrix" in r.stderr and str(parts[1]) in r.stderr
    assert not (tmp_path / "m.json").exists()


# ------------------------------------------------------------------------- the real model, the IQ ladder


@pytest.fixture(scope="module")
def iq(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SmolLM2-135M requantized by llama.cpp's own quantizer: a Q2_K base and IQ donors."""
    from tests.conftest import smollm2_quants

    teacher, q = smollm2_quants(["Q2_K", "IQ3_S", "IQ4_XS"])
    return {"teacher": teacher, **q, "dir": tmp_path_factory.mktemp("iq")}


def test_iq_donors_are_measured_planned_built_and_loaded(iq: dict[str, Path]) -> None:
    """The ladder people have: IQ types in the census, weighted by the real importance matrix exactly as NumPy
    over gguf-py weights them, in a plan, a build its audit passes, and llama.cpp running the result."""
    census = mosaic.census(iq["IQ4_XS"]).as_dict()
    assert "IQ4_XS" in json.dumps(census) and "IQ4_NL" in json.dumps(census)
    d = iq["dir"]
    doc = mosaic.measure(base=iq["Q2_K"], donors={"iq3s": iq["IQ3_S"], "iq4xs": iq["IQ4_XS"]}, reference=iq["teacher"],
                         method="weights", unit="module-group", only_layers="3", imatrix=SMOL_IMATRIX["gguf"],
                         out=d / "w.json").document
    weighted = doc["settings"]["imatrix"]["weighted"]  # every weight the matrix holds (the top holds every layer)
    assert len(weighted) == 210 and "blk.3.ffn_down.weight" in weighted and "token_embd.weight" not in weighted
    rows = {(r["group"], r["donor"]): r for r in doc["results"]}
    for group in ("ffn_down", "attn_v"):
        name = f"blk.3.{group}.weight"
        for donor, q in (("iq3s", "IQ3_S"), ("iq4xs", "IQ4_XS")):
            assert rows[(group, donor)]["eps"] == pytest.approx(_numpy_eps(iq[q], iq["teacher"], SMOL_IMATRIX["gguf"], name), rel=1e-9)
        assert rows[(group, "iq4xs")]["eps_base"] == pytest.approx(
            _numpy_eps(iq["Q2_K"], iq["teacher"], SMOL_IMATRIX["gguf"], name), rel=1e-9)
    size = iq["Q2_K"].stat().st_size + 400_000
    plan = mosaic.plan(base=iq["Q2_K"], donors={"iq3s": iq["IQ3_S"], "iq4xs": iq["IQ4_XS"]}, scores=d / "w.json",
                       max_size=size, out=d / "planned.yaml")
    assert plan.report["chosen"] and plan.report["predicted_size"] <= size
    built = mosaic.build(d / "planned.yaml", out=d / "built")
    assert mosaic.audit(built.out).ok
    assert sum(f.stat().st_size for f in built.out.glob("*.gguf")) == plan.report["predicted_size"]
    from mosaic._checkpoint.gguf_model import open_gguf_model

    types = {t.name: t.type_name for t in open_gguf_model(built.out).tensors}
    assert any(types[f"blk.3.{c['group']}.weight"].startswith("IQ") for c in plan.report["chosen"])
    rows_txt = d / "rows.txt"
    rows_txt.write_text("The river begins as a thin stream high in the mountains.\n")
    ev = mosaic.evaluate([iq["Q2_K"], built.out], reference=iq["teacher"], text=rows_txt, ctx=32)
    base_kl, mosaic_kl = (c["kl"]["mean"] for c in ev.candidates)
    assert 0 < mosaic_kl < base_kl


# ------------------------------------------------------------------------------------- from the hub


def test_a_pinned_hub_imatrix_is_fetched_verified_and_weighs_as_the_local_one(dense: dict[str, Path], hub,  # noqa: F811
                                                                              tmp_path: Path) -> None:
    """``--imatrix ORG/NAME@COMMIT:FILE``: downloaded into the cache when not there, checked against the hub's
    digest (a file that differs is refused and removed), then the same figures as the local file."""
    from mosaic._base.errors import VerificationError

    local = _weights(dense, tmp_path / "local.json", dense["gguf"])
    rev = hub.commit("test-org/tiny-imatrix", {"imatrix.gguf": dense["gguf"].read_bytes(), "README.md": b"# an imatrix\n"})
    got = _weights(dense, tmp_path / "hub.json", f"test-org/tiny-imatrix@{rev}:imatrix.gguf")
    assert got["settings"]["imatrix"] == local["settings"]["imatrix"]
    assert [r["eps"] for r in got["results"]] == [r["eps"] for r in local["results"]]
    assert "imatrix.gguf" in {p.name for p in (hub.home / "hub").rglob("imatrix.gguf")}  # type: ignore[attr-defined]
    with pytest.raises(mosaic.MosaicError, match="no file"):
        _weights(dense, tmp_path / "x.json", f"test-org/tiny-imatrix@{rev}:absent.gguf")
    # the hub claims another digest: refused (exit 1), nothing written, the download removed
    rev2 = hub.commit("test-org/other-imatrix", {"imatrix.gguf": dense["gguf"].read_bytes()})
    hub.tamper[("test-org/other-imatrix", "imatrix.gguf")] = "0" * 64
    with pytest.raises(VerificationError, match="differ from the hub's digests"):
        _weights(dense, tmp_path / "y.json", f"test-org/other-imatrix@{rev2}:imatrix.gguf")
    assert not (tmp_path / "y.json").exists()
