"""mosaic fetch / publish / make release with the real huggingface_hub client against a local fake hub.

No internet: the hub is ``mosaic/testing/hub.py`` on 127.0.0.1 (HF_ENDPOINT), the cache a tmp folder
(HF_HOME, HF_HUB_CACHE). In-process tests point huggingface_hub's constants there too, since it
reads its environment at import; the subprocess tests use the environment alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from huggingface_hub import ModelCard

from mosaic._audit.run import audit
from mosaic._base.errors import RecipeError, SourceError, VerificationError
from mosaic._base.version import __version__
from mosaic._build.run import build
from mosaic._hub.download import fetch, fetch_snapshot
from mosaic._hub.snapshot import cache_snapshot_folder, record_path, resolve_snapshot, verified_digests
from mosaic._provenance.signature import load_trust
from mosaic._release.publishing import PublishError, compare_with_hub, publish, upload_plan
from mosaic._sources.resolve import hub_snapshot
from mosaic.cli.commands import main
from mosaic.testing.exl3 import every_group_geometry
from mosaic.testing.hub import FakeHub

ROOT = Path(__file__).resolve().parents[1]
BASE = every_group_geometry(bits=2, seed=1)
DONOR = every_group_geometry(bits=3, head_bits=8, seed=2, style="library", shard_size=1 << 20)
TOKEN = "hf_mosaicTestTokenNeverPrinted0123456789"
REPO = "test-org/base-exl3"


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hub_env(fake: FakeHub, home: Path) -> dict[str, str]:
    return {**fake.environment(home), "HF_TOKEN": TOKEN}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from huggingface_hub import constants

    home = tmp_path / "hf"
    with FakeHub() as fake:
        for k, v in hub_env(fake, home).items():
            monkeypatch.setenv(k, v)
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HOME", str(home))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
        fake.home = home  # type: ignore[attr-defined]
        yield fake


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch):
    from huggingface_hub import constants

    def go() -> None:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    return go


@pytest.fixture
def published_base(hub: FakeHub, ckpt_factory) -> tuple[Path, str]:
    """The synthetic base checkpoint, committed to the fake hub; returns (local folder, commit)."""
    base = ckpt_factory(BASE)
    return base, hub.commit(REPO, files_of(base))


def write_recipe(at: Path, revision: str, donor: Path, repo: str = REPO) -> Path:
    doc = {
        "name": "hub-mosaic",
        "base": {"repo": repo, "revision": revision},
        "donors": {"q3": {"path": os.path.relpath(donor, at)}},
        "replace": [{"from": "q3", "layers": [1, "4-5"], "modules": ["mlp.experts"]}],
    }
    p = at / "recipe.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def requests(fake: FakeHub, method: str | None = None, part: str = "") -> list[str]:
    return [p for m, p in fake.log if (method is None or m == method) and part in p]


def no_token_below(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert TOKEN.encode() not in p.read_bytes(), f"token written to {p}"


# --- fetch -----------------------------------------------------------------------------------------


def test_pinned_fetch_verifies_records_and_does_not_hash_twice(hub: FakeHub, published_base, tmp_path: Path) -> None:
    base, sha = published_base
    got = fetch_snapshot(REPO, sha)
    assert got.folder == cache_snapshot_folder(REPO, sha)
    assert got.folder.is_relative_to(hub.home / "hub")  # type: ignore[attr-defined]
    on_hub = files_of(base)
    assert got.files == len(on_hub) + 1  # + the hub's .gitattributes
    assert got.hashed == got.files and got.unchanged == 0 and not got.offline
    for name, data in on_hub.items():
        assert (got.folder / name).read_bytes() == data
    # every file downloaded at the pinned commit, never through a branch
    resolves = requests(hub, "GET", "/resolve/")
    assert resolves and all(f"/resolve/{sha}/" in p for p in resolves)
    # the record: outside the snapshot, one SHA-256 per file
    rec = record_path(REPO, sha)
    assert rec.is_file() and rec.is_relative_to(hub.home / "mosaic" / "verified")  # type: ignore[attr-defined]
    assert not any(p.name.endswith(".json") and "verified" in p.name for p in got.folder.iterdir())
    digests = verified_digests(REPO, sha)
    assert digests == {n: hashlib.sha256(d).hexdigest() for n, d in files_of(got.folder).items()}
    assert set(digests) >= set(on_hub)
    # fetching again: nothing downloaded, nothing hashed
    n_get = len(requests(hub, "GET", "/resolve/"))
    again = fetch_snapshot(REPO, sha)
    assert (again.hashed, again.unchanged) == (0, got.files)
    assert len(requests(hub, "GET", "/resolve/")) == n_get
    # a file changed on disk (new mtime) drops out of verified_digests; the rest stays
    shard = next(n for n in on_hub if n.endswith(".safetensors"))
    st = (got.folder / shard).stat()
    os.utime(got.folder / shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    after = verified_digests(REPO, sha)
    assert after is not None and shard not in after and len(after) == len(digests) - 1
    assert verified_digests(REPO, "0" * 40) is None
    # --local-dir: a plain folder, its own record, the same digests
    ld = fetch_snapshot(REPO, sha, local_dir=tmp_path / "ld")
    assert ld.folder == tmp_path / "ld" and ld.hashed == ld.files
    assert verified_digests(REPO, sha, local_dir=tmp_path / "ld") == digests
    # the token was sent to the hub, and written nowhere
    assert hub.auth and all(a == f"Bearer {TOKEN}" for a in hub.auth)
    no_token_below(tmp_path)


def test_corrupted_download_is_detected_and_removed(hub: FakeHub, published_base, tmp_path: Path, ckpt_factory) -> None:
    base, sha = published_base
    shard = sorted(n for n in files_of(base) if n.endswith(".safetensors"))[0]
    good = (base / shard).read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF  # same size: only the digest can tell
    hub.corrupt[(REPO, shard)] = bytes(bad)
    cfg = (base / "config.json").read_bytes()
    hub.corrupt[(REPO, "config.json")] = cfg.replace(b"{", b" ", 1)  # a small, non-LFS file
    with pytest.raises(VerificationError) as e:
        fetch_snapshot(REPO, sha)
    msg = str(e.value)
    assert shard in msg and "config.json" in msg and e.value.exit_code == 1
    assert f"sha256:{hashlib.sha256(good).hexdigest()}" in msg  # the hub's digest, named
    folder = cache_snapshot_folder(REPO, sha)
    assert not (folder / shard).exists() and not (folder / "config.json").exists()
    digests = verified_digests(REPO, sha)
    assert digests is not None and shard not in digests and "config.json" not in digests
    # the hub serves the right bytes again: fetching again repairs the snapshot
    hub.corrupt.clear()
    got = fetch_snapshot(REPO, sha)
    assert got.hashed == 2 and (folder / shard).read_bytes() == good
    assert verified_digests(REPO, sha)[shard] == hashlib.sha256(good).hexdigest()  # type: ignore[index]
    # on the command line: exit 1, one error line naming the file
    sha2 = hub.commit(REPO, {"notes.txt": b"a new file in a new commit\n"})
    hub.corrupt[(REPO, "notes.txt")] = b"A NEW FILE in a new commit\n"
    r = CliRunner().invoke(main, ["fetch", str(write_recipe(tmp_path, sha2, ckpt_factory(DONOR)))])
    assert r.exit_code == 1 and r.output.startswith("mosaic: error:") and "notes.txt" in r.output
    assert "Traceback" not in r.output


def test_branch_names_are_refused_with_how_to_pin(hub: FakeHub, published_base, tmp_path: Path, ckpt_factory) -> None:
    for rev in ("main", "v1.0", "51058cd"):
        with pytest.raises(SourceError) as e:
            fetch_snapshot(REPO, rev)
        assert "40-hex" in str(e.value) and f"git ls-remote https://huggingface.co/{REPO}" in str(e.value)
        with pytest.raises(SourceError):
            resolve_snapshot(REPO, rev)
        assert verified_digests(REPO, rev) is None
    assert hub.log == []  # refused before any request
    recipe = write_recipe(tmp_path, "main", ckpt_factory(DONOR))
    with pytest.raises(RecipeError):
        fetch(recipe)
    r = CliRunner().invoke(main, ["fetch", str(recipe)])
    assert r.exit_code == 2 and "mosaic: error:" in r.output and "revision" in r.output
    assert hub.log == []


def test_offline_resolves_from_the_cache(hub: FakeHub, published_base, offline, tmp_path: Path, ckpt_factory) -> None:
    _, sha = published_base
    online = fetch_snapshot(REPO, sha)
    n = len(hub.log)
    offline()
    got = fetch_snapshot(REPO, sha)
    assert got.offline and got.folder == online.folder and got.hashed == 0 and got.unchanged == online.files
    assert resolve_snapshot(REPO, sha) == online.folder
    assert hub_snapshot(REPO, sha) == online.folder
    r = CliRunner().invoke(main, ["fetch", str(write_recipe(tmp_path, sha, ckpt_factory(DONOR)))])
    assert r.exit_code == 0 and "offline" in r.output and sha in r.output
    assert len(hub.log) == n  # no request at all
    with pytest.raises(SourceError) as e:
        fetch_snapshot("test-org/never-fetched", "a" * 40)
    assert "HF_HUB_OFFLINE" in str(e.value)
    with pytest.raises(SourceError) as e:
        resolve_snapshot("test-org/never-fetched", "a" * 40)
    assert "mosaic fetch" in str(e.value)


def test_incomplete_cache_names_the_missing_file(hub: FakeHub, published_base, offline, tmp_path: Path, ckpt_factory) -> None:
    base, sha = published_base
    folder = fetch_snapshot(REPO, sha).folder
    shard = sorted(n for n in files_of(base) if n.endswith(".safetensors"))[-1]
    (folder / shard).unlink()
    offline()
    for call in (lambda: resolve_snapshot(REPO, sha), lambda: fetch_snapshot(REPO, sha)):
        with pytest.raises(SourceError) as e:
            call()
        assert shard in str(e.value) and "incomplete" in str(e.value)
    recipe = write_recipe(tmp_path, sha, ckpt_factory(DONOR))
    with pytest.raises(SourceError) as e:
        build(recipe, out=tmp_path / "out", jobs=1)
    assert shard in str(e.value)
    # without mosaic's record, the listing huggingface_hub cached beside the snapshot still names it
    record_path(REPO, sha).unlink()
    with pytest.raises(SourceError) as e:
        resolve_snapshot(REPO, sha)
    assert shard in str(e.value)
    r = CliRunner().invoke(main, ["build", str(recipe), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and shard in r.output and "Traceback" not in r.output


def test_build_from_cache_resolved_repo_base_records_provenance(
    hub: FakeHub, published_base, offline, tmp_path: Path, ckpt_factory
) -> None:
    base, sha = published_base
    recipe = write_recipe(tmp_path, sha, ckpt_factory(DONOR))
    r = CliRunner().invoke(main, ["fetch", str(recipe), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [(s["repo"], s["revision"]) for s in doc["sources"]] == [(REPO, sha)]
    assert TOKEN not in r.output
    offline()
    n = len(hub.log)
    res = build(recipe, out=tmp_path / "out", jobs=2)
    assert len(hub.log) == n  # built from the cache alone
    prov = json.loads((res.out_dir / "PROVENANCE.json").read_text())
    src = prov["sources"]["base"]
    assert src["repo"] == REPO and src["revision"] == sha and "path" not in src
    digests = verified_digests(REPO, sha)
    assert digests is not None
    recorded = {f["name"]: f for f in src["files"]}
    assert recorded
    for name, f in recorded.items():
        assert f["sha256"] == digests[name] == sha256(base / name)
        assert f["size"] == (base / name).stat().st_size
    assert str(hub.home) not in json.dumps(prov)  # type: ignore[attr-defined]
    assert audit(res.out_dir, sources=recipe).ok
    card = ModelCard.load(res.out_dir / "README.md")  # the hub's own parser: lineage to the base repo
    assert card.data.base_model == REPO and card.data.base_model_relation == "quantized"
    assert f"`{REPO}` @ `{sha}`" in card.text


# --- publish ---------------------------------------------------------------------------------------


@pytest.fixture
def mosaic_dir(tmp_path: Path, ckpt_factory) -> Path:
    base, donor = ckpt_factory(BASE), ckpt_factory(DONOR)
    doc = {
        "name": "pub-mosaic",
        "base": {"path": os.path.relpath(base, tmp_path)},
        "donors": {"q3": {"path": os.path.relpath(donor, tmp_path)}},
        "replace": [{"from": "q3", "layers": [1], "modules": ["mlp.experts"]}],
    }
    (tmp_path / "pub.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return build(tmp_path / "pub.yaml", out=tmp_path / "mosaic", jobs=2).out_dir


def test_publish_refuses_a_folder_that_fails_its_audit(hub: FakeHub, mosaic_dir: Path, copy_of) -> None:
    bad = copy_of(mosaic_dir, "bad")
    cfg = bad / "generation_config.json"
    cfg.write_bytes(cfg.read_bytes() + b" ")
    for dry in (False, True):
        with pytest.raises(PublishError) as e:
            publish(bad, "test-org/pub", dry_run=dry)
        assert "audit" in str(e.value) and "generation_config.json" in str(e.value) and e.value.exit_code == 2
    r = CliRunner().invoke(main, ["publish", str(bad), "--repo", "test-org/pub"])
    assert r.exit_code == 2 and "refusing to publish" in r.output
    assert hub.log == []


def test_publish_dry_run_lists_the_upload_and_touches_nothing(hub: FakeHub, mosaic_dir: Path) -> None:
    res = publish(mosaic_dir, "test-org/pub", dry_run=True)
    on_disk = {p.name: p.stat().st_size for p in mosaic_dir.iterdir()}
    assert {f.name: f.size for f in res.files} == on_disk
    assert res.commit is None and res.dry_run
    prov = json.loads((mosaic_dir / "PROVENANCE.json").read_text())
    assert prov["recipe"]["sha256"] in res.commit_message and __version__ in res.commit_message
    r = CliRunner().invoke(main, ["publish", str(mosaic_dir), "--repo", "test-org/pub", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["dry_run"] and doc["commit"] is None
    assert [(f["name"], f["size"]) for f in doc["files"]] == sorted(on_disk.items())
    r = CliRunner().invoke(main, ["publish", str(mosaic_dir), "--repo", "test-org/pub", "--dry-run"])
    assert r.exit_code == 0 and "would upload" in r.output and "model.safetensors.index.json" in r.output
    assert hub.log == [] and "test-org/pub" not in hub.repos


def test_publish_uploads_one_commit_and_reads_back_digests(hub: FakeHub, mosaic_dir: Path, tmp_path: Path) -> None:
    hub.commit("test-org/pub", {"model-99999-of-99999.safetensors": b"stale shard of an older upload"})
    r = CliRunner().invoke(main, ["publish", str(mosaic_dir), "--repo", "test-org/pub", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    repo = hub.repos["test-org/pub"]
    assert doc["commit"] == repo.refs["main"] and doc["verified"]
    assert doc["deleted"] == ["model-99999-of-99999.safetensors"]
    assert len(requests(hub, "POST", "/commit/")) == 1  # one commit
    assert requests(hub, "PUT", "/lfs-upload/")  # shards went through LFS
    tree = repo.commits[doc["commit"]]
    assert {n: d for n, d in tree.items() if n != ".gitattributes"} == files_of(mosaic_dir)
    assert TOKEN not in r.output and all(a == f"Bearer {TOKEN}" for a in hub.auth)
    no_token_below(tmp_path)
    # the consumer side, as the README tells it: download by commit, sha256sum -c, audit as downloaded
    from huggingface_hub import snapshot_download

    dl = Path(snapshot_download("test-org/pub", revision=doc["commit"], local_dir=tmp_path / "consumer"))
    if shutil.which("sha256sum"):
        p = subprocess.run(["sha256sum", "--quiet", "-c", "sha256-manifest.txt"], cwd=dl, capture_output=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
    rep = audit(dl)
    assert rep.ok, rep.failures
    assert rep.counts["hub_files_ignored"] >= 2  # .gitattributes and the download records
    # plain output ends with the commit id; a branch is created when missing
    r = CliRunner().invoke(main, ["publish", str(mosaic_dir), "--repo", "test-org/pub", "--branch", "rc1"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-1] == repo.refs["rc1"]
    # the hub claiming another digest for a shard after the upload is a verification failure
    shard = sorted(n for n in tree if n.endswith(".safetensors"))[0]
    hub.tamper[("test-org/pub", shard)] = "0" * 64
    with pytest.raises(VerificationError) as e:
        publish(mosaic_dir, "test-org/pub", branch="rc2")
    assert shard in str(e.value) and "0" * 64 in str(e.value)


def _ec_keys(at: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    k = ec.generate_private_key(ec.SECP256R1())
    priv, pub = at / "sign.pem", at / "sign.pub"
    priv.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def test_publish_uploads_the_signature_and_a_download_verifies(hub: FakeHub, mosaic_dir: Path, tmp_path: Path) -> None:
    from model_signing import verifying

    priv, pub = _ec_keys(tmp_path)
    r = CliRunner().invoke(main, ["publish", str(mosaic_dir), "--repo", "test-org/signed", "--dry-run"])
    assert r.exit_code == 0 and "not signed" in r.output
    assert CliRunner().invoke(main, ["sign", str(mosaic_dir), "--key", str(priv)]).exit_code == 0
    r = CliRunner().invoke(main, ["publish", str(mosaic_dir), "--repo", "test-org/signed"])
    assert r.exit_code == 0, r.output
    assert "model.sig" in r.output and "--key PUBLIC_KEY" in r.output and "model_signing verify key" in r.output
    repo = hub.repos["test-org/signed"]
    tree = repo.commits[repo.refs["main"]]
    assert tree["model.sig"] == (mosaic_dir / "model.sig").read_bytes()
    # the consumer: a download (with the hub's .gitattributes and download records) verifies both ways
    from huggingface_hub import snapshot_download

    dl = Path(snapshot_download("test-org/signed", revision=repo.refs["main"], local_dir=tmp_path / "consumer"))
    assert (dl / ".cache" / "huggingface").is_dir()
    rep = audit(dl, trust=load_trust(pub, None, None))
    assert rep.ok and rep.signature and rep.signature["verified"], rep.failures
    verifying.Config().use_elliptic_key_verifier(public_key=pub).verify(dl, dl / "model.sig")
    # a signature that no longer matches the folder is not uploaded
    prov = json.loads((mosaic_dir / "PROVENANCE.json").read_text())
    prov["tool"]["version"] += "+edited"
    (mosaic_dir / "PROVENANCE.json").write_text(json.dumps(prov, indent=1) + "\n")
    from .test_audit import regenerate_manifest

    sig = (mosaic_dir / "model.sig").read_bytes()
    (mosaic_dir / "model.sig").unlink()
    regenerate_manifest(mosaic_dir)
    (mosaic_dir / "model.sig").write_bytes(sig)
    before = len(hub.log)
    for dry in (True, False):
        with pytest.raises(PublishError) as e:
            publish(mosaic_dir, "test-org/signed", dry_run=dry)
        assert "no longer matches" in str(e.value) and "PROVENANCE.json" in str(e.value)
    assert len(hub.log) == before


def test_compare_with_hub_checks_every_file(mosaic_dir: Path) -> None:
    from mosaic._hub.snapshot import HubFile, digest_local

    items, _ = upload_plan(mosaic_dir)
    remote = {}
    for it in items:
        d = digest_local(mosaic_dir / it.name)
        lfs = it.name.endswith(".safetensors")
        remote[it.name] = HubFile(it.name, it.size, d.git_sha1 if not lfs else "x", d.sha256 if lfs else None)
    assert compare_with_hub(mosaic_dir, items, remote) == []
    remote["config.json"] = HubFile("config.json", remote["config.json"].size, "f" * 40)
    del remote["README.md"]
    remote["extra.bin"] = HubFile("extra.bin", 1, "e" * 40, "e" * 64)
    problems = compare_with_hub(mosaic_dir, items, remote)
    assert len(problems) == 3
    assert any("config.json" in p for p in problems) and any("README.md: missing" in p for p in problems)
    assert any("extra.bin" in p for p in problems)


# --- the command line and make release, through the environment alone ----------------------------


def _env(fake: FakeHub, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and not k.startswith("HF_")}
    env.update(hub_env(fake, home))
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_cli_fetch_subprocess_uses_the_environment(tmp_path: Path, ckpt_factory) -> None:
    with FakeHub() as fake:
        base = ckpt_factory(BASE)
        sha = fake.commit(REPO, files_of(base))
        recipe = write_recipe(tmp_path, sha, ckpt_factory(DONOR))
        home = tmp_path / "home"
        p = subprocess.run([sys.executable, "-m", "mosaic.cli", "fetch", str(recipe), "--json"],
                           env=_env(fake, home), capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["sources"][0]["folder"].startswith(str(home / "hub"))
        assert TOKEN not in p.stdout + p.stderr
        assert (home / "mosaic" / "verified" / "test-org" / "base-exl3" / f"{sha}.json").is_file()
        # --local-dir: into DIR/<org>/<name>@<revision>, verified the same way
        p = subprocess.run([sys.executable, "-m", "mosaic.cli", "fetch", str(recipe), "--local-dir", "dl", "--json"],
                           env=_env(fake, home), capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        folder = tmp_path / "dl" / "test-org" / f"base-exl3@{sha}"
        assert json.loads(p.stdout)["sources"][0]["folder"] == str(folder)
        assert (folder / "config.json").read_bytes() == (base / "config.json").read_bytes()
        no_token_below(tmp_path)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_release_runs_fetch_build_audit_publish(tmp_path: Path, ckpt_factory) -> None:
    venv_bin = Path(sys.executable).parent
    with FakeHub() as fake:
        sha = fake.commit(REPO, files_of(ckpt_factory(BASE)))
        recipe = write_recipe(tmp_path, sha, ckpt_factory(DONOR))
        env = _env(fake, tmp_path / "home")
        args = ["make", "-s", "-C", str(ROOT), "release", f"BIN={venv_bin}", "STAMP=pyproject.toml"]
        # a revision the hub does not have: fetch fails, nothing is built or published
        (tmp_path / "x").mkdir()
        bad = write_recipe(tmp_path / "x", "b" * 40, ckpt_factory(DONOR))
        p = subprocess.run([*args, f"RECIPE={bad}", "REPO=test-org/rel", f"OUT={tmp_path / 'bad-out'}"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and "mosaic: error:" in p.stderr
        assert not (tmp_path / "bad-out").exists() and "test-org/rel" not in fake.repos
        p = subprocess.run([*args, f"RECIPE={recipe}", "REPO=test-org/rel", f"OUT={tmp_path / 'rel'}"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        commit = fake.repos["test-org/rel"].refs["main"]
        assert p.stdout.strip().splitlines()[-1] == commit
        assert [m for m, path in fake.log if "/commit/" in path] == ["POST"]
        assert TOKEN not in p.stdout + p.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_release_signs_after_the_audit_and_publishes_the_signature(tmp_path: Path, ckpt_factory) -> None:
    venv_bin = Path(sys.executable).parent
    priv, pub = _ec_keys(tmp_path)
    with FakeHub() as fake:
        sha = fake.commit(REPO, files_of(ckpt_factory(BASE)))
        recipe = write_recipe(tmp_path, sha, ckpt_factory(DONOR))
        env = _env(fake, tmp_path / "home")
        args = ["make", "-s", "-C", str(ROOT), "release", f"BIN={venv_bin}", "STAMP=pyproject.toml",
                f"RECIPE={recipe}", "REPO=test-org/srel", f"OUT={tmp_path / 'rel'}"]
        p = subprocess.run([*args, f"SIGN_KEY={tmp_path / 'absent.pem'}"], env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode != 0 and "cannot read SIGN_KEY" in p.stderr and "absent.pem" in p.stderr
        assert not (tmp_path / "rel").exists() and "test-org/srel" not in fake.repos  # nothing ran
        bad = tmp_path / "bad.pem"
        bad.write_text("not a key\n")
        p = subprocess.run([*args, f"SIGN_KEY={bad}"], env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode != 0 and "mosaic: error:" in p.stderr and "bad.pem" in p.stderr
        assert "test-org/srel" not in fake.repos  # nothing published unsigned
        p = subprocess.run([*args, f"SIGN_KEY={priv}", "FORCE=1"], env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "mosaic.cli sign" in p.stderr and "--sources" in p.stderr  # the audit against the sources, then the signature
        commit = fake.repos["test-org/srel"].refs["main"]
        assert fake.repos["test-org/srel"].commits[commit]["model.sig"] == (tmp_path / "rel" / "model.sig").read_bytes()
        assert audit(tmp_path / "rel", trust=load_trust(pub, None, None)).signature["verified"]  # type: ignore[index]
        assert str(priv.read_text().splitlines()[1]) not in p.stdout + p.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_release_fails_loudly_when_the_output_folder_cannot_be_read(tmp_path: Path) -> None:
    """Without OUT the folder comes from the recipe; a recipe that cannot be read stops everything."""
    venv_bin = Path(sys.executable).parent
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    p = subprocess.run(["make", "-s", "-C", str(ROOT), "release", f"BIN={venv_bin}", "STAMP=pyproject.toml",
                        f"RECIPE={bad}", "REPO=test-org/rel"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "make release: cannot read the output folder" in p.stderr
    assert "mosaic.cli fetch" not in p.stderr + p.stdout  # nothing ran after the failed lookup
