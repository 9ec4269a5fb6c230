"""OpenSSF model signing of a mosaic folder: keys, the signed manifest, and checking a signature.

The format is the standard's, made and checked by its reference library (``model_signing``, from
sigstore's model-transparency project): a Sigstore bundle, ``model.sig``, holding a DSSE envelope whose
in-toto statement lists every file of the folder with its SHA-256 (the library's default "files"
serialization). mosaic invents nothing of it; it decides only what is covered and where the digests
come from.

- Covered: every file of the folder except the signature itself, huggingface_hub's download records
  (``.cache/huggingface/``) and the git paths the library always leaves out (``.git``,
  ``.gitattributes``, ``.github``, ``.gitignore``). The signature records that list as its
  ``ignore_paths``, so the library's own verifier skips the same files by itself. When mosaic checks a
  signature, every other file must be covered, whatever a foreign signature chose to ignore.
- The digests are the ones the audit has just read. The library's signer and verifier hash through a
  hashing configuration the caller may give them (``set_hashing_config``); one that answers with the
  audit's digests means a 96 GB folder is read once for the audit and the signature together, not once
  more by the library. The library still makes and checks the signature and compares the manifests,
  and the tests verify mosaic's signatures with the library's verifier reading every file itself.

Keys: a private key is read only to sign, and never printed, logged or written anywhere. Every problem
with a key or the options is a :class:`SigningError` (exit 2) naming the key file.

This module knows nothing of audits, builds or the hub: the audit imports it to verify, ``mosaic sign``
and ``mosaic publish`` to sign and to check that a signature still covers the folder.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mosaic._base.errors import MosaicError, SigningError
from mosaic._base.hashing import digest_file
from mosaic._provenance.records import HUB_ARTEFACTS, SIGNATURE_NAME

#: What ``model_signing``'s hashing leaves out of every manifest unless told otherwise.
LIBRARY_GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")

#: What a mosaic signature does not cover, recorded in it as ``ignore_paths`` (sorted, so that the
#: signed statement does not depend on the order of a set).
IGNORE_PATHS: tuple[str, ...] = tuple(sorted({SIGNATURE_NAME, *HUB_ARTEFACTS, *LIBRARY_GIT_PATHS}))

#: The curves the library signs with (the Sigstore specification's), by the names people use.
CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}

#: Where a passphrase comes from, for the messages that ask for one.
PASSPHRASE_SOURCES = "--password-file FILE, the MOSAIC_KEY_PASSWORD variable, or typed on a terminal"


def is_ignored(name: str, ignore: Iterable[str] = IGNORE_PATHS) -> bool:
    """Whether a relative file name lies at or below one of ``ignore`` (whole path components)."""
    return any(name == p or name.startswith(p + "/") for p in ignore)


# --- keys ------------------------------------------------------------------------------------------


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise SigningError(f"{path}: {what}: no such file") from None
    except IsADirectoryError:
        raise SigningError(f"{path}: {what}: a folder, not a key file") from None
    except OSError as e:
        raise SigningError(f"{path}: {what}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise SigningError(f"{path}: {what}: not a PEM file (expected a '-----BEGIN ...' block)")
    return data


def _curve_of(key: object, path: Path, what: str) -> str:
    """The key's curve as people name it, or a refusal naming the key type."""
    from cryptography.hazmat.primitives.asymmetric import ec

    if not isinstance(key, (ec.EllipticCurvePublicKey, ec.EllipticCurvePrivateKey)):
        kind = type(key).__name__.lstrip("_").replace("PrivateKey", "").replace("PublicKey", "") or "this"
        raise SigningError(
            f"{path}: {what}: {kind} keys are not supported; model signing takes elliptic-curve keys "
            f"({', '.join(CURVES.values())})"
        )
    curve = key.curve.name
    if curve not in CURVES:
        raise SigningError(
            f"{path}: {what}: curve {curve} is not supported; model signing takes {', '.join(CURVES.values())}"
        )
    return CURVES[curve]


def _key_hint(public_key: Any) -> str:
    """The SHA-256 of the public key's PEM, as the library records it in a bundle to name the key."""
    from cryptography.hazmat.primitives import serialization

    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


@dataclass(frozen=True)
class SigningKey:
    """A private key file that was read and accepted: its path, curve and public key hint.

    The passphrase is kept (out of ``repr``) only to hand to the library, which reads the file again;
    the key itself is not kept."""

    path: Path
    curve: str
    hint: str
    password: bytes | None = field(default=None, repr=False)

    def describe(self) -> str:
        return f"{self.curve} key {self.path} (public key sha256 {self.hint[:16]}…)"


