"""The privacy store's ledger as a PAC server reaches it, and where its curator state lives.

The server needs from the store only the ledger's answers: the worlds' keyed id, whether they
were served, their allowance (``pac_open``) and leases (:mod:`privcode.pac.leases`). Three ways
(:class:`~privcode.serve.pac_args.EnsembleArgs`): ``ledger`` the store's ledger actor
(``privcode-store:<store id>``) or an http(s) URL of its ledger service
(:mod:`privcode.privacy.ledger_service`, the serving role's token): the server opens no store
and reads no store key, and the curator state is under ``pac_state/<worlds id>/``, which must
hold no store key; otherwise the store at ``privacy_store`` (a terminal, tests), the state
under ``pac_state`` when set, else the store's ``pac/<worlds id>/``. A missing state of served
worlds is refused, never redrawn. Details: docs/serving.md, "privcode/serve/pac_ledger.py".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from privcode.privacy.store import PrivacyStore
from privcode.serve.pac_args import EnsembleArgs, EnsembleError
from privcode.utils import fsync_dir

__all__ = ["LEDGER_TIMEOUT_S", "PacLedger"]

#: How long one ledger call may take before the server treats the ledger as unreachable.
LEDGER_TIMEOUT_S = 30.0
_STORE_KEY = "dataset-id.key"  # privcode.privacy.store.KEY_FILE


class PacLedger:
    """The ledger calls and the curator state directory of one PAC server (module docstring)."""

    def __init__(self, cfg: EnsembleArgs, *, timeout_s: float = LEDGER_TIMEOUT_S):
        self.actor = cfg.ledger
        self.root = None if self.actor else cfg.store_path
        self.pac_state = None if cfg.pac_state is None else Path(cfg.pac_state).expanduser()
        self.timeout_s = timeout_s
        self._handle: Any = None
        if self.pac_state is not None and (self.pac_state / _STORE_KEY).exists():
            raise EnsembleError(
                f"pac_state {self.pac_state} holds a privacy store key: give the curator "
                "states a directory of their own, outside the store"
            )

    def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the store's one writer."""
        if self.actor is None:
            from privcode.privacy.budget import call

            return call(self.root, method, *args)
        from privcode.privacy.ledger_actor import get_ledger, ledger_call

        if self._handle is None:
            if "://" in self.actor:  # the ledger service: the serving role's token
                from privcode.privacy.ledger_client import remote_ledger

                self._handle = remote_ledger(self.actor, timeout_s=self.timeout_s)
            else:
                self._handle = get_ledger(self.actor)
        return ledger_call(self._handle, method, *args, timeout_s=self.timeout_s)

    def worlds_id(self, digest: bytes) -> str:
        """The worlds' keyed id (the ledger holds the key)."""
        return str(self.call("pac_worlds_id", digest))

    def state_dir(self, worlds_id: str) -> Path:
        """The curator state directory of these worlds (0700)."""
        if self.pac_state is None:
            return PrivacyStore(self.root or "").pac_state_dir(worlds_id)
        self.pac_state.mkdir(mode=0o700, parents=True, exist_ok=True)
        state = self.pac_state / worlds_id
        if not state.is_dir():
            state.mkdir(mode=0o700)
            fsync_dir(self.pac_state)  # a crash keeps the new state's entry
        os.chmod(state, 0o700)
        return state

    def lease_fn(self, worlds_id: str) -> Any:
        """``lease(nats, holder, steps)`` for :class:`privcode.pac.leases.Leases`."""

        def lease(nats: float, holder: str, steps: int) -> Any:
            return self.call("pac_lease", worlds_id, nats, holder, steps)

        return lease
