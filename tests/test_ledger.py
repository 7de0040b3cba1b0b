"""The privacy-budget ledger: fail-closed grants, the write-ahead log, restarts, Ray.

The first part drives :class:`BudgetLedger` as a plain object (the WAL rules
need no cluster); the ``ray`` part runs it as the named actor on the session
head from ``conftest``, kills it, restarts it and calls it from tasks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from serve_support import scrape_metrics

from privcode.dp.accounting import DPEvent, epsilon
from privcode.dp.ledger import (
    LEDGER_NAMESPACE,
    WAL_NAME,
    BudgetLedger,
    close_ledger,
    get_ledger,
    ledger_call,
    ledger_name,
    open_ledger,
    read_wal,
    replay_wal,
)
from privcode.errors import LedgerConflictError, LedgerUnavailableError, PrivcodeError

DELTA = 1e-5
SIGMA, Q = 1.0, 0.02


def _budget_for(k: int, sigma: float = SIGMA, q: float = Q) -> float:
    """A budget that admits exactly k single steps at (sigma, q): between eps(k) and eps(k+1)."""
    lo, hi = (epsilon([DPEvent(sigma, q, n)], DELTA) for n in (k, k + 1))
    assert lo < hi
    return (lo + hi) / 2


def _wal_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------- plain object


def test_grants_exactly_until_budget_and_logs_before_returning(tmp_path):
    wal = tmp_path / "run" / WAL_NAME
    ledger = BudgetLedger("r", str(wal), _budget_for(6), DELTA)
    header = _wal_lines(wal)[0]
    assert header["type"] == "header" and header["run_id"] == "r" and header["format"] == 1
    for k in range(1, 7):
        reply = ledger.reserve(SIGMA, Q)
        assert reply["granted"] and reply["reason"] is None and reply["position"] == k
        entries = _wal_lines(wal)[1:]  # the grant is on disk when reserve returns
        assert [e["seq"] for e in entries] == list(range(1, k + 1))
        assert reply["epsilon"] == pytest.approx(epsilon([DPEvent(SIGMA, Q, k)], DELTA))
    denied = ledger.reserve(SIGMA, Q)
    assert not denied["granted"] and "budget exhausted" in denied["reason"]
    assert denied["position"] == 6 and len(_wal_lines(wal)) == 7  # a denial records nothing
    assert ledger.reserve(SIGMA * 100, Q)["granted"]  # far more noise still fits
    spent = ledger.spent()
    assert spent["steps"] == spent["position"] == 7 and spent["entries"] == 2 + 5
    assert spent["epsilon"] <= spent["budget"]
    assert set(spent["epsilon_by_accountant"]) == {"rdp", "prv"}
    assert spent["epsilon_by_accountant"]["prv"] < spent["epsilon"]  # PRV is tighter
    assert epsilon(replay_wal(wal), DELTA) == pytest.approx(spent["epsilon"], rel=1e-12)
    assert [h["seq"] for h in ledger.history()] == list(range(1, 8))
    assert {"noise_multiplier", "sample_rate", "steps", "seq"} <= set(ledger.history()[0])


def test_block_reserve_is_all_or_nothing_and_bad_requests_are_denied(tmp_path):
    ledger = BudgetLedger("r", str(tmp_path / WAL_NAME), _budget_for(10), DELTA)
    assert not ledger.reserve(SIGMA, Q, steps=11)["granted"]
    assert ledger.reserve(SIGMA, Q, steps=10)["position"] == 10
    for bad in [(0.0, Q, 1), (SIGMA, 1.5, 1), (SIGMA, Q, 0), (float("nan"), Q, 1)]:
        reply = ledger.reserve(*bad)
        assert not reply["granted"] and reply["reason"].startswith("invalid request")
    assert ledger.spent()["entries"] == 1


def test_restore_replays_the_wal(tmp_path):
    wal = tmp_path / WAL_NAME
    first = BudgetLedger("r", str(wal), 5.0, DELTA, accountant="prv")
    for sigma in (1.0, 1.0, 0.9):
        first.reserve(sigma, Q, steps=3)
    again = BudgetLedger("r", str(wal), 5.0, DELTA, accountant="prv")
    assert again.spent()["epsilon"] == first.spent()["epsilon"] > 0
    assert again.spent()["history"] == [
        {"noise_multiplier": 1.0, "sample_rate": Q, "steps": 6},
        {"noise_multiplier": 0.9, "sample_rate": Q, "steps": 3},
    ]
    assert again.reserve(1.0, Q)["position"] == 10


def test_request_id_makes_reserve_idempotent_across_restores(tmp_path):
    wal = tmp_path / WAL_NAME
    ledger = BudgetLedger("r", str(wal), 5.0, DELTA)
    first = ledger.reserve(SIGMA, Q, 2, request_id="step-0")
    again = ledger.reserve(SIGMA, Q, 2, request_id="step-0")
    assert first["granted"] and again["granted"] and again["duplicate"]
    assert again["position"] == 2 and again["epsilon"] == first["epsilon"]
    clash = ledger.reserve(SIGMA * 2, Q, 2, request_id="step-0")
    assert not clash["granted"] and "already granted" in clash["reason"]
    restored = BudgetLedger("r", str(wal), 5.0, DELTA)  # ids survive a restart (in the WAL)
    assert restored.reserve(SIGMA, Q, 2, request_id="step-0")["duplicate"]
    assert restored.reserve(SIGMA, Q, 2, request_id="step-1")["position"] == 4
    assert [e.get("request_id") for e in read_wal(wal).entries] == ["step-0", "step-1"]


def test_torn_last_line_is_dropped_and_repaired(tmp_path):
    wal = tmp_path / WAL_NAME
    ledger = BudgetLedger("r", str(wal), 5.0, DELTA)
    for _ in range(3):
        ledger.reserve(SIGMA, Q)
    full = wal.read_bytes()
    # A crash in the middle of writing grant 3: its line is cut short, with no newline.
    wal.write_bytes(full[:-25])
    contents = read_wal(wal)
    assert contents.torn_tail and len(contents.entries) == 2
    restored = BudgetLedger("r", str(wal), 5.0, DELTA)
    assert restored.spent()["position"] == 2  # never returned as granted, so not counted
    assert wal.read_bytes().endswith(b"\n") and not read_wal(wal).torn_tail
    assert restored.reserve(SIGMA, Q)["position"] == 3
    assert [e["seq"] for e in read_wal(wal).entries] == [1, 2, 3]


def test_complete_last_line_without_newline_counts(tmp_path):
    wal = tmp_path / WAL_NAME
    ledger = BudgetLedger("r", str(wal), 5.0, DELTA)
    ledger.reserve(SIGMA, Q)
    wal.write_bytes(wal.read_bytes()[:-1])  # the newline of the last grant was lost
    contents = read_wal(wal)
    assert contents.missing_newline and len(contents.entries) == 1
    restored = BudgetLedger("r", str(wal), 5.0, DELTA)
    assert restored.reserve(SIGMA, Q)["position"] == 2
    assert len(read_wal(wal).entries) == 2


def test_torn_header_only_starts_fresh(tmp_path):
    wal = tmp_path / WAL_NAME
    wal.write_bytes(b'{"accountant":"rdp","bud')
    ledger = BudgetLedger("r", str(wal), 5.0, DELTA)
    assert ledger.spent()["position"] == 0 and read_wal(wal).header["run_id"] == "r"


@pytest.mark.parametrize("damage", ["garbage", "edited", "gap", "garbled_last"])
def test_corrupt_wal_refuses_to_restore(tmp_path, damage):
    wal = tmp_path / WAL_NAME
    ledger = BudgetLedger("r", str(wal), 5.0, DELTA)
    for _ in range(3):
        ledger.reserve(SIGMA, Q)
    lines = wal.read_text().splitlines(keepends=True)
    if damage == "garbage":
        lines[2] = "this is not json\n"
    elif damage == "edited":  # valid JSON, fewer steps: caught by the checksum
        lines[2] = lines[2].replace('"steps":1', '"steps":0')
    elif damage == "gap":
        del lines[2]
    else:  # a complete (newline-terminated) last line that does not parse is not a torn write
        lines[-1] = lines[-1][:-10] + "\n"
    wal.write_text("".join(lines))
    with pytest.raises(LedgerUnavailableError, match="corrupt at line"):
        replay_wal(wal)
    with pytest.raises(LedgerUnavailableError, match="must not train"):
        BudgetLedger("r", str(wal), 5.0, DELTA)


def test_settings_change_is_refused(tmp_path):
    wal = tmp_path / WAL_NAME
    BudgetLedger("r", str(wal), 5.0, DELTA).reserve(SIGMA, Q)
    for kwargs in [{"epsilon_budget": 8.0}, {"delta": 1e-6}, {"accountant": "prv"}]:
        args = {
            "run_id": "r",
            "wal_path": str(wal),
            "epsilon_budget": 5.0,
            "delta": DELTA,
            **kwargs,
        }
        with pytest.raises(LedgerConflictError, match="cannot be changed"):
            BudgetLedger(**args)
    with pytest.raises(LedgerConflictError, match="run_id"):
        BudgetLedger("other", str(wal), 5.0, DELTA)
    assert issubclass(LedgerConflictError, LedgerUnavailableError)
    assert issubclass(LedgerUnavailableError, PrivcodeError)


def test_wal_write_failure_denies_from_then_on(tmp_path):
    wal = tmp_path / WAL_NAME
    ledger = BudgetLedger("r", str(wal), 5.0, DELTA)
    assert ledger.reserve(SIGMA, Q)["granted"]
    wal.unlink()
    wal.mkdir()  # the log is gone (and cannot be recreated as a file)
    reply = ledger.reserve(SIGMA, Q)
    assert not reply["granted"] and "could not be written" in reply["reason"]
    assert reply["position"] == 1 and ledger.describe()["failed"]
    wal.rmdir()  # even with the path free again, this instance stays closed
    assert not ledger.reserve(SIGMA, Q)["granted"] and not wal.exists()


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LedgerUnavailableError, match="cannot create"):
        BudgetLedger("r", str(blocker / "run" / WAL_NAME), 5.0, DELTA)


def test_invalid_settings():
    with pytest.raises(LedgerUnavailableError, match="budget"):
        BudgetLedger("r", "/nonexistent/x", 0.0, DELTA)
    with pytest.raises(LedgerUnavailableError, match="known: prv, rdp"):
        BudgetLedger("r", "/nonexistent/x", 1.0, DELTA, accountant="gdp")
    with pytest.raises(LedgerUnavailableError, match="run id"):
        ledger_name("")
    assert ledger_name("demo") == "privcode-ledger:demo"


@pytest.mark.heavy
def test_open_ledger_without_ray_is_refused(tmp_path):
    # In a fresh interpreter: this test session has Ray initialised already.
    code = (
        "import sys\n"
        "from privcode.dp.ledger import open_ledger\n"
        "from privcode.errors import LedgerUnavailableError\n"
        "try:\n"
        f"    open_ledger('r', {str(tmp_path)!r}, 1.0, {DELTA!r})\n"
        "except LedgerUnavailableError as exc:\n"
        "    print('refused:', exc)\n"
        "    sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "not initialized" in out.stdout
    assert not (tmp_path / WAL_NAME).exists()


# --------------------------------------------------------------------------- Ray actor


@pytest.fixture
def run(ray_connected, tmp_path):
    """A fresh run id and run dir; the ledger actor is removed afterwards."""
    run_id = _run_id()
    yield run_id, tmp_path / "run"
    close_ledger(run_id)


def test_actor_grants_until_budget(run):
    run_id, run_dir = run
    import ray

    handle = open_ledger(run_id, run_dir, _budget_for(5), DELTA)
    assert ray.get(handle.ping.remote()) == "ok"
    replies = [ray.get(handle.reserve.remote(SIGMA, Q)) for _ in range(7)]
    assert [r["granted"] for r in replies] == [True] * 5 + [False] * 2
    assert len(replay_wal(run_dir / WAL_NAME)) == 5
    spent = ray.get(handle.spent.remote())
    assert (
        spent["run_id"] == run_id and spent["position"] == 5 and spent["budget"] == _budget_for(5)
    )
    # Opening again returns the same live actor; other settings are refused.
    assert ray.get(open_ledger(run_id, run_dir, _budget_for(5), DELTA).spent.remote()) == spent
    with pytest.raises(LedgerConflictError, match="budget"):
        open_ledger(run_id, run_dir, 100.0, DELTA)
    with pytest.raises(LedgerConflictError, match="wal_path"):
        open_ledger(run_id, run_dir.parent / "elsewhere", _budget_for(5), DELTA)
    (run_dir / WAL_NAME).rename(run_dir / "moved")  # a live ledger whose log vanished
    with pytest.raises(LedgerUnavailableError, match="WAL .* is gone"):
        open_ledger(run_id, run_dir, _budget_for(5), DELTA)


def test_actor_restarts_from_its_log(run):
    import ray

    run_id, run_dir = run
    handle = open_ledger(run_id, run_dir, 50.0, DELTA)
    eps = [
        ray.get(handle.reserve.remote(SIGMA, Q, 3, request_id=f"step-{i}"))["epsilon"]
        for i in range(4)
    ]
    pid = ray.get(handle.describe.remote())["pid"]
    ray.kill(handle, no_restart=False)  # the process dies; Ray restarts the actor
    # The kill is asynchronous: this call may still reach the dying process, in which case
    # Ray re-sends it to the restarted one and its request id keeps it from counting twice.
    eps.append(
        ray.get(handle.reserve.remote(SIGMA, Q, 3, request_id="step-4"), timeout=120)["epsilon"]
    )
    _wait_restarted(handle, pid)
    reply = ray.get(handle.reserve.remote(SIGMA, Q, 3, request_id="step-5"), timeout=120)
    assert reply["granted"] and reply["position"] == 18
    eps.append(reply["epsilon"])
    assert eps == sorted(eps) and len(set(eps)) == len(eps)
    assert reply["epsilon"] == pytest.approx(
        epsilon(replay_wal(run_dir / WAL_NAME), DELTA), rel=1e-12
    )


def _wait_restarted(handle, old_pid: int, timeout_s: float = 120.0) -> None:
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while ray.get(handle.describe.remote(), timeout=timeout_s)["pid"] == old_pid:
        assert time.monotonic() < deadline, "the ledger actor was not restarted"
        time.sleep(0.2)


def test_a_restart_that_cannot_restore_stops_the_run(run):
    import ray

    run_id, run_dir = run
    handle = open_ledger(run_id, run_dir, 50.0, DELTA)
    for i in range(3):
        assert ledger_call(handle, "reserve", SIGMA, Q, request_id=str(i))["granted"]
    pid = ledger_call(handle, "describe")["pid"]
    wal = run_dir / WAL_NAME
    lines = wal.read_text().splitlines(keepends=True)
    lines[2] = "#" + lines[2]
    wal.write_text("".join(lines))
    ray.kill(handle, no_restart=False)
    with pytest.raises(LedgerUnavailableError, match="corrupt at line 3"):
        for _ in range(600):  # calls before the kill lands still reach the old process
            assert ledger_call(handle, "describe", timeout_s=60)["pid"] == pid
    with pytest.raises(LedgerUnavailableError, match="corrupt at line 3"):
        open_ledger(run_id, run_dir, 50.0, DELTA)


def test_new_ledger_after_actor_is_gone_restores_spent(run):
    import ray

    run_id, run_dir = run
    handle = open_ledger(run_id, run_dir, 50.0, DELTA, accountant="prv")
    spent = ray.get(handle.reserve.remote(0.8, Q, 20))["epsilon"]
    ray.kill(handle, no_restart=True)
    with pytest.raises(LedgerUnavailableError, match="no ledger is open"):
        _wait_gone(run_id)
    # ray.kill is asynchronous: the old handle fails once the kill has landed.
    with pytest.raises(LedgerUnavailableError, match="cannot be reached"):
        for _ in range(150):
            ledger_call(handle, "ping", timeout_s=5)
            time.sleep(0.2)
    again = open_ledger(run_id, run_dir, 50.0, DELTA, accountant="prv")
    info = ray.get(again.spent.remote())
    assert info["epsilon"] == spent and info["position"] == 20 and info["accountant"] == "prv"


def _wait_gone(run_id: str, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        get_ledger(run_id)  # raises once the name is released
        time.sleep(0.2)


def test_open_ledger_refuses_a_corrupt_log(run):
    run_id, run_dir = run
    ledger = BudgetLedger(run_id, str(run_dir / WAL_NAME), 5.0, DELTA)
    for _ in range(3):
        ledger.reserve(SIGMA, Q)
    lines = (run_dir / WAL_NAME).read_text().splitlines(keepends=True)
    lines[2] = "{garbage\n"
    (run_dir / WAL_NAME).write_text("".join(lines))
    with pytest.raises(LedgerUnavailableError, match="corrupt at line 3"):
        open_ledger(run_id, run_dir, 5.0, DELTA)


def test_open_ledger_refuses_an_unwritable_run_dir(run, tmp_path):
    run_id, _ = run
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(LedgerUnavailableError, match="cannot create"):
        open_ledger(run_id, blocker / "run", 5.0, DELTA)
    with pytest.raises(LedgerUnavailableError, match="no ledger is open"):
        get_ledger(run_id)


def test_concurrent_reserves_never_overshoot(run):
    import ray

    run_id, run_dir = run
    budget = _budget_for(25)
    open_ledger(run_id, run_dir, budget, DELTA)

    @ray.remote(num_cpus=0)
    def worker(rid: str, attempts: int) -> list[bool]:
        from privcode.dp.ledger import get_ledger

        ledger = get_ledger(rid)
        return [ray.get(ledger.reserve.remote(SIGMA, Q))["granted"] for _ in range(attempts)]

    results = ray.get([worker.remote(run_id, 12) for _ in range(4)], timeout=300)
    assert sum(map(sum, results)) == 25
    events = replay_wal(run_dir / WAL_NAME)
    assert len(events) == 25 and epsilon(events, DELTA) <= budget


def test_get_ledger_from_a_task_and_metrics(run):
    import ray

    run_id, run_dir = run
    handle = open_ledger(run_id, run_dir, 5.0, DELTA)

    @ray.remote(num_cpus=0)
    def probe(rid: str) -> tuple[str, dict]:
        from privcode.dp.ledger import get_ledger

        ledger = get_ledger(rid)
        return ray.get(ledger.ping.remote()), ray.get(ledger.reserve.remote(SIGMA, Q, 2))

    pong, reply = ray.get(probe.remote(run_id), timeout=120)
    assert pong == "ok" and reply["granted"]
    assert ray.get(handle.describe.remote())["metrics"] is True
    actor = ray.get_actor(ledger_name(run_id), namespace=LEDGER_NAMESPACE)
    assert ray.get(actor.spent.remote())["position"] == 2

    # The metrics reach the node's Prometheus endpoint, tagged with the run.
    metrics = scrape_metrics(
        f'run="{run_id}"',
        {
            "ray_privcode_epsilon_spent",
            "ray_privcode_epsilon_budget",
            "ray_privcode_dp_steps_total",
        },
        until=lambda m: m["ray_privcode_dp_steps_total"] == 2.0,
    )
    assert metrics["ray_privcode_dp_steps_total"] == 2.0
    assert metrics["ray_privcode_epsilon_budget"] == 5.0
    assert metrics["ray_privcode_epsilon_spent"] == pytest.approx(reply["epsilon"])
