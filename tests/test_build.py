"""mosaic build end to end on synthetic checkpoints: bytes, metadata, rates, determinism, refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from safetensors import deserialize

from mosaic._audit.run import audit
from mosaic._base.errors import OutputError, RecipeError, SourceError, VerificationError
from mosaic._build.provenance import validation_errors
from mosaic._build.run import PARTIAL_TAG, build
from mosaic._recipe.document import parse_recipe
from mosaic.cli.commands import main
from mosaic.testing.exl3 import Geometry, every_group_geometry, write_checkpoint

from .conftest import tree_digest

BASE = every_group_geometry(bits=2, seed=1)
DONOR = every_group_geometry(bits=3, head_bits=8, seed=2, style="library", shard_size=1 << 20)


def library_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a folder, read by the safetensors library (independent of mosaic's reader)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in deserialize(f.read_bytes()):
            assert name not in out
            out[name] = (t["dtype"], list(t["shape"]), bytes(t["data"]))
    return out


def write_recipe(dir_: Path, doc: dict, name: str = "recipe.yaml") -> Path:
    p = dir_ / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


@pytest.fixture
def sources(ckpt_factory) -> tuple[Path, Path]:
    return ckpt_factory(BASE), ckpt_factory(DONOR)


def rel(p: Path, start: Path) -> str:
    return os.path.relpath(p, start)


def recipe_doc(base: Path, donor: Path, rules: list | None = None, *, at: Path, **extra: object) -> dict:
    """A recipe document for a recipe file written in folder ``at`` (paths relative to it)."""
    doc = {
        "name": "test-mosaic",
        "base": {"path": rel(base, at)},
        "donors": {"q3": {"path": rel(donor, at)}},
        "replace": rules or [{"from": "q3", "layers": [1, "4-5"], "modules": ["mlp.experts"]}],
    }
    doc.update(extra)
    return doc


@pytest.fixture
def unchanged(sources):
    before = [tree_digest(p) for p in sources]
    yield
    assert [tree_digest(p) for p in sources] == before, "a source was modified"


def test_end_to_end(sources, tmp_path: Path, unchanged) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [
        {"from": "q3", "layers": [1, "4-5"], "modules": ["mlp.experts"]},
        {"from": "q3", "keys": ["lm_head.*"]},
    ], at=tmp_path))
    res = build(recipe, out=tmp_path / "out", jobs=2)
    out = res.out_dir
    b, d, o = library_tensors(base), library_tensors(donor), library_tensors(out)
    assert set(o) == set(b)
    from_donor = {n for n in o if (".experts." in n and any(f"layers.{layer}." in n for layer in (1, 4, 5))) or n.startswith("lm_head.")}
    assert len(from_donor) == 3 * 8 * 3 * 4 + 4
    for n, t in o.items():
        assert t == (d[n] if n in from_donor else b[n]), n
    # same shard names, same tensor order as the base
    base_idx = json.loads((base / "model.safetensors.index.json").read_text())
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx["weight_map"] == base_idx["weight_map"]
    assert idx["metadata"]["total_size"] == sum(len(t[2]) for t in o.values())
    # rates by hand: 3 MoE layers' experts at 3 bits, everything else at 2 (head excluded)
    h, ei, inter, kv = 256, 128, 512, 128
    attn, dense, experts, shared = 2 * h * h + 2 * h * kv, 3 * h * inter, 8 * 3 * h * ei, 3 * h * ei
    weights = 6 * attn + dense + 5 * (experts + shared)
    exact = Fraction(2 * weights + 3 * experts, weights)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["bits"] == round(float(exact), 2)
    base_cfg = json.loads((base / "config.json").read_text())
    base_cfg["quantization_config"]["bits"] = cfg["quantization_config"]["bits"]
    assert cfg == base_cfg
    prov = json.loads((out / "PROVENANCE.json").read_text())
    assert prov["rate"]["exact"] == pytest.approx(float(exact))
    assert prov["rate"]["by_layer_mass"] == pytest.approx((3 * 3 + 3 * 2) / 6)
    base_size = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    out_size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert prov["rate"]["by_bytes"] == pytest.approx(2 * out_size / base_size)
    assert prov["size"]["shards"] == out_size
    # quantization_config.json: replaced entries from the donor, the rest from the base
    q, bq, dq = (json.loads((p / "quantization_config.json").read_text()) for p in (out, base, donor))
    for key, entry in q["tensor_storage"].items():
        replaced = key.startswith("lm_head") or any(key.startswith(f"model.layers.{layer}.mlp.experts.") for layer in (1, 4, 5))
        assert entry == (dq if replaced else bq)["tensor_storage"][key], key
    assert q["bits"] == cfg["quantization_config"]["bits"]
    assert q["tensor_storage"]["lm_head"]["bits_per_weight"] == 8
    # carried files byte for byte; provenance valid and complete
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (base / f).read_bytes()
    assert validation_errors(prov) == []
    assert {t["name"] for t in prov["tensors"]} == set(o)
    assert all(t["source"] == ("q3" if t["name"] in from_donor else "base") for t in prov["tensors"])
    assert (out / "mosaic-recipe.yaml").read_bytes() == recipe.read_bytes()
    listed = {f["name"] for f in prov["files"]}
    assert listed == {p.name for p in out.iterdir()} - {"PROVENANCE.json", "sha256-manifest.txt"}
    assert all(c["ok"] for c in prov["checks"])
    assert str(tmp_path) not in (out / "PROVENANCE.json").read_text()
    r = subprocess.run(["sha256sum", "-c", "--quiet", "sha256-manifest.txt"], cwd=out, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    card = (out / "README.md").read_text()
    assert "| 1 | **q3 3** |" in card or "**q3 3**" in card
    assert f"{prov['rate']['exact']:.4f}" in card


def test_two_builds_identical(sources, tmp_path: Path) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    a = build(recipe, out=tmp_path / "a", jobs=1).out_dir
    b = build(recipe, out=tmp_path / "b", jobs=3).out_dir
    assert tree_digest(a) == tree_digest(b)


@pytest.mark.parametrize("link", [False, True])
def test_untouched_shards_copied_or_linked(ckpt_factory, tmp_path: Path, link: bool) -> None:
    base = ckpt_factory(BASE.with_(shard_size=1 << 20))
    donor = ckpt_factory(DONOR)
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [5], "modules": ["mlp.experts"]}], at=tmp_path))
    res = build(recipe, out=tmp_path / "o", link=link)
    untouched = [s for s in res.plan.shards if s.untouched]
    assert untouched
    for s in untouched:
        out_file = res.out_dir / s.name
        assert out_file.read_bytes() == (base / s.name).read_bytes()
        assert (os.stat(out_file).st_ino == os.stat(base / s.name).st_ino) == link
        assert res.splice.methods[s.name] == ("link" if link else "kernel")


def test_an_untouched_shard_is_hashed_once_and_compared_with_its_base_file(ckpt_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied untouched shard's base file is not hashed in step 1: the copy is read back beside it,
    compared byte for byte and hashed once; PROVENANCE is the same as when both are hashed (--link)."""
    from mosaic._base import hashing
    from mosaic._build import splice as splice_mod

    base = ckpt_factory(BASE.with_(shard_size=1 << 20))
    donor = ckpt_factory(DONOR)
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [5], "modules": ["mlp.experts"]}], at=tmp_path))
    monkeypatch.setenv("MOSAIC_NO_DIGEST_CACHE", "1")  # digests of an earlier build would spare the reads
    reads: list[tuple[str, str | None]] = []
    real = hashing.digest_file

    def recording(path, ranges=(), **kw):  # type: ignore[no-untyped-def]
        in_base = Path(path).resolve().parent == Path(base).resolve()
        reads.append((Path(path).name if in_base else "", kw.get("same_as") and Path(kw["same_as"]).name))
        return real(path, ranges, **kw)

    monkeypatch.setattr(splice_mod, "digest_file", recording)
    res = build(recipe, out=tmp_path / "copied")
    untouched = {s.name for s in res.plan.shards if s.untouched}
    hashed = {n for n, _ in reads if n}
    assert hashed and untouched and hashed & untouched == set()  # base files hashed, but none of theirs
    assert {s for _, s in reads if s} == untouched  # each compared with its copy instead
    linked = build(recipe, out=tmp_path / "linked", link=True)  # the base files hashed in step 1
    a, b = (json.loads((r.out_dir / "PROVENANCE.json").read_text()) for r in (res, linked))
    assert a["sources"] == b["sources"] and a["tensors"] == b["tensors"]


