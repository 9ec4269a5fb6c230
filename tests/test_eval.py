"""`mosaic eval`: the Spark card's panel on small GGUF models, through a real runtime (llama.cpp).

The models are two quantizations of one small mixture-of-experts model written by gguf-py: a base whose
tensors are Q4_0 and a donor of the same weights at Q8_0, and a mosaic of the base taking layer 1's
experts from the donor (assembled independently with gguf-py). The numbers are checked against a
direct numpy computation from llama.cpp's own logits of whole windows. The runtime is the `runtime`
extra (a prebuilt wheel, which `make test` installs); outside CI this module skips with the reason when
no runtime is installed; under CI=true a missing runtime fails the run. The EXL3 backend needs a CUDA GPU:
its test runs only where one is present.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mosaic._base.errors import MosaicError, SourceError
from mosaic._eval.panel import kl_lower_bound, log_softmax
from mosaic._eval.run import EvalRequest, evaluate
from mosaic._eval.scoring import windows
from mosaic.cli.commands import main
from mosaic.testing.gguf import N_VOCAB, Geometry, assemble_with_ggufpy, write_llama_gguf

GEO = Geometry(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=64, n_expert=4, n_expert_used=2, context=128)
ROWS = [
    "the mosaic model is a byte of the model",
    "a model of bytes and a mosaic of models is the model",
    "to the mosaic and in the byte is a model of the",
    "the the a of and to in is mosaic model byte s e t",
]
CTX = 16


def runtime():  # type: ignore[no-untyped-def]
    from mosaic._eval.runtime import available
    from mosaic._eval.worker import get_runtime

    if not available():
        reason = "no llama.cpp runtime is installed; `make test` installs the runtime extra (pip install -e '.[runtime]')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: mosaic eval's tests need a runtime: {reason}")
        pytest.skip(reason)
    return get_runtime()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    runtime()
    d = tmp_path_factory.mktemp("eval-models")
    base = write_llama_gguf(d / "base-q4.gguf", qtype="Q4_0", seed=11, geometry=GEO)
    donor = write_llama_gguf(d / "donor-q8.gguf", qtype="Q8_0", seed=11, geometry=GEO)
    take = {f"blk.1.ffn_{p}_exps.weight": "q8" for p in ("gate", "up", "down")}
    mosaic = assemble_with_ggufpy(base, {"q8": donor}, take, d / "mosaic.gguf")
    other_tok = write_llama_gguf(d / "other-tokenizer.gguf", qtype="Q8_0", seed=11, geometry=GEO,
                                 vocab_pieces=["▁x", "▁y", "▁z", "▁w", "▁v", "▁u", "▁r", "▁q", "▁p", "▁o", "k", "j", "i", "▁"])
    text = d / "rows.txt"
    text.write_text("\n".join(ROWS) + "\n\n")
    jsonl = d / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(ROWS)))
    return {"base": base[0], "donor": donor[0], "mosaic": mosaic, "other": other_tok[0], "text": text, "jsonl": jsonl}


def whole_window_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits of a whole window decoded in one batch, float64, every position."""
    m = runtime().load(path, ctx=CTX, batch=CTX)
    try:
        return np.array(m.decode(tokens, 0), dtype=np.float64)
    finally:
        m.close()


