"""Raising a budget on the store authority's grant (:mod:`privcode.privacy.authority`):
sign from the store's current value and deliver to its one writer, or give a store made
before authorities its key. Kept apart from :mod:`privcode.privacy.budget` (the store's
lifecycle) so that only this module signs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from privcode.errors import PrivcodeError
from privcode.privacy.authority import default_key_path, make_authority, sign_grant
from privcode.privacy.budget import _append_record, call
from privcode.privacy.store import PrivacyStore

__all__ = ["add_authority", "raise_with_authority"]


def add_authority(root: str | os.PathLike, key_path: str | os.PathLike | None = None) -> Path:
    """Give a store made before authorities its authority (:mod:`privcode.privacy.authority`):
    the public key into ``store.json``, recorded in the store log; the private key's path.
    A store that has one is refused (an authority is made once)."""
    store = PrivacyStore(Path(root).expanduser().resolve())
    identity = store.read_identity()
    if identity.get("authority"):
        raise PrivcodeError(f"the privacy store {store.root} already has its authority")
    public, path = make_authority(store.store_id, key_path)
    store.write_identity(authority=public)
    _append_record(
        {"event": "authority", "path": str(store.root), "store_id": store.store_id}, store.root
    )
    return path


def raise_with_authority(
    root: str | os.PathLike,
    key_path: str | os.PathLike | None,
    *,
    to: float,
    who: str,
    why: str,
    worlds: str | None = None,
    deliver: bool = True,
) -> dict[str, Any]:
    """Sign a raise of the records' epsilon (or ``worlds``' PAC allowance, in nats) to
    ``to`` with the authority key, from the store's current value; deliver it to the
    store's ledger (``deliver``) or return the grant (to deliver elsewhere)."""

    path = Path(root).expanduser().resolve()
    store = PrivacyStore(path)
    shown = call(path, "show")
    if worlds is None:
        current = (shown.get("budget") or {}).get("epsilon")
        fields = {"kind": "records", "from": current}
    else:
        pac = {p["worlds"]: p for p in shown.get("pac", [])}
        current = (pac.get(worlds) or {}).get("allowance_nats")
        fields = {"kind": "pac", "worlds": worlds, "from": current}
    key = key_path or default_key_path(store.store_id)
    grant = sign_grant(key, store_id=store.store_id, to=float(to), who=who, why=why, **fields)
    if not deliver:
        return grant
    return call(path, "pac_raise" if worlds else "raise_budget", grant)
