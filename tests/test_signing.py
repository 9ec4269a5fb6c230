"""mosaic sign and mosaic audit --key: OpenSSF model signing, checked both by mosaic and by the
``model_signing`` library's own verifier (reading every file itself), and the other way round."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mosaic._audit.run import audit
from mosaic._base.errors import VerificationError
from mosaic._build.run import build
from mosaic._provenance.records import MANIFEST_NAME, PROVENANCE_NAME, SIGNATURE_NAME, parse_manifest
from mosaic._provenance.signature import (
    IGNORE_PATHS,
    SigningError,
    is_ignored,
    library_manifest,
    load_signing_key,
    load_trust,
)
from mosaic._release.signing import sign
from mosaic.cli.commands import main

from .test_audit import flip, regenerate_manifest, tensor_pos
from .test_build import BASE, DONOR, recipe_doc, write_recipe

SPLICED = "model.layers.4.mlp.experts.3.down_proj.trellis"


def write_key(folder: Path, name: str, key: object, password: bytes | None = None) -> tuple[Path, Path]:
    """PEM private and public key files for ``key``; the private one encrypted with ``password``."""
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    priv = folder / f"{name}.pem"
    pub = folder / f"{name}.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc))  # type: ignore[attr-defined]
    pub.write_bytes(key.public_key().public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("keys")
    return {
        "p256": write_key(d, "p256", ec.generate_private_key(ec.SECP256R1())),
        "p384": write_key(d, "p384", ec.generate_private_key(ec.SECP384R1())),
        "p521": write_key(d, "p521", ec.generate_private_key(ec.SECP521R1())),
        "other": write_key(d, "other", ec.generate_private_key(ec.SECP256R1())),
        "encrypted": write_key(d, "encrypted", ec.generate_private_key(ec.SECP256R1()), b"correct horse"),
        "k1": write_key(d, "k1", ec.generate_private_key(ec.SECP256K1())),
        "rsa": write_key(d, "rsa", rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        "ed25519": write_key(d, "ed25519", ed25519.Ed25519PrivateKey.generate()),
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, ckpt_factory) -> Path:
    tmp = tmp_path_factory.mktemp("built")
    recipe = write_recipe(tmp, recipe_doc(ckpt_factory(BASE), ckpt_factory(DONOR), [
        {"from": "q3", "layers": [1, "4-5"], "modules": ["mlp.experts"]},
    ], at=tmp))
    return build(recipe, out=tmp / "mosaic").out_dir


@pytest.fixture(scope="module")
def signed_once(built: Path, keys, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("signed") / "m"
    shutil.copytree(built, dst)
    r = CliRunner().invoke(main, ["sign", str(dst), "--key", str(keys["p256"][0])])
    assert r.exit_code == 0, r.output
    return dst


@pytest.fixture
def signed(signed_once: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(signed_once, dst)
    return dst


@pytest.fixture
def unsigned(built: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "u"
    shutil.copytree(built, dst)
    return dst


def library_verify(folder: Path, public_key: Path) -> None:
    """The library's own verifier, guessing everything from the signature and reading every file."""
    from model_signing import verifying

    verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(folder, folder / SIGNATURE_NAME)


def run_audit(folder: Path, *args: str) -> tuple[int, str, dict]:
    r = CliRunner().invoke(main, ["audit", str(folder), *args, "--json"])
    assert "Traceback" not in r.output
    return r.exit_code, r.output, json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}


def signature_failures(doc: dict) -> list[dict]:
    return [f for c in doc["mosaics"][0]["checks"] if c["name"] == "signature" for f in c["failures"]]


# --- signing, and verifying by both sides ----------------------------------------------------------


