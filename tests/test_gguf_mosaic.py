"""GGUF mosaics: recipes over GGUF files → preflight → build → audit, on small models gguf-py writes.

Every output tensor is compared with its source tensor's bytes through gguf-py's own ``GGUFReader``
(not mosaic's reader), and with a model assembled independently by gguf-py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from mosaic._audit.run import audit
from mosaic._base.errors import MosaicError, RecipeError, SourceError
from mosaic._build.gguf_plan import check_same_model
from mosaic._build.run import build
from mosaic._checkpoint.gguf_model import open_gguf_model
from mosaic.cli.commands import main
from mosaic.testing.gguf import Geometry, assemble_with_ggufpy, write_llama_gguf
from tests.conftest import run_cli, tree_digest

MOE = Geometry(n_layer=4, n_expert=4, n_expert_used=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base Q4_0 (one file), donor Q8_0 (one file and a split set), a MoE pair, and bad donors."""
    root = tmp_path_factory.mktemp("gguf-models")
    write_llama_gguf(root / "base" / "tiny-Q4_0.gguf", qtype="Q4_0")
    write_llama_gguf(root / "q8" / "tiny-Q8_0.gguf", qtype="Q8_0")
    write_llama_gguf(root / "q8split" / "tiny-Q8_0.gguf", qtype="Q8_0", split_max_size=60_000)
    write_llama_gguf(root / "moe" / "moe-Q4_0.gguf", qtype="Q4_0", geometry=MOE)
    write_llama_gguf(root / "moe" / "moe-Q8_0.gguf", qtype="Q8_0", geometry=MOE)
    write_llama_gguf(root / "bad" / "layers.gguf", qtype="Q8_0", geometry=Geometry(n_layer=5))
    write_llama_gguf(root / "bad" / "vocab.gguf", qtype="Q8_0", vocab_pieces=["▁x", "▁y"])
    write_llama_gguf(root / "bad" / "rope.gguf", qtype="Q8_0", extra_kv={"llama.rope.freq_base": 5000.0})
    return root


def recipe(tmp: Path, models: Path, body: str, name: str = "r.yaml") -> Path:
    p = tmp / name
    p.write_text(body.replace("@M", str(models)))
    return p


BASIC = """name: tiny-mosaic
base:
  path: @M/base/tiny-Q4_0.gguf
donors:
  q8:
    path: @M/q8
replace:
  - from: q8
    layers: ["1-2"]
    modules: [attn, ffn_dense]
  - from: q8
    keys: ["output.weight"]
"""


def reader_tensors(files: list[Path]) -> dict[str, tuple[int, list[int], bytes]]:
    """name -> (type, ne, bytes) through gguf-py's GGUFReader, over all parts."""
    out = {}
    for f in files:
        for t in GGUFReader(f).tensors:
            out[t.name] = (int(t.tensor_type), [int(x) for x in t.shape], t.data.tobytes())
    return out


def gguf_parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.gguf"))


def test_every_tensor_equals_its_source_read_back_by_ggufpy(tmp_path: Path, models: Path) -> None:
    before = tree_digest(models)
    res = build(recipe(tmp_path, models, BASIC), out=tmp_path / "o")
    out = reader_tensors(gguf_parts(tmp_path / "o"))
    base = reader_tensors([models / "base/tiny-Q4_0.gguf"])
    donor = reader_tensors([models / "q8/tiny-Q8_0.gguf"])
    assert list(out) == list(base)  # the base's order
    taken = {t["name"] for t in res.provenance["tensors"] if t["source"] == "q8"}
    assert "output.weight" in taken and "blk.1.attn_q.weight" in taken and "blk.0.attn_q.weight" not in taken
    assert "blk.1.ffn_norm.weight" not in taken  # ffn_dense is gate/up/down only
    for name, got in out.items():
        assert got == (donor if name in taken else base)[name], name
    assert any(out[n][0] != base[n][0] for n in taken)  # types really changed
    assert tree_digest(models) == before  # sources untouched