@dataclass(frozen=True)
class Sigstore:
    """Keyless signing: Sigstore's certificate authority binds the signature to an OpenID identity."""

    def describe(self) -> str:
        return "Sigstore (keyless)"


Signer = SigningKey | Sigstore


def load_signing_key(path: str | os.PathLike[str], ask_password: Callable[[], str | None] | None = None) -> SigningKey:
    """Read and check a PEM private key before any file is hashed; ask for a passphrase only if it has one.

    Every problem is one :class:`SigningError`: a missing or unreadable file, a public key given
    instead, a malformed key, a missing or wrong passphrase, a key that is not on a supported curve."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    p = Path(path)
    what = "private key"
    data = _read_pem(p, what)
    if b"PRIVATE KEY-----" not in data:
        if b"PUBLIC KEY-----" in data:
            raise SigningError(f"{p}: {what}: this is a public key; signing needs the private key")
        raise SigningError(f"{p}: {what}: no PEM private key block in the file")
    password: bytes | None = None
    try:
        key = load_pem_private_key(data, None)
    except TypeError:  # the key is encrypted
        given = ask_password() if ask_password is not None else None
        if not given:
            raise SigningError(f"{p}: {what}: the key is encrypted; give its passphrase ({PASSPHRASE_SOURCES})") from None
        password = given.encode("utf-8")
        try:
            key = load_pem_private_key(data, password)
        except (ValueError, TypeError):
            raise SigningError(f"{p}: {what}: wrong passphrase") from None
        except UnsupportedAlgorithm as e:
            raise SigningError(f"{p}: {what}: unsupported key or encryption ({e})") from None
    except ValueError:
        raise SigningError(f"{p}: {what}: malformed or not a private key cryptography can read") from None
    except UnsupportedAlgorithm as e:
        raise SigningError(f"{p}: {what}: unsupported key type ({e})") from None
    curve = _curve_of(key, p, what)
    return SigningKey(p, curve, _key_hint(key.public_key()), password)  # type: ignore[union-attr]


@dataclass(frozen=True)
class Trust:
    """Who must have signed: the holder of a public key, or a Sigstore identity and its OIDC issuer."""

    key: Path | None = None
    identity: str | None = None
    issuer: str | None = None
    hint: str | None = None

    def describe(self) -> str:
        if self.key is not None:
            return f"public key {self.key}"
        return f"Sigstore identity {self.identity} (issuer {self.issuer})"

    @property
    def method(self) -> str:
        return "key" if self.key is not None else "sigstore"


def load_trust(key: str | os.PathLike[str] | None, identity: str | None, issuer: str | None) -> Trust | None:
    """The verification asked for on the command line, checked before any file is read (None: none)."""
    if key is not None and (identity or issuer):
        raise SigningError("--key and --identity/--issuer: give a public key or a Sigstore identity, not both")
    if bool(identity) != bool(issuer):
        raise SigningError("--identity and --issuer go together (the signer's identity and its OpenID Connect issuer)")
    if identity:
        return Trust(identity=identity, issuer=issuer)
    if key is None:
        return None
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    p = Path(key)
    what = "public key"
    data = _read_pem(p, what)
    if b"PRIVATE KEY-----" in data:
        raise SigningError(f"{p}: {what}: this is a private key; verify with the public key (and never hand out the private one)")
    try:
        pub = load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise SigningError(f"{p}: {what}: malformed or not a PEM public key") from None
    _curve_of(pub, p, what)
    return Trust(key=p, hint=_key_hint(pub))


# --- the library's manifest, from digests already read --------------------------------------------


def complete_digests(root: Path, names: Iterable[str], known: Mapping[str, str]) -> dict[str, str]:
    """The SHA-256 of every covered name: those the audit read, and the few it had no reason to read."""
    out: dict[str, str] = {}
    for n in names:
        if is_ignored(n):
            continue
        out[n] = known[n] if n in known else digest_file(root / n).sha256
    return out


def library_manifest(model_name: str, digests: Mapping[str, str]) -> Any:
    """A ``model_signing`` manifest of ``digests`` (relative name → SHA-256), exactly as the library's
    file serialization with SHA-256 and mosaic's ignore list would hash the folder."""
    from model_signing import manifest

    # The library's public manifest types take its digest type, which lives in its hashing core.
    from model_signing._hashing.hashing import Digest

    serialization = manifest.SerializationType.from_args(
        {"method": "files", "hash_type": "sha256", "allow_symlinks": False, "ignore_paths": list(IGNORE_PATHS)}
    )
    items = [
        manifest.FileManifestItem(path=PurePosixPath(n), digest=Digest("sha256", bytes.fromhex(d)))
        for n, d in sorted(digests.items())
        if not is_ignored(n)
    ]
    return manifest.Manifest(model_name, items, serialization)


