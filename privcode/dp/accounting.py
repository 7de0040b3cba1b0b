"""Privacy accounting for DP-SGD: epsilon of a history of steps, noise calibration.

Pure functions, no Ray. One DP-SGD step is the Poisson-subsampled Gaussian mechanism: each
record enters the batch independently with probability ``q``, the per-record gradients are
clipped to norm C and N(0, sigma^2 C^2) is added once to their sum. A history of
:class:`DPEvent` ``(sigma, q, steps)`` composes adaptively to (epsilon, delta)-DP under the
add/remove-one-record relation (as Opacus and dp-accounting assume for Poisson sampling).
Two accountants, both Opacus' (the maths is not re-derived here):

``rdp``
    Renyi DP, additive per order alpha; ``eps = min_alpha rdp(alpha) + log((alpha-1)/alpha)
    - (log delta + log alpha) / (alpha - 1)`` (Balle et al. 2020, Thm. 21) over
    :data:`RDP_ORDERS` (Opacus' grid plus 11, 128, 256, 512 and 1024: dp-accounting's grid).
``prv``
    Numerical composition of privacy loss random variables (Gopi, Lee, Wutschitz 2021), the
    upper end of its error interval (:data:`PRV_EPS_ERROR`): a guarantee, not an estimate.

Cross-checks, timings, reference values: docs/privacy.md, "privcode/dp/accounting.py".
"""

from __future__ import annotations

import abc
import functools
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from privcode.checks import check_number
from privcode.dp.events import DPEvent
from privcode.errors import AccountingError

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "DPEvent",
    "PRVAccountant",
    "RDPAccountant",
    "RDP_ORDERS",
    "SIGMA_MAX",
    "SIGMA_MIN",
    "calibrate",
    "epsilon",
    "make_accountant",
]

#: Opacus' default RDP orders plus 11 and 128..1024 (= dp-accounting's default grid).
RDP_ORDERS: tuple[float, ...] = tuple(
    sorted({1 + x / 10.0 for x in range(1, 100)} | set(range(11, 64)) | {128, 256, 512, 1024})
)
#: Width of the PRV accountant's epsilon error interval; its upper end is reported.
PRV_EPS_ERROR = 0.01
#: Search range of :func:`calibrate`.  Above SIGMA_MAX the RDP epsilon is already at
#: its floor (set by the largest order), so more noise buys nothing.
SIGMA_MIN = 1e-2
SIGMA_MAX = 1e4


def _check_delta(delta: float) -> float:
    return float(
        check_number(
            "delta",
            delta,
            min=0,
            max=1,
            min_exclusive=True,
            max_exclusive=True,
            error=AccountingError,
        )
    )


# --------------------------------------------------------------------------- accountants


