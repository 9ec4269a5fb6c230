"""`make demo`'s tour, run as the Makefile runs it: every step succeeds and each result is where it says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mosaic._audit.run import audit
from mosaic._provenance.signature import load_trust
from mosaic._recipe.document import load_recipe
from mosaic.cli.demo import run

ROOT = Path(__file__).resolve().parents[1]


def test_the_whole_tour_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "recipes").mkdir()
    shutil.copy(ROOT / "recipes" / "demo.yaml", tmp_path / "recipes" / "demo.yaml")
    monkeypatch.chdir(tmp_path)
    assert run(Path("demo"), Path("recipes/demo.yaml")) == 0
    printed = capsys.readouterr().out
    for step in ("$ mosaic census", "$ mosaic plan", "$ mosaic build", "$ mosaic audit", "$ mosaic sign",
                 "$ mosaic export gguf"):
        assert step in printed
    assert printed.count("audit passed: 1 mosaic(s)") == 3 and "signature: verified model.sig" in printed
    out, gguf = tmp_path / "demo/out/demo-mosaic", tmp_path / "demo/out/demo-mosaic-gguf"
    assert audit(out).ok and audit(gguf, sources=out).ok
    trust = load_trust(tmp_path / "demo/demo-signing.pub", None, None)
    assert audit(out, trust=trust, require_signature=True).ok
    assert sorted(p.name for p in gguf.glob("*.gguf"))
    # the plan chose, from the demo's scores, the very layers recipes/demo.yaml takes
    planned, demo = load_recipe(tmp_path / "demo/planned.yaml"), load_recipe(tmp_path / "recipes/demo.yaml")
    assert planned.rules[0].layers == demo.rules[0].layers == (1, 4, 5)
    assert json.loads((tmp_path / "demo/scores.json").read_text())["higher_is_better"] is True
    # the closing lines say where each result is
    tail = printed[printed.index("Where everything is"):]
    for p in ("demo/planned.yaml", "demo/out/demo-mosaic", "demo/out/demo-mosaic-gguf", "PROVENANCE.json", "sha256sum -c",
              "model.sig", "model_signing verify key"):
        assert p in tail


def test_the_tour_prints_what_it_always_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Every line of the tour, the command line's tables and messages, byte for byte as recorded in
    tests/data/demo-transcript.txt (but the folder it ran in and the fingerprint of its fresh key): a change
    of what the commands print shows here, and is made on purpose by recording the new transcript."""
    import re

    (tmp_path / "recipes").mkdir()
    shutil.copy(ROOT / "recipes" / "demo.yaml", tmp_path / "recipes" / "demo.yaml")
    monkeypatch.chdir(tmp_path)
    assert run(Path("demo"), Path("recipes/demo.yaml")) == 0
    printed = capsys.readouterr().out.replace(str(tmp_path), "ROOT")
    printed = re.sub(r"public key sha256 [0-9a-f]+…", "public key sha256 KEY…", printed)
    want = (ROOT / "tests" / "data" / "demo-transcript.txt").read_text(encoding="utf-8")
    assert printed.splitlines() == want.splitlines()
