"""Stage II pool telemetry: what it reads from Ray Data's executor, its sums, its bounded
timeline, its plot. The real executor is exercised by tests/test_synth.py
(test_each_filter_runs_as_its_own_pool: every row through every operator, pools of two)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from privcode.synth.telemetry import MAX_POINTS, PoolTelemetry


class Op:
    def __init__(self, name: str, **metrics):
        self.name = name
        base = dict(
            num_row_inputs_received=0,
            rows_task_outputs_generated=0,
            num_alive_actors=0,
            num_active_actors=0,
            num_pending_actors=0,
            block_generation_time=0.0,
        )
        self.metrics = SimpleNamespace(**{**base, **metrics})


class State:
    def __init__(self, blocks: int = 0):
        self.blocks = blocks

    def total_enqueued_input_blocks(self) -> int:
        return self.blocks


def executor(**ops):
    return SimpleNamespace(_topology={op: State(blocks) for op, blocks in ops.values()})


def telemetry(**kw):
    return PoolTelemetry(
        {"CannedGenerate": "generate", "Extract": "extract", "RoundTripScore": "roundtrip"},
        {"generate": 0.5, "extract": 0.1, "roundtrip": 0.25},
        metrics=False,
        **kw,
    )


def test_points_sums_and_rates():
    t = telemetry(interval=0.0)
    read = Op("ReadItems")  # not a pool: ignored
    gen = Op("MapBatches(CannedGenerate)", num_alive_actors=2, rows_task_outputs_generated=40)
    rt = Op(
        "MapBatches(RoundTripScore)",
        num_alive_actors=1,
        num_active_actors=1,
        num_pending_actors=1,
        num_row_inputs_received=40,
        rows_task_outputs_generated=16,
        block_generation_time=2.0,
    )
    with t:
        t.observe(executor(a=(read, 0), b=(gen, 0), c=(rt, 3)), force=True)
        rt.metrics.rows_task_outputs_generated, rt.metrics.block_generation_time = 40, 4.0
        rt.metrics.num_alive_actors = 2
        t.observe(executor(a=(read, 0), b=(gen, 0), c=(rt, 0)), force=True)
    tl = t.timeline()
    assert len(tl["t"]) == 2 and tl["t"] == sorted(tl["t"])
    r = tl["pools"]["roundtrip"]
    assert r["alive"] == [1, 2] and r["pending"] == [1, 1] and r["active"] == [1, 1]
    assert r["queued"] == [24, 0] and r["queued_blocks"] == [3, 0] and r["rows"] == [16, 40]
    assert tl["pools"]["extract"]["rows"] == [0, 0]  # never seen: zeros, same length
    s = t.summary(seconds=8.0)
    assert s["roundtrip"] == {
        "rows": 40,
        "busy_s": 4.0,
        "rows_per_actor_s": 10.0,  # 40 rows in 4 actor-seconds
        "rows_per_cpu_s": 40.0,  # of a quarter CPU each
        "rows_per_s": 5.0,  # over the run's 8 s
        "peak_actors": 2,
        "cpus_per_actor": 0.25,
    }
    assert s["generate"]["rows_per_actor_s"] is None  # no busy time measured: no rate
    assert s["extract"]["rows"] == 0


def test_interval_and_a_bounded_timeline():
    t = telemetry(interval=3600.0)
    ex = executor(a=(Op("MapBatches(Extract)", rows_task_outputs_generated=1), 0))
    with t:
        t.observe(ex)
        t.observe(ex)  # within the interval: not recorded
        assert len(t.t) == 1
        for _ in range(3 * MAX_POINTS):
            t.observe(ex, force=True)
    assert MAX_POINTS // 2 <= len(t.t) <= MAX_POINTS
    assert t.interval > 3600.0  # thinned: the interval doubled
    assert all(len(v) == len(t.t) for v in t.timeline()["pools"]["extract"].values())


def test_moved_internals_record_nothing_and_never_fail(caplog):
    class Moved:  # an operator whose metrics moved
        name = "MapBatches(Extract)"

    class Broken:
        _topology = {Moved(): State()}

    t = telemetry(interval=0.0)
    with t, caplog.at_level("WARNING", logger="privcode.synth"):
        t.observe(Broken(), force=True)
        t.observe(Broken(), force=True)
    assert t.t == [] and "pool telemetry off" in caplog.text
    assert caplog.text.count("pool telemetry off") == 1
    assert t.summary(1.0)["roundtrip"]["rows"] == 0


def test_only_the_active_telemetry_observes():
    from privcode.synth import telemetry as mod

    a, b = telemetry(), telemetry()
    with a:
        assert mod._active is a
    with b:
        assert mod._active is b
    assert mod._active is None


def test_pools_plot_and_report_rows(tmp_path):
    pytest.importorskip("matplotlib")
    from privcode.pipeline.report_stages import _operator_rows, plot_pools

    timeline = {
        "t": [0.0, 1.0, 2.0],
        "pools": {
            "generate": {"alive": [1, 2, 2], "queued": [0, 5, 0], "rows": [0, 10, 30]},
            "roundtrip": {"alive": [1, 1, 2], "queued": [0, 8, 2], "rows": [0, 2, 30]},
        },
    }
    assert plot_pools(timeline, tmp_path / "pools.png")
    assert (tmp_path / "pools.png").read_bytes()[:4] == b"\x89PNG"
    assert not plot_pools({"t": [0.0], "pools": timeline["pools"]}, tmp_path / "none.png")
    info = SimpleNamespace(
        operators={
            "roundtrip": {
                "rows_per_actor_s": 10.0,
                "rows_per_cpu_s": 40.0,
                "rows_per_s": 5.0,
                "peak_actors": 2,
                "cpus_per_actor": 0.25,
            }
        }
    )
    (label, value), *_ = _operator_rows(info)
    assert label.startswith("operator roundtrip") and "2 actors of 0.25 CPU" in value
