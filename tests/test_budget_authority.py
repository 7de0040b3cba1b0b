"""Raising a budget needs the store's authority, which no pipeline job holds (issue 41, point 10).

The private key lives outside the store (``--authority-key``); a job that reaches the
ledger can only deliver a grant the authority signed, and a grant raises once.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from privcode.privacy.authority import AuthorityError
from privcode.privacy.budget import call, init_store
from privcode.privacy.raising import add_authority, raise_with_authority
from privcode.privacy.store import PrivacyStore


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "privcode.cli", "budget", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )


def test_a_raise_is_signed_elsewhere_and_delivered_once(tmp_path):
    key = tmp_path / "owner" / "authority.key"
    store = tmp_path / "store"
    made = _cli("init", "--store", str(store), "--epsilon", "2", "--authority-key", str(key))
    assert made.returncode == 0, made.stderr
    assert str(key) in made.stdout and key.parent != store and store not in key.parents
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert PrivacyStore(store).read_identity()["authority"]  # the public half only
    assert not any(p.name.endswith(".key") and "authority" in p.name for p in store.iterdir())
    # Without the key (a job on the cluster has the store, not the key): no raise.
    denied = _cli("raise", "--store", str(store), "--epsilon", "3", "--who", "j", "--why", "x")
    assert denied.returncode != 0 and "no authority key" in denied.stderr
    grant = tmp_path / "grant.json"
    signed = _cli(
        "sign-raise", "--store", str(store), "--epsilon", "3", "--who", "owner",
        "--why", "study 2", "--authority-key", str(key), "--out", str(grant),
    )  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    assert call(store, "show")["budget"]["epsilon"] == 2.0  # signing changes nothing
    delivered = _cli("raise", "--store", str(store), "--grant", str(grant), "--json")
    assert delivered.returncode == 0, delivered.stderr
    assert json.loads(delivered.stdout)["budget"]["epsilon"] == 3.0
    again = _cli("raise", "--store", str(store), "--grant", str(grant))
    assert again.returncode != 0 and "already used" in again.stderr


def test_a_store_from_before_authorities_gets_one_once(tmp_path):
    from privcode.privacy.ledger import Budget

    store, _ = init_store(tmp_path / "store", Budget(2.0, 1e-5), authority_key=tmp_path / "k1")
    identity = store.read_identity()
    identity.pop("authority")  # as a store made before authorities
    (store.root / "store.json").write_text(json.dumps(identity))
    with pytest.raises(AuthorityError, match="no authority key"):
        raise_with_authority(store.root, tmp_path / "k1", to=5.0, who="o", why="w")
    path = add_authority(store.root, tmp_path / "k2")
    assert path == (tmp_path / "k2").resolve()
    with pytest.raises(Exception, match="already has its authority"):
        add_authority(store.root, tmp_path / "k3")
    with pytest.raises(AuthorityError, match="signature"):  # the old key is not the authority
        raise_with_authority(store.root, tmp_path / "k1", to=5.0, who="o", why="w")
    raised = raise_with_authority(store.root, path, to=5.0, who="o", why="w")
    assert raised["budget"]["epsilon"] == 5.0