def direct(models: dict[str, Path], candidate: str, teacher: str = "donor") -> dict[str, object]:
    """The panel computed here from llama.cpp's logits with numpy alone: exact KL, top-1, NLL, per row."""
    t_model = runtime().load(models[teacher], ctx=CTX, batch=CTX)
    try:
        row_tokens = [t_model.tokenize(text) for text in ROWS]
    finally:
        t_model.close()
    rows = []
    seen: set[tuple[int, ...]] = set()  # contexts scored: one an earlier row opened with counts once
    for toks in row_tokens:
        kl, agree, nll = [], [], []
        for w in windows(toks, CTX):
            tl = whole_window_logits(models[teacher], w)[:-1]
            cl = whole_window_logits(models[candidate], w)[:-1]
            tp = tl - np.log(np.exp(tl - tl.max(1, keepdims=True)).sum(1, keepdims=True)) - tl.max(1, keepdims=True)
            cp = cl - np.log(np.exp(cl - cl.max(1, keepdims=True)).sum(1, keepdims=True)) - cl.max(1, keepdims=True)
            new = [tuple(w[:j + 1]) not in seen for j in range(len(w) - 1)]
            seen.update(tuple(w[:j + 1]) for j in range(len(w) - 1))
            kl += list((np.exp(tp) * (tp - cp)).sum(1)[new])
            agree += list((tl.argmax(1) == cl.argmax(1)).astype(float)[new])
            nll += list(-cp[np.arange(len(w) - 1), w[1:]][new])
        rows.append({"kl": float(np.mean(kl)), "top1": float(np.mean(agree)), "nll": float(np.mean(nll)), "all_kl": kl,
                     "all_top1": agree, "all_nll": nll})
    every = {k: [x for r in rows for x in r[f"all_{k}"]] for k in ("kl", "top1", "nll")}
    return {"rows": rows, "kl": float(np.mean(every["kl"])), "top1": float(np.mean(every["top1"])),
            "nll": float(np.mean(every["nll"])), "kl_max": float(np.max(every["kl"]))}


def run(models: dict[str, Path], candidates: list[str], reference: str | Path, **kw: object) -> dict:
    req = EvalRequest([str(models[c]) for c in candidates], str(reference), models["text"], **kw)  # type: ignore[arg-type]
    return evaluate(req)


def test_the_mosaic_is_closer_to_the_teacher_than_the_base(models: dict[str, Path]) -> None:
    doc = run(models, ["base", "mosaic"], models["donor"], ctx=CTX, top_k=8)
    base, mosaic = doc["candidates"]
    assert mosaic["kl"]["mean"] < base["kl"]["mean"]
    assert mosaic["top1"] >= base["top1"]
    assert mosaic["kl"]["exact"] is True and doc["reference_kind"].startswith("live")
    assert doc["rows"] == len(ROWS) == len(base["rows"]) == len(mosaic["rows"])
    assert doc["positions"] == base["positions"] == sum(r["positions"] for r in base["rows"]) > 0
    cmp = doc["comparisons"][0]
    assert cmp["kl"]["improved"] + cmp["kl"]["regressed"] + cmp["kl"]["tied"] == len(ROWS)
    assert cmp["kl"]["improved"] > cmp["kl"]["regressed"]


def test_numbers_equal_a_direct_numpy_computation_from_llama_cpp_logits(models: dict[str, Path]) -> None:
    doc = run(models, ["base", "mosaic"], models["donor"], ctx=CTX, top_k=8)
    for got, name in zip(doc["candidates"], ("base", "mosaic")):
        want = direct(models, name)
        # the panel works in float32 with float64 sums: equal to float64 numpy within 1e-6, top-1 exactly
        assert got["kl"]["mean"] == pytest.approx(want["kl"], rel=0, abs=1e-6)
        assert got["kl"]["max"] == pytest.approx(want["kl_max"], rel=0, abs=1e-6)
        assert got["top1"] == want["top1"]
        assert got["nll"] == pytest.approx(want["nll"], rel=0, abs=1e-6)
        for g, w in zip(got["rows"], want["rows"]):
            assert (g["kl"], g["nll"]) == pytest.approx((w["kl"], w["nll"]), rel=0, abs=1e-6)
            assert g["top1"] == w["top1"]
    assert doc["positions"] == len(want["rows"][0]["all_kl"]) + sum(len(r["all_kl"]) for r in want["rows"][1:])
    assert doc["repeated"] > 0  # rows that open alike: their shared prediction counted once