def test_a_copy_that_differs_from_its_base_file_fails_the_build(ckpt_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mosaic._build import splice as splice_mod

    base = ckpt_factory(BASE.with_(shard_size=1 << 20))
    donor = ckpt_factory(DONOR)
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [5], "modules": ["mlp.experts"]}], at=tmp_path))
    real = splice_mod._copy_whole

    def corrupting(src: Path, dst: Path, durable=None) -> str:  # type: ignore[no-untyped-def]
        method = real(src, dst, durable)
        if src.suffix == ".safetensors":  # an untouched shard's copy
            with open(dst, "r+b") as f:  # the last byte of tensor data, flipped after the copy was made
                f.seek(-1, os.SEEK_END)
                last = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last ^ 1]))
        return method

    monkeypatch.setattr(splice_mod, "_copy_whole", corrupting)
    monkeypatch.setenv("MOSAIC_NO_DIGEST_CACHE", "1")
    with pytest.raises(VerificationError, match="copy differs from the base file"):
        build(recipe, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_exl3_style_donor_and_different_layouts(ckpt_factory, tmp_path: Path) -> None:
    base = ckpt_factory(BASE.with_(style="library", shard_size=3 << 20))
    donor = ckpt_factory(DONOR.with_(style="exl3", shard_size=512 << 10))
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    out = build(recipe, out=tmp_path / "o").out_dir
    o, d = library_tensors(out), library_tensors(donor)
    assert o["model.layers.4.mlp.experts.7.down_proj.trellis"] == d["model.layers.4.mlp.experts.7.down_proj.trellis"]


def test_prefix_and_mtp_layers(ckpt_factory, tmp_path: Path) -> None:
    g = Geometry(layers=3, dense_layers=1, mtp_layers=1, experts=4, prefix="model.language_model.layers", vision_blocks=1)
    base = ckpt_factory(g.with_(seed=5))
    donor = ckpt_factory(g.with_(seed=6, bits=4))
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [3], "modules": ["mlp.experts"]}], at=tmp_path))
    out = build(recipe, out=tmp_path / "o").out_dir
    prov = json.loads((out / "PROVENANCE.json").read_text())
    # the MTP layer is not a decoder layer: the rate stays the base's
    assert prov["rate"]["exact"] == pytest.approx(2.0)
    assert sum(t["source"] == "q3" for t in prov["tensors"]) == 4 * 3 * 4


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.update(extra=1), "unknown field(s) extra"),
        (lambda d: d.pop("name"), "missing required field(s) name"),
        (lambda d: d.update(name="a b"), "name"),
        (lambda d: d["replace"][0].update(layers=[99]), "replace[0].layers: layer 99 is not in the base"),
        (lambda d: d["replace"][0].update(layers=["5-3"]), "replace[0].layers[0]"),
        (lambda d: d["replace"][0].update(layers=[1, 1]), "listed more than once"),
        (lambda d: d["replace"][0].update(modules=["mlp.nothing"]), "replace[0].modules"),
        (lambda d: d["replace"][0].update({"from": "nope"}), "replace[0].from: unknown donor"),
        (lambda d: d["replace"][0].update(keys=["x"]), "exactly one of layers or keys"),
        (lambda d: d.update(replace=[{"from": "q3", "keys": ["nothing.*"]}]), "replace[0].keys[0]"),
        (lambda d: d.update(replace=[{"from": "q3", "keys": ["*.experts.0.up_proj.trellis"]}]), "part of EXL3 module"),
        (lambda d: d.update(replace=[]), "replace: must be a non-empty list"),
        (lambda d: d["replace"].append({"from": "q3", "layers": [4]}), "already selected by replace[0]"),
        (lambda d: d["donors"].update(q9={"path": "x"}), "q9"),
        (lambda d: d["donors"].update(Bad={"path": "x"}), "donors.Bad"),
        (lambda d: d.update(base={"repo": "org/name", "revision": "main"}), "base.revision: must be a full 40-hex"),
        (lambda d: d.update(base={"path": "x", "repo": "org/name"}), "either path, or repo"),
        (lambda d: d.update(output={"dir": "x", "junk": 1}), "output: unknown field(s) junk"),
        (lambda d: d.update(replace=[{"from": "q3", "layers": [2], "modules": ["mlp.experts.0"]}]), "routed experts would mix"),
    ],
)
def test_recipe_errors(sources, tmp_path: Path, mutate, needle: str) -> None:
    base, donor = sources
    doc = recipe_doc(base, donor, at=tmp_path)
    mutate(doc)
    recipe = write_recipe(tmp_path, doc)
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("mosaic: error:") and needle in r.stderr, r.stderr
    assert "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "text",
    [
        "name: x\nname: y\n",
        "!!python/object:os.system {}\n",
        "a: &a [1, 2]\nb: *a\n",
        "{{{{",
        "name: [\n",
        "\xff\xfe",
    ],
)
def test_hostile_yaml_is_a_clean_error(tmp_path: Path, text: str) -> None:
    p = tmp_path / "r.yaml"
    p.write_bytes(text.encode("latin-1"))
    r = CliRunner().invoke(main, ["build", str(p)])
    assert r.exit_code == 2 and r.stderr.startswith("mosaic: error:") and "Traceback" not in r.output


