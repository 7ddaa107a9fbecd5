"""Ed25519 signatures over manifest.json, which holds every file's sha256 and size: one signature vouches
for the whole artifact.

Why ed25519 with `cryptography`, not OpenSSF's model-signing: a production host checks a signature
offline, against a key it was given, with one small well-kept dependency. model-signing's default
flow is Sigstore (an OIDC identity, a transparency log online) and it pulls in that stack; its
key-based mode would add a second manifest format beside ours for the same guarantee.

Keys are PEM files: private PKCS#8 (written 0600), public SubjectPublicKeyInfo.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import KilnError

SIGNATURE_FILE = "signature.ed25519"


class SignatureError(KilnError):
    """A signature is missing, malformed, or does not match the key."""


def keygen(stem: Path) -> tuple[Path, Path]:
    """Write STEM.key (private) and STEM.pub; refuse to overwrite either."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private, public = stem.with_name(stem.name + ".key"), stem.with_name(stem.name + ".pub")
    for path in (private, public):
        if path.exists():
            raise SignatureError(f"{path} already exists; choose another name or remove it")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    descriptor = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(pem)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def sign(manifest: bytes, private_key: Path) -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(private_key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise SignatureError(f"--sign-key {private_key}: not a readable unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"--sign-key {private_key}: not an ed25519 key (make one with `kiln keygen`)")
    return key.sign(manifest)  # ed25519 is deterministic: the same manifest and key give the same bytes


def verify_signature(manifest: bytes, signature: bytes, public_key: Path) -> None:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(public_key.read_bytes())
    except (OSError, ValueError) as exc:
        raise SignatureError(f"--public-key {public_key}: not a readable PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"--public-key {public_key}: not an ed25519 key")
    try:
        key.verify(signature, manifest)
    except InvalidSignature:
        raise SignatureError("the manifest's signature does not match the public key "
                             "(signed by another key, or manifest.json was changed)") from None
