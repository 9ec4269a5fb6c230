"""The runtime on the hardware people measure with: GPU offload, which binding, a worker that outlives threads.

No GPU runs here (nor in CI): a stand-in binding, loaded where llama-cpp-python would be, records the offload it
is asked for and says what a GPU build's load log says; the real bindings run on the CPU, where ``all`` must
give the same numbers as 0 and one note.
"""

from __future__ import annotations

import json
import threading
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

import mosaic
from mosaic._eval import runtime as rt_mod
from mosaic._eval.runtime import ALL_LAYERS, LlamaCppPythonRuntime, parse_gpu_layers
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, write_llama_gguf
from tests.conftest import needs_runtime

GEO = Geometry(n_layer=3)
ROWS = "the model of a mosaic\nbytes and the bytes of a model\n"


def _stand_in(supports: bool, n_layer: int = 3) -> types.ModuleType:
    """What mosaic calls of llama-cpp-python's C API, recording each load's ``n_gpu_layers`` and logging
    what llama.cpp logs for it (``offloaded N/M layers to GPU`` on a build that can offload)."""
    lc = types.ModuleType("llama_cpp")
    lc.asked = []  # type: ignore[attr-defined]
    lc.repack = []  # type: ignore[attr-defined]
    lc.sink = None  # type: ignore[attr-defined]
    lc.system_info = b"CPU : SSE3 = 1 | AVX2 = 1 | REPACK = 1 | "  # type: ignore[attr-defined]

    def log_set(cb: object, user: object) -> None:
        lc.sink = cb  # type: ignore[attr-defined]

    def load(path: bytes, mp: types.SimpleNamespace) -> object:
        lc.asked.append(mp.n_gpu_layers)  # type: ignore[attr-defined]
        lc.repack.append(mp.use_extra_bufts)  # type: ignore[attr-defined]
        if supports:
            n = min(mp.n_gpu_layers, n_layer + 1)
            lc.sink(2, f"load_tensors: offloaded {n}/{n_layer + 1} layers to GPU\n".encode(), None)  # type: ignore[attr-defined]
        return object()

    ns = {
        "llama_log_callback": lambda f: f, "llama_log_set": log_set, "llama_backend_init": lambda: None,
        "llama_supports_gpu_offload": lambda: supports,
        "llama_model_default_params": lambda: types.SimpleNamespace(n_gpu_layers=-1, use_extra_bufts=True),
        "llama_print_system_info": lambda: lc.system_info,  # type: ignore[attr-defined]
        "llama_model_load_from_file": load, "llama_model_get_vocab": lambda m: object(),
        "llama_vocab_n_tokens": lambda v: 8,
        "llama_context_default_params": lambda: types.SimpleNamespace(),
        "llama_init_from_model": lambda m, cp: object(), "llama_batch_init": lambda n, e, s: object(),
        "llama_batch_free": lambda b: None, "llama_free": lambda c: None, "llama_model_free": lambda m: None,
    }
    for k, v in ns.items():
        setattr(lc, k, v)
    return lc


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    def make(supports: bool, devices: list[tuple[str, str, int]]) -> types.ModuleType:
        lc = _stand_in(supports)
        monkeypatch.setitem(__import__("sys").modules, "llama_cpp", lc)
        monkeypatch.setattr(rt_mod, "_ggml_devices", lambda: devices)
        return lc

    return make


GPU = [("CPU", "Some CPU", 0), ("CUDA0", "NVIDIA H200", 1)]


def test_a_stand_in_binding_is_asked_for_the_offload_given(stand_in) -> None:
    lc = stand_in(True, GPU)
    for asked, want, offloaded in ((None, ALL_LAYERS, 4), ("all", ALL_LAYERS, 4), (2, 2, 2), (0, 0, 0), (99, 99, 4)):
        r = LlamaCppPythonRuntime(2, False, asked)
        m = r.load(Path("x.gguf"), ctx=16, batch=16)
        assert lc.asked[-1] == want
        info = r.info
        assert info.gpu_layers == ("all" if asked is None else asked) and info.note is None
        assert m.offloaded == offloaded  # type: ignore[attr-defined]  # from the load log
        assert info.device == ("CPU (Some CPU)" if asked == 0 else "CUDA0 (NVIDIA H200)")
        m.close()