def test_source_errors(sources, ckpt_factory, tmp_path: Path, copy_of) -> None:
    base, donor = sources
    # same config.json as the base, but experts of another size: caught per module, not by config
    odd = copy_of(ckpt_factory(DONOR.with_(expert_intermediate=256)), "odd")
    (odd / "config.json").write_bytes((donor / "config.json").read_bytes())
    cases = {
        "missing": (recipe_doc(base, tmp_path / "nowhere", at=tmp_path), "is not a folder"),
        "hub": (recipe_doc(base, donor, at=tmp_path, donors={"q3": {"repo": "org/absent", "revision": "0" * 40}}), "not in the local Hugging Face cache"),
        "arch": (recipe_doc(base, ckpt_factory(DONOR.with_(hidden=384)), at=tmp_path), "different model"),
        "codebook": (recipe_doc(base, ckpt_factory(DONOR.with_(codebook="mcg")), at=tmp_path), "codebook mul1 in the base, mcg in donor"),
        "structure": (recipe_doc(base, odd, at=tmp_path), "features"),
        "mixed-donor": (recipe_doc(base, ckpt_factory(DONOR.with_(expert_bits={(4, 1): 4})), at=tmp_path), "cannot fuse"),
    }
    for label, (doc, needle) in cases.items():
        recipe = write_recipe(tmp_path, doc, f"{label}.yaml")
        r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / label)])
        assert r.exit_code == 2 and needle in r.stderr, (label, r.stderr)
        assert not (tmp_path / label).exists()


