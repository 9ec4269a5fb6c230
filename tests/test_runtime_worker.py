"""llama.cpp in a process of its own, and the panel in float32.

- A GGUF that mosaic's strict reader accepts but llama.cpp aborts on (an ``expert_used_count`` above the
  ``expert_count``: llama.cpp's ``GGML_ASSERT`` while loading), a worker killed mid-run (``SIGKILL``, as the
  kernel's out-of-memory killer does) and Ctrl-C: one line each, the right exit status, nothing left running,
  no core file, a measurement's journal intact and ``--resume`` finishing it.
- The API from a script without a ``__main__`` guard; one worker for every model of a command.
- The panel (float32 elementwise, float64 sums) against today's float64 panel on SmolLM2's own logits: every
  figure within 1e-6, top-1 and the saved top-k token ids identical, ties included.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from mosaic._base.errors import MosaicError
from mosaic._eval import panel
from mosaic._eval.backends import check_gguf
from mosaic._eval.run import EvalRequest, evaluate
from mosaic._eval.runtime import RuntimeFailure
from mosaic._eval.wire import MAX_HEADER, WireError, recv, send
from mosaic.testing.gguf import Geometry, write_llama_gguf
from tests.conftest import needs_runtime, run_cli, smollm2_quants

GEO = Geometry(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=64, n_expert=4, n_expert_used=2, context=128)
ROWS = ["the mosaic model is a byte of the model", "a model of bytes and a mosaic of models is the model",
        "to the mosaic and in the byte is a model of the", "the the a of and to in is mosaic model byte s e t"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    needs_runtime()
    d = tmp_path_factory.mktemp("worker-models")
    good = write_llama_gguf(d / "teacher-q8.gguf", qtype="Q8_0", seed=11, geometry=GEO)[0]
    cand = write_llama_gguf(d / "cand-q4.gguf", qtype="Q4_0", seed=11, geometry=GEO)[0]
    bad_geo = dataclasses.replace(GEO, n_expert_used=8)
    bad = write_llama_gguf(d / "aborts.gguf", qtype="Q8_0", seed=11, geometry=bad_geo)[0]
    text = d / "rows.txt"
    text.write_text("\n".join(ROWS * 3) + "\n")
    return {"teacher": good, "cand": cand, "bad": bad, "text": text, "dir": d}


def _workers_marked(mark: str) -> list[int]:
    """Live worker processes started with ``MOSAIC_TEST_MARK=mark`` in their environment."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if b"mosaic._eval.worker_main" in cmd and f"MOSAIC_TEST_MARK={mark}".encode() in env.split(b"\0") and state != "Z":
            found.append(int(pid))
    return found