class Accountant(abc.ABC):
    """Composes DP events and reports epsilon at a given delta.

    ``history`` lists the composed events, consecutive events with the same
    (sigma, q) merged into one with their steps added (as Opacus does), so a
    long run at fixed settings stays one entry and costs one evaluation.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._history: list[DPEvent] = []

    def compose(self, event: DPEvent) -> Accountant:
        """Add ``event`` to the history; returns self."""
        if not isinstance(event, DPEvent):
            raise AccountingError(f"compose() takes a DPEvent, got {type(event).__name__}")
        last = self._history[-1] if self._history else None
        if last is not None and (last.noise_multiplier, last.sample_rate) == (
            event.noise_multiplier,
            event.sample_rate,
        ):
            self._history[-1] = DPEvent(
                last.noise_multiplier, last.sample_rate, last.steps + event.steps
            )
        else:
            self._history.append(event)
        return self

    @property
    def history(self) -> list[DPEvent]:
        return list(self._history)

    @property
    def steps(self) -> int:
        """Total number of steps composed so far."""
        return sum(e.steps for e in self._history)

    def epsilon(self, delta: float) -> float:
        """Epsilon of the composed history at ``delta`` (0.0 for an empty history).

        Never NaN: a value the analysis cannot bound is reported as ``inf``.
        """
        delta = _check_delta(delta)
        if not self._history:
            return 0.0
        eps = float(self._epsilon(delta))
        return eps if not math.isnan(eps) else math.inf

    @abc.abstractmethod
    def _epsilon(self, delta: float) -> float: ...

    def copy(self) -> Accountant:
        new = type(self)()
        new._history = list(self._history)
        return new

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: ``{"accountant": name, "history": [[sigma, q, steps], ...]}``."""
        return {
            "accountant": self.name,
            "history": [[e.noise_multiplier, e.sample_rate, e.steps] for e in self._history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the history with the one in ``state`` (from :meth:`state_dict`)."""
        if not isinstance(state, Mapping) or "history" not in state:
            raise AccountingError("accountant state must be a mapping with a 'history' key")
        if state.get("accountant", self.name) != self.name:
            raise AccountingError(
                f"cannot load the state of a {state.get('accountant')!r} "
                f"accountant into a {self.name!r} accountant"
            )
        history: list[DPEvent] = []
        for row in state["history"]:
            try:
                sigma, q, steps = row
            except (TypeError, ValueError):
                raise AccountingError(
                    f"bad history entry {row!r}: want [sigma, q, steps]"
                ) from None
            history.append(DPEvent(sigma, q, steps))
        self._history = []
        for event in history:
            self.compose(event)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self.steps}, history={self._history!r})"


@functools.lru_cache(maxsize=1024)
def _rdp_one_step(q: float, sigma: float) -> np.ndarray:
    """Opacus' RDP vector of one subsampled-Gaussian step at :data:`RDP_ORDERS`.

    RDP composes additively, so T steps are T times this vector (exactly what
    ``compute_rdp(steps=T)`` returns); caching it makes a ledger that adds one
    step at a time cost one evaluation per (sigma, q), not one per step.
    """
    from opacus.accountants.analysis import rdp as opacus_rdp

    vec = np.asarray(
        opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(RDP_ORDERS)),
        dtype=np.float64,
    )
    vec.setflags(write=False)
    return vec


class RDPAccountant(Accountant):
    """Renyi-DP accountant (Opacus' subsampled-Gaussian RDP at :data:`RDP_ORDERS`)."""

    name = "rdp"

    def _epsilon(self, delta: float) -> float:
        from opacus.accountants.analysis import rdp as opacus_rdp

        rdp = sum(e.steps * _rdp_one_step(e.sample_rate, e.noise_multiplier) for e in self._history)
        with warnings.catch_warnings():
            # Opacus warns when the optimum sits at the edge of the order grid;
            # the bound is still valid, only possibly loose.
            warnings.simplefilter("ignore")
            eps, _ = opacus_rdp.get_privacy_spent(
                orders=list(RDP_ORDERS), rdp=np.asarray(rdp, dtype=float).tolist(), delta=delta
            )
        return eps


class PRVAccountant(Accountant):
    """PRV accountant (Opacus' ``PRVAccountant``), reporting its epsilon upper bound."""

    name = "prv"

    def __init__(self) -> None:
        super().__init__()
        self._cache: tuple[tuple, float] | None = None

    def _epsilon(self, delta: float) -> float:
        from opacus.accountants import PRVAccountant as OpacusPRV

        key = (tuple(self._history), delta)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        impl = OpacusPRV()
        impl.history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in self._history]
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # log(0) and overflow at the domain edges are expected
            eps = float(impl.get_epsilon(delta, eps_error=PRV_EPS_ERROR))
        self._cache = (key, eps)
        return eps

    def copy(self) -> Accountant:
        new = super().copy()
        assert isinstance(new, PRVAccountant)
        new._cache = self._cache  # the key includes the history, so sharing is safe
        return new


#: Accountant name -> class.  ``make_accountant(name)`` builds one.
ACCOUNTANTS: dict[str, type[Accountant]] = {"rdp": RDPAccountant, "prv": PRVAccountant}


def make_accountant(name: str) -> Accountant:
    """A fresh accountant by name (see :data:`ACCOUNTANTS`)."""
    try:
        return ACCOUNTANTS[name]()
    except (KeyError, TypeError):
        raise AccountingError(
            f"unknown accountant {name!r}; known: {', '.join(sorted(ACCOUNTANTS))}"
        ) from None


# --------------------------------------------------------------------------- functions


def epsilon(history: Iterable[DPEvent] | DPEvent, delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` of the composition of ``history`` (DP events, in order)."""
    acc = make_accountant(accountant)
    for event in [history] if isinstance(history, DPEvent) else history:
        acc.compose(event)
    return acc.epsilon(delta)


def calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tol: float = 1e-4,
    prior: Sequence[Sequence[DPEvent]] = (),
) -> float:
    """Smallest noise multiplier whose ``steps`` steps at rate q stay within ``target_epsilon``.

    ``prior``: the histories the records already spent (one per distinct group,
    :mod:`privcode.privacy.groups`); then ``max_h epsilon(h + [(sigma, q, steps)]) <= target``,
    still decreasing in sigma. A prior that alone reaches the target is an
    :class:`AccountingError`. Returns a sigma whose epsilon (same accountant) was computed and
    found within the target (never an overshoot), with a certified ``lo >= sigma * (1 - tol)``
    whose epsilon exceeds it: the smallest to relative tolerance ``tol``. Search: secant steps on
    log(epsilon) against log(sigma), bisection as fallback. SIGMA_MIN if even it meets the
    target; AccountingError if SIGMA_MAX does not. Details: docs/privacy.md,
    "privcode/dp/accounting.py".
    """
    check_number("target epsilon", target_epsilon, min=0, min_exclusive=True, error=AccountingError)
    check_number("tol", tol, min=0, max=0.1, min_exclusive=True, error=AccountingError)
    delta = _check_delta(delta)
    DPEvent(1.0, sample_rate, steps)  # validates q and steps
    make_accountant(accountant)  # validates the name
    target = float(target_epsilon)
    histories = [tuple(h) for h in prior if h] or [()]
    for history in histories:
        if history and not epsilon(history, delta, accountant) < target:
            raise AccountingError(
                f"target epsilon {target:g} cannot be met: records of this training set have "
                f"already spent epsilon {epsilon(history, delta, accountant):.4g} at delta "
                f"{delta:g} ({accountant}); no further step fits"
            )
    cache: dict[float, float] = {}
    recent: list[float] = []  # sigmas in evaluation order: the secant uses the last two

    def eps_at(sigma: float) -> float:
        if sigma not in cache:
            new = DPEvent(sigma, sample_rate, steps)
            try:
                cache[sigma] = max(epsilon([*h, new], delta, accountant) for h in histories)
            except Exception:  # noqa: BLE001 - a failed evaluation must never pass as "within"
                cache[sigma] = math.inf
            recent.append(sigma)
        return cache[sigma]

    lo, hi = _bracket(eps_at, target, sample_rate, steps, delta, accountant)
    if lo is None:
        return hi
    last_step = hi - lo
    while hi - lo > tol * hi:
        width = hi - lo
        x = _secant(recent[-2], recent[-1], cache, target)
        # Safeguard (as in Numerical Recipes' rtsafe): bisect when the secant
        # leaves the bracket or does not at least halve the previous step; the
        # RDP curve has kinks where the optimal order changes.
        if x is None or not lo < x < hi or abs(x - recent[-1]) > 0.5 * last_step:
            x = math.sqrt(lo * hi)
        x = min(max(x, lo + 1e-3 * width), hi - 1e-3 * width)
        last_step = abs(x - recent[-1])
        # The probe straddles x so the bracket can close from both sides, and it
        # gives the next secant a short baseline (close to a Newton step).
        probe_gap = 0.5 * tol * x
        if eps_at(x) <= target:
            hi = x
            probe = x - probe_gap
            if probe > lo:
                lo, hi = (lo, probe) if eps_at(probe) <= target else (probe, hi)
        else:
            lo = x
            probe = x + probe_gap
            if probe < hi:
                lo, hi = (lo, probe) if eps_at(probe) <= target else (probe, hi)
    return float(hi)


def _bracket(
    eps_at, target: float, q: float, steps: int, delta: float, accountant: str
) -> tuple[float | None, float]:
    """(lo, hi) with eps(lo) > target >= eps(hi); lo None when SIGMA_MIN already meets it."""
    lo: float | None = None
    hi: float | None = None
    sigma = 1.0
    while True:
        if eps_at(sigma) <= target:
            hi = sigma
            if lo is not None:
                return lo, hi
            if sigma <= SIGMA_MIN:
                return None, SIGMA_MIN
            sigma = max(SIGMA_MIN, sigma / _growth(eps_at(sigma), target))
        else:
            lo = sigma
            if hi is not None:
                return lo, hi
            if sigma >= SIGMA_MAX:
                raise AccountingError(
                    f"target epsilon {target:g} cannot be met at delta {delta:g} with "
                    f"{steps} steps at sample rate {q:g} ({accountant}): even noise multiplier "
                    f"{SIGMA_MAX:g} gives epsilon {eps_at(sigma):.4g}; raise the target or "
                    f"delta, or use fewer steps or a smaller sample rate"
                )
            sigma = min(SIGMA_MAX, sigma * _growth(eps_at(sigma), target))


def _growth(eps: float, target: float) -> float:
    """Bracketing step factor: epsilon scales roughly like 1/sigma, so move by the ratio."""
    if not math.isfinite(eps) or eps <= 0:
        return 4.0
    ratio = max(eps / target, target / eps)
    return min(max(1.25 * ratio, 1.5), 10.0)


def _secant(s1: float, s2: float, cache: dict[float, float], target: float) -> float | None:
    """Root of log eps - log target on the log-sigma axis through two points; None if undefined."""
    e1, e2 = cache[s1], cache[s2]
    if not (
        math.isfinite(e1) and math.isfinite(e2) and e1 > 0 and e2 > 0 and e1 != e2 and s1 != s2
    ):
        return None
    a, b = math.log(s1), math.log(s2)
    fa, fb = math.log(e1) - math.log(target), math.log(e2) - math.log(target)
    x = math.exp(a + (b - a) * fa / (fa - fb))
    return x if math.isfinite(x) else None