def test_codebook_change_refused(ckpt_factory, tmp_path: Path) -> None:
    base = ckpt_factory(BASE)
    donor = ckpt_factory(DONOR.with_(group_codebooks={"attention": "mcg"}))
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "keys": ["model.layers.2.self_attn.k_proj.*"]}], at=tmp_path))
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert "model.layers.2.self_attn.k_proj: codebook mul1 in the base, mcg in donor" in r.stderr


def test_existing_output_and_force(sources, tmp_path: Path) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("precious")
    with pytest.raises(OutputError, match="already exists"):
        build(recipe, out=out)
    assert (out / "keep").read_text() == "precious"
    bad = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [77]}], at=tmp_path), "bad.yaml")
    with pytest.raises(RecipeError):
        build(bad, out=out, force=True)
    assert (out / "keep").read_text() == "precious"  # a failed --force build keeps the old output
    build(recipe, out=out, force=True)
    assert not (out / "keep").exists() and (out / "PROVENANCE.json").exists()
    assert not [p for p in tmp_path.iterdir() if PARTIAL_TAG in p.name]


def test_output_inside_source_refused(sources, tmp_path: Path) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    with pytest.raises(OutputError):
        build(recipe, out=base / "inside")


def test_not_enough_space(sources, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil as sh

    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(10**9, 10**9 - 1000, 1000))  # type: ignore[attr-defined]
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "bytes free" in r.stderr
    assert not (tmp_path / "o").exists()