def test_sign_then_verify_with_mosaic_and_with_the_library(signed: Path, keys) -> None:
    pub = keys["p256"][1]
    code, out, doc = run_audit(signed, "--key", str(pub))
    assert code == 0, out
    sig = doc["mosaics"][0]["signature"]
    assert sig["state"] == "verified" and sig["verified"] and sig["method"] == "key"
    assert sig["files"] == len(list(signed.iterdir())) - 1  # every file but model.sig
    assert any(c["name"] == "signature" and c["ok"] for c in doc["mosaics"][0]["checks"])
    library_verify(signed, pub)  # the independent check: the library hashes the folder itself
    # the manifest does not list the signature, sha256sum -c still passes, the audit knows the file
    listed = parse_manifest((signed / MANIFEST_NAME).read_bytes(), MANIFEST_NAME)
    assert SIGNATURE_NAME not in listed
    if shutil.which("sha256sum"):
        p = subprocess.run(["sha256sum", "--quiet", "-c", MANIFEST_NAME], cwd=signed, capture_output=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
    assert audit(signed).ok


def test_signature_is_the_library_format_over_every_file(signed: Path) -> None:
    """What mosaic signs is what the library's own hashing of the folder gives, ignore list included."""
    from model_signing import hashing
    from model_signing._signing import signing as lib_signing

    bundle = json.loads((signed / SIGNATURE_NAME).read_bytes())
    assert bundle["mediaType"].startswith("application/vnd.dev.sigstore.bundle")
    import base64

    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    assert statement["predicateType"] == lib_signing._PREDICATE_TYPE
    ser = statement["predicate"]["serialization"]
    assert ser == {"method": "files", "hash_type": "sha256", "allow_symlinks": False, "ignore_paths": list(IGNORE_PATHS)}
    names = sorted(r["name"] for r in statement["predicate"]["resources"])
    assert names == sorted(p.name for p in signed.iterdir() if p.name != SIGNATURE_NAME)
    theirs = hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME]).hash(signed)
    digests = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    assert library_manifest(signed.name, digests) == theirs
    assert digests[PROVENANCE_NAME] == hashlib.sha256((signed / PROVENANCE_NAME).read_bytes()).hexdigest()


@pytest.mark.parametrize("curve", ["p384", "p521"])
def test_every_supported_curve_signs_and_verifies(unsigned: Path, keys, curve: str) -> None:
    priv, pub = keys[curve]
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--key", str(priv), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["signature"]["file"] == SIGNATURE_NAME and out["audit"]["ok"]
    assert run_audit(unsigned, "--key", str(pub))[0] == 0
    library_verify(unsigned, pub)