def test_a_row_given_twice_is_one_row_of_evidence(models: dict[str, Path], tmp_path: Path) -> None:
    """The same text twice predicts the same tokens from the same contexts: the panel's numbers do not move."""
    once = run(models, ["base"], models["donor"], ctx=CTX, top_k=8)
    text = tmp_path / "twice.txt"
    text.write_text("\n".join([*ROWS, ROWS[1]]) + "\n")
    twice = evaluate(EvalRequest([str(models["base"])], str(models["donor"]), text, ctx=CTX, top_k=8))
    a, b = once["candidates"][0], twice["candidates"][0]
    assert b["kl"] == a["kl"] and (b["top1"], b["nll"]) == (a["top1"], a["nll"])
    assert twice["positions"] == once["positions"] and twice["repeated"] > once["repeated"]
    assert b["rows"][-1]["positions"] == 0 and len(b["rows"]) == len(ROWS) + 1


def test_the_teacher_against_itself(models: dict[str, Path]) -> None:
    doc = run(models, ["donor"], models["donor"], ctx=CTX)
    (c,) = doc["candidates"]
    assert c["top1"] == 1.0
    assert c["kl"]["mean"] == pytest.approx(0.0, abs=1e-12) and c["kl"]["max"] == pytest.approx(0.0, abs=1e-12)


def test_a_saved_reference_gives_the_live_numbers(models: dict[str, Path], tmp_path: Path) -> None:
    saved = tmp_path / "teacher.npz"
    live = run(models, ["base", "mosaic"], models["donor"], ctx=CTX, top_k=N_VOCAB, save_reference=saved)
    again = run(models, ["base", "mosaic"], saved)
    assert again["reference_kind"].startswith("saved") and again["candidates"][0]["kl"]["exact"] is False
    for a, b in zip(live["candidates"], again["candidates"]):
        assert (b["top1"], b["nll"]) == (a["top1"], a["nll"])
        # with every token kept, the lower bound is the exact KL (up to the float32 the file stores)
        assert b["kl"]["mean"] == pytest.approx(a["kl"]["mean"], rel=1e-4, abs=1e-6)
    # with a small k it is a lower bound, never above the exact value
    small = tmp_path / "top4.npz"
    run(models, ["base"], models["donor"], ctx=CTX, top_k=4, save_reference=small)
    bound = run(models, ["base"], small)["candidates"][0]
    assert bound["kl"]["mean"] <= live["candidates"][0]["kl"]["mean"] + 1e-9
    assert bound["top1"] == live["candidates"][0]["top1"]


def test_a_mismatched_reference_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    saved = tmp_path / "teacher.npz"
    run(models, ["base"], models["donor"], ctx=CTX, save_reference=saved)
    other_text = tmp_path / "other.txt"
    other_text.write_text("a different row\n")
    with pytest.raises(MosaicError, match="saved for another text"):
        evaluate(EvalRequest([str(models["base"])], str(saved), other_text))
    with pytest.raises(MosaicError, match="--ctx"):
        evaluate(EvalRequest([str(models["base"])], str(saved), models["text"], ctx=CTX * 2))
    with pytest.raises(SourceError, match="tokenizer differs"):
        evaluate(EvalRequest([str(models["other"])], str(saved), models["text"]))
    with pytest.raises(SourceError, match="tokenizer differs"):
        evaluate(EvalRequest([str(models["other"])], str(models["donor"]), models["text"], ctx=CTX))


