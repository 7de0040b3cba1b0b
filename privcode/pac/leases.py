"""Leases: a PAC curator spends only nats the store's ledger handed it first.

The ledger (:meth:`privcode.privacy.ledger.StoreLedger.pac_lease`,
:mod:`privcode.privacy.pac_budgets`) keeps, per set of worlds, the allowance
``A`` and ``L``, the sum of every lease it ever granted (all curators, all
restarts). A curator holding :class:`Leases` pays each private step from its
current block; when the block is empty it asks for the next one, and the
lease is in the ledger's log before the step's token is released. Hence, with
``N`` the private steps of every curator of these worlds ever::

    b * N  <=  L  <=  A.

A curator that starts holds nothing (``left = 0``): everything leased
before counts as spent, whatever its ``curator.json`` says, so a restored
older state rolls nothing back (it wastes at most the block its holder had
not spent). Its first call (0 nats) makes it the worlds' holder: every
earlier holder is refused from then on (the fencing between replicas, on
one node or several), and a state older than one the ledger saw is refused.

Block size ``B`` (private steps per lease, :func:`block_steps`). A lease is
one actor call plus one fsynced log append (milliseconds); a private step is
one forward of the m worlds, and a completion charges at most its session's
budget. ``B = ceil(session_budget / b)`` (64 steps at the defaults 2^-10 and
2^-16) means a completion needs at most one lease and most need none (one
round trip per ``B`` private tokens, whatever the traffic). It is capped at
``A / (16 b)``: a restart or a takeover loses at most the old holder's
block, so a small allowance loses at most 1/16 of itself per restart. A
start leases 0 nats, so restarts without traffic lose nothing.

A lease the ledger refuses (another holder took over, a rolled-back state)
stops this curator's private steps for good; an unreachable ledger stops
them for :attr:`Leases.retry_s` (the caller falls back or answers an error;
nothing private is released unpaid). Pure Python; the ledger is a callable.
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