def test_signing_and_verifying_read_the_folder_once(unsigned: Path, keys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library is handed the audit's digests: it never opens a file of the folder to hash it."""
    from model_signing._hashing import io as lib_io

    def refuse(self: object) -> None:
        raise AssertionError("the library read a file again")

    monkeypatch.setattr(lib_io.SimpleFileHasher, "compute", refuse)
    reads: list[str] = []
    import mosaic._audit.mosaic_folder as mf

    real = mf.digest_file
    monkeypatch.setattr(mf, "digest_file", lambda p, *a, **k: reads.append(Path(p).name) or real(p, *a, **k))
    sign(unsigned, load_signing_key(keys["p256"][0]))
    assert sorted(reads) == sorted(p.name for p in unsigned.iterdir() if p.name != SIGNATURE_NAME)
    reads.clear()
    rep = audit(unsigned, trust=load_trust(keys["p256"][1], None, None))
    assert rep.ok and rep.signature and rep.signature["verified"], rep.failures
    assert len(reads) == len(set(reads))  # each file once


# --- tampering, each caught and named -------------------------------------------------------------


def _flip_shard(m: Path) -> str:
    shard, a, _ = tensor_pos(m, SPLICED)
    flip(shard, a + 3)
    return shard.name


def _add_file(m: Path) -> str:
    (m / "notes.txt").write_text("added after signing\n")
    return "notes.txt"


def _remove_file(m: Path) -> str:
    (m / "generation_config.json").unlink()
    return "generation_config.json"


def _reforge_provenance(m: Path) -> str:
    p = m / PROVENANCE_NAME
    doc = json.loads(p.read_text())
    doc["tool"]["version"] = doc["tool"]["version"] + "+forged"
    p.write_text(json.dumps(doc, indent=1) + "\n")
    sig = m / SIGNATURE_NAME
    kept = sig.read_bytes()
    sig.unlink()
    regenerate_manifest(m)  # the forger makes the manifest agree again (without listing model.sig)
    sig.write_bytes(kept)
    rep = audit(m)
    assert rep.ok, rep.failures  # without a key nothing tells
    return PROVENANCE_NAME


@pytest.mark.parametrize("tamper", [_flip_shard, _add_file, _remove_file, _reforge_provenance])
def test_tampering_after_signing_fails_naming_the_file(signed: Path, keys, tamper) -> None:
    pub = keys["p256"][1]
    name = tamper(signed)
    code, _, doc = run_audit(signed, "--key", str(pub))
    assert code == 1
    fails = signature_failures(doc)
    assert any(f["file"] == name for f in fails), fails
    assert doc["mosaics"][0]["signature"]["state"] == "failed" and not doc["mosaics"][0]["signature"]["verified"]
    r = CliRunner().invoke(main, ["audit", str(signed), "--key", str(pub)])
    assert r.exit_code == 1 and name in r.output and "verified model.sig" not in r.output
    with pytest.raises(ValueError):
        library_verify(signed, pub)  # the library agrees


def test_wrong_public_key_fails_naming_the_signature(signed: Path, keys) -> None:
    code, _, doc = run_audit(signed, "--key", str(keys["other"][1]))
    assert code == 1
    fails = signature_failures(doc)
    assert fails and fails[0]["file"] == SIGNATURE_NAME and "does not verify with public key" in fails[0]["detail"]
    with pytest.raises(ValueError):
        library_verify(signed, keys["other"][1])


def test_corrupt_signature_file_fails(signed: Path, keys) -> None:
    (signed / SIGNATURE_NAME).write_text("{not json")
    code, _, doc = run_audit(signed, "--key", str(keys["p256"][1]))
    assert code == 1 and signature_failures(doc)[0]["file"] == SIGNATURE_NAME
    (signed / SIGNATURE_NAME).unlink()
    (signed / SIGNATURE_NAME).symlink_to(signed / MANIFEST_NAME)
    code, _, doc = run_audit(signed, "--key", str(keys["p256"][1]))
    assert code == 1 and any("symbolic link" in f["detail"] for f in signature_failures(doc))


# --- without a key, and --require-signature --------------------------------------------------------


def test_unverified_signature_is_reported_never_called_verified(signed: Path) -> None:
    code, _, doc = run_audit(signed)
    assert code == 0
    sig = doc["mosaics"][0]["signature"]
    assert sig["present"] and not sig["verified"] and sig["state"] == "unverified" and sig["by"] is None
    r = CliRunner().invoke(main, ["audit", str(signed)])
    assert r.exit_code == 0 and "present, NOT verified" in r.output and "signature: verified" not in r.output
    code, _, doc = run_audit(signed, "--require-signature")
    assert code == 1 and signature_failures(doc)[0]["file"] == SIGNATURE_NAME


def test_unsigned_folder_stays_valid_unless_a_signature_is_required(unsigned: Path, keys) -> None:
    code, _, doc = run_audit(unsigned)
    assert code == 0 and doc["mosaics"][0]["signature"]["state"] == "absent"
    r = CliRunner().invoke(main, ["audit", str(unsigned)])
    assert r.exit_code == 0 and "signature: none" in r.output
    for args in (["--require-signature"], ["--key", str(keys["p256"][1])]):
        code, _, doc = run_audit(unsigned, *args)
        assert code == 1 and "not signed" in signature_failures(doc)[0]["detail"]


# --- signatures made by the library itself ---------------------------------------------------------


def test_library_made_signature_verifies_with_mosaic(unsigned: Path, keys) -> None:
    from model_signing import hashing, signing

    priv, pub = keys["p256"]
    signing.Config().use_elliptic_key_signer(private_key=priv).set_hashing_config(
        hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME])
    ).sign(unsigned, unsigned / SIGNATURE_NAME)
    code, out, doc = run_audit(unsigned, "--key", str(pub))
    assert code == 0, out
    assert doc["mosaics"][0]["signature"]["verified"]
    # the library's defaults alone (the signature file not even ignored) verify too
    (unsigned / SIGNATURE_NAME).unlink()
    signing.Config().use_elliptic_key_signer(private_key=priv).sign(unsigned, unsigned / SIGNATURE_NAME)
    assert run_audit(unsigned, "--key", str(pub))[0] == 0