def test_without_a_gpu_all_runs_on_the_cpu_with_one_note(stand_in) -> None:
    lc = stand_in(False, [("CPU", "Some CPU", 0)])
    r = LlamaCppPythonRuntime(2, False, None)  # the default where nothing can be offloaded: 0, no note
    r.load(Path("x.gguf"), ctx=16, batch=16)
    assert lc.asked[-1] == 0 and r.info.gpu_layers == 0 and r.info.note is None and r.info.device == "CPU (Some CPU)"
    for asked in ("all", 5):
        r = LlamaCppPythonRuntime(2, False, asked)
        m = r.load(Path("x.gguf"), ctx=16, batch=16)
        assert lc.asked[-1] == 0 and m.offloaded == 0  # type: ignore[attr-defined]
        assert r.info.gpu_layers == asked and "no GPU" in (r.info.note or "") and r.info.device == "CPU (Some CPU)"
    # a build that says it can offload but lists no GPU device: the same
    stand_in(True, [("CPU", "Some CPU", 0)])
    assert "no GPU" in (LlamaCppPythonRuntime(2, False, "all").info.note or "")


def test_a_build_with_amx_loads_without_the_weight_repack_and_says_so(stand_in) -> None:
    """A llama.cpp built natively on a CPU with AMX was seen to crash in ggml_backend_amx_mul_mat on Q4_K models
    unless the weight repack is off (llama-perplexity's --no-repack): mosaic's runtime turns it off there."""
    lc = stand_in(False, [("CPU", "Some CPU", 0)])
    r = LlamaCppPythonRuntime(2, False, None)
    r.load(Path("x.gguf"), ctx=16, batch=16)
    assert lc.repack[-1] is True and r.info.note is None  # a generic build: repack as llama.cpp chooses
    lc.system_info = b"CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 | "
    r = LlamaCppPythonRuntime(2, False, None)
    r.load(Path("x.gguf"), ctx=16, batch=16)
    assert lc.repack[-1] is False and r.info.note == rt_mod.AMX_NOTE
    r = LlamaCppPythonRuntime(2, False, "all")  # both notes, one line
    assert r.info.note is not None and "no GPU" in r.info.note and r.info.note.endswith("; " + rt_mod.AMX_NOTE)


def test_gpu_layers_parsing_and_refusals_are_one_line(tmp_path: Path) -> None:
    assert parse_gpu_layers(None) is None and parse_gpu_layers("all") == "all" and parse_gpu_layers("ALL") == "all"
    assert parse_gpu_layers("0") == 0 and parse_gpu_layers(12) == 12
    model = write_llama_gguf(tmp_path / "m.gguf", qtype="Q8_0", geometry=GEO)[0]
    (tmp_path / "rows.txt").write_text(ROWS)
    for bad in ("-1", "1.5", "most", ""):
        for cmd in (["eval", str(model), "--reference", str(model), "--text", str(tmp_path / "rows.txt")],
                    ["measure", "--base", str(model), "--donor", f"d={model}", "--reference", str(model), "--text",
                     str(tmp_path / "rows.txt"), "--out", str(tmp_path / "m.json")]):
            r = CliRunner().invoke(main, [*cmd, "--gpu-layers", bad])
            assert r.exit_code == 2 and r.stderr.startswith("mosaic: error: --gpu-layers") and r.stderr.count("\n") == 1, r.output
    assert not (tmp_path / "m.json").exists()


def test_the_binding_preferred_is_a_llama_cpp_python_with_memory_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    for has, want_first in ((True, "llama-cpp-python"), (False, None)):
        pkg = tmp_path / ("new" if has else "old") / "llama_cpp"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "llama_cpp.py").write_text("def llama_decode(): ...\n" + ("def llama_memory_clear(mem, data): ...\n" if has else ""))
        monkeypatch.syspath_prepend(str(pkg.parent))
        importlib.invalidate_caches()
        monkeypatch.delitem(__import__("sys").modules, "llama_cpp", raising=False)
        found = rt_mod.available()
        if want_first:
            assert found[0] == want_first
        else:
            assert "llama-cpp-python" not in found
            monkeypatch.setenv("MOSAIC_RUNTIME", "llama-cpp-python")
            with pytest.raises(mosaic.MosaicError, match="too old"):
                rt_mod.in_process_runtime(threads=1, gpu_layers=0)
            monkeypatch.delenv("MOSAIC_RUNTIME")
        monkeypatch.undo()


# ------------------------------------------------------------------------------------ with the runtime


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    needs_runtime()
    d = tmp_path_factory.mktemp("offload")
    paths = {q: write_llama_gguf(d / f"{q}.gguf", qtype=q, seed=3, geometry=GEO)[0] for q in ("Q4_0", "Q8_0")}
    (d / "rows.txt").write_text(ROWS)
    paths["rows"] = d / "rows.txt"
    return paths


