"""Leases: a PAC curator spends only nats the store's ledger handed it first.
Design notes: docs/serving.md, "privcode/pac/leases.py".

The ledger (:meth:`privcode.privacy.ledger.StoreLedger.pac_lease`,
:mod:`privcode.privacy.pac_budgets`) keeps, per set of worlds, the allowance ``A`` and ``L``,
the sum of every lease it ever granted (all curators, all restarts). :class:`Leases` pays each
private step from its current block and, when empty, leases the next, in the ledger's log
before the step's token is released. So, ``N`` the private steps of every curator of these
worlds ever: ``b * N <= L <= A``. A starting curator holds nothing (everything leased before
counts as spent, whatever its ``curator.json`` says); its first (0-nat) call makes it the
holder and fences every earlier one; a state older than one the ledger saw is refused. Block:
``B = ceil(session_budget / b)`` steps, capped at ``A / (16 b)`` (:func:`block_steps`). A
refused lease stops private steps for good, an unreachable ledger for :attr:`Leases.retry_s`:
nothing private is released unpaid. Pure Python; the ledger is a callable.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from privcode.errors import LedgerConflictError, PrivcodeError

__all__ = ["LEASE_SHARE", "Leases", "block_steps"]

log = logging.getLogger("privcode.pac")

#: The largest share of the allowance one lease may hold (lost at most per restart).
LEASE_SHARE = 16
_RTOL = 1e-9

#: ``lease(nats, holder, steps) -> {"granted", "leased", "allowance"}`` (the ledger's reply).
LeaseFn = Callable[[float, str, int], Mapping[str, Any]]


def block_steps(b: float, session_budget: float, allowance: float) -> int:
    """Private steps per lease: ``clamp(ceil(session_budget / b), 1, floor(A / (16 b)))``."""
    per_session = math.ceil(session_budget / b * (1 - _RTOL))
    cap = math.floor(allowance / (LEASE_SHARE * b) * (1 + _RTOL))
    return max(1, min(per_session, cap))


class Leases:
    """The blocks of one curator (module docstring); ``lease`` calls the store's ledger."""

    def __init__(
        self,
        lease: LeaseFn,
        b: float,
        block: int,
        *,
        holder: str | None = None,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._lease, self.b, self.block = lease, float(b), max(1, int(block))
        self.holder = holder or secrets.token_hex(16)
        self.retry_s, self._clock = retry_s, clock
        self.left = 0  #: private steps leased to this holder, not yet spent
        self.leased = 0.0  #: the ledger's L at its last reply (all holders)
        self.allowance = math.inf  #: the ledger's A at its last reply
        self.failed: str | None = None  #: why this holder may lease nothing more
        self._retry_at = -math.inf

    def start(self, steps: int) -> None:
        """Become the worlds' holder (0 nats); the ledger's refusal propagates (fail closed)."""
        self._take(self._lease(0.0, self.holder, int(steps)))

    def unpaid(self, steps: int) -> str | None:
        """None when one more private step is paid for (leasing a block if none is left),
        else ``"deployment"`` (the allowance is leased out) or ``"ledger"`` (refused or
        unreachable). ``steps``: the curator's private steps so far."""
        if self.left > 0:
            return None
        if self.failed is not None or self._clock() < self._retry_at:
            return "ledger"
        try:
            reply = self._lease(self.block * self.b, self.holder, int(steps))
        except LedgerConflictError as exc:
            self.failed = str(exc)
            log.error("PAC curator: the ledger refuses its leases: %s", exc)
            return "ledger"
        except PrivcodeError as exc:  # unreachable: no private step until it answers
            self._retry_at = self._clock() + self.retry_s
            log.error("PAC curator: no lease from the ledger (%s)", exc)
            return "ledger"
        self._take(reply)
        return None if self.left > 0 else "deployment"

    def spend(self) -> None:
        """One private step paid (after :meth:`unpaid` said None)."""
        if self.left <= 0:
            raise RuntimeError("a PAC step was spent without a lease")
        self.left -= 1

    def charged(self, local: float) -> float:
        """What counts as spent: ``L`` less this holder's unspent steps (``local``, the
        curator's own count, when that is not lower up to rounding)."""
        spent = self.leased - self.left * self.b
        return local if spent <= local * (1 + _RTOL) + 1e-300 else spent

    def _take(self, reply: Mapping[str, Any]) -> None:
        granted = float(reply["granted"])
        self.leased, self.allowance = float(reply["leased"]), float(reply["allowance"])
        self.left += math.floor(granted / self.b * (1 + _RTOL))
