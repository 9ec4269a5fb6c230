"""GGUF sources from the hub: ``mosaic fetch`` downloads only the files of the recipe's quantization
(a GGUF repository holds many), and the build and ``audit --sources`` find them in the cache offline.
The hub is mosaic/testing/hub.py on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mosaic._audit.run import audit
from mosaic._base.errors import SourceError
from mosaic._build.run import build
from mosaic._hub.download import select_files
from mosaic.cli.commands import main
from mosaic.testing.gguf import write_llama_gguf
from mosaic.testing.hub import FakeHub

from .test_hub import files_of, hub, offline  # noqa: F401  (fixtures)

REPO = "test-org/tiny-GGUF"


@pytest.fixture
def gguf_repo(hub: FakeHub, tmp_path: Path) -> str:  # noqa: F811
    src = tmp_path / "repo"
    write_llama_gguf(src / "tiny-Q4_0.gguf", qtype="Q4_0")
    write_llama_gguf(src / "Q8_0" / "tiny-Q8_0.gguf", qtype="Q8_0", split_max_size=60_000)
    write_llama_gguf(src / "tiny-Q5_0.gguf", qtype="Q5_0")  # a quantization no recipe here uses
    (src / "README.md").write_text("---\nbase_model: test-org/tiny\n---\n# tiny GGUF\n")
    return hub.commit(REPO, files_of(src))


def test_select_files_takes_a_quantization_and_its_whole_split_set() -> None:
    names = {"a-Q4_0.gguf", "Q8_0/a-Q8_0-00001-of-00002.gguf", "Q8_0/a-Q8_0-00002-of-00002.gguf", "README.md", "a-Q5_0.gguf"}
    assert select_files(names, ["*Q4_0*"]) == {"a-Q4_0.gguf"}
    assert select_files(names, ["Q8_0"]) == {"Q8_0/a-Q8_0-00001-of-00002.gguf", "Q8_0/a-Q8_0-00002-of-00002.gguf"}
    assert select_files(names, ["Q8_0/*-00001-of-*.gguf"]) == select_files(names, ["Q8_0"])
    assert select_files(names, ["*Q6_K*"]) == set()


def test_fetch_downloads_only_the_selected_quantizations_then_builds_offline(
    hub: FakeHub, gguf_repo: str, offline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: hub-gguf\n"
        f"base:\n  repo: {REPO}\n  revision: {gguf_repo}\n  file: '*Q4_0.gguf'\n"
        f"donors:\n  q8:\n    repo: {REPO}\n    revision: {gguf_repo}\n    file: Q8_0\n"
        "replace:\n  - from: q8\n    layers: [1]\n"
    )
    r = CliRunner().invoke(main, ["fetch", str(recipe), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    parts = sorted(p.name for p in (tmp_path / "repo" / "Q8_0").glob("*.gguf"))
    assert len(parts) > 1
    assert [s["files"] for s in doc["sources"]] == [1 + len(parts)]  # Q4_0 and every Q8_0 part, nothing else
    got = [p for p in (h for _, h in hub.log) if "/resolve/" in p]
    assert not any("Q5_0" in p or "README" in p for p in got)
    offline()
    n = len(hub.log)
    import mosaic._build.gguf_write as gw

    whole: list[Path] = []
    real = gw.digest_file
    monkeypatch.setenv("MOSAIC_NO_DIGEST_CACHE", "1")
    monkeypatch.setattr(gw, "digest_file", lambda path, *a, **k: (whole.append(Path(path)), real(path, *a, **k))[1])
    res = build(recipe, out=tmp_path / "o")
    assert len(hub.log) == n  # from the cache alone
    assert whole and all(p.parent.name.startswith(".o.mosaic-partial-") for p in whole)  # fetched files: not hashed again
    src = res.provenance["sources"]
    assert src["base"]["file"] == "*Q4_0.gguf" and src["q8"]["file"] == "Q8_0" and "path" not in src["base"]
    assert [f["name"] for f in src["base"]["files"]] == ["tiny-Q4_0.gguf"]
    assert src["q8"]["files"] and all(f["name"].startswith("Q8_0/tiny-Q8_0-0000") for f in src["q8"]["files"])
    assert audit(res.out_dir, sources=recipe).ok
    card = (res.out_dir / "README.md").read_text()
    assert f"base_model: {REPO}" in card and "base_model_relation: quantized" in card


def test_a_pattern_that_names_nothing_is_refused(hub: FakeHub, gguf_repo: str, tmp_path: Path) -> None:  # noqa: F811
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: x\nbase:\n  repo: {REPO}\n  revision: {gguf_repo}\n  file: '*Q6_K*'\n"
        f"donors:\n  q8:\n    repo: {REPO}\n    revision: {gguf_repo}\n    file: Q8_0\n"
        "replace:\n  - from: q8\n    layers: [1]\n"
    )
    r = CliRunner().invoke(main, ["fetch", str(recipe)])
    assert r.exit_code == 2 and "'*Q6_K*' names no file of the repository" in r.output
    with pytest.raises(SourceError, match="not in the local Hugging Face cache"):
        build(recipe, out=tmp_path / "o")


# --- headers by ranges: census and plan of GGUF hub sources, nothing of their tensors ------------------------


def _served(fake: FakeHub, repo: str) -> dict[str, int]:
    return {p: n for (r, p), n in fake.served.items() if r == repo}


@pytest.fixture
def big_vocab_repo(hub: FakeHub, tmp_path: Path) -> tuple[str, Path]:  # noqa: F811
    """A model whose header is several MB (a 150,000-token vocabulary): read as the parse asks for it."""
    from mosaic.testing.gguf import Geometry

    src = tmp_path / "big"
    geo = Geometry(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=32, n_vocab=150_000)
    write_llama_gguf(src / "big-Q4_0.gguf", qtype="Q4_0", geometry=geo)
    write_llama_gguf(src / "big-Q8_0.gguf", qtype="Q8_0", geometry=geo)
    return hub.commit("test-org/big-GGUF", files_of(src)), src


def test_census_of_a_gguf_hub_source_reads_its_header_only(hub: FakeHub, big_vocab_repo: tuple[str, Path]) -> None:  # noqa: F811
    from mosaic._formats.gguf_container import read_gguf

    sha, src = big_vocab_repo
    header = read_gguf(src / "big-Q4_0.gguf").data_start
    assert header > 3 << 20  # larger than the first read
    r = CliRunner().invoke(main, ["census", f"test-org/big-GGUF@{sha}:big-Q4_0.gguf", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    served = _served(hub, "test-org/big-GGUF")
    assert set(served) == {"big-Q4_0.gguf"}  # not the other quantization
    assert header <= served["big-Q4_0.gguf"] <= header * 1.5 + (1 << 20) < (src / "big-Q4_0.gguf").stat().st_size
    assert doc["hub_bytes_read"] == served["big-Q4_0.gguf"]
    local = json.loads(CliRunner().invoke(main, ["census", str(src / "big-Q4_0.gguf"), "--json"]).stdout)
    assert {k: v for k, v in doc.items() if k not in ("path", "hub_bytes_read")} == {k: v for k, v in local.items() if k != "path"}
    again = CliRunner().invoke(main, ["census", f"test-org/big-GGUF@{sha}:big-Q4_0.gguf", "--json"])
    assert json.loads(again.stdout)["hub_bytes_read"] == 0  # the ranges are cached (and hashed again before use)


def test_plan_of_gguf_hub_sources_reads_headers_only_and_equals_the_local_plan(hub: FakeHub, gguf_repo: str,  # noqa: F811
                                                                               tmp_path: Path) -> None:
    from mosaic._formats.gguf_container import read_gguf

    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"higher_is_better": True, "scores": {"0": 0.1, "1": 0.9, "2": 0.5, "3": 0.2}}))
    r = CliRunner().invoke(main, ["plan", "--base", f"{REPO}@{gguf_repo}:tiny-Q4_0.gguf", "--donor", f"q8={REPO}@{gguf_repo}:Q8_0/*.gguf",
                                  "--scores", str(scores), "--layers", "2", "--unit", "layer", "--out", str(tmp_path / "p.yaml"),
                                  "--json"])
    assert r.exit_code == 0, r.output
    remote = json.loads(r.stdout)
    served = _served(hub, REPO)
    src = tmp_path / "repo"
    assert set(served) == {"tiny-Q4_0.gguf", *(f"Q8_0/{p.name}" for p in (src / "Q8_0").glob("*.gguf"))}
    for name, n in served.items():
        assert n == min((src / name).stat().st_size, 1 << 20)  # one first read covers these small headers
    assert remote["hub_bytes_read"] == {"base": served["tiny-Q4_0.gguf"],
                                        "q8": sum(n for k, n in served.items() if k.startswith("Q8_0/"))}
    local = json.loads(CliRunner().invoke(main, ["plan", "--base", str(src / "tiny-Q4_0.gguf"), "--donor", f"q8={src / 'Q8_0'}",
                                                 "--scores", str(scores), "--layers", "2", "--unit", "layer", "--json"]).stdout)
    assert (remote["chosen"], remote["predicted_size"]) == (local["chosen"], local["predicted_size"])
    assert read_gguf(src / "tiny-Q4_0.gguf").data_start < served["tiny-Q4_0.gguf"]


# --- build --stream: only the ranges the mosaic holds ---------------------------------------------------------


def _stream_recipe(tmp_path: Path, sha: str) -> Path:
    r = tmp_path / "stream.yaml"
    r.write_text(
        "name: streamed-gguf\n"
        f"base:\n  repo: {REPO}\n  revision: {sha}\n  file: tiny-Q4_0.gguf\n"
        f"donors:\n  q8:\n    repo: {REPO}\n    revision: {sha}\n    file: Q8_0\n"
        "replace:\n  - from: q8\n    layers: [1, 2]\n    modules: [attn]\n  - from: q8\n    keys: [output.weight]\n"
    )
    return r


def test_streamed_build_reads_only_what_it_takes_and_equals_a_build_from_fetched_files(
    hub: FakeHub, gguf_repo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    import mosaic._hub.partial as partial
    from mosaic._checkpoint.gguf_model import open_gguf_model

    monkeypatch.setattr(partial, "GGUF_FIRST_READ", 4096)  # these headers are small: read them, not the files
    monkeypatch.setenv("MOSAIC_NO_DIGEST_CACHE", "1")
    recipe = _stream_recipe(tmp_path, gguf_repo)
    res = build(recipe, out=tmp_path / "s", stream=True)
    served = _served(hub, REPO)
    src = tmp_path / "repo"
    base = open_gguf_model(src / "tiny-Q4_0.gguf")
    donor = open_gguf_model(src / "Q8_0")
    tensors = res.provenance["tensors"]
    for model, sid, prefix in ((base, "base", ""), (donor, "q8", "Q8_0/")):
        taken = {t["name"] for t in tensors if t["source"] == sid}
        for f in model.files:
            header = model.headers[f].data_start
            own = sum(t.nbytes + model.alignment for t in model.tensors if t.file == f and t.name in taken)
            assert served.get(prefix + f, 0) <= header * 1.5 + 8192 + own, f  # headers + what it takes
    assert served["tiny-Q4_0.gguf"] < (src / "tiny-Q4_0.gguf").stat().st_size  # not the whole base
    assert "tiny-Q5_0.gguf" not in served
    # the same bytes as a build from fetched files; PROVENANCE differs only in what could not be checked
    r = CliRunner().invoke(main, ["fetch", str(recipe)])
    assert r.exit_code == 0, r.output
    fetched = build(recipe, out=tmp_path / "f")
    parts = sorted(p.name for p in (tmp_path / "f").glob("*.gguf"))
    assert parts and all((tmp_path / "s" / n).read_bytes() == (tmp_path / "f" / n).read_bytes() for n in parts)
    assert res.provenance["tensors"] == fetched.provenance["tensors"]
    partial_files = {(sid, f["name"]) for sid, s in res.provenance["sources"].items() for f in s["files"]
                     if f.get("sha256_verified") is False}
    assert ("base", "tiny-Q4_0.gguf") in partial_files
    for sid, s in fetched.provenance["sources"].items():
        assert [{k: v for k, v in f.items()} for f in s["files"]] == \
            [{k: v for k, v in f.items() if k != "sha256_verified"} for f in res.provenance["sources"][sid]["files"]]
    card = (res.out_dir / "README.md").read_text()
    assert "read from the hub by byte ranges: `tiny-Q4_0.gguf`" in card
    assert audit(res.out_dir).ok and audit(res.out_dir, sources=recipe).ok


def test_a_streamed_gguf_build_resumes_a_dropped_connection(hub: FakeHub, gguf_repo: str, tmp_path: Path,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import mosaic._hub.partial as partial

    monkeypatch.setattr(partial, "GGUF_FIRST_READ", 4096)
    hub.drop[(REPO, "tiny-Q4_0.gguf")] = 2
    res = build(_stream_recipe(tmp_path, gguf_repo), out=tmp_path / "s", stream=True)
    assert hub.drop[(REPO, "tiny-Q4_0.gguf")] == 0 and audit(res.out_dir).ok


# --- rebuild and publish --recipe-only of a GGUF mosaic ---------------------------------------------------------


def _same_folder(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.fixture
def published_gguf_mosaic(hub: FakeHub, gguf_repo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:  # noqa: F811
    """A GGUF mosaic of the hub's quantizations built by an older mosaic (version 0.0.9), published whole."""
    import mosaic
    import mosaic._build.gguf_plan as gp
    import mosaic._build.gguf_write as gw
    from mosaic._release.publishing import publish

    monkeypatch.setattr(gp, "__version__", "0.0.9")
    monkeypatch.setattr(gw, "__version__", "0.0.9")
    res = build(_stream_recipe(tmp_path, gguf_repo), out=tmp_path / "built", stream=True)
    monkeypatch.setattr(gp, "__version__", mosaic.__version__)
    monkeypatch.setattr(gw, "__version__", mosaic.__version__)
    assert res.provenance["gguf"]["mosaic_keys"]["mosaic.version"] == "0.0.9"
    pub = publish(res.out_dir, "test-org/gguf-mosaic")
    return res.out_dir, pub.commit


