"""Throwaway signing keys for tests, examples and the demo (a real release signs with the publisher's own)."""

from __future__ import annotations

import os
from pathlib import Path


def write_signing_key(folder: str | os.PathLike[str], stem: str = "signing") -> tuple[Path, Path]:
    """A fresh P-256 key pair, unencrypted: ``folder/<stem>.pem`` (private) and ``folder/<stem>.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = root / f"{stem}.pem", root / f"{stem}.pub"
    private.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public
