"""Who may raise a budget: the store's authority, an Ed25519 key that no pipeline job holds.
Design notes: docs/privacy.md, "privcode/privacy/authority.py".

``privcode budget init`` makes the key pair: the public key goes into ``store.json``
(``authority``), the private key OUTSIDE the store (:func:`default_key_path`, 0600), where no
Ray pod mounts it. A raise is a grant::

    message   = canonical JSON {"kind", "store_id", "from", "to", "who", "why", ["worlds"]}
    signature = Ed25519(private key, "privcode-raise/1\\0" || message)

``kind`` is ``records`` (the per-record epsilon budget) or ``pac`` (a worlds' allowance, nats).
The ledger checks the signature against the identity's public key, the store id, and that
``from`` is its current value, so a grant raises once. Ed25519 is ``cryptography``'s (OpenSSL).

"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from privcode.errors import PrivcodeError

__all__ = [
    "AuthorityError",
    "default_key_path",
    "make_authority",
    "sign_grant",
    "verify_grant",
]

_DOMAIN = b"privcode-raise/1\0"
_KINDS = ("records", "pac")


class AuthorityError(PrivcodeError):
    """A raise without a valid grant of the store's authority."""


def default_key_path(store_id: str) -> Path:
    """``${XDG_CONFIG_HOME:-~/.config}/privcode/authority/<store_id>.key``."""
    config = os.environ.get("XDG_CONFIG_HOME", "").strip()
    base = Path(config) if config and os.path.isabs(config) else Path("~/.config").expanduser()
    return (base / "privcode" / "authority" / f"{store_id}.key").resolve()


def make_authority(store_id: str, path: str | os.PathLike | None = None) -> tuple[str, Path]:
    """A new key pair: the private key written to ``path`` (0600, never over a file); the
    public key (base64 of its 32 raw bytes) and where the private key is."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    target = Path(path).expanduser().resolve() if path else default_key_path(store_id)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AuthorityError(f"an authority key already exists at {target}") from None
    try:
        os.write(fd, base64.b64encode(raw) + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    public = key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return base64.b64encode(public).decode(), target


def _message(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_grant(key_path: str | os.PathLike, **fields: Any) -> dict[str, Any]:
    """A grant of ``fields`` (module docstring) signed with the private key at ``key_path``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if fields.get("kind") not in _KINDS:
        raise AuthorityError(f"a grant's kind is one of {', '.join(_KINDS)}")
    path = Path(key_path).expanduser()
    try:
        raw = base64.b64decode(path.read_bytes().strip(), validate=True)
        key = Ed25519PrivateKey.from_private_bytes(raw)
    except FileNotFoundError:
        raise AuthorityError(
            f"no authority key at {path}: a raise is signed by the store's authority (made "
            "by `privcode budget init`; --authority-key names where it is kept)"
        ) from None
    except ValueError as exc:
        raise AuthorityError(f"the authority key {path} is damaged ({exc})") from None
    signature = key.sign(_DOMAIN + _message(fields))
    return {"message": fields, "signature": base64.b64encode(signature).decode()}


def verify_grant(public_b64: str | None, grant: Any, **expected: Any) -> dict[str, Any]:
    """The grant's message, after checking its signature with ``public_b64`` and that each
    of ``expected`` (``kind``, ``store_id``, ``from``, ...) is what it says;
    :class:`AuthorityError` otherwise."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not public_b64:
        raise AuthorityError(
            "this store has no authority key (made before authorities): create one with "
            "`privcode budget authority --store PATH` where the data owner keeps keys"
        )
    if not isinstance(grant, dict) or not isinstance(grant.get("message"), dict):
        raise AuthorityError("a raise needs a grant signed by the store's authority")
    message = grant["message"]
    try:
        public = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_b64))
        public.verify(
            base64.b64decode(str(grant.get("signature", ""))), _DOMAIN + _message(message)
        )
    except (InvalidSignature, ValueError):
        raise AuthorityError("the grant's signature is not the store authority's") from None
    for name, value in expected.items():
        if message.get(name) != value:
            raise AuthorityError(
                f"the grant's {name} is {message.get(name)!r}, not {value!r} (signed for "
                "another store, or already used: a grant raises once)"
            )
    for name in ("who", "why"):
        if not str(message.get(name, "")).strip():
            raise AuthorityError(f"a grant must say {name}")
    return message