def test_metadata_kept_file_type_kept_mosaic_keys_added(tmp_path: Path, models: Path) -> None:
    r = recipe(tmp_path, models, BASIC)
    build(r, out=tmp_path / "o")
    out = GGUFReader(tmp_path / "o" / "tiny-mosaic.gguf")
    base = GGUFReader(models / "base/tiny-Q4_0.gguf")
    for name, f in base.fields.items():
        if name.startswith("GGUF."):
            continue
        assert out.fields[name].contents() == f.contents(), name
    assert out.fields["general.file_type"].contents() == base.fields["general.file_type"].contents()
    import hashlib

    assert out.fields["mosaic.recipe.sha256"].contents() == hashlib.sha256(r.read_bytes()).hexdigest()
    assert out.fields["mosaic.recipe.name"].contents() == "tiny-mosaic"
    assert out.fields["mosaic.tensors.from_donors"].contents() == 17
    assert not any(n.startswith("split.") for n in out.fields)


def test_equals_a_model_assembled_independently_by_ggufpy(tmp_path: Path, models: Path) -> None:
    res = build(recipe(tmp_path, models, BASIC), out=tmp_path / "o")
    take = {t["name"]: t["source"] for t in res.provenance["tensors"] if t["source"] != "base"}
    ref = assemble_with_ggufpy([models / "base/tiny-Q4_0.gguf"], {"q8": [models / "q8/tiny-Q8_0.gguf"]}, take,
                               tmp_path / "ref.gguf")
    assert reader_tensors([ref]) == reader_tensors(gguf_parts(tmp_path / "o"))


def test_split_output_like_llama_gguf_split_loads_as_one_model(tmp_path: Path, models: Path) -> None:
    body = BASIC.replace("path: @M/q8\n", "path: @M/q8split/tiny-Q8_0-00001-of-00004.gguf\n")
    body += "output:\n  split_max_size: 50K\n"
    res = build(recipe(tmp_path, models, body), out=tmp_path / "o")
    parts = gguf_parts(tmp_path / "o")
    n = len(parts)
    assert n > 1 and [p.name for p in parts] == [f"tiny-mosaic-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    total = 0
    for i, p in enumerate(parts):
        r = GGUFReader(p)
        assert r.fields["split.no"].contents() == i and r.fields["split.count"].contents() == n
        assert r.fields["split.tensors.count"].contents() == len(res.provenance["tensors"])
        assert ("general.architecture" in r.fields) == (i == 0)  # metadata in the first part only
        tensor_bytes = sum(t.n_bytes for t in r.tensors)
        assert len(r.tensors) == 1 or tensor_bytes <= 50_000  # a part passes the limit only with one tensor
        total += len(r.tensors)
    assert total == len(res.provenance["tensors"])
    whole = open_gguf_model(parts[0])  # named by its first part, the set is one model
    assert [t.name for t in whole.tensors] == list(reader_tensors([models / "base/tiny-Q4_0.gguf"]))
    assert audit(tmp_path / "o", sources=True).ok


def test_two_builds_are_byte_identical(tmp_path: Path, models: Path) -> None:
    r = recipe(tmp_path, models, BASIC)
    build(r, out=tmp_path / "a")
    build(r, out=tmp_path / "b")
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")


def test_manifest_checks_with_sha256sum_and_provenance_is_complete(tmp_path: Path, models: Path) -> None:
    build(recipe(tmp_path, models, BASIC), out=tmp_path / "o")
    r = subprocess.run(["sha256sum", "-c", "--quiet", "sha256-manifest.txt"], cwd=tmp_path / "o", capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "o" / "PROVENANCE.json").read_text())
    assert doc["format"] == "gguf" and doc["schema"] == "mosaic.provenance/v1"
    assert {f["name"] for f in doc["files"]} == {"tiny-mosaic.gguf", "mosaic-recipe.yaml", "README.md"}
    t = next(t for t in doc["tensors"] if t["name"] == "blk.1.attn_q.weight")
    assert (t["dtype"], t["type_id"], t["shape"], t["bits"], t["source"]) == ("Q8_0", 8, [64, 64], 8.5, "q8")
    assert doc["rate"]["base"] < doc["rate"]["exact"] < doc["rate"]["donors"]["q8"]
    card = (tmp_path / "o" / "README.md").read_text()
    assert "| 1–2 | 8.5" in card and "| 0 | 4.5" in card  # bits per layer from the tensors' types