def _hashing_config(known: Any | None, serialization: Mapping[str, Any] | None = None) -> Any:
    """A ``model_signing`` hashing configuration that answers with ``known`` (a manifest) instead of
    reading the folder, or, with None, the library's own hashing as a signature's ``serialization``
    describes it (by file or by shard, its hash), with mosaic's ignore list and no other. ``used`` tells
    whether the library got as far as hashing (it verifies the signature first)."""
    from model_signing import hashing

    class _Config(hashing.Config):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            ser = serialization or {}
            algorithm = ser.get("hash_type", "sha256")
            if ser.get("method") == "shards":
                self.use_shard_serialization(hashing_algorithm=algorithm, shard_size=int(ser["shard_size"]))
            elif known is None:
                self.use_file_serialization(hashing_algorithm=algorithm)
            self.set_ignored_paths(paths=IGNORE_PATHS, ignore_git_paths=True)
            self.used = False

        def add_ignored_paths(self, *, model_path: Any, paths: Iterable[Any]) -> None:
            # The verifier passes the signature's own ignore list here. mosaic lets no signer exempt a
            # file: every file but mosaic's own list (which holds the signature file) must be covered.
            return None

        def hash(self, model_path: Any, *, files_to_hash: Iterable[Any] | None = None) -> Any:
            self.used = True
            return known if known is not None else super().hash(model_path, files_to_hash=files_to_hash)

    return _Config()


# --- reading a bundle (what it claims, before or after the library verified it) --------------------


class MalformedSignature(ValueError):
    """``model.sig`` is not a model signing bundle mosaic can read."""


def read_statement(path: Path) -> dict[str, Any]:
    """The in-toto statement inside a bundle, not verified: to choose how to hash, and to name which
    files differ once the library has verified the signature."""
    try:
        bundle = json.loads(path.read_bytes())
        payload = base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True)
        statement = json.loads(payload)
        predicate = statement["predicate"]
        if not isinstance(predicate["serialization"], dict) or not isinstance(predicate["resources"], list):
            raise TypeError("serialization or resources")
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError, RecursionError) as e:
        raise MalformedSignature(f"not a model signing bundle ({type(e).__name__}: {str(e)[:120]})") from None
    return statement


def signed_files(statement: Mapping[str, Any]) -> dict[str, str] | None:
    """Name → SHA-256 of what a statement signs, when it signs whole files with SHA-256 (else None)."""
    pred = statement["predicate"]
    ser = pred["serialization"]
    if ser.get("method") != "files" or ser.get("hash_type") != "sha256":
        return None
    out: dict[str, str] = {}
    for r in pred["resources"]:
        if not isinstance(r, dict) or not isinstance(r.get("name"), str) or not isinstance(r.get("digest"), str):
            raise MalformedSignature(f"malformed resource {str(r)[:80]}")
        out[r["name"]] = r["digest"]
    return out


def differences(signed: Mapping[str, str], actual: Mapping[str, str]) -> list[tuple[str, str]]:
    """(file, what differs) for every file whose presence or digest disagrees with the signature."""
    out = []
    for n in sorted(set(signed) | set(actual)):
        if n not in actual:
            out.append((n, "signed, but missing from the folder"))
        elif n not in signed:
            out.append((n, "not covered by the signature (added after signing, or left out by the signer)"))
        elif signed[n] != actual[n]:
            out.append((n, "SHA-256 differs from the signature (changed after signing)"))
    return out


# --- signing and verifying through the library ------------------------------------------------------


@dataclass
class Signed:
    """What ``sign_digests`` wrote: the signature file, how many files it covers, and by whom."""

    path: Path
    files: int
    by: str


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines()[0] if str(e) else type(e).__name__)[:300]


@dataclass
class PreparedSigner:
    """The library's signing configuration, made before anything is read (see :func:`prepare_signer`)."""

    config: Any = field(repr=False)
    by: str


def prepare_signer(signer: Signer) -> PreparedSigner:
    """Make the library's signer now, so that a key the library refuses, or Sigstore's trust root out of
    reach, stops the command before a 96 GB folder is read. (Sigstore's sign-in happens when signing.)"""
    from model_signing import signing

    try:
        config = signing.Config()
        if isinstance(signer, SigningKey):
            # The library hands the passphrase to cryptography, which takes bytes.
            config = config.use_elliptic_key_signer(private_key=signer.path, password=signer.password)  # type: ignore[arg-type]
        else:
            config = config.use_sigstore_signer(use_ambient_credentials=True)
    except Exception as e:  # the library's and the transport's errors (never carrying key material): one line
        where = f"{signer.path}: " if isinstance(signer, SigningKey) else ""
        raise SigningError(f"{where}cannot sign with {signer.describe()}: {_first_line(e)}") from None
    return PreparedSigner(config, signer.describe())


