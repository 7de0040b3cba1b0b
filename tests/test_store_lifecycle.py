"""A privacy store's life: created only by `privcode budget init`, never reset by accident.

Issue 41, points 3 and 4. Every loss (the log, the key, the head, entries at the end of
the log, the directory's name) is a refusal naming what is missing, never a fresh budget;
`privcode budget verify` names each damage; `privcode budget wipe` is the one reset and
leaves a record outside the store; the default location does not depend on run.out_dir.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from privcode.cli import main as cli_main
from privcode.dp.events import DPEvent
from privcode.errors import LedgerUnavailableError
from privcode.privacy.budget import init_store, store_log_path, verify_store, wipe
from privcode.privacy.ledger import WAL_NAME, Budget, StoreLedger, pack_fingerprints
from privcode.privacy.store import (
    ENV_VAR,
    HEAD_FILE,
    IDENTITY_FILE,
    KEY_FILE,
    PrivacyStore,
    StoreError,
    StoreIntegrityError,
    default_store,
    resolve_store,
)
from privcode.privacy.wal import encode_line, read_head

SIGMA, Q = 1.0, 0.02
BUDGET = Budget(50.0, 1e-5).to_dict()


def records(n: int) -> list[tuple[str, str]]:
    return [(f"prompt {i}", f"def f{i}():\n    return {i}\n") for i in range(n)]


def plan(steps: int) -> dict:
    return DPEvent(SIGMA, Q, steps).to_dict()


def spend(root: Path, steps: int = 3) -> str:
    """A job admitted on 10 records with ``steps`` grants, then finished: its id."""
    fps = pack_fingerprints(PrivacyStore(root).record_fingerprints(records(10)))
    ledger = StoreLedger(root)
    try:
        job = ledger.admit(fps, plan(steps), BUDGET, run="r")["job"]
        for i in range(steps):
            assert ledger.reserve(job, SIGMA, Q, 1, request_id=f"s{i}")["granted"]
        ledger.finish(job)
    finally:
        ledger.close()
    return job


def spent_steps(root: Path) -> int:
    ledger = StoreLedger(root)
    try:
        return sum(j["steps_granted"] for j in ledger.show()["jobs"])
    finally:
        ledger.close()


def verify_rc(root: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main(["budget", "verify", "--store", str(root)])
    return rc, capsys.readouterr().out


@pytest.fixture
def store(tmp_path) -> Path:
    root, created = init_store(tmp_path / "store")
    assert created
    return root.root


# --------------------------------------------------------------------------- creation


def test_a_path_never_initialised_is_refused_and_nothing_is_created(tmp_path):
    root = tmp_path / "nowhere" / "store"
    for open_it in (PrivacyStore, StoreLedger):
        with pytest.raises(StoreError, match="no privacy store at") as err:
            open_it(root)
        assert f"privcode budget init --store {root}" in str(err.value)
    assert not root.exists() and not root.parent.exists()
    root.mkdir(parents=True)  # an empty directory is no store either
    with pytest.raises(StoreError, match="no store files"):
        PrivacyStore(root)
    assert os.listdir(root) == []


def test_init_creates_the_store_whole_and_refuses_an_existing_one(tmp_path, capsys):
    root = tmp_path / "store"
    assert cli_main(["budget", "init", "--store", str(root), "--epsilon", "3"]) == 0
    assert "created the privacy store" in capsys.readouterr().out
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for name in (KEY_FILE, IDENTITY_FILE, WAL_NAME, HEAD_FILE):
        assert stat.S_IMODE((root / name).stat().st_mode) == 0o600, name
    identity = json.loads((root / IDENTITY_FILE).read_text())
    store = PrivacyStore(root)
    assert identity["store_id"] == store.store_id == store.ledger_id
    assert identity["path"] == str(root.resolve()) and identity["created"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # no temporary left beside it
    ledger = StoreLedger(root)
    assert ledger.describe()["budget"]["epsilon"] == 3.0  # set by init, on record
    ledger.close()
    # A second init is refused; --if-absent (make demo) leaves the store as it is.
    assert cli_main(["budget", "init", "--store", str(root)]) == 2
    assert "already exists" in capsys.readouterr().err
    key = (root / KEY_FILE).read_bytes()
    assert cli_main(["budget", "init", "--store", str(root), "--if-absent"]) == 0
    assert (root / KEY_FILE).read_bytes() == key
    # Not over a directory that holds something else either.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(StoreError, match="is not a privacy store"):
        init_store(tmp_path / "other")


def test_concurrent_inits_make_one_store(tmp_path):
    code = (
        "import sys; from privcode.privacy.budget import init_store\n"
        "s, made = init_store(sys.argv[1], if_absent=True); print(s.store_id, made)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "s")], stdout=subprocess.PIPE, text=True
        )
        for _ in range(5)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({o[0] for o in outs}) == 1 and sum(o[1] == "True" for o in outs) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_default_location_does_not_depend_on_run_out_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    expected = (tmp_path / "data" / "privcode" / "privacy-store").resolve()
    assert default_store() == expected
    for out_dir in ("runs", "runs/exp", tmp_path / "elsewhere" / "runs", "/srv/x/runs"):
        assert resolve_store("", out_dir) == expected
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_store() == (Path.home() / ".local/share/privcode/privacy-store").resolve()
    # The config names it, or the environment variable; both naming two stores is an error.
    assert resolve_store(tmp_path / "cfg", "runs") == (tmp_path / "cfg").resolve()
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_store("", "runs") == (tmp_path / "env").resolve()
    with pytest.raises(StoreError, match="two privacy stores named"):
        resolve_store(tmp_path / "cfg", "runs")


def test_make_demo_initialises_its_store_outside_what_make_clean_deletes(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    text = subprocess.run(
        ["make", "-s", "-n", "-C", str(repo), "demo", "sweep", "study"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    store = f"{repo}/privacy-store"
    assert f"budget init --store '{store}' --if-absent" in text  # quoted: see the Makefile
    runs = [line for line in text.splitlines() if " run --config " in line]
    assert runs and all(f"--set 'privacy.store={store}'" in line for line in runs)
    clean = subprocess.run(
        ["make", "-s", "-n", "-C", str(repo), "clean"], capture_output=True, text=True, check=True
    ).stdout
    assert "privacy-store" not in clean
    assert "/privacy-store/" in (repo / ".gitignore").read_text().splitlines()


# --------------------------------------------------------------------------- no silent reset


def test_deleting_the_log_is_refused(store, capsys):
    spend(store)
    (store / WAL_NAME).unlink()
    for open_it in (PrivacyStore, StoreLedger):
        with pytest.raises(LedgerUnavailableError, match=f"missing {WAL_NAME}"):
            open_it(store)
    rc, out = verify_rc(store, capsys)
    assert rc == 1 and "FAIL" in out and WAL_NAME in out


def test_deleting_the_log_of_a_store_that_never_trained_is_refused(store):
    (store / WAL_NAME).unlink()
    with pytest.raises(StoreIntegrityError, match=f"missing {WAL_NAME}"):
        StoreLedger(store)


def test_deleting_the_key_is_refused(store, capsys):
    spend(store)
    (store / KEY_FILE).unlink()
    for open_it in (PrivacyStore, StoreLedger):
        with pytest.raises(LedgerUnavailableError, match=f"lost its key {KEY_FILE}") as err:
            open_it(store)
        assert "grants no budget" in str(err.value)
    assert not (store / KEY_FILE).exists()  # never recreated
    rc, out = verify_rc(store, capsys)
    assert rc == 1 and KEY_FILE in out


def test_a_key_of_another_store_is_refused(store, tmp_path):
    other, _ = init_store(tmp_path / "other")
    shutil.copy(other.key_path, store / KEY_FILE)
    with pytest.raises(StoreIntegrityError, match="not the key of the privacy store"):
        PrivacyStore(store)


def test_truncating_the_log_by_one_entry_is_refused(store, capsys):
    spend(store)
    wal = store / WAL_NAME
    lines = wal.read_bytes().splitlines(keepends=True)
    wal.write_bytes(b"".join(lines[:-1]))
    with pytest.raises(LedgerUnavailableError, match="1 entry was removed") as err:
        StoreLedger(store)
    assert "truncated" in str(err.value) and WAL_NAME in str(err.value)
    rc, out = verify_rc(store, capsys)
    assert rc == 1 and "truncated" in out
    # Cutting an entry from the middle breaks the chain instead.
    wal.write_bytes(b"".join(lines[:3] + lines[4:]))
    with pytest.raises(LedgerUnavailableError, match="hash chain .* broken"):
        StoreLedger(store)


def test_the_head_missing_stale_or_of_another_log_is_refused(store, tmp_path, capsys):
    spend(store)
    head = store / HEAD_FILE
    saved = head.read_bytes()
    head.unlink()
    with pytest.raises(StoreIntegrityError, match=f"missing {HEAD_FILE}"):
        StoreLedger(store)
    assert verify_rc(store, capsys)[0] == 1
    head.write_bytes(saved)
    # The log of another store does not verify here (its genesis is that store's).
    other, _ = init_store(tmp_path / "other")
    spend(other.root)
    shutil.copy(other.root / WAL_NAME, store / WAL_NAME)
    with pytest.raises(LedgerUnavailableError, match="another store"):
        StoreLedger(store)


def test_a_crash_between_an_append_and_its_head_only_over_counts(store):
    from privcode.privacy.wal import line_hash, write_head

    spend(store, steps=2)
    ledger = StoreLedger(store)
    fps = pack_fingerprints(PrivacyStore(store).record_fingerprints(records(10)))
    job = ledger.admit(fps, plan(1), BUDGET)["job"]
    ledger.close()
    lines = (store / WAL_NAME).read_bytes().splitlines(keepends=True)
    # The last entry is logged but the head still names the one before it (a crash between).
    write_head(store / HEAD_FILE, len(lines) - 1, line_hash(lines[-2]))
    again = StoreLedger(store)  # the logged admission counts: over-counting, never under
    assert job in {j["job"] for j in again.show()["jobs"]}
    again.close()
    assert read_head(store / HEAD_FILE)["entries"] == len(lines)  # repaired
    # Two entries behind is no crash: a stale head (an old copy) is refused.
    write_head(store / HEAD_FILE, len(lines) - 2, line_hash(lines[-3]))
    with pytest.raises(LedgerUnavailableError, match="stale"):
        StoreLedger(store)


def test_renaming_or_moving_the_store_is_refused_until_the_move_is_recorded(store, capsys):
    job = spend(store)
    moved = store.parent / "moved"
    store.rename(moved)
    # The old path: no store there, and the store log says one was lost (not a fresh budget).
    with pytest.raises(StoreError, match="no privacy store"):
        StoreLedger(store)
    with pytest.raises(StoreError, match="is gone without a wipe"):
        init_store(store, if_absent=True)
    # The new path: refused, naming both paths and how to accept a deliberate move.
    with pytest.raises(StoreIntegrityError, match="renamed, moved or copied") as err:
        StoreLedger(moved)
    assert str(store) in str(err.value) and "--accept-move" in str(err.value)
    rc, out = verify_rc(moved, capsys)
    assert rc == 1 and "--accept-move" in out
    assert cli_main(["budget", "verify", "--store", str(moved), "--accept-move"]) == 0
    assert "recorded: moved from" in capsys.readouterr().out
    entry = json.loads((moved / WAL_NAME).read_text().splitlines()[-1])
    assert (entry["type"], entry["from"], entry["to"]) == ("move", str(store), str(moved))
    ledger = StoreLedger(moved)
    assert [j["job"] for j in ledger.show()["jobs"]] == [job]  # the same spent budget
    ledger.close()
    assert verify_store(moved)["ok"]
    # Moved away on record: a new store may be made at the old path.
    assert init_store(store)[1]


def test_a_copy_beside_its_original_is_refused(store):
    spend(store)
    copy = store.parent / "copy"
    shutil.copytree(store, copy)
    with pytest.raises(StoreIntegrityError, match="renamed, moved or copied"):
        PrivacyStore(copy)


def test_a_store_from_before_the_chain_is_accepted_once_and_chained(store, capsys):
    job = spend(store)
    # The store as an older privcode left it: no identity, no head, no prev_hash.
    wal = store / WAL_NAME
    old = [json.loads(line) for line in wal.read_text().splitlines()]
    for entry in old:
        entry.pop("prev_hash")
        entry.pop("crc")
    legacy = b"".join(encode_line(e) for e in old)
    wal.write_bytes(legacy)
    (store / IDENTITY_FILE).unlink()
    (store / HEAD_FILE).unlink()
    assert verify_store(store)["ok"]  # acceptable as it is: migrated on the next open
    ledger = StoreLedger(store)
    assert [j["job"] for j in ledger.show()["jobs"]] == [job]
    ledger.close()
    entries = [json.loads(line) for line in wal.read_text().splitlines()]
    assert entries[-1]["type"] == "chain" and entries[-1]["legacy_entries"] == len(old)
    assert (store / IDENTITY_FILE).exists() and (store / HEAD_FILE).exists()
    assert verify_store(store)["ok"] and spent_steps(store) == 3
    # Accepted once: the legacy log put back over the chained one is refused, and so are an
    # entry removed from, or rewritten (with a valid CRC) in, what came before the chain.
    chained = wal.read_bytes()
    wal.write_bytes(legacy)
    with pytest.raises(LedgerUnavailableError, match="older copy"):
        StoreLedger(store)
    lines = chained.splitlines(keepends=True)
    wal.write_bytes(b"".join(lines[:2] + lines[3:]))
    with pytest.raises(LedgerUnavailableError, match="no chain entry covering"):
        StoreLedger(store)
    grant = next(i for i, e in enumerate(old) if e["type"] == "grant")
    lines[grant] = encode_line({**old[grant], "steps": 0})
    wal.write_bytes(b"".join(lines))
    with pytest.raises(LedgerUnavailableError, match="no longer match"):
        StoreLedger(store)


def test_a_store_from_before_the_log_with_only_its_key_starts_its_chain(tmp_path):
    """An older store that only ever named datasets (its key, no ledger): its ids are kept."""
    root = tmp_path / "old"
    root.mkdir(mode=0o700)
    (root / KEY_FILE).write_bytes(bytes(range(32)))
    os.chmod(root / KEY_FILE, 0o600)
    ids = PrivacyStore(root).opaque("t", "x")
    StoreLedger(root).close()
    assert PrivacyStore(root).opaque("t", "x") == ids and verify_store(root)["ok"]
    assert (root / IDENTITY_FILE).exists() and (root / HEAD_FILE).exists()
    (root / "jobs").mkdir()  # but an older store with jobs and no log has lost its log
    (root / WAL_NAME).unlink()
    with pytest.raises(StoreIntegrityError, match=f"missing {WAL_NAME}"):
        PrivacyStore(root)


# --------------------------------------------------------------------------- verify


def test_verify_passes_a_good_store_and_names_each_damage(store, tmp_path, capsys):
    job = spend(store)
    rc, out = verify_rc(store, capsys)
    assert rc == 0 and "FAIL" not in out and "hash chain intact" in out
    capsys.readouterr()
    assert cli_main(["budget", "verify", "--store", str(store), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and {c["check"] for c in result["checks"]} >= {
        "key",
        "identity",
        "ledger",
        "jobs",
        "groups",
    }
    pristine = tmp_path / "pristine"
    shutil.copytree(store, pristine)

    def damaged(damage, check: str, words: str) -> None:
        shutil.rmtree(store)
        shutil.copytree(pristine, store)
        damage()
        rc, out = verify_rc(store, capsys)
        assert rc == 1, (check, out)
        failed = [line for line in out.splitlines() if line.strip().startswith("FAIL")]
        assert any(check in line and words in line for line in failed), (check, out)

    fps = store / "jobs" / f"{job}.fps"
    damaged(lambda: (store / WAL_NAME).unlink(), "ledger", WAL_NAME)
    damaged(lambda: (store / KEY_FILE).unlink(), "key", KEY_FILE)
    damaged(lambda: (store / HEAD_FILE).unlink(), "ledger", HEAD_FILE)
    damaged(lambda: (store / IDENTITY_FILE).unlink(), "identity", IDENTITY_FILE)
    damaged(lambda: _truncate(store / WAL_NAME), "ledger", "truncated")
    damaged(lambda: fps.write_bytes(b"\0" * 16), "jobs", job)
    damaged(lambda: fps.unlink(), "jobs", "missing")
    damaged(lambda: (store / "groups" / "index.bin").write_bytes(b"x"), "groups", "snapshot")
    damaged(lambda: os.chmod(store / KEY_FILE, 0o644), "permissions", KEY_FILE)
    capsys.readouterr()
    assert cli_main(["budget", "verify", "--store", str(tmp_path / "none")]) == 1


def _truncate(wal: Path) -> None:
    wal.write_bytes(b"".join(wal.read_bytes().splitlines(keepends=True)[:-1]))


# --------------------------------------------------------------------------- wipe


def test_wipe_records_the_store_outside_it_first(store, tmp_path, monkeypatch, capsys):
    spend(store)
    shown = StoreLedger(store)
    worst = shown.show()["epsilon_spent"]
    sid = shown.store_id
    shown.close()
    log = tmp_path / "outside" / "wipes.log"
    monkeypatch.setenv("PRIVCODE_WIPE_LOG", str(log))
    assert store_log_path() == log
    assert cli_main(["budget", "wipe", "--store", str(store)]) == 2  # no --confirm
    assert store.is_dir() and "--confirm" in capsys.readouterr().err
    # No record, no wipe: a store log that cannot be written keeps the store.
    monkeypatch.setenv("PRIVCODE_WIPE_LOG", str(store / "inside.log"))
    with pytest.raises(Exception, match="inside the store"):
        wipe(store, str(store))
    assert (store / KEY_FILE).exists()
    monkeypatch.setenv("PRIVCODE_WIPE_LOG", str(log))
    assert (
        cli_main(["budget", "wipe", "--store", str(store), "--confirm", str(store), "--why", "t"])
        == 0
    )
    assert not store.exists()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    record = records[-1]
    assert record["event"] == "wipe" and record["path"] == str(store)
    assert record["store_id"] == sid and record["epsilon_spent"] == pytest.approx(worst)
    assert record["user"] and record["time"] and record["why"] == "t"
    assert record["budget"]["epsilon"] == 50.0
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    # Wiped on record: a new store may be made at the path (a fresh budget, deliberately).
    assert init_store(store)[1]


def test_a_damaged_store_can_still_be_wiped_on_record(store, tmp_path, monkeypatch):
    spend(store)
    (store / WAL_NAME).unlink()
    monkeypatch.setenv("PRIVCODE_WIPE_LOG", str(tmp_path / "w.log"))
    record = wipe(store, str(store))
    assert record["epsilon_spent"] is None and WAL_NAME in record["unreadable"]
    assert not store.exists()


def test_a_store_deleted_without_a_wipe_blocks_init_until_the_loss_is_recorded(store):
    shutil.rmtree(store)
    with pytest.raises(StoreError, match="gone without a wipe"):
        init_store(store, if_absent=True)
    made, created = init_store(store, replace_lost=True)
    assert created
    events = [json.loads(line)["event"] for line in store_log_path().read_text().splitlines()]
    assert events[-2:] == ["replace-lost", "init"]