def test_cli_json_and_table(models: dict[str, Path]) -> None:
    r = CliRunner().invoke(main, ["eval", str(models["base"]), str(models["mosaic"]), "--reference", str(models["donor"]),
                                  "--text", str(models["jsonl"]), "--ctx", str(CTX), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) >= {"reference", "tokens", "rows", "candidates", "comparisons"}
    assert set(doc["candidates"][0]["kl"]) == {"mean", "p50", "p95", "p99", "max", "exact"}
    assert doc["rows"] == len(ROWS)
    r = CliRunner().invoke(main, ["eval", str(models["base"]), str(models["mosaic"]), "--reference", str(models["donor"]),
                                  "--text", str(models["text"]), "--ctx", str(CTX)])
    assert r.exit_code == 0, r.output
    assert str(models["mosaic"]) in r.output and "improve" in r.output


def test_per_position_kl_is_each_rows_own_and_gives_the_panels_tail(models: dict[str, Path]) -> None:
    """``--per-position`` adds each row's KL at every position: the row's mean and the panel's percentiles come
    back from them exactly, so a reader resampling rows gets the tail the panel reports. Without it, rows stay
    small."""
    plain = run(models, ["base"], models["donor"], ctx=CTX)
    r = CliRunner().invoke(main, ["eval", str(models["base"]), "--reference", str(models["donor"]), "--text",
                                  str(models["jsonl"]), "--ctx", str(CTX), "--per-position", "--json"])
    assert r.exit_code == 0, r.output
    (c,) = json.loads(r.stdout)["candidates"]
    assert all("kl_positions" not in row for row in plain["candidates"][0]["rows"])
    every = np.concatenate([np.asarray(row["kl_positions"]) for row in c["rows"]])
    assert every.size == c["positions"] and min(row["positions"] for row in c["rows"]) > 0
    for row in c["rows"]:
        assert len(row["kl_positions"]) == row["positions"]
        assert float(np.mean(row["kl_positions"])) == pytest.approx(row["kl"], rel=1e-12, abs=1e-15)
    assert float(np.percentile(every, 99)) == pytest.approx(c["kl"]["p99"], rel=1e-12, abs=1e-15)
    assert float(every.max()) == pytest.approx(c["kl"]["max"], rel=1e-12, abs=1e-15)
    assert c["kl"]["mean"] == pytest.approx(plain["candidates"][0]["kl"]["mean"], rel=1e-12)


def test_kl_lower_bound_is_exact_with_the_whole_vocabulary_and_below_it_otherwise() -> None:
    rng = np.random.default_rng(0)
    t = log_softmax(rng.standard_normal((20, 50)) * 3)
    c = log_softmax(rng.standard_normal((20, 50)) * 3)
    exact = (np.exp(t) * (t - c)).sum(1)
    order = np.argsort(-t, axis=1)
    for k in (1, 5, 20, 49, 50):
        ids = order[:, :k]
        lb = kl_lower_bound(ids, np.take_along_axis(t, ids, 1), c)
        assert np.all(lb <= exact + 1e-12)
    ids = order
    assert np.allclose(kl_lower_bound(ids, np.take_along_axis(t, ids, 1), c), exact)


def test_rows_files_are_read_strictly(tmp_path: Path) -> None:
    from mosaic._eval.rows import load_rows

    (tmp_path / "a.txt").write_text("\n\n")
    with pytest.raises(MosaicError, match="no rows"):
        load_rows(tmp_path / "a.txt")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n{"id": 3}\n')
    with pytest.raises(MosaicError, match='line 2: needs a non-empty string field "text"'):
        load_rows(tmp_path / "b.jsonl")
    (tmp_path / "c.txt").write_text("one\n\ntwo [x]\n")
    assert load_rows(tmp_path / "c.txt").texts == ("one", "two [x]")


def test_exl3_backend_needs_a_gpu(tmp_path: Path) -> None:
    """Without torch and a CUDA GPU the EXL3 backend is a one-line error; with one, it runs (GPU machines only)."""
    from mosaic.testing.exl3 import demo_geometry, write_checkpoint

    folder = write_checkpoint(tmp_path / "exl3", demo_geometry())
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu:
        pytest.skip("a CUDA GPU is present: the EXL3 backend's run is exercised by the GPU suite, not here")
    (tmp_path / "x.txt").write_text("a row\n")
    r = CliRunner().invoke(main, ["eval", str(folder), "--reference", str(folder), "--text", str(tmp_path / "x.txt")])
    assert r.exit_code == 2 and r.stderr.startswith("mosaic: error: ") and r.stderr.count("\n") == 1
    assert "exl3" in r.stderr and ("GPU" in r.stderr or "extra" in r.stderr)


@pytest.mark.parametrize(
    "content",
    [b"PK\x03\x04 not really a zip", b"", b"plain text"],
)
def test_a_damaged_reference_file_is_a_one_line_error(tmp_path: Path, content: bytes) -> None:
    from mosaic._eval.reference import load_reference

    bad = tmp_path / "teacher.npz"
    bad.write_bytes(content)
    with pytest.raises(MosaicError, match="not a saved reference"):
        load_reference(bad)


def test_a_reference_with_a_bad_header_is_refused(tmp_path: Path) -> None:
    from mosaic._eval.reference import FORMAT, load_reference

    for meta in (b"[1]", json.dumps({"format": FORMAT}).encode(), b'{"format": "' + FORMAT.encode() + b'", "format": 1}'):
        p = tmp_path / "r.npz"
        with open(p, "wb") as f:
            np.savez(f, meta=np.frombuffer(meta, np.uint8), tokens=np.zeros(0, np.int32), row_starts=np.zeros(1, np.int64),
                     top_ids=np.zeros((0, 2), np.int32), top_lp=np.zeros((0, 2), np.float32))
        with pytest.raises(MosaicError):
            load_reference(p)


# ------------------------------------------------------------------------------------------ bad input


def _cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


def _one_line_error(code: int, err: str) -> None:
    assert code == 2, err
    assert err.startswith("mosaic: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("cut", [100, 4000, -1000])
@pytest.mark.parametrize("role", ["candidate", "reference"])
def test_a_truncated_gguf_is_one_error_line_before_the_runtime_sees_it(models: dict[str, Path], tmp_path: Path,
                                                                        cut: int, role: str) -> None:
    data = models["base"].read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:cut])
    cand, ref = (bad, models["donor"]) if role == "candidate" else (models["base"], bad)
    code, _, err = _cli("eval", str(cand), "--reference", str(ref), "--text", str(models["text"]), "--ctx", str(CTX))
    _one_line_error(code, err)
    assert str(bad) in err