def _one_line(r: subprocess.CompletedProcess, code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mosaic: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    return lines[0]


# ----------------------------------------------------------------------------------- containment


def test_a_gguf_the_strict_reader_accepts_but_llama_cpp_aborts_on_is_one_line(models: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    assert check_gguf(models["bad"]).n_vocab  # mosaic's reader has nothing against it: llama.cpp asserts
    r = run_cli(["eval", str(models["bad"]), "--reference", str(models["teacher"]), "--text", str(models["text"]),
                 "--ctx", "16", "--json"], cwd=tmp_path)
    line = _one_line(r, 2)
    assert line.startswith(f"mosaic: error: llama.cpp aborted while loading {models['bad']}: "), line
    # llama.cpp's own words, which its versions put differently (the prebuilt wheel's, and the compiled binding's)
    assert re.search(r"GGML_ASSERT\(\w*(hparams\.)?n_expert_used\w* <= hparams\.n_expert\) failed", line), line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("core")]  # no core file
    # with --verbose, llama.cpp's own lines are shown (on stderr) and the error line still ends it
    r = run_cli(["eval", str(models["bad"]), "--reference", str(models["teacher"]), "--text", str(models["text"]),
                 "--ctx", "16", "--verbose"], cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert "GGML_ASSERT" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("mosaic: error: llama.cpp aborted")


def test_after_an_abort_the_same_process_runs_the_next_model(models: dict[str, Path]) -> None:
    req = EvalRequest([str(models["bad"])], str(models["teacher"]), models["text"], ctx=16)
    with pytest.raises(RuntimeFailure, match=r"^llama\.cpp aborted while loading .*aborts\.gguf: .*GGML_ASSERT"):
        evaluate(req)
    doc = evaluate(EvalRequest([str(models["cand"])], str(models["teacher"]), models["text"], ctx=16))
    assert doc["candidates"][0]["positions"] > 0 and doc["candidates"][0]["kl"]["mean"] > 0


def test_a_worker_killed_mid_run_is_one_line(models: dict[str, Path]) -> None:
    r = run_cli(["eval", str(models["cand"]), "--reference", str(models["teacher"]), "--text", str(models["text"]),
                 "--ctx", "16"], fault="llama-decode:5:kill")
    line = _one_line(r, 2)
    assert line.startswith("mosaic: error: llama.cpp was killed by signal 9 while decoding "), line
    assert line.endswith("(out of memory?)") and ("teacher-q8.gguf" in line or "cand-q4.gguf" in line)


def test_ctrl_c_exits_130_and_leaves_no_worker(models: dict[str, Path]) -> None:
    mark = uuid.uuid4().hex
    env = {**os.environ, "MOSAIC_TEST_MARK": mark, "MOSAIC_FAULT": "panel-batch:3:int"}
    import signal

    r = subprocess.run([sys.executable, "-m", "mosaic.cli", "eval", str(models["cand"]), "--reference",
                        str(models["teacher"]), "--text", str(models["text"]), "--ctx", "16"],
                       capture_output=True, text=True, env=env, timeout=300,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130 and r.stderr.strip().splitlines()[-1] == "mosaic: interrupted", r.stderr
    assert _workers_marked(mark) == []


_SCRIPT = """
import sys, mosaic
ev = mosaic.evaluate([sys.argv[1], sys.argv[1]], reference=sys.argv[2], text=sys.argv[3], ctx=16)
print(ev.candidates[0]["positions"], ev.candidates[0]["kl"]["mean"] == ev.candidates[1]["kl"]["mean"])
"""


def test_the_api_from_a_script_without_a_main_guard(models: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "release.py"
    script.write_text(_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(models["cand"]), str(models["teacher"]), str(models["text"])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n, same = r.stdout.split()
    assert int(n) > 0 and same == "True" and r.stderr == ""


def test_one_worker_holds_every_model_of_a_command(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Teacher and candidates load in one process, so decoding never uses more threads than --threads."""
    from mosaic._eval import worker as worker_mod

    worker_mod.close_all()  # a worker started by another test has no mark
    mark = uuid.uuid4().hex
    monkeypatch.setenv("MOSAIC_TEST_MARK", mark)
    seen: list[list[int]] = []
    real = worker_mod.score_in_worker

    def spy(*a: object, **kw: object) -> object:
        seen.append(_workers_marked(mark))
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(worker_mod, "score_in_worker", spy)
    import mosaic._eval.run as run_mod

    monkeypatch.setattr(run_mod, "score_in_worker", spy)
    doc = evaluate(EvalRequest([str(models["cand"]), str(models["teacher"])], str(models["teacher"]), models["text"],
                               ctx=16, threads=2))
    assert len(seen) == 1 and len(seen[0]) == 1, seen
    assert doc["runtime"]["threads"] == 2
    worker_mod.close_all()
    assert _workers_marked(mark) == []


# ----------------------------------------------------------------------------------- preload


def _logits(m: object, tokens: list[int]) -> np.ndarray:
    m.clear()  # type: ignore[attr-defined]
    return np.array(m.decode(tokens, 0))  # type: ignore[attr-defined]


def test_a_preloaded_model_is_the_model_a_load_gives_and_only_its_own_path_claims_it(models: dict[str, Path]) -> None:
    from mosaic._eval.worker import get_runtime

    rt = get_runtime(threads=2)
    teacher = rt.load(models["teacher"], ctx=32, batch=32)
    tokens = teacher.tokenize(ROWS[0])[:16]
    try:
        plain = rt.load(models["cand"], ctx=32, batch=32)
        want = _logits(plain, tokens)
        plain.close()
        ticket = rt.preload(models["cand"], ctx=32, batch=32, name="next")
        assert rt.worker.preloading == "next"
        first = _logits(teacher, tokens)  # the teacher decodes while the candidate loads
        got = rt.load(models["cand"], ctx=32, batch=32, ticket=ticket)
        assert rt.worker.preloading == ""
        np.testing.assert_array_equal(_logits(got, tokens), want)
        np.testing.assert_array_equal(_logits(teacher, tokens), first)
        got.close()
        # a ticket claims only its own path: another is loaded as usual and the preload is closed
        ticket = rt.preload(models["cand"], ctx=32, batch=32)
        other = rt.load(models["teacher"], ctx=32, batch=32, ticket=ticket)
        np.testing.assert_array_equal(_logits(other, tokens), first)
        other.close()
        again = rt.load(models["cand"], ctx=32, batch=32, ticket=ticket)  # spent: a load of its own
        np.testing.assert_array_equal(_logits(again, tokens), want)
        again.close()
        rt.preload(models["cand"], ctx=32, batch=32)
        rt.forget()
        assert rt.worker.preloading == ""
    finally:
        teacher.close()


def test_a_preload_that_llama_cpp_aborts_on_names_it(models: dict[str, Path]) -> None:
    """Whether the worker dies during a request or between two, the line names the model it was loading ahead."""
    from mosaic._eval.worker import get_runtime

    rt = get_runtime(threads=2)
    teacher = rt.load(models["teacher"], ctx=32, batch=32)
    rt.preload(models["bad"], ctx=32, batch=32, name="the next candidate")
    with pytest.raises(RuntimeFailure, match=r"^llama\.cpp aborted while .*loading the next candidate.*GGML_ASSERT"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            teacher.tokenize(ROWS[0])
            time.sleep(0.01)
    doc = evaluate(EvalRequest([str(models["cand"])], str(models["teacher"]), models["text"], ctx=16))
    assert doc["candidates"][0]["positions"] > 0  # the next command's worker is a new one


# ----------------------------------------------------------------------------------- measure


def test_a_measurement_whose_worker_is_killed_keeps_its_journal_and_resumes(tmp_path: Path) -> None:
    teacher, q = smollm2_quants(["Q2_K", "Q8_0"])
    text = tmp_path / "rows.txt"
    paragraphs = (Path(__file__).parent / "data" / "paragraphs.txt").read_text().splitlines()
    text.write_text("\n".join(p[:160] for p in paragraphs[:2]) + "\n")
    out = tmp_path / "m.json"
    args = ["measure", "--base", str(q["Q2_K"]), "--donor", f"q8={q['Q8_0']}", "--reference", str(teacher),
            "--text", str(text), "--unit", "module-group", "--only-layers", "0", "--ctx", "64", "--top-k", "8",
            "--method", "swaps", "--out", str(out)]
    # one decode per row and model, in order: the teacher's two, the base's two, the first candidate's two; the
    # 7th is the second candidate's first, while the third is loaded beside it. (A kill at a load would race the
    # decode beside it: which request sees the worker die is the scheduler's choice.)
    r = run_cli(args, fault="llama-decode:7:kill", timeout=600)
    line = _one_line(r, 2)
    assert re.fullmatch(r"mosaic: error: llama\.cpp was killed by signal 9 while decoding layer 0 \w+ from q8 "
                        r"\(and loading layer 0 \w+ from q8 beside it\) \(out of memory\?\)", line), line
    journal = tmp_path / "m.json.partial"
    assert not out.exists() and journal.is_file()
    kinds = [json.loads(x)["kind"] for x in journal.read_text().splitlines()[1:]]
    assert kinds == ["teacher", "base", "result"], kinds
    r = run_cli([*args, "--resume", "--json"], timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert not journal.exists() and json.loads(out.read_text()) == doc
    groups = [x["group"] for x in doc["results"]]
    assert len(groups) == len(set(groups)) >= 3  # the killed candidate ran again, once


def test_a_worker_killed_while_loading_ahead_names_the_candidate_however_the_kill_is_seen(tmp_path: Path) -> None:
    """The 6th load is the third candidate's, beside the second's decode: the kill is seen by the preload's own
    request, between two requests, or by the decode, as the scheduler has it; each line names the candidate."""
    teacher, q = smollm2_quants(["Q2_K", "Q8_0"])
    text = tmp_path / "rows.txt"
    paragraphs = (Path(__file__).parent / "data" / "paragraphs.txt").read_text().splitlines()
    text.write_text("\n".join(p[:160] for p in paragraphs[:2]) + "\n")
    out = tmp_path / "m.json"
    r = run_cli(["measure", "--base", str(q["Q2_K"]), "--donor", f"q8={q['Q8_0']}", "--reference", str(teacher),
                 "--text", str(text), "--unit", "module-group", "--only-layers", "0", "--ctx", "64", "--top-k", "8",
                 "--method", "swaps", "--out", str(out)], fault="llama-load:6:kill", timeout=600)
    line = _one_line(r, 2)
    assert re.fullmatch(r"mosaic: error: llama\.cpp was killed by signal 9 while (loading layer 0 \w+ from q8 ahead|"
                        r"decoding layer 0 \w+ from q8 \(and loading layer 0 \w+ from q8 beside it\)) "
                        r"\(out of memory\?\)", line), line
    assert not out.exists() and (tmp_path / "m.json.partial").is_file()


# ----------------------------------------------------------------------------------- the panel


def _f64_panel(t_logits: np.ndarray, c_logits: np.ndarray, nxt: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """The panel as it was computed in float64 throughout (the reference the float32 panel must equal)."""
    def lsm(x: np.ndarray) -> np.ndarray:
        x = np.array(x, dtype=np.float64)
        x -= x.max(axis=-1, keepdims=True)
        x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
        return x

    t, c = lsm(t_logits), lsm(c_logits)
    part = np.argpartition(-t, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(t, part, axis=-1)
    ids = np.take_along_axis(part, np.lexsort((part, -vals), axis=-1), axis=-1)
    top_lp = np.take_along_axis(t, ids, axis=-1).astype(np.float32)
    q_top = np.take_along_axis(c, ids, axis=-1)
    p_top = np.exp(top_lp.astype(np.float64))
    r = np.clip(1.0 - p_top.sum(-1), 0.0, 1.0)
    q_r = np.clip(1.0 - np.exp(q_top).sum(-1), 1e-300, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(r > 0, r * (np.log(np.maximum(r, 1e-300)) - np.log(q_r)), 0.0)
    return {"kl": np.maximum((np.exp(t) * (t - c)).sum(-1), 0.0), "ids": ids.astype(np.int32), "top_lp": top_lp,
            "agree": (c.argmax(-1) == ids[:, 0]).astype(np.float64), "nll": -c[np.arange(len(nxt)), nxt],
            "lower": np.maximum((p_top * (top_lp - q_top)).sum(-1) + tail, 0.0)}


def _f32_panel(t_logits: np.ndarray, c_logits: np.ndarray, nxt: np.ndarray, k: int) -> dict[str, np.ndarray]:
    t, c = panel.log_probs(t_logits.astype(np.float32)), panel.log_probs(c_logits.astype(np.float32))
    ids, lps = panel.top_k(t, k)
    agree, kl, nll = panel.position_scores(ids[:, 0], panel.kl_exact(t, c), c, nxt)
    return {"kl": kl, "ids": ids, "top_lp": lps, "agree": agree, "nll": nll, "lower": panel.kl_lower_bound(ids, lps, c)}


def _compare(t_logits: np.ndarray, c_logits: np.ndarray, nxt: np.ndarray, k: int) -> float:
    old, new = _f64_panel(t_logits, c_logits, nxt, k), _f32_panel(t_logits, c_logits, nxt, k)
    assert np.array_equal(new["ids"], old["ids"])  # the saved top-k: the same tokens in the same order
    assert np.array_equal(new["agree"], old["agree"])  # top-1, ties broken alike
    worst = 0.0
    for key in ("kl", "nll", "lower", "top_lp"):
        d = float(np.max(np.abs(new[key].astype(np.float64) - old[key].astype(np.float64))))
        assert d <= 1e-6, (key, d)
        worst = max(worst, d)
    return worst


@pytest.fixture(scope="module")
def smol_logits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SmolLM2's logits (the published Q4_1, and llama.cpp's Q2_K of it) at 192 positions of real text."""
    from mosaic._eval.worker import get_runtime

    teacher, q = smollm2_quants(["Q2_K"])
    q2 = q["Q2_K"]
    rt = get_runtime()
    paragraphs = (Path(__file__).parent / "data" / "paragraphs.txt").read_text().splitlines()
    out = []
    for path in (teacher, q2):
        m = rt.load(path, ctx=256, batch=64)
        try:
            toks = m.tokenize(" ".join(paragraphs[:8]))[:193]
            assert len(toks) == 193
            out.append(np.concatenate([m.decode(toks[s:s + 64], s).copy() for s in range(0, 192, 64)]))
        finally:
            m.close()
    return out[0], out[1], np.asarray(toks[1:193])


def test_the_float32_panel_equals_the_float64_panel_on_smollm2(smol_logits: tuple[np.ndarray, ...]) -> None:
    t, c, nxt = smol_logits
    assert t.shape == c.shape and t.shape[0] == 192 and t.shape[1] == 49152
    for k in (1, 8, 32):
        _compare(t, c, nxt, k)
    _compare(t, t, nxt, 32)  # the teacher against itself: KL 0 both ways
    assert float(np.max(panel.kl_exact(panel.log_probs(t), panel.log_probs(t)))) == 0.0


def test_ties_break_as_before_lower_id_first(smol_logits: tuple[np.ndarray, ...]) -> None:
    t, c, nxt = (x.copy() for x in smol_logits)
    rng = np.random.default_rng(5)
    for i in range(0, t.shape[0], 3):  # the top token's logit copied onto others, some above, some below its id
        top = int(t[i].argmax())
        for j in rng.choice(t.shape[1], 4, replace=False):
            t[i, j] = t[i, top]
            c[i, j] = c[i, int(c[i].argmax())]
    for i in range(1, t.shape[0], 5):  # a whole row of equal logits
        t[i] = 0.25
        c[i] = -1.5
    _compare(t, c, nxt, 32)


# ----------------------------------------------------------------------------------- the wire


def test_the_wire_carries_arrays_and_refuses_what_is_not_a_message() -> None:
    f = io.BytesIO()
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros((0, 5), np.int32), "c": np.ones(3)}
    send(f, {"op": "x", "n": 1}, dict(arrays))
    f.seek(0)
    head, got = recv(f)
    assert head == {"op": "x", "n": 1}
    assert all(np.array_equal(got[k], v) and got[k].dtype == v.dtype for k, v in arrays.items())
    with pytest.raises(WireError, match="stream ended"):
        recv(io.BytesIO(b""))
    with pytest.raises(WireError, match="inside a message"):
        recv(io.BytesIO(f.getvalue()[:-3]))
    with pytest.raises(WireError, match="header of"):
        recv(io.BytesIO((MAX_HEADER + 1).to_bytes(8, "little")))
    with pytest.raises(WireError, match="not JSON"):
        recv(io.BytesIO((3).to_bytes(8, "little") + b"{{{"))
    for head, what in (({"arrays": [["x", "|O", [1]]]}, "dtype"), ({"arrays": [["x", "<f4", [-1]]]}, "listed as"),
                       ({"arrays": [["x", "<f4"]]}, "listed as"), ({"arrays": "x"}, "listed as"), ([1, 2], "not a JSON object")):
        bad = json.dumps(head).encode()
        with pytest.raises(WireError, match=what):
            recv(io.BytesIO(len(bad).to_bytes(8, "little") + bad))


def test_a_refusal_in_the_worker_is_the_same_error_here(models: dict[str, Path], tmp_path: Path) -> None:
    from mosaic._eval.worker import get_runtime

    missing = tmp_path / "gone.gguf"
    with pytest.raises(MosaicError, match="could not load the model"):
        get_runtime().load(missing, ctx=16, batch=16)


@pytest.mark.parametrize(("v2", "v1", "want"), [
    ("max 100000\n", None, None),  # no quota
    ("150000 100000\n", None, 2),  # 1.5 CPUs: 2 threads
    ("50000 100000\n", None, 1),
    (None, ("300000", "100000"), 3),  # cgroup v1
    (None, ("-1", "100000"), None),
    ("garbage", ("200000", "100000"), 2),  # an unreadable v2 file: v1 decides
])
def test_the_default_threads_keep_within_the_cgroups_cpu_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               v2: str | None, v1: tuple[str, str] | None,
                                                               want: int | None) -> None:
    from mosaic._eval import runtime as rt

    cpu_max, quota, period = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    if v2 is not None:
        cpu_max.write_text(v2)
    if v1 is not None:
        quota.write_text(v1[0])
        period.write_text(v1[1])
    monkeypatch.setattr(rt, "CGROUP_CPU_MAX", cpu_max)
    monkeypatch.setattr(rt, "CGROUP_V1", (quota, period))
    assert rt.cpu_quota() == want
    monkeypatch.setattr(rt.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert rt.default_threads() == (64 if want is None else want)


def test_a_refusal_raised_in_the_worker_arrives_as_its_own_class(models: dict[str, Path], tmp_path: Path) -> None:
    """The saved top-k is checked against the text where the panel runs, in the worker: a reference holding fewer
    positions than the text is a FormatError here too (exit 2, its message whole)."""
    from mosaic._base.errors import FormatError
    from mosaic._eval.reference import load_reference

    saved = tmp_path / "teacher.npz"
    evaluate(EvalRequest([], str(models["teacher"]), models["text"], ctx=16, save_reference=saved))
    ref = load_reference(saved)
    ref.top_ids, ref.top_lp = ref.top_ids[:-3], ref.top_lp[:-3]
    short = tmp_path / "short.npz"
    ref.save(short)
    with pytest.raises(FormatError, match="fewer positions than the text needs"):
        evaluate(EvalRequest([str(models["cand"])], str(short), models["text"]))