def test_moe_ffn_exps_group_takes_only_routed_experts(tmp_path: Path, models: Path) -> None:
    body = """name: moe-mosaic
base:
  path: @M/moe
  file: moe-Q4_0.gguf
donors:
  q8:
    path: @M/moe
    file: "*Q8_0*"
replace:
  - from: q8
    layers: [0, "2-3"]
    modules: [ffn_exps]
"""
    res = build(recipe(tmp_path, models, body), out=tmp_path / "o")
    taken = sorted(t["name"] for t in res.provenance["tensors"] if t["source"] == "q8")
    assert taken == sorted(f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 2, 3) for p in ("gate", "up", "down"))
    assert res.provenance["sources"]["q8"]["file"] == "*Q8_0*"
    assert audit(tmp_path / "o", sources=True).ok


# --- audit failures name the file and tensor ---------------------------------------------------------


@pytest.fixture
def built(tmp_path: Path, models: Path) -> Path:
    build(recipe(tmp_path, models, BASIC), out=tmp_path / "o")
    return tmp_path / "o"


def failures(folder: Path, **kw) -> list[tuple[str, str | None, str | None]]:
    rep = audit(folder, **kw)
    return [(f.check, f.file, f.tensor) for f in rep.failures]


def test_untouched_build_passes_audit_with_sources(built: Path, tmp_path: Path) -> None:
    rep = audit(built, sources=tmp_path / "r.yaml")
    assert rep.ok, rep.failures
    assert {"manifest", "provenance", "gguf", "tensors", "recipe", "card", "sources"} <= set(rep.ran)


def test_flipped_tensor_byte_is_named(built: Path) -> None:
    doc = json.loads((built / "PROVENANCE.json").read_text())
    r = GGUFReader(built / "tiny-mosaic.gguf")
    t = next(t for t in r.tensors if t.name == "blk.2.ffn_up.weight")
    with open(built / "tiny-mosaic.gguf", "r+b") as f:
        f.seek(int(t.data_offset) + 5)
        b = f.read(1)
        f.seek(int(t.data_offset) + 5)
        f.write(bytes([b[0] ^ 1]))
    got = failures(built)
    assert ("tensors", "tiny-mosaic.gguf", "blk.2.ffn_up.weight") in got
    assert ("manifest", "tiny-mosaic.gguf", None) in got
    assert len(doc["tensors"]) == 39