def test_not_a_model_is_one_error_line(models: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    (tmp_path / "empty").mkdir()
    for cand in (tmp_path / "x.gguf", tmp_path / "empty", tmp_path / "missing.gguf"):
        code, _, err = _cli("eval", str(cand), "--reference", str(models["donor"]), "--text", str(models["text"]))
        _one_line_error(code, err)


def test_a_ctx_above_the_models_context_length_is_refused_naming_both(models: dict[str, Path]) -> None:
    code, _, err = _cli("eval", str(models["base"]), "--reference", str(models["donor"]), "--text", str(models["text"]),
                        "--ctx", str(GEO.context * 4))
    _one_line_error(code, err)
    assert f"--ctx {GEO.context * 4}" in err and f"llama.context_length, {GEO.context}" in err


def test_what_the_runtime_still_refuses_is_one_error_line(models: dict[str, Path], tmp_path: Path) -> None:
    """A file the strict reader accepts but llama.cpp cannot build a model from (an architecture it lacks)."""
    data = models["donor"].read_bytes()
    key = b"general.architecture" + (8).to_bytes(4, "little") + (5).to_bytes(8, "little")
    assert data.count(key + b"llama") == 1
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(data.replace(key + b"llama", key + b"llamx"))
    code, _, err = _cli("eval", str(odd), "--reference", str(models["donor"]), "--text", str(models["text"]), "--ctx", str(CTX))
    _one_line_error(code, err)
    assert "llama.cpp could not load the model" in err and str(odd) in err


def test_a_tokenizer_mismatch_says_in_words_what_differs(models: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = _cli("eval", str(models["other"]), "--reference", str(models["donor"]), "--text", str(models["text"]),
                        "--ctx", str(CTX))
    _one_line_error(code, err)
    assert "token list" in err and "{" not in err
    big = write_llama_gguf(tmp_path / "bigger-vocab.gguf", qtype="Q8_0", seed=11,
                           geometry=Geometry(**{**GEO.__dict__, "n_vocab": N_VOCAB + 16}))[0]
    code, _, err = _cli("eval", str(big), "--reference", str(models["donor"]), "--text", str(models["text"]), "--ctx", str(CTX))
    _one_line_error(code, err)
    assert f"vocabulary size is {N_VOCAB + 16}, the reference's {N_VOCAB}" in err


# ------------------------------------------------------------------------------------- what reaches the user


def _subprocess_eval(*args: str) -> tuple[int, str, str]:
    from tests.conftest import run_cli

    p = run_cli(["eval", *args], timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_the_runtimes_log_lines_never_reach_the_terminal_unless_verbose(models: dict[str, Path]) -> None:
    """In a real process (the runtime writes to file descriptor 2, which CliRunner does not capture)."""
    args = (str(models["base"]), "--reference", str(models["donor"]), "--text", str(models["text"]), "--ctx", str(CTX))
    code, out, err = _subprocess_eval(*args)
    assert code == 0, err
    assert err == ""
    assert "llama_" not in out and "load_tensors" not in out and "reference" in out
    code, _, err = _subprocess_eval(*args, "--verbose")
    assert code == 0 and "llama_model_loader" in err


def test_a_teacher_saved_alone_with_no_candidate(models: dict[str, Path], tmp_path: Path) -> None:
    saved = tmp_path / "teacher.npz"
    code, out, err = _cli("eval", "--reference", str(models["donor"]), "--text", str(models["text"]), "--ctx", str(CTX),
                          "--save-reference", str(saved), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["candidates"] == [] and doc["comparisons"] == [] and doc["saved_reference"] == str(saved)
    assert doc["positions"] > 0 and saved.is_file()
    later = run(models, ["base"], saved)
    live = run(models, ["base"], models["donor"], ctx=CTX)
    assert later["candidates"][0]["top1"] == live["candidates"][0]["top1"]
    code, _, err = _cli("eval", "--reference", str(models["donor"]), "--text", str(models["text"]))
    _one_line_error(code, err)
    assert "CANDIDATE" in err and "--save-reference" in err


def test_what_ran_is_recorded_and_another_runtimes_reference_is_accepted_and_said_so(models: dict[str, Path],
                                                                                      tmp_path: Path) -> None:
    from mosaic._eval.reference import load_reference

    rt = runtime().info
    saved = tmp_path / "teacher.npz"
    doc = run(models, ["base"], models["donor"], ctx=CTX, save_reference=saved)
    assert doc["runtime"] == {"name": rt.name, "version": rt.version, "llama_cpp": rt.llama_cpp, "threads": rt.threads,
                              "gpu_layers": rt.gpu_layers, "offloaded": 0, "device": rt.device}
    assert doc["runtime"]["threads"] >= 1 and doc["runtime"]["llama_cpp"] not in ("", "unknown")
    ref = load_reference(saved)
    assert ref.runtime == doc["runtime"]
    same = run(models, ["base"], saved)
    assert same["notes"] == [] and same["reference_runtime"] == doc["runtime"]
    # the same reference as another runtime would have saved it
    ref.runtime = {"name": "llama-cpp-python", "version": "0.3.16", "llama_cpp": "b6000", "threads": 8}
    other = tmp_path / "other-runtime.npz"
    ref.save(other)
    doc = run(models, ["base"], other)
    assert doc["candidates"][0]["top1"] == same["candidates"][0]["top1"]
    (note,) = doc["notes"]
    assert "llama-cpp-python 0.3.16" in note and rt.name in note
    r = CliRunner().invoke(main, ["eval", str(models["base"]), "--reference", str(other), "--text", str(models["text"])])
    assert r.exit_code == 0 and "note: the reference was saved by llama-cpp-python" in r.stdout
    # a reference of an earlier mosaic, with no runtime recorded
    ref.runtime = None
    old = tmp_path / "old.npz"
    ref.save(old)
    assert "without a record of its runtime" in run(models, ["base"], old)["notes"][0]


def test_batches_smaller_than_a_window_give_the_whole_windows_numbers(models: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    whole = run(models, ["base", "mosaic"], models["donor"], ctx=CTX)
    import mosaic._eval.backends as backends
    import mosaic._eval.run as run_mod

    monkeypatch.setattr(backends, "MAX_BATCH", 5)
    monkeypatch.setattr(backends, "MIN_BATCH", 1)
    monkeypatch.setattr(run_mod, "CHUNK_FLOATS", 3 * N_VOCAB)  # three positions of float64 at a time
    small = run(models, ["base", "mosaic"], models["donor"], ctx=CTX)
    assert small["batch"] == 5 and whole["batch"] == CTX
    for a, b in zip(whole["candidates"], small["candidates"]):
        assert b["positions"] == a["positions"]
        assert b["kl"]["mean"] == pytest.approx(a["kl"]["mean"], rel=1e-6, abs=1e-9)
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-7)
        assert b["top1"] == a["top1"]


def test_the_llama_cpp_python_binding_gives_the_same_panel(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a user has llama-cpp-python (it compiles llama.cpp: `make llama-tools` installs it, `make test` does not):
    the same panel as the runtime extra's cyllama."""
    from mosaic._eval.runtime import available

    if "llama-cpp-python" not in available():
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python compiles llama.cpp); "
                    "the default runtime is tested above")
    saved = models["text"].parent / "saved-by-the-default-runtime.npz"
    monkeypatch.setenv("MOSAIC_RUNTIME", "cyllama")  # the runtime extra's: where llama-cpp-python is, it is preferred
    default = run(models, ["base", "mosaic"], models["donor"], ctx=CTX, save_reference=saved)
    monkeypatch.setenv("MOSAIC_RUNTIME", "llama-cpp-python")
    other = run(models, ["base", "mosaic"], models["donor"], ctx=CTX)
    across = run(models, ["base"], saved)  # a reference saved by one runtime, scored on the other
    assert across["notes"] and "llama-cpp-python" in across["notes"][0]
    assert other["runtime"]["name"] == "llama-cpp-python"
    for a, b in zip(default["candidates"], other["candidates"]):
        assert b["positions"] == a["positions"]
        assert b["kl"]["mean"] == pytest.approx(a["kl"]["mean"], rel=1e-3, abs=1e-6)
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-4)


_PEAK = """
import resource, sys
from mosaic.cli.commands import main
from mosaic._eval.worker import close_all
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    close_all()  # the llama.cpp worker ends and is reaped: its peak joins RUSAGE_CHILDREN
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print("PEAK", peak * 1024, file=sys.stderr)
"""


def _peak_rss(*args: str) -> int:
    """The peak of mosaic's process and of its llama.cpp worker, added (at most the tree's peak)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _PEAK, "eval", *args], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return int(p.stderr.split("PEAK ")[-1])


def test_peak_memory_does_not_grow_with_ctx_row_length_or_rows(tmp_path: Path) -> None:
    """A large vocabulary, one row of ~4,750 tokens: ctx 4096 against ctx 512, and the same words as 8 rows.
    Decoding a whole window at once would hold 4096 × 16,384 float32 logits per model (256 MiB) and more again
    as float64; a batch at a time holds 512 × 16,384 (32 MiB) whatever the window. (Rows shorter than a batch
    touch less of the batch's buffers, so the rows compared here are all longer than one batch.)"""
    runtime()
    geo = Geometry(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32, context=8192, n_vocab=16384)
    teacher = write_llama_gguf(tmp_path / "t.gguf", qtype="Q8_0", seed=3, geometry=geo)[0]
    cand = write_llama_gguf(tmp_path / "c.gguf", qtype="Q4_0", seed=3, geometry=geo)[0]
    sentence = "the mosaic model is a byte of the model and a mosaic"  # 50 tokens
    one = tmp_path / "one.txt"
    one.write_text(" ".join([sentence] * 95) + "\n")
    many = tmp_path / "many.txt"
    many.write_text("".join(" ".join([sentence] * 12) + "\n" for _ in range(8)))
    common = (str(cand), "--reference", str(teacher), "--json")
    long_window = _peak_rss(*common, "--text", str(one), "--ctx", "4096")
    short_window = _peak_rss(*common, "--text", str(one), "--ctx", "512")
    short_rows = _peak_rss(*common, "--text", str(many), "--ctx", "512")
    tokens = json.loads(_cli("eval", *common, "--text", str(one), "--ctx", "4096")[1])["tokens"]
    assert 4096 < tokens < 6000
    mib = 1 << 20
    assert abs(long_window - short_window) < 48 * mib, (long_window / mib, short_window / mib)
    assert abs(short_rows - short_window) < 48 * mib, (short_rows / mib, short_window / mib)


# ------------------------------------------------------------------------------------------ the picture


def test_the_frontier_picture_is_the_same_bytes_for_the_same_inputs(models: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (make test installs it)")
    args = ["eval", str(models["base"]), str(models["mosaic"]), "--reference", str(models["donor"]), "--text",
            str(models["text"]), "--ctx", str(CTX)]
    svgs = []
    for name in ("a.svg", "b.svg"):
        code, out, err = _cli(*args, "--plot", str(tmp_path / name), "--json")
        assert code == 0, err
        assert json.loads(out)["plot"] == str(tmp_path / name)
        svgs.append((tmp_path / name).read_bytes())
    assert svgs[0] == svgs[1] and svgs[0].startswith(b"<?xml")
    text = svgs[0].decode()
    # a labelled point per candidate and the teacher at its own size; no date in the file
    assert "base-q4.gguf" in text and "mosaic.gguf" in text and "donor-q8.gguf (teacher)" in text
    assert "<dc:date>" not in text
    code, _, err = _cli(*args, "--plot", str(tmp_path / "c.png"))
    assert code == 0, err
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert err == ""  # quiet: no font-cache or backend chatter


def test_a_frontier_per_quantizer_joins_each_series_in_a_colour_of_its_own(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (make test installs it)")
    from mosaic._eval.plot import COLOURS, draw

    kl = {("stock", 1): 0.30, ("stock", 2): 0.10, ("mixer", 1): 0.20, ("mixer", 2): 0.05, ("mosaic", 1): 0.15, ("mosaic", 2): 0.04}
    order = [("mixer", 2), ("stock", 1), ("mosaic", 2), ("stock", 2), ("mixer", 1), ("mosaic", 1)]  # any order
    cands = [{"model": f"{s}-{n}.gguf", "kl": {"mean": kl[(s, n)]}, "top1": 1 - kl[(s, n)]} for s, n in order]
    names = [f"Q{n}" if s == "stock" else None for s, n in order]
    out = tmp_path / "f.svg"
    draw(out, cands, [n * 10**8 for _, n in order], ("t.gguf", 3 * 10**8), "frontier", series=[s for s, _ in order], labels=names)
    text = out.read_text()
    for s in ("mixer", "stock", "mosaic"):
        assert f">{s}<" in text  # each series named in both legends
    assert text.count(">Q1<") == text.count(">Q2<") == 2 and "stock-1.gguf" not in text  # labels given, file names not
    for colour in COLOURS[:3]:  # the series in the order they first come, each its colour, joined by a line
        assert f"fill: none; stroke: {colour}; stroke-linecap: square" in text  # a line, not only markers
    draw(tmp_path / "g.svg", cands, [n * 10**8 for _, n in order], ("t.gguf", 3 * 10**8), "frontier", series=[s for s, _ in order],
         labels=names)
    assert (tmp_path / "g.svg").read_bytes() == out.read_bytes()


def test_the_picture_is_refused_before_any_model_runs(models: dict[str, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong format, or no matplotlib: one line, before a runtime is handed any file (here a candidate that
    does not exist would be the next error)."""
    import builtins

    missing = tmp_path / "missing.gguf"
    base = ["eval", str(missing), "--reference", str(models["donor"]), "--text", str(models["text"])]
    code, _, err = _cli(*base, "--plot", str(tmp_path / "p.pdf"))
    _one_line_error(code, err)
    assert ".svg or .png" in err
    real = builtins.__import__

    def no_matplotlib(name: str, *a: object, **k: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code, _, err = _cli(*base, "--plot", str(tmp_path / "p.svg"))
    _one_line_error(code, err)
    assert "plot extra" in err and "mosaic[plot]" in err and not (tmp_path / "p.svg").exists()
