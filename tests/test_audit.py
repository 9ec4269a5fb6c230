"""The audit catches any change, naming file and tensor, and never cries wolf on an untouched build."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mosaic._audit.run import audit
from mosaic._build.run import build
from mosaic._formats.safetensors_reader import read_header
from mosaic._provenance.records import FileRecord, manifest, parse_manifest
from mosaic.cli.commands import main
from mosaic.testing.exl3 import Geometry, glm_geometry

from .test_build import BASE, DONOR, recipe_doc, write_recipe

SPLICED = "model.layers.4.mlp.experts.3.down_proj.trellis"
KEPT = "model.layers.2.mlp.experts.3.down_proj.trellis"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, ckpt_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("built")
    base, donor = ckpt_factory(BASE), ckpt_factory(DONOR)
    recipe = write_recipe(tmp, recipe_doc(base, donor, [
        {"from": "q3", "layers": [1, "4-5"], "modules": ["mlp.experts"]},
        {"from": "q3", "keys": ["lm_head.*"]},
    ], at=tmp))
    return build(recipe, out=tmp / "mosaic").out_dir, recipe


@pytest.fixture
def mosaic(built, tmp_path: Path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(built[0], dst)
    return dst


def failures(folder: Path, **kw: object) -> list[tuple[str, str | None, str | None]]:
    rep = audit(folder, **kw)  # type: ignore[arg-type]
    return [(f.check, f.file, f.tensor) for f in rep.failures]


def flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))


def tensor_pos(folder: Path, name: str) -> tuple[Path, int, int]:
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / idx["weight_map"][name]
    a, b = read_header(shard).file_range(name)
    return shard, a, b


def regenerate_manifest(folder: Path) -> None:
    recs = [FileRecord(p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in folder.iterdir()]
    (folder / "sha256-manifest.txt").write_bytes(manifest(recs))


# --- no false alarms ----------------------------------------------------------------------------


def test_untouched_build_passes(built) -> None:
    rep = audit(built[0])
    assert rep.ok, rep.failures
    assert rep.counts["tensors"] > 0 and "card" in rep.ran


def test_untouched_build_passes_with_sources(built, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, recipe = built
    rep = audit(folder, sources=recipe)
    assert rep.ok, rep.failures
    assert rep.counts["source_tensors"] == rep.counts["tensors"]
    monkeypatch.chdir(recipe.parent)  # without RECIPE: paths relative to the current directory
    assert audit(folder, sources=True).ok


@pytest.mark.parametrize(
    "geometry",
    [
        Geometry(layers=3, dense_layers=1, experts=4, style="library"),
        Geometry(layers=3, dense_layers=0, experts=4, prefix="model.language_model.layers", mtp_layers=1, vision_blocks=1),
        Geometry(arch="llama", layers=3, experts=0, bits=3, codebook="mcg"),
        Geometry(layers=2, dense_layers=1, experts=4, codebook="3inst", shard_size=1 << 30),
    ],
)
def test_no_false_alarm_across_geometries(tmp_path: Path, geometry: Geometry) -> None:
    from mosaic.testing.exl3 import write_checkpoint

    base = write_checkpoint(tmp_path / "b", geometry.with_(seed=1))
    donor = write_checkpoint(tmp_path / "d", geometry.with_(seed=2, bits=4, style="exl3" if geometry.style == "library" else "library"))
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [1]}], at=tmp_path))
    out = build(recipe, out=tmp_path / "o").out_dir
    rep = audit(out, sources=recipe)
    assert rep.ok, rep.failures


# --- one change per test, each caught and located -------------------------------------------------


def test_flipped_byte_in_spliced_tensor(mosaic: Path) -> None:
    shard, a, _ = tensor_pos(mosaic, SPLICED)
    flip(shard, a + 10)
    f = failures(mosaic)
    assert ("tensors", shard.name, SPLICED) in f
    assert ("manifest", shard.name, None) in f


def test_flipped_byte_in_kept_tensor(mosaic: Path) -> None:
    shard, _, b = tensor_pos(mosaic, KEPT)
    flip(shard, b - 1)
    assert ("tensors", shard.name, KEPT) in failures(mosaic)


def test_flipped_byte_in_header(mosaic: Path) -> None:
    shard, _, _ = tensor_pos(mosaic, KEPT)
    data = shard.read_bytes()
    pos = data.index(b'"shape":[') + 9  # a shape digit: still JSON, now wrong
    flip(shard, pos)
    f = failures(mosaic)
    assert any(c == "safetensors" and fl == shard.name for c, fl, _ in f)
    assert ("manifest", shard.name, None) in f


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "config.json", "quantization_config.json", "mosaic-recipe.yaml", "README.md"])
def test_flipped_byte_in_metadata_file(mosaic: Path, name: str) -> None:
    p = mosaic / name
    data = p.read_bytes()
    pos = data.rindex(b"e")  # a letter in a key, a name or the card's text
    flip(p, pos)
    f = failures(mosaic)
    assert ("manifest", name, None) in f
    assert ("provenance", name, None) in f


def test_flipped_byte_in_provenance(mosaic: Path) -> None:
    p = mosaic / "PROVENANCE.json"
    data = p.read_bytes()
    flip(p, data.index(b'"sha256": "') + 12)
    f = failures(mosaic)
    assert ("manifest", "PROVENANCE.json", None) in f


def test_truncated_shard(mosaic: Path) -> None:
    shard, _, _ = tensor_pos(mosaic, KEPT)
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    f = failures(mosaic)
    assert any(c == "safetensors" and fl == shard.name for c, fl, _ in f)


def test_bytes_appended(mosaic: Path) -> None:
    shard, _, _ = tensor_pos(mosaic, KEPT)
    with open(shard, "ab") as fh:
        fh.write(b"\0" * 8)
    rep = audit(mosaic)
    assert any(f.check == "safetensors" and f.file == shard.name and "TrailingBytes" in f.detail for f in rep.failures)


def test_stray_shard(mosaic: Path) -> None:
    shard, _, _ = tensor_pos(mosaic, KEPT)
    shutil.copy(shard, mosaic / "model-00003-of-00003.safetensors")
    f = failures(mosaic)
    assert ("manifest", "model-00003-of-00003.safetensors", None) in f
    assert ("provenance", "model-00003-of-00003.safetensors", None) in f


def test_missing_file(mosaic: Path) -> None:
    (mosaic / "tokenizer.json").unlink()
    f = failures(mosaic)
    assert ("manifest", "tokenizer.json", None) in f
    assert ("provenance", "tokenizer.json", None) in f


def test_two_same_size_tensors_swapped(mosaic: Path) -> None:
    a_name, b_name = "model.layers.2.mlp.experts.1.up_proj.trellis", "model.layers.2.mlp.experts.2.up_proj.trellis"
    shard, a0, a1 = tensor_pos(mosaic, a_name)
    shard_b, b0, b1 = tensor_pos(mosaic, b_name)
    assert shard == shard_b and a1 - a0 == b1 - b0
    data = bytearray(shard.read_bytes())
    data[a0:a1], data[b0:b1] = data[b0:b1], data[a0:a1]
    shard.write_bytes(bytes(data))
    f = failures(mosaic)
    assert ("tensors", shard.name, a_name) in f and ("tensors", shard.name, b_name) in f


def test_tensor_renamed_in_header(mosaic: Path) -> None:
    shard, _, _ = tensor_pos(mosaic, KEPT)
    data = shard.read_bytes()
    old = KEPT.encode()
    new = old.replace(b"experts.3.", b"experts.9.")
    shard.write_bytes(data.replace(old, new, 1))
    f = failures(mosaic)
    assert ("index", "model.safetensors.index.json", KEPT) in f
    assert any(c == "tensors" and t == new.decode() for c, _, t in f)


def test_duplicate_key_in_header(mosaic: Path) -> None:
    shard, _, _ = tensor_pos(mosaic, KEPT)
    data = shard.read_bytes()
    twin = b'"' + KEPT.replace("down_proj", "gate_proj").encode() + b'"'  # same length, renamed to KEPT
    assert twin in data
    shard.write_bytes(data.replace(twin, b'"' + KEPT.encode() + b'"', 1))
    rep = audit(mosaic)
    assert any(f.check == "safetensors" and "DuplicateKey" in f.detail and f.tensor == KEPT for f in rep.failures)


def test_source_switched_with_manifest_regenerated(mosaic: Path) -> None:
    p = mosaic / "PROVENANCE.json"
    doc = json.loads(p.read_text())
    for t in doc["tensors"]:
        if t["name"] == KEPT:
            t["source"] = "q3"
    from mosaic._provenance.records import dumps

    p.write_bytes(dumps(doc))
    regenerate_manifest(mosaic)
    f = failures(mosaic)
    shard = json.loads((mosaic / "model.safetensors.index.json").read_text())["weight_map"][KEPT]
    assert ("recipe", shard, KEPT) in f
    assert ("manifest", "PROVENANCE.json", None) not in f  # the manifest was made to agree


def test_card_number_edited_with_manifest_regenerated(mosaic: Path) -> None:
    p = mosaic / "README.md"
    text = p.read_text()
    doc = json.loads((mosaic / "PROVENANCE.json").read_text())
    exact = f"{doc['rate']['exact']:.4f}"
    p.write_text(text.replace(exact, "9.9999"))
    regenerate_manifest(mosaic)
    assert ("card", "README.md", None) in failures(mosaic)


def test_symlink_in_mosaic_fails(mosaic: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("x")
    (mosaic / "extra.json").symlink_to(tmp_path / "elsewhere")
    assert ("folder", "extra.json", None) in failures(mosaic)


def test_unsafe_names_in_manifest_refused(mosaic: Path) -> None:
    p = mosaic / "sha256-manifest.txt"
    p.write_text(p.read_text() + f"{'0' * 64}  ../../etc/passwd\n")
    rep = audit(mosaic)
    assert any(f.check == "manifest" and "refused" in f.detail for f in rep.failures)


def test_sources_catch_a_forged_tensor(built, tmp_path: Path) -> None:
    """Bytes changed and every record (provenance, card, manifest) rewritten to match: only --sources sees it."""
    folder, recipe = built
    m = tmp_path / "forged"
    shutil.copytree(folder, m)
    shard, a, b = tensor_pos(m, SPLICED)
    flip(shard, a + 1)
    new_digest = hashlib.sha256(shard.read_bytes()[a:b]).hexdigest()
    doc = json.loads((m / "PROVENANCE.json").read_text())
    for t in doc["tensors"]:
        if t["name"] == SPLICED:
            t["sha256"] = new_digest
    for f in doc["files"]:
        if f["name"] == shard.name:
            f["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    from mosaic._provenance.card import render_card
    from mosaic._provenance.records import dumps

    (m / "README.md").write_bytes(render_card(doc))
    for f in doc["files"]:
        if f["name"] == "README.md":
            f["sha256"] = hashlib.sha256((m / "README.md").read_bytes()).hexdigest()
            f["size"] = (m / "README.md").stat().st_size
    (m / "PROVENANCE.json").write_bytes(dumps(doc))
    regenerate_manifest(m)
    assert audit(m).ok  # self-consistent
    rep = audit(m, sources=recipe)
    assert [(f.check, f.tensor) for f in rep.failures] == [("sources", SPLICED)]


def test_sources_recipe_must_match_the_copy(built, tmp_path: Path) -> None:
    folder, recipe = built
    other = tmp_path / "other.yaml"
    other.write_bytes(recipe.read_bytes() + b"# changed\n")
    rep = audit(folder, sources=other)
    assert any(f.check == "sources" and "differs" in f.detail for f in rep.failures)


def test_cli_exit_codes_json_and_tree(built, tmp_path: Path) -> None:
    folder, _ = built
    r = CliRunner().invoke(main, ["audit", str(folder.parent), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] and len(doc["mosaics"]) == 1
    r = CliRunner().invoke(main, ["audit", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.startswith("mosaic: error:")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "config.json").write_text("{}")
    r = CliRunner().invoke(main, ["audit", str(tmp_path), "--json"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert [m["ok"] for m in doc["mosaics"]] == [False]


def test_sha256sum_agrees(built) -> None:
    folder, _ = built
    r = subprocess.run(["sha256sum", "-c", "--quiet", "sha256-manifest.txt"], cwd=folder, capture_output=True)
    assert r.returncode == 0


def test_audit_does_not_import_the_planner() -> None:
    code = ("import sys, mosaic._audit.run; bad = [m for m in sys.modules if m.split('.')[:2] in (['mosaic', 'build'], ['mosaic', 'plan'])];"
            " print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_manifest_parser_is_strict() -> None:
    with pytest.raises(ValueError):
        parse_manifest(b"abc  x\n", "m")
    with pytest.raises(ValueError):
        parse_manifest(f"{'a' * 64}  x\n{'b' * 64}  x\n".encode(), "m")
    assert parse_manifest(f"{'a' * 64}  x y\n".encode(), "m") == {"x y": "a" * 64}


def test_glm_geometry_mosaic_audits_clean(tmp_path: Path) -> None:
    from mosaic.testing.exl3 import write_checkpoint

    g = glm_geometry(layers=6, dense_layers=3, experts=16, vision_blocks=1, shard_size=1 << 20)
    base = write_checkpoint(tmp_path / "b", g.with_(seed=1))
    donor = write_checkpoint(tmp_path / "d", g.with_(seed=2, bits=3))
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [3, "5-6"], "modules": ["mlp.experts"]}], at=tmp_path))
    out = build(recipe, out=tmp_path / "o").out_dir
    assert audit(out, sources=recipe).ok


def test_hub_download_artefacts_are_not_a_failure(mosaic: Path) -> None:
    (mosaic / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    meta = mosaic / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / "config.json.metadata").write_text("abc\n")
    rep = audit(mosaic)
    assert rep.ok, rep.failures
    assert rep.counts["hub_files_ignored"] == 2
    # anything else hidden is still a failure
    (mosaic / ".cache" / "other").write_text("x")
    assert ("manifest", ".cache/other", None) in failures(mosaic)


def test_an_overflowing_number_in_provenance_is_a_failure_not_a_traceback(mosaic: Path) -> None:
    p = mosaic / "PROVENANCE.json"
    text = p.read_text()
    start = text.index('"exact": ') + len('"exact": ')
    end = text.index(",", start)
    p.write_text(text[:start] + "1e400" + text[end:])
    regenerate_manifest(mosaic)
    r = CliRunner().invoke(main, ["audit", str(mosaic)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert any(c == "provenance" for c, _, _ in failures(mosaic))


def test_an_empty_tensor_list_names_every_tensor_it_leaves_out(mosaic: Path) -> None:
    """PROVENANCE.json with "tensors": [] (valid for the schema): every shard tensor is reported as
    missing from it, one failure each."""
    from mosaic._provenance.records import dumps

    m = mosaic
    p = m / "PROVENANCE.json"
    doc = json.loads(p.read_bytes())
    n = len(doc["tensors"])
    doc["tensors"] = []
    p.write_bytes(dumps(doc))
    rep = audit(m)
    missing = [f for f in rep.failures if f.check == "tensors" and "not in PROVENANCE.json" in f.detail]
    assert len(missing) == n and not rep.ok