def test_audit_cli_exit_1_names_file_and_tensor(built: Path) -> None:
    r = GGUFReader(built / "tiny-mosaic.gguf")
    t = next(t for t in r.tensors if t.name == "output.weight")
    with open(built / "tiny-mosaic.gguf", "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(b"\xff\xff")
    res = CliRunner().invoke(main, ["audit", str(built)])
    assert res.exit_code == 1
    assert "FAIL tensors: tiny-mosaic.gguf: output.weight:" in res.output


def test_extra_file_edited_card_and_wrong_source_claim_fail(built: Path) -> None:
    (built / "notes.txt").write_text("x")
    card = built / "README.md"
    card.write_text(card.read_text().replace("8.5", "9.5"))
    got = failures(built)
    assert ("manifest", "notes.txt", None) in got
    assert ("card", "README.md", None) in got


def test_provenance_source_claim_against_recipe(built: Path) -> None:
    p = built / "PROVENANCE.json"
    doc = json.loads(p.read_text())
    t = next(t for t in doc["tensors"] if t["name"] == "blk.0.attn_q.weight")
    t["source"] = "q8"
    p.write_text(json.dumps(doc))
    got = failures(built)
    assert ("recipe", "tiny-mosaic.gguf", "blk.0.attn_q.weight") in got


def test_sources_changed_since_the_build_fail(built: Path, tmp_path: Path, models: Path) -> None:
    src = tmp_path / "models"
    shutil.copytree(models, src)
    r = recipe(tmp_path, src, BASIC, "r2.yaml")
    shutil.rmtree(built)
    build(r, out=built)
    write_llama_gguf(src / "q8" / "tiny-Q8_0.gguf", qtype="Q8_0", seed=7)  # same model shape, other weights
    got = failures(built, sources=r)
    assert ("sources", "tiny-mosaic.gguf", "output.weight") in got
    assert ("sources", "tiny-Q8_0.gguf", None) in got


def test_sources_recipe_must_equal_the_mosaics(built: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text((tmp_path / "r.yaml").read_text() + "# changed\n")
    assert ("sources", None, None) in failures(built, sources=other)


# --- bad pairs and bad recipes are refused, naming the key, tensor or field -----------------------------


@pytest.mark.parametrize(
    ("donor", "needle"),
    [
        ("bad/layers.gguf", "key 'llama.block_count' is 5, the base has 4"),
        ("bad/vocab.gguf", "key 'tokenizer.ggml.tokens' differs at index 259"),
        ("bad/rope.gguf", "key 'llama.rope.freq_base' is 5000.0, the base has 10000.0"),
        ("moe/moe-Q8_0.gguf", "key 'llama.expert_count' is not in the base"),
    ],
)
def test_bad_pairs_are_refused(tmp_path: Path, models: Path, donor: str, needle: str) -> None:
    body = BASIC.replace("path: @M/q8\n", f"path: @M/{donor}\n")
    with pytest.raises(SourceError) as e:
        build(recipe(tmp_path, models, body), out=tmp_path / "o")
    assert needle in str(e.value)
    assert not (tmp_path / "o").exists()


def test_shape_and_tensor_set_differences_are_refused(models: Path) -> None:
    base = open_gguf_model(models / "base/tiny-Q4_0.gguf")
    donor = open_gguf_model(models / "q8/tiny-Q8_0.gguf")
    check_same_model(base, "q8", donor)  # the real pair passes
    ts = list(donor.tensors)
    ts[3] = replace(ts[3], ne=(32, 128))
    with pytest.raises(SourceError, match=r"tensor 'blk.0.attn_k.weight' has shape \[32, 128\]"):
        check_same_model(base, "q8", replace(donor, tensors=tuple(ts)))
    with pytest.raises(SourceError, match=re.escape("tensor 'output.weight' is missing")):
        check_same_model(base, "q8", replace(donor, tensors=tuple(t for t in donor.tensors if t.name != "output.weight")))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (("layers: [\"1-2\"]", "layers: [\"1-9\"]"), "replace[0].layers: layer(s) 4, 5, 6, 7, 8, 9 not in the base"),
        (("modules: [attn, ffn_dense]", "modules: [attn, ffn_exps]"), "replace[0].modules[1]: 'ffn_exps' matches no tensor"),
        (("keys: [\"output.weight\"]", "keys: [\"blk.1.attn_q.*\"]"), "replace[1]: tensor 'blk.1.attn_q.weight' is also selected by replace[0]"),
        (("keys: [\"output.weight\"]", "keys: [\"nothing.*\"]"), "replace[1].keys[0]: 'nothing.*' matches no tensor"),
        (("path: @M/q8\n", "path: @M/q8\n    file: ../x.gguf\n"), "donors.q8.file: '../x.gguf' must be a relative name"),
    ],
)
def test_bad_recipes_are_refused_naming_the_field(tmp_path: Path, models: Path, change: tuple[str, str], needle: str) -> None:
    body = BASIC.replace(*change)
    assert body != BASIC
    with pytest.raises(RecipeError) as e:
        build(recipe(tmp_path, models, body), out=tmp_path / "o")
    assert needle in str(e.value)


