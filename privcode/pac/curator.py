"""The PAC curator: the realised world, the posterior over worlds and the budgets.

The curator alone holds the secret ``S`` (the realised world, uniform over ``m`` worlds, drawn
ONCE with a CSPRNG: ``secrets.randbelow``) and the posterior ``P`` over worlds. Every token goes
through :meth:`Curator.step` (:func:`privcode.pac.mechanism.pac_step`): unanimity among the
worlds of positive posterior is released free (a function of the votes alone, even with every
budget spent); else, with under ``b`` nats left to the session or the deployment, no release
(kind ``"fallback"``: the caller emits the PUBLIC model's token; posterior and noise untouched);
else ``b`` nats are charged to the session and the deployment, the posterior updated and the
state persisted, and only then is the index returned: the ledger is on disk before anything
leaves the server.

Guarantee (scope ``"deployment"``, the default and proven setting): ONE posterior shared by all
sessions, updated by every private step in the order taken (under a lock), so
``I(S; everything released) <= I(S; R_1..N) <= b N``, ``N`` the charged steps over all
sessions (deployment charged / ``b``), adaptive prompts included (each step's noise is
calibrated on the whole history). Assumptions: one curator per ``state_dir`` (one replica);
no budget is reset by a restart; an unreadable or inconsistent state, or one of another
``m``/``b``/scope, is an error (the secret is never silently redrawn); with leases
(:meth:`Curator.use_leases`) what the ledger leased counts as spent. Scope ``"session"``
bounds ``I(S; session) <= b T_session`` PER SESSION ONLY (the bounds do not add up over
sessions); the curator warns loudly when it is used. Owners (API keys) have their own budget
and session cap (they bound what one client takes from others, not the privacy bound).

Charges are integer steps: ``charged = b * steps``, a budget ``T * b`` allows exactly ``T``
(relative tolerance 1e-9). Nothing returns, logs or raises the secret or a posterior;
:meth:`Curator.measured_leakage_nats` is an operator audit, never for API clients. Pure
Python/numpy. Design notes: docs/serving.md, "privcode/pac/curator.py".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from privcode.errors import PrivcodeError
from privcode.pac.bounds import posterior_entropy
from privcode.pac.curator_state import check_owners, check_posterior, check_session
from privcode.pac.mechanism import pac_step
from privcode.utils import atomic_path, canonical_json

log = logging.getLogger("privcode.pac")

__all__ = [
    "STATE_FILE",
    "STATE_FORMAT",
    "Curator",
    "CuratorError",
    "CuratorStateError",
    "DEFAULT_OWNER",
    "SessionLimitError",
    "SessionScopeWarning",
    "StepOutcome",
    "UnknownSessionError",
]

STATE_FILE = "curator.json"
STATE_FORMAT = "privcode-pac-curator/2"
#: Earlier formats still read (format 1: no owners, sessions without owner or last use).
_READ_FORMATS = ("privcode-pac-curator/1", STATE_FORMAT)
#: The owner of sessions opened without one (and of format-1 sessions).
DEFAULT_OWNER = "default"
_SCOPES = ("deployment", "session")
#: Relative slack on budget comparisons: ``T * b`` rounded must still allow T steps.
_BUDGET_RTOL = 1e-9


class CuratorError(PrivcodeError, ValueError):
    """A curator argument or request is invalid (names the value and why)."""


class UnknownSessionError(CuratorError, KeyError):
    """No open session has this id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SessionLimitError(CuratorError):
    """Too many open sessions: the deployment's cap or the owner's."""


class CuratorStateError(PrivcodeError):
    """The persisted curator state cannot be used: the curator must not start (fail closed)."""


class SessionScopeWarning(UserWarning):
    """Scope ``"session"``: the privacy bound holds per session only."""


@dataclass(frozen=True)
class StepOutcome:
    """One token's outcome; safe to show the caller (no secret-dependent state but the release)."""

    index: int | None  #: released candidate index; None = fallback (emit the public token)
    charged: float  #: nats charged: b for a private step, else 0
    kind: Literal["free", "private", "fallback"]


@dataclass
class _Session:
    budget: float
    private: int = 0
    free: int = 0
    fallback: int = 0
    posterior: np.ndarray | None = None  # scope "session" only
    owner: str = DEFAULT_OWNER
    last_used: float = 0.0  # wall clock (s): a restart keeps the idle time


