"""Stage II telemetry: each operator's pool size, queue depth and throughput over time.

:class:`PoolTelemetry` samples Ray Data's per-operator runtime metrics in the driver every
``interval`` seconds (an execution callback, :func:`install_callback`) while a synthesis run is
active: a timeline per operator (actors alive / busy / pending, ``queued`` = rows received -
rows produced, ``queued_blocks``, rows produced), ``privcode_synth_*`` gauges for the Ray
dashboard, and :meth:`PoolTelemetry.summary` (``rows_per_actor_s = rows / busy_s``). These are
timings and counts of public computation on DP outputs, with no sample content. It reads Ray
Data's internal executor state: a Ray upgrade that moves it makes it record nothing (logged
once), never fail the run. Design notes: docs/methods.md, "synth/telemetry.py".
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("privcode.synth")

__all__ = ["POOLS_FILE", "PoolTelemetry", "install_callback"]

#: The timeline and throughput of a run's pools, next to its stats.json.
POOLS_FILE = "pools.json"

#: Timeline points kept per operator; past it, every other point is dropped and the
#: sampling interval doubles, so a run of any length keeps a bounded timeline.
MAX_POINTS = 240
_FIELDS = ("alive", "active", "pending", "queued", "queued_blocks", "rows")

_active: PoolTelemetry | None = None
_lock = threading.Lock()


class PoolTelemetry:
    """Samples Ray Data's operator metrics while active (``with PoolTelemetry(...)``).

    Build it before the dataset: a dataset keeps a copy of the DataContext that holds the
    callback.

    ``operators`` maps a UDF class name (what Ray Data calls the operator:
    ``MapBatches(<name>)``) to the pool's name (``generate``, ``extract``,
    ``execution``, ``roundtrip``); ``cpus`` the CPUs of one actor of each pool.
    """

    def __init__(
        self,
        operators: dict[str, str],
        cpus: dict[str, float],
        *,
        interval: float = 1.0,
        metrics: bool = True,
    ):
        self.operators = dict(operators)
        self.cpus = dict(cpus)
        self.interval = float(interval)
        self.t: list[float] = []
        self.series: dict[str, dict[str, list[float]]] = {
            name: {f: [] for f in _FIELDS} for name in dict.fromkeys(self.operators.values())
        }
        self.last: dict[str, dict[str, float]] = {}
        self._start = 0.0
        self._next = 0.0
        self._gauges = _gauges() if metrics else None
        self._broken = False
        install_callback()  # before the dataset exists: a dataset copies the DataContext

    def __enter__(self) -> PoolTelemetry:
        global _active
        self._start = time.monotonic()
        with _lock:
            _active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        with _lock:
            if _active is self:
                _active = None

    # ---- sampling (called from the executor's loop) ------------------------------------

    def _pool(self, op: Any) -> str | None:
        name = getattr(op, "name", "")
        for udf, pool in self.operators.items():
            if f"({udf})" in name or name.endswith(udf):
                return pool
        return None

    def observe(self, executor: Any, *, force: bool = False) -> None:
        """Record one point from ``executor`` (a Ray Data StreamingExecutor), at most one
        per ``interval`` unless ``force``."""
        now = time.monotonic()
        if self._broken or (not force and now < self._next):
            return
        self._next = now + self.interval
        try:
            point = self._read(executor)
        except Exception as exc:  # Ray Data internals moved: record nothing, never fail
            self._broken = True
            log.warning("synth: pool telemetry off (%s: %s)", type(exc).__name__, exc)
            return
        if not point:
            return
        self.t.append(round(now - self._start, 2))
        for pool, series in self.series.items():
            values = point.get(pool) or self.last.get(pool) or dict.fromkeys(_FIELDS, 0.0)
            for f in _FIELDS:
                series[f].append(values[f])
        self.last.update(point)
        if len(self.t) > MAX_POINTS:
            self._thin()
        if self._gauges is not None:
            self._publish(point)

    def _read(self, executor: Any) -> dict[str, dict[str, float]]:
        topology = getattr(executor, "_topology", None)
        if not topology:
            return {}
        point: dict[str, dict[str, float]] = {}
        for op, state in topology.items():
            pool = self._pool(op)
            if pool is None:
                continue
            m = op.metrics
            rows_in = float(m.num_row_inputs_received)
            rows_out = float(m.rows_task_outputs_generated)
            prev = point.get(pool)  # one pool, one operator; sum if Ray Data split it
            cur = {
                "alive": float(m.num_alive_actors),
                "active": float(m.num_active_actors),
                "pending": float(m.num_pending_actors),
                "queued": max(0.0, rows_in - rows_out),
                "queued_blocks": float(state.total_enqueued_input_blocks()),
                "rows": rows_out,
                "busy_s": float(m.block_generation_time or 0.0),
            }
            point[pool] = {k: cur[k] + (prev or {}).get(k, 0.0) for k in cur}
        return point

    def _thin(self) -> None:
        self.t = self.t[::2]
        for series in self.series.values():
            for f in _FIELDS:
                series[f] = series[f][::2]
        self.interval *= 2

    def _publish(self, point: dict[str, dict[str, float]]) -> None:
        g = self._gauges
        try:
            for pool, v in point.items():
                tags = {"operator": pool}
                for state in ("alive", "active", "pending"):
                    g["actors"].set(v[state], tags={**tags, "state": state})
                g["queue_rows"].set(v["queued"], tags=tags)
                g["queue_blocks"].set(v["queued_blocks"], tags=tags)
                g["rows"].set(v["rows"], tags=tags)
        except Exception:  # a driver outside Ray: no dashboard metrics, nothing else lost
            self._gauges = None

    # ---- results -----------------------------------------------------------------------

    def summary(self, seconds: float) -> dict[str, dict[str, Any]]:
        """Per pool: rows, busy_s, rows_per_actor_s, rows_per_cpu_s, rows_per_s (wall),
        peak_actors, cpus_per_actor."""
        out = {}
        for pool in self.series:
            last = self.last.get(pool, {})
            rows, busy = last.get("rows", 0.0), last.get("busy_s", 0.0)
            cpus = self.cpus.get(pool, 0.0)
            per_actor = rows / busy if busy > 0 else None
            out[pool] = {
                "rows": int(rows),
                "busy_s": float(f"{busy:.3g}"),  # 3 significant: a sub-10 ms pool stays > 0
                "rows_per_actor_s": _r(per_actor),
                "rows_per_cpu_s": _r(per_actor / cpus) if per_actor and cpus > 0 else None,
                "rows_per_s": _r(rows / seconds) if seconds > 0 else None,
                "peak_actors": int(max(self.series[pool]["alive"], default=0)),
                "cpus_per_actor": cpus,
            }
        return out

    def timeline(self) -> dict[str, Any]:
        """``{"t": [s...], "pools": {pool: {alive, active, pending, queued, queued_blocks,
        rows: [...]}}}``, at most :data:`MAX_POINTS` points."""
        return {"t": list(self.t), "pools": {p: dict(s) for p, s in self.series.items()}}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _gauges() -> dict[str, Any] | None:
    try:
        from ray.util.metrics import Gauge

        op = ("operator",)
        return {
            "actors": Gauge(
                "privcode_synth_pool_actors",
                "Stage II actors per operator pool (state: alive, active, pending).",
                tag_keys=("operator", "state"),
            ),
            "queue_rows": Gauge(
                "privcode_synth_queue_rows",
                "Samples received by a Stage II operator and not yet produced.",
                tag_keys=op,
            ),
            "queue_blocks": Gauge(
                "privcode_synth_queue_blocks",
                "Blocks waiting in a Stage II operator's input queue.",
                tag_keys=op,
            ),
            "rows": Gauge(
                "privcode_synth_rows", "Samples a Stage II operator has produced.", tag_keys=op
            ),
        }
    except Exception:
        return None


_installed = False


def install_callback() -> None:
    """Register the telemetry's execution callback with Ray Data (once per process)."""
    global _installed
    if _installed:
        return
    from ray.data import DataContext

    ctx = DataContext.get_current()
    cls = _callback_class()
    if cls not in ctx.custom_execution_callback_classes:
        ctx.custom_execution_callback_classes.append(cls)
    _installed = True


_CALLBACK: type | None = None


def _callback_class() -> type:
    """The ExecutionCallback subclass (built lazily: importing this module needs no Ray)."""
    global _CALLBACK
    if _CALLBACK is None:
        from ray.data._internal.execution.execution_callback import ExecutionCallback

        class _Telemetry(ExecutionCallback):
            def on_execution_step(self, executor: Any) -> None:
                current = _active
                if current is not None:
                    current.observe(executor)

            def after_execution_succeeds(self, executor: Any) -> None:
                current = _active
                if current is not None:
                    current.observe(executor, force=True)

        _Telemetry.__name__ = _Telemetry.__qualname__ = "TelemetryCallback"
        _CALLBACK = _Telemetry
    return _CALLBACK
