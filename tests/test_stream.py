"""Hub-native mosaics: census and plan from headers read by ranges, streamed builds, rebuilds of published mosaics.

Against a local hub look-alike (mosaic/testing/hub.py) that counts the bytes it serves, redirects LFS reads
to a storage URL as the real hub does, and can drop connections, corrupt files or name another commit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mosaic._audit.run import audit
from mosaic._build.run import build
from mosaic._formats.safetensors_reader import read_header
from mosaic._hub.partial import PartialSnapshot, _subtract
from mosaic._hub.ranges import RangeReader
from mosaic._release.publishing import publish
from mosaic.cli.commands import main
from mosaic.testing.hub import FakeHub

from .test_hub import BASE, DONOR, REPO, files_of, hub, offline, published_base  # noqa: F401  (fixtures)

DONOR_REPO = "test-org/donor-exl3"


def served(fake: FakeHub, repo: str, suffix: str = ".safetensors") -> int:
    return sum(n for (r, p), n in fake.served.items() if r == repo and p.endswith(suffix))


@pytest.fixture
def donor_on_hub(hub: FakeHub, ckpt_factory) -> tuple[Path, str]:  # noqa: F811
    donor = ckpt_factory(DONOR)
    return donor, hub.commit(DONOR_REPO, files_of(donor))


# --- the range arithmetic and the partial snapshot -----------------------------------------------


def test_subtract_ranges() -> None:
    assert _subtract([(0, 10)], []) == [(0, 10)]
    assert _subtract([(0, 10)], [(2, 4), (6, 8)]) == [(0, 2), (4, 6), (8, 10)]
    assert _subtract([(0, 10), (10, 20)], [(5, 15)]) == [(0, 5), (15, 20)]
    assert _subtract([(3, 4)], [(0, 10)]) == []


@pytest.mark.parametrize("redirect", [False, True])
def test_headers_only_are_read_and_match_the_files(hub: FakeHub, published_base, redirect: bool) -> None:  # noqa: F811
    base, sha = published_base
    hub.redirect_lfs = redirect
    snap = PartialSnapshot(REPO, sha)
    moved = snap.open_for_reading()
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert served(hub, REPO) == sum(min(100_000, (base / n).stat().st_size) for n in shards)
    assert moved == sum(hub.served.values())
    for n in shards:
        assert read_header(snap.folder / n).tensors == read_header(base / n).tensors
    assert (snap.folder / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert snap.unverified() == shards
    small = [p for p in base.iterdir() if not p.name.endswith(".safetensors")]
    assert moved - served(hub, REPO) == sum(p.stat().st_size for p in small)  # small files whole, once


# --- plan and census from the hub: headers only --------------------------------------------------


def probe_bytes(folder: Path) -> int:
    return sum(min(100_000, p.stat().st_size) for p in folder.glob("*.safetensors"))


def scores_file(tmp_path: Path) -> Path:
    p = tmp_path / "scores.json"
    p.write_text(json.dumps({"higher_is_better": True, "scores": {str(i): s for i, s in enumerate([0.1, 0.9, 0.2, 0.3, 0.8, 0.7])}}))
    return p


def test_plan_and_census_from_the_hub_read_headers_only(hub: FakeHub, published_base, donor_on_hub, tmp_path: Path) -> None:  # noqa: F811
    base, sha = published_base
    donor, dsha = donor_on_hub
    hub.redirect_lfs = True
    r = CliRunner().invoke(main, ["plan", "--base", f"{REPO}@{sha}", "--donor", f"q3={DONOR_REPO}@{dsha}",
                                  "--scores", str(scores_file(tmp_path)), "--layers", "2", "--json"])
    assert r.exit_code == 0, r.output
    remote = json.loads(r.stdout)
    assert served(hub, REPO) == probe_bytes(base) and served(hub, DONOR_REPO) == probe_bytes(donor)
    assert remote["hub_bytes_read"] == {"base": sum(v for (rp, _), v in hub.served.items() if rp == REPO),
                                        "q3": sum(v for (rp, _), v in hub.served.items() if rp == DONOR_REPO)}
    local = json.loads(CliRunner().invoke(main, ["plan", "--base", str(base), "--donor", f"q3={donor}",
                                                 "--scores", str(scores_file(tmp_path)), "--layers", "2", "--json"]).stdout)
    assert (remote["chosen"], remote["predicted_size"]) == (local["chosen"], local["predicted_size"])
    # census: the same report as from the folder; again no tensor bytes (the headers are cached now)
    before = dict(hub.served)
    r = CliRunner().invoke(main, ["census", f"{REPO}@{sha}", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert hub.served == before and doc["hub_bytes_read"] == 0
    here = json.loads(CliRunner().invoke(main, ["census", str(base), "--json"]).stdout)
    assert {k: v for k, v in doc.items() if k not in ("path", "hub_bytes_read", "notes")} == \
        {k: v for k, v in here.items() if k not in ("path", "notes")}
    assert doc["notes"] == [*here["notes"], "opened from its headers: 163 codebook marker values not read (codebooks from their names)"]
    plain = CliRunner().invoke(main, ["census", f"{REPO}@{sha}"])
    assert "bytes from the hub by ranges" in plain.output


# --- streamed builds ---------------------------------------------------------------------------------


RULES = [{"from": "q3", "layers": [1, "4-5"], "modules": ["mlp.experts"]}]


def hub_recipe(at: Path, sha: str, dsha: str, *, base_path: Path | None = None, donor_path: Path | None = None) -> Path:
    doc = {
        "name": "streamed",
        "base": {"path": str(base_path)} if base_path else {"repo": REPO, "revision": sha},
        "donors": {"q3": {"path": str(donor_path)} if donor_path else {"repo": DONOR_REPO, "revision": dsha}},
        "replace": RULES,
    }
    p = at / ("local.yaml" if base_path else "recipe.yaml")
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def union(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(ranges):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def expected_donor_bytes(donor: Path, out: Path) -> int:
    """Header probes plus the selected tensors' bytes, derived from the files, not from mosaic's plan."""
    prov = json.loads((out / "PROVENANCE.json").read_text())
    taken = {t["name"] for t in prov["tensors"] if t["source"] == "q3"}
    total = 0
    for f in sorted(donor.glob("*.safetensors")):
        h = read_header(f)
        ranges = [(0, min(100_000, f.stat().st_size))] + [h.file_range(t.name) for t in h.tensors if t.name in taken]
        total += union(ranges)
    return total


def test_streamed_build_reads_only_what_it_takes_and_equals_a_local_build(
    hub: FakeHub, published_base, donor_on_hub, tmp_path: Path  # noqa: F811
) -> None:
    base, sha = published_base
    donor, dsha = donor_on_hub
    hub.redirect_lfs = True
    r = CliRunner().invoke(main, ["build", str(hub_recipe(tmp_path, sha, dsha)), "--stream", "--out", str(tmp_path / "s"), "--json"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "s"
    assert served(hub, DONOR_REPO) == expected_donor_bytes(donor, out)
    assert served(hub, DONOR_REPO) < sum(p.stat().st_size for p in donor.glob("*.safetensors")) / 2
    assert json.loads(r.stdout)["hub_bytes_read"]["q3"] == sum(v for (rp, _), v in hub.served.items() if rp == DONOR_REPO)
    local = build(hub_recipe(tmp_path, sha, dsha, base_path=base, donor_path=donor), out=tmp_path / "l").out_dir
    for f in sorted(local.iterdir()):
        if f.name.endswith(".safetensors") or f.name in ("config.json", "quantization_config.json", "model.safetensors.index.json"):
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    ps, pl = (json.loads((d / "PROVENANCE.json").read_text()) for d in (out, local))
    assert ps["tensors"] == pl["tensors"]
    flags = {f["name"]: f.get("sha256_verified", True) for f in ps["sources"]["q3"]["files"]}
    assert {n for n, v in flags.items() if v is False} == {p.name for p in donor.glob("*.safetensors") if p.name in flags}
    assert "read from the hub by byte ranges" in (out / "README.md").read_text()
    assert audit(out).ok
    # again: every range is in the cache (hashed again before use); nothing more is read
    before = dict(hub.served)
    build(hub_recipe(tmp_path, sha, dsha), out=tmp_path / "s2", stream=True)
    assert {k: v for k, v in hub.served.items() if k[1].endswith(".safetensors")} == \
        {k: v for k, v in before.items() if k[1].endswith(".safetensors")}
    assert (tmp_path / "s2" / "PROVENANCE.json").read_bytes() == (out / "PROVENANCE.json").read_bytes()


def test_a_dropped_connection_is_resumed(hub: FakeHub, published_base, donor_on_hub, tmp_path: Path) -> None:  # noqa: F811
    _base, sha = published_base
    donor, dsha = donor_on_hub
    first = sorted(p.name for p in donor.glob("*.safetensors"))[0]
    hub.drop[(DONOR_REPO, first)] = 2
    res = build(hub_recipe(tmp_path, sha, dsha), out=tmp_path / "s", stream=True)
    assert hub.drop[(DONOR_REPO, first)] == 0
    assert audit(res.out_dir).ok


def test_a_connection_that_keeps_dropping_fails_keeps_what_was_read_and_resumes(
    hub: FakeHub, published_base, donor_on_hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    _base, sha = published_base
    donor, dsha = donor_on_hub
    monkeypatch.setattr(RangeReader, "__init__", _fast_retries(RangeReader.__init__))
    last = sorted(p.name for p in donor.glob("*.safetensors"))[-1]
    hub.drop[(DONOR_REPO, last)] = 100
    r = CliRunner().invoke(main, ["build", str(hub_recipe(tmp_path, sha, dsha)), "--stream", "--out", str(tmp_path / "s")])
    assert r.exit_code == 2 and last in r.stderr and "could not be read" in r.stderr
    assert not (tmp_path / "s").exists() and not list(tmp_path.glob(".s.mosaic-partial-*"))
    hub.drop.clear()
    before = served(hub, DONOR_REPO)
    build(hub_recipe(tmp_path, sha, dsha), out=tmp_path / "s", stream=True)
    # the second run read only what the first could not finish: less than a fresh run would
    assert served(hub, DONOR_REPO) - before < expected_donor_bytes(donor, tmp_path / "s")
    assert audit(tmp_path / "s").ok


def _fast_retries(init):  # type: ignore[no-untyped-def]
    def wrapped(self, *a, **kw):  # type: ignore[no-untyped-def]
        kw.update(retries=2, backoff=0.01)
        init(self, *a, **kw)
    return wrapped


def test_another_commit_is_refused(hub: FakeHub, published_base, donor_on_hub, tmp_path: Path) -> None:  # noqa: F811
    _base, sha = published_base
    _donor, dsha = donor_on_hub
    hub.other_commit[DONOR_REPO] = "f" * 40
    r = CliRunner().invoke(main, ["build", str(hub_recipe(tmp_path, sha, dsha)), "--stream", "--out", str(tmp_path / "s")])
    assert r.exit_code == 1 and "served commit ffff" in r.stderr and DONOR_REPO in r.stderr
    assert not (tmp_path / "s").exists()


def test_a_corrupted_file_read_whole_is_caught_and_discarded(hub: FakeHub, published_base, donor_on_hub, tmp_path: Path) -> None:  # noqa: F811
    base, sha = published_base
    _donor, dsha = donor_on_hub
    cfg = (base / "config.json").read_bytes()
    hub.corrupt[(REPO, "config.json")] = cfg.replace(b"{", b"[", 1)
    r = CliRunner().invoke(main, ["build", str(hub_recipe(tmp_path, sha, dsha)), "--stream", "--out", str(tmp_path / "s")])
    assert r.exit_code == 1 and "config.json" in r.stderr and "do not match the hub's digest" in r.stderr
    assert not (tmp_path / "s").exists()
    assert not (PartialSnapshot(REPO, sha).folder / "config.json").exists()  # nothing unverified is kept


def test_a_damaged_cached_range_is_read_again(hub: FakeHub, published_base, donor_on_hub, tmp_path: Path) -> None:  # noqa: F811
    _base, sha = published_base
    donor, dsha = donor_on_hub
    build(hub_recipe(tmp_path, sha, dsha), out=tmp_path / "a", stream=True)
    snap = PartialSnapshot(DONOR_REPO, dsha)
    name = sorted(p.name for p in donor.glob("*.safetensors"))[0]
    piece = snap.pieces(name)[-1]
    with open(snap.folder / name, "r+b") as f:
        f.seek(piece.start)
        b = f.read(1)
        f.seek(piece.start)
        f.write(bytes([b[0] ^ 1]))
    before = served(hub, DONOR_REPO)
    build(hub_recipe(tmp_path, sha, dsha), out=tmp_path / "b", stream=True)
    assert served(hub, DONOR_REPO) - before == piece.end - piece.start
    assert (tmp_path / "b" / "PROVENANCE.json").read_bytes() == (tmp_path / "a" / "PROVENANCE.json").read_bytes()


def test_without_stream_an_uncached_repo_source_is_an_error_naming_both_ways(
    hub: FakeHub, published_base, donor_on_hub, tmp_path: Path  # noqa: F811
) -> None:
    _base, sha = published_base
    _donor, dsha = donor_on_hub
    r = CliRunner().invoke(main, ["build", str(hub_recipe(tmp_path, sha, dsha)), "--out", str(tmp_path / "s")])
    assert r.exit_code == 2 and "mosaic fetch" in r.stderr and "--stream" in r.stderr
    assert served(hub, REPO) == 0


# --- rebuilding a published mosaic ------------------------------------------------------------------


MOSAIC_REPO = "test-org/streamed-mosaic"


@pytest.fixture
def published_mosaic(hub: FakeHub, published_base, donor_on_hub, tmp_path: Path) -> tuple[Path, str]:  # noqa: F811
    """A mosaic of two hub sources, published; the range cache is emptied so rebuilds start cold."""
    _base, sha = published_base
    _donor, dsha = donor_on_hub
    hub.redirect_lfs = True
    out = build(hub_recipe(tmp_path, sha, dsha), out=tmp_path / "m", stream=True).out_dir
    commit = publish(out, MOSAIC_REPO).commit
    assert commit is not None
    shutil.rmtree(hub.home / "mosaic" / "ranges")  # type: ignore[attr-defined]
    hub.served.clear()
    return out, commit


def same_folder(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_rebuild_is_byte_identical_and_reads_no_published_shard(hub: FakeHub, published_mosaic, donor_on_hub, tmp_path: Path) -> None:  # noqa: F811
    out, commit = published_mosaic
    donor, _ = donor_on_hub
    r = CliRunner().invoke(main, ["rebuild", f"{MOSAIC_REPO}@{commit}", "--out", str(tmp_path / "r"), "--json"])
    assert r.exit_code == 0, r.output
    same_folder(out, tmp_path / "r")
    assert served(hub, MOSAIC_REPO) == 0  # the published shards are never read
    assert served(hub, DONOR_REPO) == expected_donor_bytes(donor, out)
    doc = json.loads(r.stdout)
    assert doc["identical"] and doc["hub_bytes_read"]["published"] == sum(
        v for (rp, _), v in hub.served.items() if rp == MOSAIC_REPO)
    assert audit(tmp_path / "r").ok


def test_rebuild_with_a_local_base_reads_only_the_donors_ranges(hub: FakeHub, published_mosaic, published_base, tmp_path: Path) -> None:  # noqa: F811
    out, commit = published_mosaic
    base, _ = published_base
    r = CliRunner().invoke(main, ["rebuild", f"{MOSAIC_REPO}@{commit}", "--source", f"base={base}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    same_folder(out, tmp_path / "r")
    assert served(hub, REPO) == 0 and served(hub, MOSAIC_REPO) == 0 and served(hub, DONOR_REPO) > 0
    assert "source base from" in r.output


def test_rebuild_catches_a_corrupted_range_names_the_tensor_and_keeps_nothing(
    hub: FakeHub, published_mosaic, donor_on_hub, tmp_path: Path  # noqa: F811
) -> None:
    out, commit = published_mosaic
    donor, _ = donor_on_hub
    prov = json.loads((out / "PROVENANCE.json").read_text())
    victim = next(t["name"] for t in prov["tensors"] if t["source"] == "q3" and t["name"].endswith(".trellis"))
    shard = next(f for f in sorted(donor.glob("*.safetensors")) if victim in {t.name for t in read_header(f).tensors})
    a, _ = read_header(shard).file_range(victim)
    data = bytearray(shard.read_bytes())
    data[a + 3] ^= 0xFF
    hub.corrupt[(DONOR_REPO, shard.name)] = bytes(data)
    r = CliRunner().invoke(main, ["rebuild", f"{MOSAIC_REPO}@{commit}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 1, r.output
    assert victim in r.stderr and "'q3'" in r.stderr
    assert not (tmp_path / "r").exists() and not [p for p in tmp_path.iterdir() if "mosaic-partial" in p.name]


def test_rebuild_needs_the_recipes_local_folders(hub: FakeHub, published_base, donor_on_hub, tmp_path: Path) -> None:  # noqa: F811
    _base, sha = published_base
    donor, _ = donor_on_hub
    out = build(hub_recipe(tmp_path, sha, "0" * 40, donor_path=donor), out=tmp_path / "m", stream=True).out_dir
    commit = publish(out, MOSAIC_REPO).commit
    r = CliRunner().invoke(main, ["rebuild", f"{MOSAIC_REPO}@{commit}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 2 and "--source q3=PATH" in r.stderr
    r = CliRunner().invoke(main, ["rebuild", f"{MOSAIC_REPO}@{commit}", "--out", str(tmp_path / "r"), "--source", f"q3={donor}"])
    assert r.exit_code == 0, r.output
    same_folder(out, tmp_path / "r")


def test_publish_recipe_only_then_rebuild(hub: FakeHub, published_mosaic, tmp_path: Path) -> None:  # noqa: F811
    out, _ = published_mosaic
    res = publish(out, "test-org/recipe-only", recipe_only=True)
    files = hub.repos["test-org/recipe-only"].commits[res.commit]
    assert not [n for n in files if n.endswith(".safetensors")]
    assert {"mosaic-recipe.yaml", "PROVENANCE.json", "sha256-manifest.txt", "README.md", "config.json"} <= set(files)
    assert "recipe only" in res.commit_message
    assert "mosaic rebuild" in files["README.md"].decode()
    r = CliRunner().invoke(main, ["rebuild", f"test-org/recipe-only@{res.commit}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    same_folder(out, tmp_path / "r")


def test_a_signed_mosaic_published_recipe_only_rebuilds_and_still_verifies(hub: FakeHub, published_mosaic,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    from .test_hub import _ec_keys

    out, _ = published_mosaic
    priv, pub = _ec_keys(tmp_path)
    assert CliRunner().invoke(main, ["sign", str(out), "--key", str(priv)]).exit_code == 0
    res = publish(out, "test-org/signed-recipe-only", recipe_only=True)
    assert "model.sig" in hub.repos["test-org/signed-recipe-only"].commits[res.commit]
    r = CliRunner().invoke(main, ["rebuild", f"test-org/signed-recipe-only@{res.commit}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    same_folder(out, tmp_path / "r")
    r = CliRunner().invoke(main, ["audit", str(tmp_path / "r"), "--key", str(pub)])
    assert r.exit_code == 0 and "signature: verified model.sig" in r.output, r.output


def test_rebuild_refuses_a_published_file_its_sources_do_not_give(hub: FakeHub, published_mosaic, tmp_path: Path) -> None:  # noqa: F811
    """A forged repo whose config.json was changed, with a manifest made to agree: not 'identical'."""
    import hashlib

    from mosaic._provenance.records import FileRecord, manifest

    out, _ = published_mosaic
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    files["config.json"] = files["config.json"].replace(b"{", b'{"forged": 1, ', 1)
    del files["sha256-manifest.txt"]
    files["sha256-manifest.txt"] = manifest([FileRecord(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in files.items()])
    forged = hub.commit("test-org/forged", files)
    r = CliRunner().invoke(main, ["rebuild", f"test-org/forged@{forged}", "--out", str(tmp_path / "r")])
    assert r.exit_code == 1 and "config.json: the published file differs" in r.stderr
    assert not (tmp_path / "r").exists() and not [p for p in tmp_path.iterdir() if "mosaic-partial" in p.name]
