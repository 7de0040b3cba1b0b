"""The operator's own metrics, on its ``--metrics-port`` (Prometheus text format).

* ``privcode_operator_runs{phase}``: PrivCodeRuns by phase, as the operator last saw them;
* ``privcode_operator_admissions_total{result}``: admissions by result (admitted, refused,
  invalid, reserved-before: a retried handler that found its run's reservation);
* ``privcode_operator_reconcile_errors_total{handler}``: handler failures kopf retries.

Counts of runs only: no record, no epsilon of a store (those are the ledger's, operator-only).
Each :class:`OperatorMetrics` has its own registry (tests run several operators in one process).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["OperatorMetrics"]

PHASES = ("Admitted", "Running", "Succeeded", "Failed", "Refused")


class OperatorMetrics:
    """The operator's counters and gauges (module docstring)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge
        from prometheus_client import Counter as PromCounter

        self.registry = CollectorRegistry()
        self.runs = Gauge(
            "privcode_operator_runs", "PrivCodeRuns by phase.", ["phase"], registry=self.registry
        )
        self.admissions = PromCounter(
            "privcode_operator_admissions",
            "Admissions by result.",
            ["result"],
            registry=self.registry,
        )
        self.errors = PromCounter(
            "privcode_operator_reconcile_errors",
            "Handler failures (retried).",
            ["handler"],
            registry=self.registry,
        )
        self._phases: dict[str, str] = {}

    def phase(self, uid: str, phase: str | None) -> None:
        """Run ``uid`` is in ``phase`` now (None: gone)."""
        if phase is None:
            self._phases.pop(uid, None)
        else:
            self._phases[uid] = phase
        counts = Counter(self._phases.values())
        for name in PHASES:
            self.runs.labels(phase=name).set(counts.get(name, 0))

    def serve(self, port: int, host: str = "0.0.0.0") -> Any:
        """Expose the registry over HTTP on ``host:port``; the server."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=host, registry=self.registry)

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