def test_sigkill_midway_leaves_no_output_and_rerun_succeeds(tmp_path: Path) -> None:
    base = write_checkpoint(tmp_path / "base", every_group_geometry(experts=64, shard_size=16 << 20, seed=11))
    donor = write_checkpoint(tmp_path / "donor", every_group_geometry(experts=64, bits=4, shard_size=16 << 20, seed=12))
    before = [tree_digest(base), tree_digest(donor)]
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [1, 2, 3, 4, 5], "modules": ["mlp.experts"]}], at=tmp_path))
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "mosaic.cli", "build", str(recipe), "--out", str(out), "--jobs", "1"])
    deadline = time.time() + 60
    while time.time() < deadline and not [p for p in tmp_path.iterdir() if PARTIAL_TAG in p.name]:
        time.sleep(0.005)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    build(recipe, out=out)
    assert not [p for p in tmp_path.iterdir() if PARTIAL_TAG in p.name]
    assert [tree_digest(base), tree_digest(donor)] == before
    assert json.loads((out / "PROVENANCE.json").read_text())["checks"]


def test_json_output(sources, tmp_path: Path) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "o"), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["tensors"] > 0 and all(c["ok"] for c in doc["checks"])


def test_source_error_types(sources, tmp_path: Path) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path, donors={"q3": {"path": rel(donor, tmp_path)}, "q4": {"path": rel(donor, tmp_path)}}))
    with pytest.raises(SourceError, match="used by no replace rule"):
        build(recipe, out=tmp_path / "o")


