"""The train stage's noise and its release's epsilon (admission: :mod:`privcode.privacy.admission`).

:func:`noise_for` is a job's sigma: the configured multiplier, or the one
calibrated to ``train.epsilon`` at the job's sample rate and steps;
:func:`release_spent` is the release's own epsilon (its job's grants) under
every accountant.
"""

from __future__ import annotations

from typing import Any

from privcode.config import TrainConfig
from privcode.dp.accounting import ACCOUNTANTS, DPEvent, calibrate, epsilon

__all__ = ["noise_for", "planned_event", "release_spent"]


def noise_for(cfg: TrainConfig, sample_rate: float) -> tuple[float, bool]:
    """(sigma, calibrated): the configured multiplier, or the calibrated one when it is 0."""
    if cfg.noise_multiplier > 0:
        return float(cfg.noise_multiplier), False
    return float(calibrate(cfg.epsilon, cfg.delta, sample_rate, cfg.steps, cfg.accountant)), True


def planned_event(cfg: TrainConfig, records: int) -> DPEvent:
    """The job's plan on ``records`` training records: Poisson rate
    ``q = min(1, expected batch / records)``, its sigma (:func:`noise_for`), ``steps``."""
    q = min(1.0, cfg.expected_batch_size / records)
    return DPEvent(noise_for(cfg, q)[0], q, cfg.steps)


def release_spent(history: list[dict], cfg: TrainConfig) -> dict[str, Any]:
    """The release's own epsilon (its job's grants) under every accountant."""
    events = [DPEvent.from_dict(e) for e in history]
    by: dict[str, float | None] = {}
    for name in ACCOUNTANTS:
        try:
            by[name] = epsilon(events, cfg.delta, name) if events else 0.0
        except Exception:  # noqa: BLE001 - informative only
            by[name] = None
    return {
        "epsilon": by[cfg.accountant],
        "epsilon_by_accountant": by,
        "steps": sum(e.steps for e in events),
    }