def test_source_resolution_errors(tmp_path: Path, models: Path) -> None:
    cases = [
        (BASIC.replace("path: @M/q8\n", "path: @M/moe\n"), "holds 2 models"),
        (BASIC.replace("path: @M/q8\n", "path: @M/q8split/tiny-Q8_0-00002-of-00004.gguf\n"), "name its first file, tiny-Q8_0-00001-of-00004.gguf"),
        (BASIC.replace("path: @M/q8\n", "path: @M/moe\n    file: '*Q5*'\n"), "no .gguf file here"),
        (BASIC + "output:\n  exclude: [x]\n", "output.exclude: a GGUF mosaic carries only its GGUF files"),
    ]
    for body, needle in cases:
        with pytest.raises(MosaicError) as e:
            build(recipe(tmp_path, models, body), out=tmp_path / "o")
        assert needle in str(e.value), str(e.value)
    part = tmp_path / "partial"
    shutil.copytree(models / "q8split", part)
    (part / "tiny-Q8_0-00003-of-00004.gguf").unlink()
    with pytest.raises(SourceError, match=re.escape("tiny-Q8_0-00003-of-00004.gguf missing")):
        build(recipe(tmp_path, models, BASIC.replace("path: @M/q8\n", f"path: {part}\n")), out=tmp_path / "o")


def test_mixed_formats_are_refused(tmp_path: Path, models: Path, demo_base: Path) -> None:
    body = BASIC.replace("path: @M/q8\n", f"path: {demo_base}\n")
    with pytest.raises(RecipeError, match=re.escape("donors.q8: is an EXL3 folder, but the base is a GGUF model")):
        build(recipe(tmp_path, models, body), out=tmp_path / "o")


