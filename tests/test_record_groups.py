"""Per-record accounting (privcode.privacy.groups) against a per-record brute force, and the
record fingerprints of the privacy store (same record, whatever the file copy)."""

from __future__ import annotations

import functools
import os
import random
import subprocess
from pathlib import Path

import pytest
from conftest import init_store

from privcode.dp.accounting import DPEvent, epsilon
from privcode.errors import AccountingError
from privcode.privacy.groups import RecordGroups, merge_events
from privcode.privacy.store import PrivacyStore, canonical_text, record_fingerprint

DELTA = 1e-5
KEY = bytes(range(32))


def fps(n: int, start: int = 0) -> list[bytes]:
    return [
        record_fingerprint(KEY, f"prompt {i}", f"def f{i}():\n    return {i}\n")
        for i in range(start, start + n)
    ]


def test_a_record_is_the_same_whatever_its_encoding(tmp_path):
    store = PrivacyStore(init_store(tmp_path / "store"))
    rows = [("Write add", "def add(a, b):\n    return a + b\n"), ("", "x = 'caf\u00e9'\n")]
    copies = [
        rows,
        [(p, c.replace("\n", "\r\n")) for p, c in rows],  # CRLF line ends
        [(p, c.rstrip("\n")) for p, c in reversed(rows)],  # reordered, no final newline
        [(p, c.replace("\u00e9", "e\u0301")) for p, c in rows],  # decomposed accent (NFD)
    ]
    prints = [sorted(store.record_fingerprints(copy)) for copy in copies]
    assert all(p == prints[0] for p in prints) and len(set(prints[0])) == 2
    # Prompt and code are separate fields: moving text across them is another record.
    assert record_fingerprint(KEY, "ab", "c") != record_fingerprint(KEY, "a", "bc")
    # Keyed: another store names the same records differently (nothing to match outside it).
    other = PrivacyStore(init_store(tmp_path / "other"))
    assert not set(other.record_fingerprints(rows)) & set(prints[0])
    assert canonical_text("a\r\nb\n\n") == "a\nb"
    assert oct(os.stat(tmp_path / "store").st_mode & 0o777) == "0o700"


def brute_force(jobs: dict[str, tuple[set[bytes], list[DPEvent]]], fp: bytes) -> float:
    """A record's epsilon straight from its definition: compose every job that saw it."""
    saw = tuple(name for name, (records, _) in sorted(jobs.items()) if fp in records)
    return _compose(tuple(e for name in saw for e in jobs[name][1]))


@functools.cache
def _compose(events: tuple[DPEvent, ...]) -> float:
    return epsilon(events, DELTA) if events else 0.0


def test_admission_is_the_worst_record_by_brute_force():
    rng = random.Random(0)
    universe = fps(300)
    groups = RecordGroups("rdp", DELTA)
    seen: dict[str, tuple[set[bytes], list[DPEvent]]] = {}
    for j in range(6):
        records = set(rng.sample(universe, rng.randint(40, 200)))
        planned = [DPEvent(rng.choice([0.8, 1.0, 1.3]), rng.choice([0.01, 0.02]), 50 * (j + 1))]
        query = set(rng.sample(universe, 120))
        adm = groups.admission(query, planned, budget=100.0)
        worst = max(brute_force({**seen, "new": (query, planned)}, fp) for fp in query)
        assert adm.worst.epsilon_after == pytest.approx(worst, rel=1e-9)
        assert adm.records == 120
        assert adm.new_records == sum(
            1 for fp in query if not any(fp in r for r, _ in seen.values())
        )
        # One composition per distinct group: the groups partition the query.
        assert sum(g.records for g in adm.groups) == 120
        groups.add_job(f"job{j}", records, planned)
        seen[f"job{j}"] = (records, planned)
        # The groups of a job, kept per job, are those a scan of every group finds.
        for name in seen:
            scan = {g: n for g, n in groups.groups().items() if name in g}
            assert groups.groups_of_job(name) == scan
            assert sum(scan.values()) == len(seen[name][0])
    for fp in rng.sample(universe, 30):  # every record's own epsilon, as stored
        group = next((g for g, _ in groups.group_counts([fp]).items()), frozenset())
        assert groups.epsilon(group) == pytest.approx(brute_force(seen, fp), rel=1e-9)