def test_library_command_line_signature_verifies_with_mosaic(unsigned: Path, keys) -> None:
    priv, pub = keys["p384"]
    p = subprocess.run([sys.executable, "-m", "model_signing", "sign", "key", str(unsigned), "--private_key", str(priv),
                        "--signature", str(unsigned / SIGNATURE_NAME)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert run_audit(unsigned, "--key", str(pub))[0] == 0


def test_library_signature_by_shards_is_verified_by_the_library_hashing(unsigned: Path, keys) -> None:
    from model_signing import hashing, signing

    priv, pub = keys["p256"]
    signing.Config().use_elliptic_key_signer(private_key=priv).set_hashing_config(
        hashing.Config().use_shard_serialization(shard_size=100_000).set_ignored_paths(paths=[SIGNATURE_NAME])
    ).sign(unsigned, unsigned / SIGNATURE_NAME)
    assert run_audit(unsigned, "--key", str(pub))[0] == 0
    _flip_shard(unsigned)
    code, _, doc = run_audit(unsigned, "--key", str(pub))
    assert code == 1 and signature_failures(doc)


def test_a_file_the_signer_left_out_is_not_covered(unsigned: Path, keys) -> None:
    """A foreign signature may ignore what it likes; mosaic holds every file of the folder to it."""
    from model_signing import hashing, signing

    priv, pub = keys["p256"]
    signing.Config().use_elliptic_key_signer(private_key=priv).set_hashing_config(
        hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME, "README.md"])
    ).sign(unsigned, unsigned / SIGNATURE_NAME)
    library_verify(unsigned, pub)  # the library honours the signer's ignore list
    code, _, doc = run_audit(unsigned, "--key", str(pub))
    assert code == 1 and [f["file"] for f in signature_failures(doc)] == ["README.md"]