def test_rebuild_of_a_gguf_mosaic_is_byte_identical_and_reads_no_published_gguf(
    hub: FakeHub, published_gguf_mosaic: tuple[Path, str], tmp_path: Path  # noqa: F811
) -> None:
    out, commit = published_gguf_mosaic
    hub.served.clear()
    r = CliRunner().invoke(main, ["rebuild", f"test-org/gguf-mosaic@{commit}", "--out", str(tmp_path / "r"), "--json"])
    assert r.exit_code == 0, r.output
    assert not [p for (repo, p) in hub.served if repo == "test-org/gguf-mosaic" and p.endswith(".gguf")]
    _same_folder(out, tmp_path / "r")  # written with the published mosaic's own keys (an older version's)
    assert audit(tmp_path / "r").ok


def test_publish_recipe_only_of_a_gguf_mosaic_then_rebuild(hub: FakeHub, published_gguf_mosaic: tuple[Path, str],  # noqa: F811
                                                           tmp_path: Path) -> None:
    from mosaic._release.publishing import publish

    out, _ = published_gguf_mosaic
    res = publish(out, "test-org/gguf-recipe-only", recipe_only=True)
    files = hub.repos["test-org/gguf-recipe-only"].commits[res.commit]
    assert not [n for n in files if n.endswith(".gguf")]
    assert "mosaic rebuild" in files["README.md"].decode()
    r = CliRunner().invoke(main, ["rebuild", f"test-org/gguf-recipe-only@{res.commit}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    _same_folder(out, tmp_path / "r")


def test_rebuild_of_a_gguf_mosaic_from_local_sources(hub: FakeHub, published_gguf_mosaic: tuple[Path, str],  # noqa: F811
                                                     tmp_path: Path) -> None:
    out, commit = published_gguf_mosaic
    src = tmp_path / "repo"
    hub.served.clear()
    r = CliRunner().invoke(main, ["rebuild", f"test-org/gguf-mosaic@{commit}", "--source", f"base={src / 'tiny-Q4_0.gguf'}",
                                  "--source", f"q8={src}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    assert not [p for (repo, p) in hub.served if repo == REPO]  # a .gguf as it is, a folder with the recipe's file
    gguf_parts = sorted(p.name for p in out.glob("*.gguf"))
    assert all((out / n).read_bytes() == (tmp_path / "r" / n).read_bytes() for n in gguf_parts)


def test_rebuild_catches_a_corrupted_gguf_range_names_the_tensor_and_keeps_nothing(
    hub: FakeHub, published_gguf_mosaic: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """A range read in part cannot be checked against the hub's file digest: the rebuild's check of every
    tensor against the published PROVENANCE.json catches it (a file read whole is caught by its digest)."""
    import mosaic._hub.partial as partial
    from mosaic._checkpoint.gguf_model import open_gguf_model
    from mosaic._hub.partial import ranges_root

    monkeypatch.setattr(partial, "GGUF_FIRST_READ", 4096)  # the base's header only, then its ranges

    out, commit = published_gguf_mosaic
    shutil.rmtree(ranges_root() / "test-org" / "tiny-GGUF")  # the range cache of the first build
    prov = json.loads((out / "PROVENANCE.json").read_text())
    victim = next(t["name"] for t in prov["tensors"] if t["source"] == "base" and t["name"].startswith("blk.3."))
    src = tmp_path / "repo" / "tiny-Q4_0.gguf"
    t = open_gguf_model(src).by_name()[victim]
    data = bytearray(src.read_bytes())
    data[t.start + 5] ^= 0xFF
    hub.corrupt[(REPO, "tiny-Q4_0.gguf")] = bytes(data)
    r = CliRunner().invoke(main, ["rebuild", f"test-org/gguf-mosaic@{commit}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 1, r.output
    assert victim in r.stderr and "'base'" in r.stderr
    assert not (tmp_path / "r").exists() and not [p for p in tmp_path.iterdir() if "mosaic-partial" in p.name]
    # nothing of the failed read is kept: with the hub mended, the rebuild reads it again and is identical
    del hub.corrupt[(REPO, "tiny-Q4_0.gguf")]
    r = CliRunner().invoke(main, ["rebuild", f"test-org/gguf-mosaic@{commit}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    _same_folder(out, tmp_path / "r")