def test_trusted_source_digests_skip_reads_but_are_still_checked(ckpt_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Digests verified at download let the build skip reading untouched shards and unused tensors;
    a wrong one is still caught when the copy is read back."""
    from mosaic._base.hashing import digest_file
    from mosaic._build import splice as splice_mod
    from mosaic._build.run import plan_build
    from mosaic._recipe.document import load_recipe

    base = ckpt_factory(BASE.with_(shard_size=1 << 20))
    donor = ckpt_factory(DONOR)
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [5], "modules": ["mlp.experts"]}], at=tmp_path))
    plan = plan_build(load_recipe(recipe))
    (tmp_path / "a").mkdir()
    plain = splice_mod.splice(plan, tmp_path / "a")
    known = {
        "base": {n: digest_file(base / n).sha256 for n in plan.used_files["base"]},
        "q3": {n: digest_file(donor / n).sha256 for n in plan.used_files["q3"]},
    }
    read: list[str] = []
    real = splice_mod.digest_file
    monkeypatch.setattr(splice_mod, "digest_file", lambda p, *a, **k: (read.append(str(p)), real(p, *a, **k))[1])
    (tmp_path / "b").mkdir()
    trusted = splice_mod.splice(plan, tmp_path / "b", known=known)
    assert trusted.tensors == plain.tensors and trusted.files == plain.files
    assert not [p for p in read if p.startswith((str(base), str(donor))) and p.endswith(".safetensors")]  # no shard read whole
    untouched = next(s.name for s in plan.shards if s.untouched)
    known["base"][untouched] = "0" * 64
    (tmp_path / "c").mkdir()
    with pytest.raises(VerificationError, match=f"{untouched}: copy differs"):
        splice_mod.splice(plan, tmp_path / "c", known=known)


def test_digest_cache_spares_rereading_sources_and_cannot_fool_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json as _json

    from mosaic._build import digest_cache
    from mosaic._build import splice as splice_mod

    monkeypatch.setenv("MOSAIC_CACHE_DIR", str(tmp_path / "cache"))
    g = BASE.with_(shard_size=1 << 20)
    base = write_checkpoint(tmp_path / "base", g.with_(seed=31))
    donor = write_checkpoint(tmp_path / "donor", DONOR.with_(seed=32))
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [{"from": "q3", "layers": [5], "modules": ["mlp.experts"]}], at=tmp_path))
    first = build(recipe, out=tmp_path / "one").out_dir
    read: list[str] = []
    real = splice_mod.digest_file
    monkeypatch.setattr(splice_mod, "digest_file", lambda p, *a, **k: (read.append(str(p)), real(p, *a, **k))[1])
    second = build(recipe, out=tmp_path / "two").out_dir
    assert tree_digest(first) == tree_digest(second)
    # no shard read whole again (configs, index and tokenizer files are small and always hashed)
    assert not [p for p in read if p.startswith((str(base), str(donor))) and p.endswith(".safetensors")]
    # a rewritten source (new mtime) misses the cache
    shard = sorted(base.glob("*.safetensors"))[-1]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1))
    read.clear()
    build(recipe, out=tmp_path / "three")
    assert str(shard) in read
    # poisoned entries with intact identities cannot let a wrong byte through: the build fails
    entries = list((tmp_path / "cache").glob("*.json"))
    assert entries and all(_json.loads(e.read_text())["path"].endswith(".safetensors") for e in entries)
    for entry in entries:
        doc = _json.loads(entry.read_text())
        doc["sha256"] = "0" * 64
        doc["tensors"] = {k: "0" * 64 for k in doc["tensors"]}
        entry.write_text(_json.dumps(doc))
    assert digest_cache.lookup(doc["path"]) is not None
    with pytest.raises(VerificationError):
        build(recipe, out=tmp_path / "four")
    assert not (tmp_path / "four").exists()
    # and it can be turned off
    monkeypatch.setenv("MOSAIC_NO_DIGEST_CACHE", "1")
    assert digest_cache.lookup(doc["path"]) is None


def test_card_names_key_rules_by_their_globs(sources, tmp_path: Path) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, [
        {"from": "q3", "layers": [4], "modules": ["mlp.experts"]},
        {"from": "q3", "keys": ["lm_head.*"]},
    ], at=tmp_path))
    out = build(recipe, out=tmp_path / "o").out_dir
    card = (out / "README.md").read_text()
    assert "rule 1: from `q3`, keys `lm_head.*`: 1 module(s), 4 tensors" in card
    assert "rule 0: from `q3`, layers 4:" in card


def test_build_summary_without_rates_prints() -> None:
    from rich.console import Console

    from mosaic.cli.render import render_build

    console = Console(record=True, width=120)
    summary = {
        "output": "o", "size": {"shards": 1}, "shards": {}, "tensors": 1, "from_donors": 0, "checks": [],
        "rate": {"exact": None, "config_bits": None, "by_bytes": None, "by_layer_mass": None, "base": None},
    }
    render_build(console, summary)
    assert "rate: exact - bpw" in console.export_text()


# --- source locations: absolute folders are accepted and recorded as written ------------------------


def test_absolute_source_paths_build_audit_and_audit_with_sources(sources, tmp_path: Path, monkeypatch) -> None:
    base, donor = sources
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    doc = recipe_doc(base, donor, at=recipe_dir)
    doc["base"] = {"path": str(base.resolve())}
    doc["donors"]["q3"] = {"path": str(donor.resolve())}
    recipe = write_recipe(recipe_dir, doc)
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    # one note, on one line, naming the folders and how to make the recipe portable
    notes = [ln for ln in r.output.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and str(base.resolve()) in notes[0] and "repo + revision" in notes[0]
    prov = json.loads((tmp_path / "m" / "PROVENANCE.json").read_text())
    assert prov["sources"]["base"]["path"] == str(base.resolve())
    assert prov["sources"]["q3"]["path"] == str(donor.resolve())
    assert validation_errors(prov) == []
    assert audit(tmp_path / "m").ok
    assert audit(tmp_path / "m", sources=recipe).ok
    monkeypatch.chdir(tmp_path)  # without RECIPE: absolute paths resolve the same from anywhere
    rep = audit(tmp_path / "m", sources=True)
    assert rep.ok, rep.failures
    assert "sources" in rep.ran


def test_home_relative_and_dotdot_source_paths_are_source_locations(sources, tmp_path: Path, monkeypatch) -> None:
    base, donor = sources
    monkeypatch.setenv("HOME", str(base.parent))
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    doc = recipe_doc(base, donor, at=deep)
    doc["base"] = {"path": f"~/{base.name}"}
    recipe = write_recipe(deep, doc)
    assert doc["donors"]["q3"]["path"].startswith("../")
    res = build(recipe, out=tmp_path / "m")
    assert res.provenance["sources"]["base"]["path"] == f"~/{base.name}"
    assert audit(tmp_path / "m", sources=recipe).ok


def test_relative_sources_get_the_portability_note_and_hub_sources_do_not(sources, tmp_path: Path) -> None:
    base, donor = sources
    recipe = write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path))
    res = build(recipe, out=tmp_path / "m")
    assert len(res.notes) == 1 and "base: " in res.notes[0] and "q3: " in res.notes[0]
    pinned = {"repo": "org/m", "revision": "0" * 40}
    doc = {**recipe_doc(base, donor, at=tmp_path), "base": pinned, "donors": {"q3": pinned}}
    hub = parse_recipe(yaml.safe_dump(doc).encode(), tmp_path / "r.yaml")
    assert hub.folder_sources() == {}


def test_a_json_file_changed_after_it_was_read_is_not_spliced(demo_base, copy_of) -> None:  # type: ignore[no-untyped-def]
    """The layout splices the index and quantization_config.json from the texts the census checked:
    read again, they must be those bytes, or nothing is written from them."""
    from mosaic._base.errors import CheckpointError
    from mosaic._checkpoint.folder import QCONFIG_NAME, open_checkpoint

    folder = copy_of(demo_base)
    ck = open_checkpoint(folder)
    assert ck.read_again(QCONFIG_NAME) == (folder / QCONFIG_NAME).read_bytes()
    (folder / QCONFIG_NAME).write_bytes((folder / QCONFIG_NAME).read_bytes() + b" ")
    with pytest.raises(CheckpointError, match="changed since it was read"):
        ck.read_again(QCONFIG_NAME)
    with pytest.raises(CheckpointError, match="changed since it was read"):
        ck.read_again(ck.shards[0])  # never parsed: nothing recorded to prove it by


@pytest.mark.parametrize("minified", [("base",), ("donor",), ("base", "donor")])
def test_quantization_configs_in_another_layout_build_the_same_document(sources, copy_of, tmp_path: Path, minified) -> None:  # type: ignore[no-untyped-def]
    """A base or donor whose quantization_config.json is not in exllamav3's layout (minified: no
    entry spans to prove) is parsed whole; the mosaic's document is the same as from the indent=4
    texts, only written anew, and the mosaic audits clean."""
    from mosaic._audit.run import audit

    base, donor = sources
    ref = build(write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path)), out=tmp_path / "ref", jobs=1).out_dir
    folders = {"base": base, "donor": donor}
    for which in minified:
        folders[which] = copy_of(folders[which], which)
        q = folders[which] / "quantization_config.json"
        q.write_text(json.dumps(json.loads(q.read_text()), separators=(",", ":")))
    at = tmp_path / "r2"
    at.mkdir()
    out = build(write_recipe(at, recipe_doc(folders["base"], folders["donor"], at=at)), out=tmp_path / "out", jobs=1).out_dir
    got, want = (json.loads((p / "quantization_config.json").read_bytes()) for p in (out, ref))
    assert got == want
    if "base" not in minified:  # the base's text is spliced as before: the same bytes
        assert (out / "quantization_config.json").read_bytes() == (ref / "quantization_config.json").read_bytes()
    assert audit(out).ok


def test_a_donor_entry_span_holding_two_members_is_never_spliced(sources, copy_of, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A donor text whose entry, by its lines, runs on into a second member ("zz.extra"): valid
    JSON, but the span is not one member. The mosaic takes the entry the whole parse gives, and
    nothing of the member that rode along."""
    from mosaic._audit.run import audit
    from mosaic._checkpoint.qconfig import entry_span_list

    base, donor = sources
    donor = copy_of(donor, "donor")
    q = donor / "quantization_config.json"
    text = q.read_bytes()
    span = next(s for s in entry_span_list(text) if ".layers.4.mlp.experts." in s.key)
    entry = text[span.start : span.end]
    assert entry.endswith(b"\n        }")
    forged = entry[: -len(b"\n        }")] + b'\n            }, "zz.extra": {\n            "bits_per_weight": 9\n        }'
    q.write_bytes(text[: span.start] + forged + text[span.end :])
    whole = json.loads(q.read_bytes())
    assert "zz.extra" in whole["tensor_storage"] and span.key in whole["tensor_storage"]
    out = build(write_recipe(tmp_path, recipe_doc(base, donor, at=tmp_path)), out=tmp_path / "out", jobs=1).out_dir
    got = json.loads((out / "quantization_config.json").read_bytes())
    assert "zz.extra" not in got["tensor_storage"]
    assert got["tensor_storage"][span.key] == whole["tensor_storage"][span.key]
    assert audit(out).ok
