"""One composable DP-SGD event, :class:`DPEvent`: what the ledger grants and a release lists.

Its own module, free of the accountants' imports (opacus, dp-accounting), so
the release's privacy record (:mod:`privcode.artifacts.privacy`) and serving
can hold DP events without importing the accounting maths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from privcode.checks import check_number
from privcode.errors import AccountingError

__all__ = ["DPEvent"]


@dataclass(frozen=True)
class DPEvent:
    """``steps`` DP-SGD steps with noise multiplier ``sigma`` at Poisson sample rate ``q``.

    Validated on construction: sigma > 0 and finite, 0 < q <= 1, steps an
    integer >= 1.  A noise multiplier of 0 is refused: it gives no privacy
    and every accountant would report infinity.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int = 1

    def __post_init__(self) -> None:
        sigma = check_number(
            "noise_multiplier",
            self.noise_multiplier,
            min=0,
            min_exclusive=True,
            error=AccountingError,
        )
        q = check_number(
            "sample_rate", self.sample_rate, min=0, max=1, min_exclusive=True, error=AccountingError
        )
        steps = check_number("steps", self.steps, min=1, integer=True, error=AccountingError)
        # Plain Python numbers: hashable, JSON-serialisable, equal across numpy/float inputs.
        object.__setattr__(self, "noise_multiplier", float(sigma))
        object.__setattr__(self, "sample_rate", float(q))
        object.__setattr__(self, "steps", int(steps))

    def to_dict(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DPEvent:
        try:
            return cls(d["noise_multiplier"], d["sample_rate"], d.get("steps", 1))
        except (KeyError, TypeError, AttributeError) as exc:
            raise AccountingError(f"not a DP event: {d!r} ({exc})") from None