def sign_digests(root: Path, names: Iterable[str], digests: Mapping[str, str], signer: PreparedSigner) -> Signed:
    """Sign ``root`` with the library over the given digests (every file not ignored), writing
    ``model.sig`` atomically (a temporary name in the folder, renamed when complete)."""
    covered = complete_digests(root, names, digests)
    config = signer.config.set_hashing_config(_hashing_config(library_manifest(root.name, covered)))
    tmp = root / f".{SIGNATURE_NAME}.partial-{os.getpid()}"
    try:
        config.sign(root, tmp)
        os.replace(tmp, root / SIGNATURE_NAME)
    except MosaicError:
        raise
    except Exception as e:  # the library's and the signer's errors (never carrying key material): one line
        raise SigningError(f"{root / SIGNATURE_NAME}: signing with {signer.by} failed: {_first_line(e)}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return Signed(root / SIGNATURE_NAME, len(covered), signer.by)


@dataclass
class SignatureCheck:
    """What is known of a folder's signature: present, verified by whom, and what failed (file, detail)."""

    present: bool
    trust: Trust | None = None
    verified: bool = False
    files: int | None = None
    failures: list[tuple[str | None, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        if not self.present:
            state = "absent"
        elif self.verified:
            state = "verified"
        elif self.trust is None:
            state = "unverified"
        else:
            state = "failed"
        return {
            "file": SIGNATURE_NAME,
            "present": self.present,
            "verified": self.verified,
            "state": state,
            "method": self.trust.method if self.trust else None,
            "by": self.trust.describe() if self.trust and self.verified else None,
            "files": self.files,
        }


def check_signature(root: Path, names: Iterable[str], digests: Mapping[str, str], trust: Trust | None) -> SignatureCheck:
    """Verify ``root/model.sig`` with the library against ``trust``, comparing it with the digests the
    audit read (``names``: every file the audit saw). Without ``trust`` only its presence is told."""
    sig = root / SIGNATURE_NAME
    if sig.is_symlink():
        return SignatureCheck(True, trust, failures=[(SIGNATURE_NAME, "a symbolic link, not a signature file")])
    if not sig.is_file():
        return SignatureCheck(False, trust)
    if trust is None:
        return SignatureCheck(True)
    try:
        statement = read_statement(sig)
        signed = signed_files(statement)
    except MalformedSignature as e:
        return SignatureCheck(True, trust, failures=[(SIGNATURE_NAME, str(e))])
    actual = complete_digests(root, names, digests)
    # A signature over whole files with SHA-256 (mosaic's, and the library's default) is checked
    # against the digests already read; any other serialization is hashed again by the library.
    serialization = statement["predicate"]["serialization"]
    try:
        config = _hashing_config(library_manifest(root.name, actual) if signed is not None else None, serialization)
    except (KeyError, TypeError, ValueError) as e:
        return SignatureCheck(True, trust, failures=[(SIGNATURE_NAME, f"unsupported serialization {str(serialization)[:120]} ({e})")])
    from model_signing import verifying

    try:
        lib = verifying.Config()
        if trust.key is not None:
            lib = lib.use_elliptic_key_verifier(public_key=trust.key)
        else:  # Sigstore's trust root comes from the network (TUF); failing to get it is a failure too
            lib = lib.use_sigstore_verifier(identity=trust.identity, oidc_issuer=trust.issuer)  # type: ignore[arg-type]
        lib.set_hashing_config(config).verify(root, sig)
    except Exception as e:  # the library's and the crypto's errors: failures, named
        message = _first_line(e)
        if not config.used:
            return SignatureCheck(True, trust, failures=[(SIGNATURE_NAME, f"does not verify with {trust.describe()}: {message}")])
        found = differences(signed, actual) if signed is not None else []
        return SignatureCheck(True, trust, files=len(statement["predicate"]["resources"]),
                              failures=[(n, d) for n, d in found] or [(None, message)])
    return SignatureCheck(True, trust, verified=True, files=len(statement["predicate"]["resources"]))


def stale_files(root: Path, names: Iterable[str], digests: Mapping[str, str]) -> list[tuple[str, str]]:
    """Where ``model.sig`` (read, not verified) no longer matches the folder: for ``mosaic publish``,
    which has no key but must not upload a signature every consumer's verification would refuse."""
    statement = read_statement(root / SIGNATURE_NAME)
    signed = signed_files(statement)
    if signed is None:
        return []
    return differences(signed, complete_digests(root, names, digests))
