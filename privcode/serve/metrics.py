"""Ray metrics of the serving apps (Prometheus, shown on the Ray dashboard): numbers only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["PacMetrics"]


class PacMetrics:
    """Ray metrics of the deployment, shown on the Ray dashboard (numbers only).

    Counter ``privcode_pac_tokens`` (tag ``kind``: private / free /
    fallback), Gauges ``privcode_pac_charged_nats``,
    ``privcode_pac_budget_nats`` and ``privcode_pac_sessions_open``, all
    tagged ``app``: exact, for the operator (the dashboard); API keys see the
    deployment's totals only rounded up (``GET /v1/privacy``).
    """

    def __init__(self, app_name: str):
        from ray.util.metrics import Counter, Gauge

        keys = ("app",)
        self.tokens = Counter(
            "privcode_pac_tokens",
            "Tokens released by the PAC ensemble, by "
            "kind (private: charged b nats; free: unanimous; fallback: "
            "public model).",
            tag_keys=("app", "kind"),
        )
        self.charged = Gauge(
            "privcode_pac_charged_nats",
            "Nats charged to the deployment (all sessions, all restarts).",
            tag_keys=keys,
        )
        self.budget = Gauge(
            "privcode_pac_budget_nats", "The deployment's budget in nats.", tag_keys=keys
        )
        self.sessions = Gauge("privcode_pac_sessions_open", "Open PAC sessions.", tag_keys=keys)
        for metric in (self.tokens, self.charged, self.budget, self.sessions):
            metric.set_default_tags({"app": app_name})

    def update(self, completion: Any, deployment: Mapping[str, Any]) -> None:
        for kind in ("private", "free", "fallback"):
            n = getattr(completion, f"{kind}_tokens", 0) if completion is not None else 0
            if n:
                self.tokens.inc(n, tags={"kind": kind})
        self.charged.set(deployment["deployment_charged"])
        self.budget.set(deployment["deployment_budget"])
        self.sessions.set(deployment["sessions_open"])