def test_shared_records_carry_their_charges_and_disjoint_ones_do_not():
    corpus = fps(100)
    groups = RecordGroups("rdp", DELTA)
    run = [DPEvent(1.0, 0.02, 400)]
    one = epsilon(run, DELTA)
    assert groups.admission(corpus, run, budget=1.2 * one).fits
    groups.add_job("sweep-eps4", corpus, run)
    # The same rows again (renamed run, another out_dir, a copy): composes.
    again = groups.admission(list(reversed(corpus)), run, budget=1.2 * one)
    assert not again.fits and again.worst.epsilon == pytest.approx(one)
    assert again.worst.epsilon_after == pytest.approx(epsilon(run * 2, DELTA))
    assert "does not fit" in again.message() and "100 training records" in again.message()
    # A superset: the old rows are the worst records, the extra rows start from zero.
    superset = groups.admission(corpus + fps(50, 1000), run, budget=1.2 * one)
    assert not superset.fits and superset.new_records == 50
    assert {g.records for g in superset.groups} == {100, 50}
    # Disjoint data has its own budget.
    assert groups.admission(fps(100, 5000), run, budget=1.2 * one).fits


def test_steps_are_checked_against_every_group_of_the_job():
    groups = RecordGroups("rdp", DELTA)
    a, b = fps(60), fps(60, 30)  # 30 records shared
    groups.add_job("a", a, [DPEvent(1.0, 0.05, 300)])
    groups.add_job("b", b, [])  # b's plan is empty: it asks per step
    budget = epsilon([DPEvent(1.0, 0.05, 300), DPEvent(1.0, 0.05, 100)], DELTA)
    assert groups.check_step("b", [DPEvent(1.0, 0.05, 100)], budget) is None
    over = groups.check_step("b", [DPEvent(1.0, 0.05, 101)], budget)
    assert over is not None and over.jobs == {"a", "b"} and over.records == 30
    assert over.epsilon_after > budget
    # The check changes nothing; committing does.
    assert groups.jobs["b"] == ()
    groups.set_events("b", [DPEvent(1.0, 0.05, 60), DPEvent(1.0, 0.05, 40)])
    assert groups.jobs["b"] == (DPEvent(1.0, 0.05, 100),)


def test_state_round_trips_and_damage_is_refused():
    groups = RecordGroups("rdp", DELTA)
    groups.add_job("a", fps(80), [DPEvent(1.0, 0.02, 100)])
    groups.add_job("b", fps(80, 40), [DPEvent(0.9, 0.02, 50)])
    back = RecordGroups.from_state(groups.state(), groups.index_bytes())
    assert back.groups() == groups.groups() and back.jobs == groups.jobs
    assert back.records == 120
    assert all(back.groups_of_job(j) == groups.groups_of_job(j) for j in ("a", "b"))
    assert sorted(back.groups().values()) == [40, 40, 40]
    with pytest.raises(ValueError, match="whole number"):
        RecordGroups.from_state(groups.state(), groups.index_bytes()[:-1])
    state = groups.state()
    state["jobs"].pop("a")
    with pytest.raises(ValueError, match="job that does not exist"):
        RecordGroups.from_state(state, groups.index_bytes())
    with pytest.raises(AccountingError, match="already recorded"):
        groups.add_job("a", fps(1), [])
    with pytest.raises(AccountingError, match="16 bytes"):
        groups.add_job("c", [b"short"], [])
    assert "c" not in groups.jobs  # a refused add changes nothing


def test_merge_events_keeps_the_composition():
    events = [DPEvent(1.0, 0.01, 10), DPEvent(2.0, 0.01, 5), DPEvent(1.0, 0.01, 7)]
    merged = merge_events(events)
    assert merged == (DPEvent(1.0, 0.01, 17), DPEvent(2.0, 0.01, 5))
    assert epsilon(merged, DELTA) == pytest.approx(epsilon(events, DELTA), rel=1e-12)


def test_make_clean_leaves_the_privacy_store(tmp_path):
    """`make clean` removes runs and reports, never the demo's store beside them (its budgets)."""
    makefile = Path(__file__).resolve().parents[1] / "Makefile"
    (tmp_path / "runs" / "demo" / "train").mkdir(parents=True)
    (tmp_path / "reports").mkdir()
    store = PrivacyStore(init_store(tmp_path / "privacy-store"))  # make demo's DEMO_STORE
    subprocess.run(["make", "-s", "-f", str(makefile), "-C", str(tmp_path), "clean"], check=True)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "reports").exists()
    assert store.key_path.is_file() and PrivacyStore(tmp_path / "privacy-store").store_id
