"""The field checks of a persisted PAC curator state (``curator.json``).

:meth:`privcode.pac.curator.Curator._load` reads the file; these check its
parts. ``bad(why)`` builds the error to raise (fail closed: a curator never
starts on a state it cannot trust). A posterior must be a distribution over
the ``m`` worlds, ``P(s) >= 0``, ``sum_s P(s) = 1`` (relative 1e-9), with
``P(S) > 0`` at the secret world ``S`` (the true world is never excluded).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["check_owners", "check_posterior", "check_session"]

Bad = Callable[[str], Exception]
_COUNTS = ("private_tokens", "free_tokens", "fallback_tokens")


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def check_owners(owners: Any, steps: int, bad: Bad) -> dict[str, int]:
    """Owner -> charged steps, together at most the deployment's ``steps``."""
    if not isinstance(owners, dict) or any(
        not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0
        for k, v in owners.items()
    ):
        raise bad("'owners' must map owners to charged steps")
    if sum(owners.values()) > steps:
        raise bad("'owners' hold more private steps than the deployment")
    return dict(owners)


def check_session(
    entry: Any, steps: int, now: float, default_owner: str, bad: Bad
) -> tuple[float, list[int], str, float]:
    """A session entry's (budget, [private, free, fallback], owner, last use)."""
    where = "sessions entry"
    if not isinstance(entry, dict):
        raise bad(f"a {where} is not an object")
    budget = entry.get("budget")
    if not (_finite(budget) and budget > 0):
        raise bad(f"a {where} has no valid 'budget'")
    counts = [entry.get(k) for k in _COUNTS]
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise bad(f"a {where} has invalid token counts")
    if counts[0] > steps:
        raise bad(f"a {where} has more private tokens than the deployment")
    owner, last = entry.get("owner", default_owner), entry.get("last_used", now)
    if not isinstance(owner, str) or not owner:
        raise bad(f"a {where} has no valid 'owner'")
    if not _finite(last):
        raise bad(f"a {where} has no valid 'last_used'")
    return float(budget), counts, owner, float(last)


def check_posterior(value: Any, m: int, secret: int, name: str, bad: Bad) -> np.ndarray:
    """A valid posterior over ``m`` worlds, positive at the secret (module docstring)."""
    try:
        p = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise bad(f"{name!r} is not a list of numbers") from None
    if (
        p.shape != (m,)
        or not np.all(np.isfinite(p))
        or np.any(p < 0)
        or not math.isclose(float(p.sum()), 1.0, rel_tol=1e-9)
        or p[secret] <= 0
    ):
        raise bad(f"{name!r} is not a valid posterior over {m} worlds")
    return p