def _check_positive(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise CuratorError(f"{name} must be a finite number of nats > 0, got {value!r}")
    return float(value)


def _fits(steps: int, b: float, budget: float) -> bool:
    """Whether ``steps`` charges of ``b`` nats fit in ``budget``."""
    return steps * b <= budget * (1.0 + _BUDGET_RTOL)


class Curator:
    """Secret, posterior(s) and budgets of one PAC-private deployment (see the module docstring).

    ``m`` worlds, ``b`` nats per private token; ``deployment_budget``: nats
    over all sessions; ``session_budget``: the default (and largest) budget
    of a session. ``rng_seed`` seeds the NOISE generator only (tests); None
    draws it from ``secrets``. The secret is always drawn with ``secrets``.
    """

    def __init__(
        self,
        m: int,
        b: float,
        *,
        deployment_budget: float,
        session_budget: float,
        scope: str = "deployment",
        state_dir: str | os.PathLike | None = None,
        rng_seed: int | None = None,
        max_sessions: int = 4096,
        max_sessions_per_owner: int | None = None,
        owner_budget: float | None = None,
        session_ttl_s: float | None = None,
        clock: Any = time.time,
    ):
        if isinstance(m, bool) or not isinstance(m, int | np.integer) or m < 2:
            raise CuratorError(f"m (number of worlds) must be an integer >= 2, got {m!r}")
        if scope not in _SCOPES:
            raise CuratorError(f"scope must be one of {', '.join(_SCOPES)}, got {scope!r}")
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise CuratorError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.m, self.scope = int(m), scope
        self.b = _check_positive("b (per-token budget)", b)
        self.deployment_budget = _check_positive("deployment_budget", deployment_budget)
        self.session_budget = _check_positive("session_budget", session_budget)
        self.max_sessions = max_sessions
        self.max_sessions_per_owner = max_sessions_per_owner or max_sessions
        #: Nats one owner (API key) may be charged, all its sessions and restarts together.
        self.owner_budget = (
            self.deployment_budget
            if owner_budget is None
            else _check_positive("owner_budget", owner_budget)
        )
        self.session_ttl_s = session_ttl_s
        self._clock = clock
        self._owners: dict[str, int] = {}  # owner -> charged steps (closed sessions included)
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(secrets.randbits(128) if rng_seed is None else rng_seed)
        self._sessions: dict[str, _Session] = {}
        self._steps = 0  # charged steps of the deployment, all sessions, closed ones included
        self._leases: Any = None  # privcode.pac.leases.Leases once served from a ledger
        self._path = None if state_dir is None else Path(state_dir).expanduser() / STATE_FILE
        if scope == "session":
            msg = (
                "PAC curator scope 'session': each session has its own posterior starting "
                "uniform, so the bound I(S; release) <= b * tokens holds PER SESSION only, "
                "against an attacker who sees a single session; it does NOT bound what an "
                "attacker seeing several sessions learns. Use scope 'deployment' for that."
            )
            warnings.warn(msg, SessionScopeWarning, stacklevel=2)
            log.error(msg)
        if self._path is not None and self._path.exists():
            self._load(self._path)
            log.info(
                "PAC curator restored from %s: m=%d b=%.3g scope=%s charged=%.6g nats, "
                "%d open sessions",
                self._path,
                self.m,
                self.b,
                scope,
                self._charged(),
                len(self._sessions),
            )
        else:
            self._secret = secrets.randbelow(self.m)
            self._posterior = np.full(self.m, 1.0 / self.m) if scope == "deployment" else None
            if self._path is not None:
                self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._write(self._snapshot())
            log.info(
                "PAC curator started: m=%d b=%.3g scope=%s deployment budget %.6g nats, state %s",
                self.m,
                self.b,
                scope,
                self.deployment_budget,
                self._path or "in memory only",
            )

    # -- public API

    def use_leases(self, leases: Any) -> None:
        """Pay every private step from ``leases`` (:class:`privcode.pac.leases.Leases`) from
        now on; its start (becoming the worlds' holder) is refused for a rolled-back state."""
        with self._lock:
            leases.start(self._steps)
            self._leases = leases

    def open_session(self, budget: float | None = None, owner: str = DEFAULT_OWNER) -> str:
        """A new session id (random) of ``owner``; its budget is ``min(budget, session_budget)``.

        Idle sessions past ``session_ttl_s`` are closed first (their charges stay spent);
        :class:`SessionLimitError` past ``max_sessions`` or the owner's
        ``max_sessions_per_owner``."""
        budget = (
            self.session_budget
            if budget is None
            else min(_check_positive("session budget", budget), self.session_budget)
        )
        with self._lock:
            self._expire()
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimitError(
                    f"too many open sessions ({len(self._sessions)}; "
                    f"max_sessions={self.max_sessions}): close some first"
                )
            mine = sum(1 for s in self._sessions.values() if s.owner == owner)
            if mine >= self.max_sessions_per_owner:
                raise SessionLimitError(
                    f"this API key holds {mine} open sessions (at most "
                    f"{self.max_sessions_per_owner}): close some first, or let them expire"
                )
            sid = secrets.token_hex(16)
            session = _Session(budget=budget, owner=owner, last_used=self._clock())
            if self.scope == "session":
                session.posterior = np.full(self.m, 1.0 / self.m)
            sessions = {**self._sessions, sid: session}
            if self._path is not None:
                self._write(self._snapshot(sessions=sessions))
            self._sessions = sessions
        return sid

    def close_session(self, sid: str, owner: str | None = None) -> None:
        """Forget a session (its charges stay in the deployment's and its owner's totals)."""
        with self._lock:
            self._get(sid, owner)
            sessions = {k: v for k, v in self._sessions.items() if k != sid}
            if self._path is not None:
                self._write(self._snapshot(sessions=sessions))
            self._sessions = sessions

    def session_info(self, sid: str, owner: str | None = None) -> dict[str, Any]:
        """Budget and token counts of a session (never the posterior or the secret).

        ``owner``: the caller; another owner's session is unknown to it."""
        with self._lock:
            s = self._get(sid, owner)
            charged = self.b * s.private
            spent = self.b * self._owners.get(s.owner, 0)
            return {
                "owner_charged": spent,
                "owner_remaining": max(self.owner_budget - spent, 0.0),
                "session": sid,
                "budget": s.budget,
                "charged": charged,
                "remaining": max(s.budget - charged, 0.0),
                "private_tokens": s.private,
                "free_tokens": s.free,
                "fallback_tokens": s.fallback,
            }

    def can_pay(self, sid: str, owner: str | None = None) -> str | None:
        """None when a private token of ``sid`` could be paid now, else which budget cannot:
        ``"session"``, ``"key"``, ``"deployment"`` or ``"ledger"`` (no lease: refused or
        unreachable)."""
        with self._lock:
            s = self._get(sid, owner)
            return self._unpaid(s)

    def owner_can_pay(self, owner: str) -> str | None:
        """Like :meth:`can_pay` for a new one-shot session of ``owner``."""
        with self._lock:
            return self._unpaid(_Session(self.session_budget, owner=owner))

    def owner_info(self, owner: str) -> dict[str, Any]:
        """``owner``'s own charged private tokens and open sessions (never another's)."""
        with self._lock:
            mine = sum(1 for s in self._sessions.values() if s.owner == owner)
            return {"owner_private_tokens": self._owners.get(owner, 0), "owner_sessions_open": mine}

    def deployment_info(self) -> dict[str, Any]:
        """Deployment-wide parameters and budget (never the posterior or the secret)."""
        with self._lock:
            charged = self._charged()
            if self._leases is not None:  # what the ledger leased counts as spent
                charged = self._leases.charged(charged)
            return {
                "m": self.m,
                "b": self.b,
                "scope": self.scope,
                "deployment_budget": self.deployment_budget,
                "deployment_charged": charged,
                "deployment_remaining": max(self.deployment_budget - charged, 0.0),
                "private_tokens": self._steps,
                "session_budget": self.session_budget,
                "sessions_open": len(self._sessions),
            }

    def step(self, sid: str, votes: np.ndarray) -> StepOutcome:
        """One token of session ``sid`` from the worlds' ``votes[m]`` (candidate indices)."""
        (outcome,) = self.step_many([(sid, votes)])
        if isinstance(outcome, CuratorError):
            raise outcome
        return outcome

    def step_many(
        self, steps: Sequence[tuple[str, np.ndarray]]
    ) -> list[StepOutcome | CuratorError]:
        """Tokens of several sessions at once (group commit): the outcomes :meth:`step` would
        give called once per ``(sid, votes)`` in order, with ONE state write for them all.

        The write goes to disk before any outcome is returned; a failed write raises, undoes
        the lot in memory and releases nothing. A step :meth:`step` would refuse (bad votes,
        an unknown session) gets its :class:`CuratorError` in its place; the others go on.
        """
        with self._lock:
            undo = (self._steps, self._posterior, dict(self._owners))
            sessions: dict[str, _Session] = {}  # each touched session as it was
            out: list[StepOutcome | CuratorError] = []
            try:
                for sid, votes in steps:
                    try:
                        session = self._get(sid)
                        sessions.setdefault(sid, dataclasses.replace(session))
                        out.append(self._release(session, self._checked(votes)))
                    except CuratorError as exc:
                        out.append(exc)
                if self._path is not None and self._steps > undo[0]:
                    self._write(self._snapshot())
            except BaseException:
                if self._leases is not None:  # the leased steps were not spent after all
                    self._leases.left += self._steps - undo[0]
                self._steps, self._posterior, self._owners = undo
                for sid, old in sessions.items():
                    if sid in self._sessions:
                        self._sessions[sid] = old
                raise
            return out

    def _checked(self, votes: Any) -> np.ndarray:
        votes = np.asarray(votes)
        if (
            votes.shape != (self.m,)
            or not np.issubdtype(votes.dtype, np.integer)
            or (votes.size and votes.min() < 0)
        ):
            raise CuratorError(
                f"votes must be {self.m} candidate indices >= 0 (one per world), "
                f"got {votes.dtype} {votes.shape}"
            )
        return votes

    def _release(self, session: _Session, votes: np.ndarray) -> StepOutcome:
        """One step in memory (under the lock): the caller writes the state before it shows
        the outcome to anyone."""
        session.last_used = self._clock()
        prior = self._posterior if self.scope == "deployment" else session.posterior
        active = np.unique(votes[prior > 0])
        if active.size == 1:
            session.free += 1
            return StepOutcome(int(active[0]), 0.0, "free")
        if self._unpaid(session) is not None:
            session.fallback += 1
            return StepOutcome(None, 0.0, "fallback")
        out = pac_step(votes, prior, self._secret, self.b, self._rng)
        self._steps += 1
        if self._leases is not None:
            self._leases.spend()
        session.private += 1
        self._owners[session.owner] = self._owners.get(session.owner, 0) + 1
        if self.scope == "deployment":
            self._posterior = out.posterior
        else:
            session.posterior = out.posterior
        return StepOutcome(out.token, out.charged, "private")

    def measured_leakage_nats(self, sid: str | None = None) -> float:
        """``log m - H(P)``: the entropy drop of the current posterior (OPERATOR AUDIT ONLY).

        Deployment scope: the shared posterior (``sid`` must be None). Session
        scope: that session's posterior (``sid`` required). This depends on
        the secret; averaged over deployments it estimates ``I(S; H)``
        (:func:`privcode.pac.bounds.measured_leakage`). Never show it to an
        API client.
        """
        with self._lock:
            if self.scope == "deployment":
                if sid is not None:
                    raise CuratorError(
                        "scope 'deployment' has one posterior: call "
                        "measured_leakage_nats() without a session id"
                    )
                posterior = self._posterior
            else:
                if sid is None:
                    raise CuratorError(
                        "scope 'session': pass the session id whose leakage to measure"
                    )
                posterior = self._get(sid).posterior
            return math.log(self.m) - posterior_entropy(posterior)

    def __repr__(self) -> str:
        return (
            f"Curator(m={self.m}, b={self.b!r}, scope={self.scope!r}, "
            f"sessions={len(self._sessions)}, state={str(self._path) if self._path else None})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a Curator holds the realised world and is never serialised or copied; "
            "its state persists only through state_dir"
        )

    # -- internals

    def _charged(self) -> float:
        return self.b * self._steps

    def _unpaid(self, session: _Session) -> str | None:
        if not _fits(session.private + 1, self.b, session.budget):
            return "session"
        if not _fits(self._owners.get(session.owner, 0) + 1, self.b, self.owner_budget):
            return "key"
        if not _fits(self._steps + 1, self.b, self.deployment_budget):
            return "deployment"
        return None if self._leases is None else self._leases.unpaid(self._steps)

    def _expire(self) -> None:
        """Close every session idle past ``session_ttl_s`` (under the lock)."""
        if self.session_ttl_s is None:
            return
        cutoff = self._clock() - self.session_ttl_s
        live = {k: v for k, v in self._sessions.items() if v.last_used >= cutoff}
        if len(live) != len(self._sessions):
            if self._path is not None:
                self._write(self._snapshot(sessions=live))
            self._sessions = live

    def _get(self, sid: str, owner: str | None = None) -> _Session:
        session = self._sessions.get(sid) if isinstance(sid, str) else None
        if session is not None and (
            (owner is not None and session.owner != owner)
            or (
                self.session_ttl_s is not None
                and session.last_used < self._clock() - self.session_ttl_s
            )
        ):
            if owner is None or session.owner == owner:
                self._expire()
            session = None
        if session is None:
            raise UnknownSessionError(
                "unknown or closed PAC session id (open one with open_session)"
            )
        return session

    def _snapshot(
        self,
        *,
        sessions: dict[str, _Session] | None = None,
    ) -> dict[str, Any]:
        """The state as JSON (``sessions``: in place of the open ones)."""
        post = self._posterior
        out_sessions = {}
        for sid, s in (self._sessions if sessions is None else sessions).items():
            entry: dict[str, Any] = {
                "owner": s.owner,
                "last_used": s.last_used,
                "budget": s.budget,
                "private_tokens": s.private,
                "free_tokens": s.free,
                "fallback_tokens": s.fallback,
            }
            if self.scope == "session":
                entry["posterior"] = [float(x) for x in s.posterior]
            out_sessions[sid] = entry
        return {
            "format": STATE_FORMAT,
            "m": self.m,
            "b": self.b,
            "scope": self.scope,
            "secret": int(self._secret),
            "deployment_budget": self.deployment_budget,
            "deployment_steps": self._steps,
            "deployment_charged": self.b * self._steps,
            "posterior": None if post is None else [float(x) for x in post],
            "owners": dict(self._owners),
            "sessions": out_sessions,
            "NOT_PUBLIC": "holds the realised world: readable by the PAC server only",
        }

    def _write(self, state: dict[str, Any]) -> None:
        with atomic_path(self._path) as tmp:
            os.chmod(tmp, 0o600)  # the file holds the secret: 0600 whatever atomic_path's mode
            tmp.write_text(canonical_json(state), encoding="utf-8")

    def _load(self, path: Path) -> None:
        def bad(why: str) -> CuratorStateError:
            return CuratorStateError(
                f"{path}: {why}; refusing to start (the secret is never "
                "redrawn: fix or restore the file, or remove it to start "
                "a NEW deployment with a fresh budget)"
            )

        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise bad(f"unreadable curator state ({type(exc).__name__})") from None
        if not isinstance(state, dict) or state.get("format") not in _READ_FORMATS:
            raise bad(f"not a curator state file (format must be {STATE_FORMAT!r})")
        for key, mine in (("m", self.m), ("b", self.b), ("scope", self.scope)):
            if state.get(key) != mine:
                raise bad(f"made with {key}={state.get(key)!r}, this curator has {key}={mine!r}")
        secret, steps = state.get("secret"), state.get("deployment_steps")
        if isinstance(secret, bool) or not isinstance(secret, int) or not 0 <= secret < self.m:
            raise bad(f"'secret' must be an integer in [0, {self.m})")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise bad("'deployment_steps' must be an integer >= 0")
        self._secret, self._steps = secret, steps
        if self.scope == "deployment":
            self._posterior = self._read_posterior(state.get("posterior"), "posterior", bad)
        else:
            self._posterior = None
        self._owners = check_owners(state.get("owners", {}), steps, bad)
        sessions = state.get("sessions")
        if not isinstance(sessions, dict):
            raise bad("'sessions' must be an object")
        for sid, entry in sessions.items():
            budget, counts, owner, last = check_session(
                entry, steps, self._clock(), DEFAULT_OWNER, bad
            )
            session = _Session(budget, *counts, owner=owner, last_used=last)
            if self.scope == "session":
                session.posterior = self._read_posterior(
                    entry.get("posterior"), "sessions entry posterior", bad
                )
            self._sessions[str(sid)] = session
        if "deployment_budget" in state and state["deployment_budget"] != self.deployment_budget:
            log.warning(
                "PAC curator: deployment budget changed from %r to %r nats across a "
                "restart (charges are kept)",
                state["deployment_budget"],
                self.deployment_budget,
            )

    def _read_posterior(self, value: Any, name: str, bad: Any) -> np.ndarray:
        return check_posterior(value, self.m, self._secret, name, bad)
