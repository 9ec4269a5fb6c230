"""GGUF sources from the hub: ``mosaic fetch`` downloads only the files of the recipe's quantization
(a GGUF repository holds many), and the build and ``audit --sources`` find them in the cache offline.
The hub is tests/fakehub.py on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mosaic.audit.run import audit
from mosaic.build.run import build
from mosaic.cli.commands import main
from mosaic.errors import SourceError
from mosaic.hub.fetch import select_files
from mosaic.testing_gguf import write_llama_gguf

from .fakehub import FakeHub
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
    import mosaic.build.gguf_write as gw

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