def test_library_command_line_verifies_a_download_with_hub_records_and_extra_files(signed: Path, keys) -> None:
    """The README's recipe for verifying without mosaic: the hub's records are skipped by the
    signature's own ignore list; a file of one's own needs --ignore-paths."""
    pub = keys["p256"][1]
    (signed / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (signed / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text("commit\netag\n")
    (signed / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    base = [sys.executable, "-m", "model_signing", "verify", "key", str(signed), "--signature",
            str(signed / SIGNATURE_NAME), "--public_key", str(pub)]
    p = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert run_audit(signed, "--key", str(pub))[0] == 0
    (signed / "my-notes.txt").write_text("mine\n")
    p = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "my-notes.txt" in p.stdout + p.stderr
    p = subprocess.run([*base, "--ignore-paths", str(signed / "my-notes.txt")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


# --- mosaic sign refuses what it should -----------------------------------------------------------


def test_sign_refuses_a_folder_that_fails_its_audit(unsigned: Path, keys) -> None:
    _flip_shard(unsigned)
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--key", str(keys["p256"][0])])
    assert r.exit_code == 1 and r.output.startswith("mosaic: error:") and "refusing to sign" in r.output
    assert not (unsigned / SIGNATURE_NAME).exists()
    assert [p.name for p in unsigned.iterdir() if p.name.startswith(".")] == []


def test_sign_again_needs_force_and_replaces(signed: Path, keys) -> None:
    before = (signed / SIGNATURE_NAME).read_bytes()
    r = CliRunner().invoke(main, ["sign", str(signed), "--key", str(keys["other"][0])])
    assert r.exit_code == 2 and "already signed" in r.output and "--force" in r.output
    assert (signed / SIGNATURE_NAME).read_bytes() == before
    r = CliRunner().invoke(main, ["sign", str(signed), "--key", str(keys["other"][0]), "--force"])
    assert r.exit_code == 0, r.output
    assert run_audit(signed, "--key", str(keys["other"][1]))[0] == 0
    assert run_audit(signed, "--key", str(keys["p256"][1]))[0] == 1


def test_sign_with_sources(unsigned: Path, built: Path, keys) -> None:
    recipe = built.parent / "recipe.yaml"
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--key", str(keys["p256"][0]), "--sources", str(recipe), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert "sources" in [c["name"] for c in doc["audit"]["checks"]]


def test_sign_a_gguf_export(tmp_path: Path, ckpt_factory, keys) -> None:
    from mosaic._export.gguf import export_gguf
    from mosaic.testing.exl3 import Geometry

    src = ckpt_factory(Geometry(arch="llama", layers=2, experts=0, bits=3, codebook="mcg"))
    out = tmp_path / "gguf"
    export_gguf(src, out)
    priv, pub = keys["p256"]
    r = CliRunner().invoke(main, ["sign", str(out), "--key", str(priv)])
    assert r.exit_code == 0, r.output
    code, o, doc = run_audit(out, "--key", str(pub))
    assert code == 0 and doc["mosaics"][0]["signature"]["verified"], o
    library_verify(out, pub)
    (out / "manifest.json").write_bytes((out / "manifest.json").read_bytes() + b" ")
    code, _, doc = run_audit(out, "--key", str(pub))
    assert code == 1 and any(f["file"] == "manifest.json" for f in signature_failures(doc))


# --- keys: every problem one line, exit 2, no key material printed --------------------------------


def _key_body(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("-----")]


@pytest.mark.parametrize(
    ("which", "setup", "needle"),
    [
        ("missing", None, "no such file"),
        ("malformed", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "malformed"),
        ("not-pem", "just text\n", "not a PEM file"),
        ("public", "p256-pub", "this is a public key"),
        ("encrypted", "encrypted", "the key is encrypted"),
        ("rsa", "rsa", "RSA keys are not supported"),
        ("ed25519", "ed25519", "Ed25519 keys are not supported"),
        ("k1", "k1", "curve secp256k1 is not supported"),
    ],
)
def test_bad_private_keys_are_one_line_errors(unsigned: Path, keys, tmp_path: Path, which: str, setup: str | None,
                                               needle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOSAIC_KEY_PASSWORD", raising=False)
    if setup is None:
        key = tmp_path / "absent.pem"
    elif setup == "p256-pub":
        key = keys["p256"][1]
    elif setup in keys:
        key = keys[setup][0]
    else:
        key = tmp_path / "bad.pem"
        key.write_text(setup)
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--key", str(key)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mosaic: error:") and str(key) in lines[0] and needle in lines[0]
    assert "Traceback" not in r.output
    if key.exists():
        assert not any(b in r.output for b in _key_body(key))
    assert not (unsigned / SIGNATURE_NAME).exists()


def test_passphrase_from_the_environment_or_a_file(unsigned: Path, keys, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    priv, pub = keys["encrypted"]
    monkeypatch.setenv("MOSAIC_KEY_PASSWORD", "wrong")
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--key", str(priv)])
    assert r.exit_code == 2 and "wrong passphrase" in r.output and "wrong" not in r.output.replace("wrong passphrase", "")
    assert len(r.output.strip().splitlines()) == 1
    pw = tmp_path / "pw"
    pw.write_text("correct horse\n")
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--key", str(priv), "--password-file", str(pw)])
    assert r.exit_code == 0, r.output
    assert "correct horse" not in r.output and not any(b in r.output for b in _key_body(priv))
    monkeypatch.setenv("MOSAIC_KEY_PASSWORD", "correct horse")
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--key", str(priv), "--force"])
    assert r.exit_code == 0, r.output
    assert run_audit(unsigned, "--key", str(pub))[0] == 0
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--key", str(priv), "--force", "--password-file", str(tmp_path / "none")])
    assert r.exit_code == 2 and "--password-file" in r.output


def test_signing_never_writes_the_key_anywhere(unsigned: Path, keys) -> None:
    priv = keys["p256"][0]
    assert sign(unsigned, load_signing_key(priv)).signed.files > 0
    body = "".join(_key_body(priv)).encode()
    for p in unsigned.rglob("*"):
        if p.is_file():
            assert body not in p.read_bytes()
            assert all(line.encode() not in p.read_bytes() for line in _key_body(priv))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["sign", "{m}"], "give --key PRIVATE_KEY, or --sigstore"),
        (["sign", "{m}", "--key", "{priv}", "--sigstore"], "give --key PRIVATE_KEY, or --sigstore"),
        (["sign", "{m}", "--sigstore", "--password-file", "x"], "--password-file goes with --key"),
        (["audit", "{m}", "--key", "{priv}"], "this is a private key"),
        (["audit", "{m}", "--key", "{pub}", "--identity", "me@example.com", "--issuer", "https://x"], "not both"),
        (["audit", "{m}", "--identity", "me@example.com"], "--identity and --issuer go together"),
        (["audit", "{m}", "--key", "{rsa}"], "RSA keys are not supported"),
        (["audit", "{m}", "--key", "{m}/none.pub"], "no such file"),
    ],
)
def test_option_and_public_key_errors_are_one_line(unsigned: Path, keys, args: list[str], needle: str) -> None:
    fill = {"m": str(unsigned), "priv": str(keys["p256"][0]), "pub": str(keys["p256"][1]), "rsa": str(keys["rsa"][1])}
    r = CliRunner().invoke(main, [a.format(**fill) for a in args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mosaic: error:") and needle in lines[0], r.output
    assert not any(b in r.output for b in _key_body(keys["p256"][0]))


def test_trust_and_ignore_rules() -> None:
    assert load_trust(None, None, None) is None
    t = load_trust(None, "me@example.com", "https://accounts.example.com")
    assert t is not None and t.method == "sigstore" and "me@example.com" in t.describe()
    assert is_ignored(".cache/huggingface/download/x.metadata") and is_ignored(SIGNATURE_NAME)
    assert is_ignored(".git/config") and not is_ignored(".cache/other") and not is_ignored("model.sig.txt")
    with pytest.raises(SigningError):
        load_signing_key("/nonexistent/key.pem")


def test_sign_api_refuses_with_verification_error(unsigned: Path, keys) -> None:
    (unsigned / "stray.bin").write_bytes(b"x")
    with pytest.raises(VerificationError) as e:
        sign(unsigned, load_signing_key(keys["p256"][0]))
    assert "stray.bin" in str(e.value) and e.value.exit_code == 1


# --- Sigstore: a thin pass-through to the library (its network is not reachable from the tests) ----


def test_sigstore_signing_is_passed_to_the_library_before_anything_is_read(unsigned: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from model_signing import signing

    import mosaic._release.signing as sign_mod

    calls: list[dict] = []

    def fake(self: object, **kw: object) -> None:
        calls.append(kw)
        raise RuntimeError("Failed to refresh TUF metadata\nsecond line")

    monkeypatch.setattr(signing.Config, "use_sigstore_signer", fake)
    monkeypatch.setattr(sign_mod, "audit", lambda *a, **k: pytest.fail("audited before the signer was ready"))
    r = CliRunner().invoke(main, ["sign", str(unsigned), "--sigstore"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "mosaic: error: cannot sign with Sigstore (keyless): Failed to refresh TUF metadata"]
    assert calls == [{"use_ambient_credentials": True}]
    assert not (unsigned / SIGNATURE_NAME).exists()


def test_sigstore_identity_is_passed_to_the_library_and_a_failure_is_named(signed: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from model_signing import verifying

    calls: list[dict] = []

    def fake(self: object, **kw: object) -> None:
        calls.append(kw)
        raise ValueError("no trust root")

    monkeypatch.setattr(verifying.Config, "use_sigstore_verifier", fake)
    code, _, doc = run_audit(signed, "--identity", "me@example.com", "--issuer", "https://accounts.example.com")
    assert code == 1
    assert calls == [{"identity": "me@example.com", "oidc_issuer": "https://accounts.example.com"}]
    f = signature_failures(doc)
    assert f[0]["file"] == SIGNATURE_NAME and "Sigstore identity me@example.com" in f[0]["detail"]
    assert doc["mosaics"][0]["signature"]["method"] == "sigstore" and not doc["mosaics"][0]["signature"]["verified"]


# --- hostile signature files ------------------------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("MOSAIC_FUZZ_EXAMPLES", "200"))


def _bundle_with(payload: object) -> bytes:
    import base64

    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return json.dumps({"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
                       "dsseEnvelope": {"payload": base64.b64encode(raw).decode(), "payloadType": "application/vnd.in-toto+json",
                                        "signatures": [{"sig": "AAAA", "keyid": ""}]}}).encode()


_HOSTILE = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(str.encode),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                 max_leaves=20).map(lambda v: json.dumps(v).encode()),
    st.recursive(st.none() | st.integers() | st.text(max_size=8),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(
                     st.sampled_from(["predicate", "serialization", "resources", "name", "digest", "method"]), c, max_size=3),
                 max_leaves=12).map(_bundle_with),
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_HOSTILE)
@example(data=b"[" * 100_000)
@example(data=_bundle_with(b"{" * 100_000))
@example(data=_bundle_with({"predicate": {"serialization": {"method": "files", "hash_type": "sha256"},
                                          "resources": [{"name": "../../etc/passwd", "digest": "00"}, 7]}}))
@example(data=_bundle_with({"predicate": {"serialization": {"method": "shards"}, "resources": []}}))
def test_fuzz_read_statement_refuses_cleanly(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    from mosaic._provenance.signature import MalformedSignature, read_statement, signed_files

    p = tmp_path_factory.mktemp("sig") / SIGNATURE_NAME
    p.write_bytes(data)
    try:
        statement = read_statement(p)
        files = signed_files(statement)
    except MalformedSignature as e:  # the only way to refuse: one line, the audit's failure detail
        assert "\n" not in str(e) and str(e).startswith(("not a model signing bundle", "malformed resource"))
    else:
        assert isinstance(statement["predicate"]["resources"], list)
        assert files is None or all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())


def test_hostile_signature_files_through_the_audit(signed: Path, keys) -> None:
    """Whatever model.sig holds, `mosaic audit --key` reports a failed signature (exit 1) in one piece."""
    cases = [b"", b"[" * 100_000, b"\xff\xfe", _bundle_with(b"{" * 100_000),
             _bundle_with({"predicate": {"serialization": {"method": "shards"}, "resources": []}}),
             _bundle_with({"predicate": {"serialization": {"method": "files", "hash_type": "sha256"},
                                         "resources": [{"name": "../../x", "digest": "00"}]}})]
    for data in cases:
        (signed / SIGNATURE_NAME).write_bytes(data)
        code, out, doc = run_audit(signed, "--key", str(keys["p256"][1]))
        assert code == 1, out
        assert signature_failures(doc) and doc["mosaics"][0]["signature"]["state"] == "failed"