def test_cpu_only_all_gives_one_note_and_the_numbers_of_zero(models: dict[str, Path]) -> None:
    runs = {gl: mosaic.evaluate([models["Q4_0"]], reference=models["Q8_0"], text=models["rows"], ctx=16, gpu_layers=gl).as_dict()
            for gl in (0, "all")}
    assert runs[0]["candidates"] == runs["all"]["candidates"]
    rt0, rta = runs[0]["runtime"], runs["all"]["runtime"]
    assert rt0["gpu_layers"] == 0 and rta["gpu_layers"] == "all" and rt0["offloaded"] == rta["offloaded"] == 0
    assert rt0["device"] == rta["device"] and rt0["device"].startswith("CPU")
    assert runs[0]["notes"] == [] and len(runs["all"]["notes"]) == 1 and "no GPU" in runs["all"]["notes"][0]


def test_a_reference_saved_on_another_device_is_used_with_a_note(models: dict[str, Path], tmp_path: Path) -> None:
    saved = tmp_path / "teacher.npz"
    mosaic.evaluate([], reference=models["Q8_0"], text=models["rows"], ctx=16, save_reference=saved)
    import numpy as np

    with np.load(saved) as z:
        data = dict(z)
    meta = json.loads(bytes(data["meta"]).decode())
    meta["runtime"]["device"] = "CUDA0 (NVIDIA H200)"
    meta["runtime"]["gpu_layers"], meta["runtime"]["offloaded"] = "all", 4
    data["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    moved = tmp_path / "teacher-gpu.npz"
    np.savez(moved, **data)
    ev = mosaic.evaluate([models["Q4_0"]], reference=moved, text=models["rows"]).as_dict()
    assert any("saved on CUDA0 (NVIDIA H200)" in n and "ran on CPU" in n for n in ev["notes"]), ev["notes"]


def test_a_worker_started_from_a_thread_that_ends_keeps_serving(models: dict[str, Path]) -> None:
    from mosaic._eval.worker import get_runtime

    rt = get_runtime(threads=1, gpu_layers=0)
    rt.close()  # the next call starts the worker: from the thread below
    held: dict[str, object] = {}

    def start() -> None:
        held["model"] = rt.load(models["Q8_0"], ctx=16, batch=16)

    t = threading.Thread(target=start)
    t.start()
    t.join()
    assert not t.is_alive()
    m = held["model"]
    pid = rt.worker._proc.pid  # type: ignore[union-attr]
    import time

    time.sleep(0.5)  # a parent-death signal of the ended thread would have arrived by now
    assert rt.worker.alive() and rt.worker._proc.pid == pid  # type: ignore[union-attr]
    assert m.tokenize("the model of a mosaic")  # type: ignore[attr-defined]  # the model loaded in the thread serves
    m.close()  # type: ignore[attr-defined]


def test_merge_takes_parts_measured_on_other_devices_and_resume_refuses_another(models: dict[str, Path], tmp_path: Path) -> None:
    parts = []
    for k in (1, 2):
        parts.append(tmp_path / f"part{k}.json")
        mosaic.measure(base=models["Q4_0"], donors={"q8": models["Q8_0"]}, reference=models["Q8_0"], text=models["rows"],
                       ctx=16, unit="layer", shard=f"{k}/2", gpu_layers=0, out=parts[-1])
    doc = json.loads(parts[1].read_text())
    doc["runtime"].update({"device": "CUDA0 (NVIDIA H200)", "gpu_layers": "all", "offloaded": 4, "threads": 16})
    parts[1].write_text(json.dumps(doc))
    merged = mosaic.measure(merge=parts, out=tmp_path / "m.json").document
    assert len(merged["measured"]) == 3 and merged["runtime"]["device"].startswith("CPU")
    doc["runtime"]["version"] = "0.0.1"  # another runtime is another measurement
    parts[1].write_text(json.dumps(doc))
    with pytest.raises(mosaic.MosaicError, match=r"runtime\.version differs"):
        mosaic.measure(merge=parts, out=tmp_path / "m2.json")
    # the journal of a measurement made with one offload is not resumed with another
    from mosaic._measure.journal import Journal, journal_path

    fp = {"runtime": {"name": "cyllama", "gpu_layers": 0, "device": "CPU (x)"}}
    Journal.start(journal_path(tmp_path / "r.json"), fp).close()
    with pytest.raises(mosaic.MosaicError, match=r"runtime\.gpu_layers changed"):
        Journal.resume(journal_path(tmp_path / "r.json"), {"runtime": {**fp["runtime"], "gpu_layers": "all"}})
