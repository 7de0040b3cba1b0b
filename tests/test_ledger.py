"""The privacy store's ledger: admission, per-record grants, one writer, restores, Ray.

The first part drives :class:`StoreLedger` as a plain object (the log, lock
and fencing rules need no cluster); the ``ray`` part runs it as the store's
named actor on the session head from ``conftest``: two drivers at once, a
second actor on the same store, a kill in the middle of a reservation.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from conftest import init_store

from privcode.data.records import Record, read_records, write_records
from privcode.dp.accounting import DPEvent, epsilon
from privcode.errors import LedgerConflictError, LedgerUnavailableError
from privcode.privacy.ledger import WAL_NAME, Budget, StoreLedger, pack_fingerprints
from privcode.privacy.ledger_actor import (
    LEDGER_NAMESPACE,
    StoreLedgerActor,
    close_ledger,
    ledger_call,
    ledger_name,
    open_ledger,
    store_id,
)
from privcode.privacy.store import PrivacyStore
from privcode.privacy.wal import encode_line

DELTA = 1e-5
SIGMA, Q = 1.0, 0.02


def plan(steps: int, sigma: float = SIGMA, q: float = Q) -> dict:
    return DPEvent(sigma, q, steps).to_dict()


def eps(*steps: int) -> float:
    return epsilon([DPEvent(SIGMA, Q, n) for n in steps], DELTA)


def between(a: int, b: int) -> float:
    """A budget admitting a steps' composition but not b steps' (single event)."""
    lo, hi = eps(a), eps(b)
    assert lo < hi
    return (lo + hi) / 2


def budget(e: float) -> dict:
    return Budget(e, DELTA).to_dict()


def records(n: int, start: int = 0) -> list[tuple[str, str]]:
    return [(f"prompt {i}", f"def f{i}():\n    return {i}\n") for i in range(start, start + n)]


def fps_of(store_root, rows) -> bytes:
    return pack_fingerprints(PrivacyStore(store_root).record_fingerprints(rows))


def wal_lines(root) -> list[dict]:
    return [json.loads(line) for line in (root / WAL_NAME).read_text().splitlines()]


def grant_all(ledger: StoreLedger, job: str, n: int, prefix: str = "s") -> list[dict]:
    return [ledger.reserve(job, SIGMA, Q, 1, request_id=f"{prefix}{i}") for i in range(n)]


# --------------------------------------------------------------------------- plain object


def test_admission_reserves_the_plan_and_grants_are_logged_before_returning(tmp_path):
    root = init_store(tmp_path / "store")
    fps = fps_of(root, records(50))
    ledger = StoreLedger(root)
    reply = ledger.admit(fps, plan(40), budget(between(60, 90)), run="a")
    assert reply["admitted"] and reply["new_records"] == 50 and reply["epsilon_spent"] == 0
    assert reply["epsilon_after"] == pytest.approx(eps(40))
    job = reply["job"]
    for i in range(40):
        r = ledger.reserve(job, SIGMA, Q, 1, request_id=f"s{i}")
        assert r["granted"] and r["position"] == i + 1
        assert sum(e["type"] == "grant" for e in wal_lines(root)) == i + 1  # durable first
    # The same records again: 40 planned on top of 40 spent does not fit 60..90.
    again = ledger.admit(fps, plan(40), budget(between(60, 90)), run="renamed")
    assert not again["admitted"] and "job" not in again
    assert again["epsilon_spent"] == pytest.approx(eps(40))
    assert "worst of the 50 training records" in again["message"]
    # A refused job records nothing; a plan that fits is admitted on the spent records.
    assert sum(e["type"] == "admit" for e in wal_lines(root)) == 1
    ok = ledger.admit(fps, plan(20), budget(between(60, 90)), run="renamed")
    assert ok["admitted"] and ok["epsilon_after"] == pytest.approx(eps(60))
    # The whole log: header, budget (set once, by the first job), 2 admits, 40 grants.
    kinds = [e["type"] for e in wal_lines(root)]
    assert kinds[:3] == ["header", "budget", "admit"] and kinds.count("budget") == 1
    assert {e["epoch"] for e in wal_lines(root)[1:]} == {1}
    assert oct(os.stat(root / WAL_NAME).st_mode & 0o777) == "0o600"
    assert oct(os.stat(root).st_mode & 0o777) == "0o700"


def test_running_jobs_hold_their_plans_and_finishing_releases_the_rest(tmp_path):
    root = init_store(tmp_path / "store")
    fps = fps_of(root, records(30))
    ledger = StoreLedger(root)
    b = budget(between(100, 120))
    first = ledger.admit(fps, plan(100), b, run="a")["job"]
    # While the first job runs, its whole plan counts: a second one does not fit.
    assert not ledger.admit(fps, plan(30), b, run="b")["admitted"]
    grant_all(ledger, first, 10)
    done = ledger.finish(first)
    assert done["steps"] == 10 and done["history"] == [plan(10)]
    assert done["record_epsilon"] == pytest.approx(eps(10))
    # Finished: its unused plan is free again, and it is granted nothing more.
    assert ledger.admit(fps, plan(30), b, run="b")["admitted"]
    assert not ledger.reserve(first, SIGMA, Q)["granted"]
    assert "finished" in ledger.reserve(first, SIGMA, Q)["reason"]
    assert not ledger.reserve("nope", SIGMA, Q)["granted"]


def test_a_step_past_the_plan_must_fit_for_every_record(tmp_path):
    root = init_store(tmp_path / "store")
    ledger = StoreLedger(root)
    job = ledger.admit(fps_of(root, records(5)), plan(10), budget(between(12, 13)))["job"]
    replies = grant_all(ledger, job, 14)
    assert [r["granted"] for r in replies] == [True] * 12 + [False] * 2
    assert "budget exhausted" in replies[-1]["reason"]
    assert not ledger.reserve(job, 2 * SIGMA, Q)["granted"]  # not the admitted (sigma, q)


def test_renamed_runs_copies_and_supersets_hit_the_same_records(tmp_path):
    root = init_store(tmp_path / "store")
    rows = [Record(id=f"r{i}", prompt=p, code=c) for i, (p, c) in enumerate(records(40))]
    write_records(rows, tmp_path / "train.parquet")
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    crlf = [
        Record(id=f"x{i}", prompt=r.prompt, code=r.code.replace("\n", "\r\n"))
        for i, r in enumerate(shuffled)
    ]
    write_records(crlf, tmp_path / "copy.jsonl")
    extra = [Record(id=f"n{i}", prompt=p, code=c) for i, (p, c) in enumerate(records(10, 100))]
    write_records(rows + extra, tmp_path / "superset.jsonl")
    store = PrivacyStore(root)

    def fps(path):
        return pack_fingerprints(
            store.record_fingerprints((r.prompt, r.code) for r in read_records(path))
        )

    ledger = StoreLedger(root)
    b = budget(between(50, 60))
    job = ledger.admit(fps(tmp_path / "train.parquet"), plan(25), b, run="first")["job"]
    grant_all(ledger, job, 25)
    ledger.finish(job)
    for name in ("copy.jsonl", "superset.jsonl"):
        reply = ledger.admit(fps(tmp_path / name), plan(40), b, run=f"other-{name}")
        assert not reply["admitted"], name  # 25 + 40 > 50..60 on the shared records
        assert reply["epsilon_spent"] == pytest.approx(eps(25))
    assert ledger.admit(fps(tmp_path / "superset.jsonl"), plan(25), b)["new_records"] == 10


def test_restore_from_the_log_the_snapshot_or_the_jobs(tmp_path):
    root = init_store(tmp_path / "store")
    ledger = StoreLedger(root)
    b = budget(50.0)
    a = ledger.admit(fps_of(root, records(20)), plan(30), b)["job"]
    grant_all(ledger, a, 7)
    c = ledger.admit(fps_of(root, records(20, 10)), plan(30), b)["job"]
    grant_all(ledger, c, 3)
    ledger.finish(c)
    before = ledger.show()
    ledger.close()
    again = StoreLedger(root)
    assert again.show()["groups"] == before["groups"] and again.show()["jobs"] == before["jobs"]
    # Request ids survive: a re-sent grant is answered from the log.
    assert again.reserve(a, SIGMA, Q, 1, request_id="s3").get("duplicate")
    again.close()
    for damage in ("delete", "garble"):
        snap = root / "groups" / "index.bin"
        if damage == "delete":
            snap.unlink()
        else:
            snap.write_bytes(b"\0" * 40)
        rebuilt = StoreLedger(root)  # from every job's records file
        assert rebuilt.show()["groups"] == before["groups"]
        rebuilt.close()
    (root / "groups" / "index.bin").unlink()
    (root / "jobs" / f"{a}.fps").unlink()
    with pytest.raises(LedgerUnavailableError, match="missing"):
        StoreLedger(root)


def test_torn_tail_is_repaired_and_a_corrupt_line_refuses(tmp_path):
    root = init_store(tmp_path / "store")
    ledger = StoreLedger(root)
    job = ledger.admit(fps_of(root, records(5)), plan(10), budget(50.0))["job"]
    grant_all(ledger, job, 3)
    ledger.close()
    wal = root / WAL_NAME
    good = wal.read_bytes()
    wal.write_bytes(good + b'{"type":"grant","jo')  # a write cut short by a crash
    restored = StoreLedger(root)
    assert wal.read_bytes() == good and restored.show()["jobs"][0]["steps_granted"] == 3
    restored.close()
    lines = good.splitlines(keepends=True)
    lines[3] = lines[3].replace(b'"steps":1', b'"steps":0')  # altered in place: CRC fails
    wal.write_bytes(b"".join(lines))
    with pytest.raises(LedgerUnavailableError, match="corrupt at line 4"):
        StoreLedger(root)


def test_one_writer_a_second_one_and_a_fenced_stale_one_fail_closed(tmp_path):
    root = init_store(tmp_path / "store")
    a = StoreLedger(root)
    job = a.admit(fps_of(root, records(5)), plan(20), budget(50.0))["job"]
    with pytest.raises(LedgerUnavailableError, match="another ledger holds"):
        StoreLedger(root)
    # A network split: the lock is lost and another writer takes the store over.
    a.close()
    b = StoreLedger(root)
    assert b.describe()["epoch"] == a.describe()["epoch"] + 1
    stale = a.reserve(job, SIGMA, Q, 1, request_id="x")
    assert not stale["granted"] and "another writer took over" in stale["reason"]
    with pytest.raises(LedgerUnavailableError, match="another writer"):
        a.admit(fps_of(root, records(5)), plan(1), budget(50.0))
    assert b.reserve(job, SIGMA, Q, 1, request_id="y")["granted"]
    b.close()
    assert StoreLedger(root).show()["jobs"][0]["steps_granted"] == 1  # the log is intact


def test_the_budget_is_set_once_and_raised_only_on_record(tmp_path):
    root = init_store(tmp_path / "store")
    ledger = StoreLedger(root)
    fps = fps_of(root, records(5))
    assert ledger.admit(fps, plan(10), budget(2.0))["budget"]["epsilon"] == 2.0
    # Another run's train.epsilon does not move it; an explicit higher one is refused.
    assert ledger.admit(fps, plan(1), budget(9.0))["budget"]["epsilon"] == 2.0
    with pytest.raises(LedgerConflictError, match="privcode budget raise"):
        ledger.admit(fps, plan(1), budget(9.0), explicit=True)
    assert ledger.admit(fps, plan(1), budget(1.0), explicit=True)["budget"]["epsilon"] == 1.0
    from privcode.privacy.authority import AuthorityError, default_key_path, sign_grant

    key, sid = default_key_path(ledger._store.store_id), ledger._store.store_id

    def grant(to, who="data owner", why="second study approved", **over):
        fields = {"kind": "records", "store_id": sid, "from": 2.0, "to": to, "who": who}
        return sign_grant(key, **{**fields, "why": why, **over})

    with pytest.raises(AuthorityError, match="who"):
        ledger.raise_budget(grant(4.0, who=" "))
    with pytest.raises(LedgerConflictError, match="does not raise"):
        ledger.raise_budget(grant(1.5, "owner", "lower"))
    # Without the authority's key there is no raise: a forged, an altered or another
    # store's grant, or one signed for another starting value, is refused.
    forged = {"message": grant(4.0)["message"], "signature": grant(5.0)["signature"]}
    with pytest.raises(AuthorityError, match="signature"):
        ledger.raise_budget(forged)
    with pytest.raises(AuthorityError, match="store_id"):
        ledger.raise_budget(grant(4.0, store_id="another"))
    with pytest.raises(AuthorityError, match="from"):
        ledger.raise_budget(grant(4.0, **{"from": 3.0}))
    good = grant(4.0)
    ledger.raise_budget(good)
    raised = [e for e in wal_lines(root) if e["type"] == "budget"][-1]
    assert (raised["epsilon"], raised["who"]) == (4.0, "data owner")
    assert raised["grant"] == good["signature"]
    with pytest.raises(AuthorityError, match="already used"):
        ledger.raise_budget(good)  # a grant raises once
    ledger.close()
    assert StoreLedger(root).describe()["budget"]["epsilon"] == 4.0


def test_a_pre_store_run_ledger_is_imported_once(tmp_path):
    root = init_store(tmp_path / "store")
    ledger = StoreLedger(root)
    fps = fps_of(root, records(5))
    events = [plan(1)] * 30
    assert ledger.import_legacy(fps, events, "src", budget(3.0))["imported"] == 30
    assert ledger.import_legacy(fps, events, "src", budget(3.0))["imported"] == 0
    reply = ledger.admit(fps, plan(1), budget(3.0))
    assert reply["epsilon_spent"] == pytest.approx(eps(30))
    ledger.close()
    (root / "groups" / "index.bin").unlink()  # rebuilt from the jobs' records, imports too
    again = StoreLedger(root)
    assert again.import_legacy(fps, events, "src", budget(3.0))["imported"] == 0
    assert again.admission(fps, plan(1), budget(3.0))["epsilon_spent"] == pytest.approx(eps(30, 1))


def test_show_has_aggregates_only(tmp_path):
    root = init_store(tmp_path / "store")
    ledger = StoreLedger(root)
    job = ledger.admit(fps_of(root, records(8)), plan(5), budget(5.0), run="demo")["job"]
    grant_all(ledger, job, 5)
    ledger.finish(job)
    shown = ledger.show()
    assert shown["records"] == 8 and len(shown["groups"]) == 1
    group = shown["groups"][0]
    assert group["records"] == 8 and group["epsilon"]["rdp"] == pytest.approx(eps(5))
    assert group["epsilon"]["prv"] is not None and group["epsilon"]["prv"] > 0
    text = json.dumps(shown)
    for fp in PrivacyStore(root).record_fingerprints(records(8)):
        assert fp.hex() not in text


# --------------------------------------------------------------------------- Ray actor


@pytest.fixture
def store(ray_connected, tmp_path):
    root = init_store(tmp_path / "store")
    yield root
    close_ledger(root)


def test_two_drivers_on_overlapping_data_never_exceed_the_budget(store):
    import ray

    open_ledger(store)
    b = budget(between(60, 61))
    a_fps, b_fps = fps_of(store, records(40)), fps_of(store, records(40, 20))

    @ray.remote(num_cpus=0)
    def driver(name: str, fps: bytes, tag: str, plans: list, b: dict) -> int:
        handle = ray.get_actor(name, namespace="privcode")
        reply = ray.get(handle.admit.remote(fps, plans[0], b, run=tag))
        if not reply["admitted"]:
            reply = ray.get(handle.admit.remote(fps, plans[1], b, run=tag))
        granted = 0
        for i in range(60):
            r = ray.get(handle.reserve.remote(reply["job"], 1.0, 0.02, 1, request_id=f"{tag}{i}"))
            granted += bool(r["granted"])
        ray.get(handle.finish.remote(reply["job"]))
        return granted

    name, plans = ledger_name(store_id(store)), [plan(40), plan(20)]
    counts = ray.get([driver.remote(name, f, t, plans, b) for f, t in ((a_fps, "a"), (b_fps, "b"))])
    assert sorted(counts) == [20, 40]
    shown = ledger_call(open_ledger(store), "show")
    assert shown["epsilon_spent"] <= b["epsilon"]
    assert shown["epsilon_spent"] == pytest.approx(eps(60))  # the 20 shared records
    assert sum(e["type"] == "grant" for e in wal_lines(store)) == 60


def test_a_second_actor_on_one_store_fails_closed(store):
    import ray

    open_ledger(store)
    other = ray.remote(StoreLedgerActor).options(namespace="another-cluster", num_cpus=0)
    with pytest.raises(ray.exceptions.RayActorError, match="another ledger holds"):
        ray.get(other.remote(str(store)).describe.remote(), timeout=60)


def test_actor_killed_mid_reservation_restores_monotone(store):
    import ray

    handle = open_ledger(store)
    job = ledger_call(handle, "admit", fps_of(store, records(10)), plan(30), budget(50.0))["job"]
    positions = []
    for i in range(12):
        ref = handle.reserve.remote(job, SIGMA, Q, 1, request_id=f"k{i}")
        if i in (4, 8):
            ray.kill(handle, no_restart=False)  # dies with the call in flight; Ray re-sends it
        positions.append(ray.get(ref, timeout=120)["position"])
    assert positions == sorted(positions) and positions[-1] == 12
    grants = [e for e in wal_lines(store) if e["type"] == "grant"]
    assert len(grants) == 12 and len({g["request_id"] for g in grants}) == 12
    assert len({e["epoch"] for e in wal_lines(store)[1:]}) >= 2  # written by restarted actors


def test_open_ledger_names_and_metrics(store):
    from serve_support import scrape_metrics

    handle = open_ledger(store)
    info = ledger_call(handle, "describe")
    assert info["root"] == str(store.resolve()) and info["store_id"] == store_id(store)
    import ray

    assert ray.get_actor(ledger_name(store_id(store)), namespace=LEDGER_NAMESPACE)
    job = ledger_call(handle, "admit", fps_of(store, records(3)), plan(4), budget(5.0))["job"]
    for i in range(4):
        ledger_call(handle, "reserve", job, SIGMA, Q, 1, request_id=str(i))
    ledger_call(handle, "finish", job)
    found = scrape_metrics(
        f'store="{store_id(store)}"',
        {
            "ray_privcode_epsilon_spent",
            "ray_privcode_epsilon_budget",
            "ray_privcode_dp_steps_total",
        },
        until=lambda m: m.get("ray_privcode_dp_steps_total") == 4.0,
    )
    assert found["ray_privcode_epsilon_budget"] == 5.0
    assert found["ray_privcode_epsilon_spent"] == pytest.approx(eps(4))


def test_wal_lines_are_canonical():
    line = encode_line({"b": 1, "a": 2})
    assert line.endswith(b"\n") and line.index(b'"a"') < line.index(b'"b"')