def test_cli_build_errors_are_one_line_and_exit_2(tmp_path: Path, models: Path) -> None:
    body = BASIC.replace("path: @M/q8\n", "path: @M/bad/layers.gguf\n")
    r = subprocess.run([sys.executable, "-m", "mosaic.cli", "build", str(recipe(tmp_path, models, body)), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("mosaic: error: donor 'q8'") and r.stderr.count("\n") == 1
    assert "llama.block_count" in r.stderr and not (tmp_path / "o").exists()


def test_cli_build_json_then_audit_json(tmp_path: Path, models: Path) -> None:
    r = CliRunner().invoke(main, ["build", str(recipe(tmp_path, models, BASIC)), "--out", str(tmp_path / "o"), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["tensors"] == 39 and doc["from_donors"] == 17 and doc["shards"] == {"tiny-mosaic.gguf": doc["shards"]["tiny-mosaic.gguf"]}
    r = CliRunner().invoke(main, ["audit", str(tmp_path / "o"), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True


def test_interrupted_build_leaves_no_output(tmp_path: Path, models: Path) -> None:
    out = tmp_path / "o"
    r = run_cli(["build", str(recipe(tmp_path, models, BASIC)), "--out", str(out)], fault="copy:3:kill")
    assert r.returncode == -9
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".o.mosaic-partial-")]  # hidden, tagged
    build(recipe(tmp_path, models, BASIC), out=out)  # the next build removes it
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".o.mosaic-partial-")]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fsynced descriptor through /proc")
def test_every_gguf_output_file_is_durable_before_the_rename(tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF parts are fsynced in the background while read back, the small files too; the
    folder is renamed into place only once every file in it is synced."""
    synced: set[str] = set()
    unsynced_at_rename: list[set[str]] = []
    out = tmp_path / "o"
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))

    def rename(src: object, dst: object) -> None:
        if Path(str(dst)) == out:
            unsynced_at_rename.append({str(p) for p in Path(str(src)).rglob("*") if p.is_file()} - synced)
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    build(recipe(tmp_path, models, BASIC), out=out)
    assert unsynced_at_rename == [set()]
    assert audit(out).ok


# --- plan: exact sizes from each tensor's type ------------------------------------------------------------


@pytest.mark.parametrize("budget", ["--max-size", "--target-rate", "--layers"])
def test_plan_predicts_the_built_size_to_the_byte(tmp_path: Path, models: Path, budget: str) -> None:
    scores = tmp_path / "scores.csv"
    scores.write_text("layer,score\n0,1\n1,4\n2,3\n3,0.5\n")
    value = {"--max-size": "150000", "--target-rate": "6.2", "--layers": "2"}[budget]
    out = tmp_path / "plans" / "p.yaml"
    r = CliRunner().invoke(main, ["plan", "--base", str(models / "base/tiny-Q4_0.gguf"), "--donor", f"q8={models / 'q8'}",
                                  "--scores", str(scores), "--unit", "layer", budget, value, "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    chosen = [c["layer"] for c in rep["chosen"]]
    assert chosen and chosen[0] == 1  # the best-scored layer first
    res = build(out, out=tmp_path / "o")
    assert res.provenance["size"]["shards"] == rep["predicted_size"]
    assert sorted({t["name"].split(".")[1] for t in res.provenance["tensors"] if t["source"] == "q8"}) == [str(x) for x in chosen]
    if budget == "--max-size":
        assert rep["predicted_size"] <= 150000
    if budget == "--target-rate":
        assert res.provenance["rate"]["exact"] <= 6.2
    if budget == "--layers":
        assert chosen == [1, 2]


def test_plan_layer_experts_on_moe_and_refusals(tmp_path: Path, models: Path) -> None:
    scores = tmp_path / "s.json"
    scores.write_text('{"higher_is_better": false, "scores": {"0": 0.3, "1": 0.1, "2": 0.2, "3": 0.9}}')
    out = tmp_path / "p.yaml"
    r = CliRunner().invoke(main, ["plan", "--base", str(models / "moe/moe-Q4_0.gguf"), "--donor",
                                  f"q8={models / 'moe/moe-Q8_0.gguf'}", "--scores", str(scores), "--layers", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "modules: [ffn_exps]" in out.read_text() and "layers: [1, 2]" in out.read_text()
    assert build(out, out=tmp_path / "o").provenance["size"]["shards"] > 0
    r = CliRunner().invoke(main, ["plan", "--base", str(models / "base/tiny-Q4_0.gguf"), "--donor", f"q8={models / 'q8'}",
                                  "--scores", str(scores), "--layers", "2"])
    assert r.exit_code == 2 and "no layer has routed experts" in r.output and "--unit layer" in r.output
    r = CliRunner().invoke(main, ["plan", "--base", str(models / "base/tiny-Q4_0.gguf"), "--donor", f"q8={models / 'q8'}",
                                  "--scores", str(scores), "--unit", "layer", "--max-size", "1000"])
    assert r.exit_code == 2 and "no plan is that small" in r.output and "114,432 bytes" in r.output


def test_output_beside_the_sources_is_fine_but_never_over_them(tmp_path: Path, models: Path) -> None:
    src = tmp_path / "models"
    shutil.copytree(models / "base", src)
    shutil.copytree(models / "q8", src, dirs_exist_ok=True)
    body = BASIC.replace("@M/base/tiny-Q4_0.gguf", str(src / "tiny-Q4_0.gguf")).replace("@M/q8", str(src / "tiny-Q8_0.gguf"))
    r = recipe(tmp_path, models, body)
    build(r, out=src / "mosaic")  # a new folder beside the quantizations it is made of
    before = tree_digest(src / "mosaic")
    with pytest.raises(MosaicError, match="is, contains or lies inside a source"):
        build(r, out=src, force=True)
    assert (src / "tiny-Q4_0.gguf").exists() and tree_digest(src / "mosaic") == before


def test_census_of_gguf_models_and_mosaics(tmp_path: Path, models: Path) -> None:
    r = CliRunner().invoke(main, ["census", str(models / "q8split" / "tiny-Q8_0-00001-of-00004.gguf"), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["format"] == "gguf" and len(rep["files"]) == 4 and rep["tensors"] == 39
    assert rep["types"]["Q8_0"]["bits"] == 8.5 and rep["layers"][0]["groups"]["attn"]["types"] == ["F32", "Q8_0"]
    build(recipe(tmp_path, models, BASIC), out=tmp_path / "o")
    r = CliRunner().invoke(main, ["census", str(tmp_path / "o"), "--json"])
    rep = json.loads(r.output)
    rates = [row["rate"] for row in rep["layers"]]
    assert rates[1] == rates[2] > rates[0] == rates[3]  # layers 1-2 from the Q8_0 donor
    r = CliRunner().invoke(main, ["census", str(tmp_path / "o")])
    assert r.exit_code == 0 and "bits per layer and module group" in r.output
    r = CliRunner().invoke(main, ["census", str(models / "moe")])
    assert r.exit_code == 2 and r.output.startswith("mosaic: error:") and "holds 2 models" in r.output


def test_sign_and_verify_a_gguf_mosaic(built: Path, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    r = CliRunner().invoke(main, ["sign", str(built), "--key", str(priv)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["audit", str(built), "--key", str(pub), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["mosaics"][0]["signature"]["verified"] is True
    with open(built / "tiny-mosaic.gguf", "r+b") as f:  # tampered after signing
        f.seek(-1, os.SEEK_END)
        f.write(b"\x01")
    r = CliRunner().invoke(main, ["audit", str(built), "--key", str(pub), "--json"])
    assert r.exit_code == 1
    failed = {(f["check"], f["file"]) for c in json.loads(r.stdout)["mosaics"][0]["checks"] for f in c["failures"]}
    assert ("signature", "tiny-mosaic.gguf") in failed


def test_stream_with_local_sources_builds_as_without(tmp_path: Path, models: Path) -> None:
    """--stream changes only how uncached hub sources are read: local sources build the same bytes."""
    plain = build(recipe(tmp_path, models, BASIC), out=tmp_path / "o")
    streamed = build(recipe(tmp_path, models, BASIC), out=tmp_path / "s", stream=True)
    assert (plain.out_dir / "tiny-mosaic.gguf").read_bytes() == (streamed.out_dir / "tiny-mosaic.gguf").read_bytes()
    assert streamed.provenance == plain.provenance


@pytest.mark.parametrize(("fault", "rc", "says"), [("copy:2:enospc", 2, "mosaic: error: No space left on device"),
                                                   ("verified:1:int", 130, "mosaic: interrupted"),
                                                   ("provenance:1:eio", 2, "mosaic: error: Input/output error"),
                                                   ("fsync:1:eio", 2, "mosaic: error: Input/output error"),
                                                   ("fsync:1:int", 130, "mosaic: interrupted"),
                                                   ("fsync:2:int", 130, "mosaic: interrupted")])
def test_failed_or_interrupted_build_removes_its_temporary_folder(tmp_path: Path, models: Path, fault: str, rc: int, says: str) -> None:
    out = tmp_path / "o"
    r = run_cli(["build", str(recipe(tmp_path, models, BASIC)), "--out", str(out)], fault=fault)
    assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (rc, says), r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]  # no output, no temporary folder


def _resign_manifest(folder: Path) -> None:
    """A forger's step: the manifest made to agree with edited files, so only the deeper checks can object."""
    import hashlib

    from mosaic._provenance.records import FileRecord, manifest

    recs = [FileRecord(p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in folder.iterdir() if p.name != "sha256-manifest.txt"]
    (folder / "sha256-manifest.txt").write_bytes(manifest(recs))


def test_provenance_with_a_repeated_key_a_repeated_tensor_or_a_failed_check_fails(built: Path) -> None:
    p = built / "PROVENANCE.json"
    original = p.read_text()
    p.write_text(original.replace('{\n  "schema"', '{\n  "name": "x",\n  "schema"', 1))
    _resign_manifest(built)
    assert ("provenance", "PROVENANCE.json", None) in failures(built)
    doc = json.loads(original)
    doc["checks"][0]["ok"] = False
    p.write_text(json.dumps(doc, indent=2))
    _resign_manifest(built)
    got = audit(built)
    assert not got.ok and any("failed checks" in f.detail for f in got.failures)
    doc = json.loads(original)
    doc["tensors"].append(dict(doc["tensors"][0]))
    p.write_text(json.dumps(doc, indent=2))
    _resign_manifest(built)
    assert any(f.check == "provenance" and "listed twice" in f.detail for f in audit(built).failures)


def test_rates_compare_like_with_like_and_are_audited(built: Path, tmp_path: Path, models: Path) -> None:
    """Each of the mosaic's rates has the base's beside it over the same tensors; the audit derives them again."""
    from mosaic._provenance.gguf_card import render_gguf_card

    doc = json.loads((built / "PROVENANCE.json").read_text())
    rate = doc["rate"]
    base = open_gguf_model(models / "base" / "tiny-Q4_0.gguf")
    layers = [t for t in base.tensors if t.layer is not None]
    assert rate["base_layer_mass"] == pytest.approx(8 * sum(t.nbytes for t in layers) / sum(t.elements for t in layers), abs=1e-6)
    assert rate["base_by_bytes"] == pytest.approx(8 * base.size / sum(t.elements for t in base.tensors), abs=1e-6)
    # the mosaic takes Q8_0 layers: over the blk.N layers it is above its base, as over all tensors
    assert rate["by_layer_mass"] > rate["base_layer_mass"] and rate["exact"] > rate["base"]
    assert f"({rate['base_layer_mass']:.4f} over the `blk.N` layers)" in (built / "README.md").read_text()
    r = CliRunner().invoke(main, ["build", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "again")])
    assert r.exit_code == 0, r.output
    assert (f"blk.N layers {rate['by_layer_mass']:.4f} vs {rate['base_layer_mass']:.4f}" in r.output
            and f"all tensors {rate['exact']:.4f} vs {rate['base']:.4f}" in r.output)
    assert audit(built, sources=tmp_path / "r.yaml").ok

    def rewrite(d: dict) -> None:
        import hashlib

        card = render_gguf_card(d)
        (built / "README.md").write_bytes(card)
        for f in d["files"]:
            if f["name"] == "README.md":
                f.update(size=len(card), sha256=hashlib.sha256(card).hexdigest())
        (built / "PROVENANCE.json").write_text(json.dumps(d, indent=2))
        _resign_manifest(built)

    wrong = json.loads(json.dumps(doc))
    wrong["rate"]["by_layer_mass"] = round(rate["by_layer_mass"] - 0.5, 6)
    wrong["rate"]["base_layer_mass"] = round(rate["base_layer_mass"] + 0.5, 6)
    rewrite(wrong)
    got = audit(built, sources=tmp_path / "r.yaml")
    details = [f.detail for f in got.failures]
    assert any(d.startswith("rate.by_layer_mass is ") for d in details)
    assert any(d.startswith("rate.base_layer_mass is ") for d in details)
    older = json.loads(json.dumps(doc))  # a record of an earlier mosaic, before the base's like-for-like rates
    del older["rate"]["base_by_bytes"], older["rate"]["base_layer_mass"]
    rewrite(older)
    got = audit(built, sources=tmp_path / "r.yaml")
    assert got.ok, got.failures
