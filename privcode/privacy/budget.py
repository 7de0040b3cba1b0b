"""The privacy store seen from a terminal: `privcode budget init | show | raise | verify | wipe`.
Design notes: docs/privacy.md, "privcode/privacy/budget.py".

Every call that reads or changes the budget goes through the store's one writer: the ledger actor
when this process is connected to Ray or a cluster holds the store, else the ledger as a plain
object for the length of the call (it takes the store's lock, so never beside an actor). What is
printed is aggregates only. :func:`init_store` is the only creator (whole or not at all);
:func:`verify_store` checks a store and records a deliberate move; :func:`wipe` deletes one after
appending a record to the store log OUTSIDE it (:func:`store_log_path`), the log that also
records every init and accepted move.

"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from privcode.errors import LedgerUnavailableError, PrivcodeError
from privcode.privacy.authority import make_authority
from privcode.privacy.ledger import (
    RECORD_ENTRIES,
    WAL_FORMAT,
    Budget,
    LoadedLog,
    StoreLedger,
    load_log,
)
from privcode.privacy.ledger_actor import ledger_call, open_ledger
from privcode.privacy.ledger_client import remote_ledger
from privcode.privacy.store import (
    HEAD_FILE,
    IDENTITY_FILE,
    IDENTITY_FORMAT,
    JOBS_DIR,
    KEY_BYTES,
    KEY_FILE,
    WAL_FILE,
    PrivacyStore,
    StoreError,
    current_user,
    store_id_of,
)
from privcode.privacy.wal import append_line, genesis_hash, repair, write_chained, write_head

__all__ = [
    "WIPE_LOG_ENV",
    "accept_move",
    "call",
    "format_show",
    "format_verify",
    "init_store",
    "store_log_path",
    "verify_store",
    "wipe",
]

WIPE_LOG_ENV = "PRIVCODE_WIPE_LOG"


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@contextlib.contextmanager
def _ledger(root: Path) -> Iterator[Any]:
    """(kind, ledger): the actor inside a Ray process or when a cluster holds the store, else
    a plain one here for the length of the call; the ledger service when one is named."""
    if (
        _ray_initialized() or remote_ledger() is not None
    ):  # a Serve replica, a stage: the cluster's one writer
        yield "actor", open_ledger(root)
        return
    try:
        plain = StoreLedger(root)
    except LedgerUnavailableError as exc:
        if "another ledger holds" not in str(exc):
            raise
        from privcode.cluster.local import connect

        connect(os.environ.get("RAY_ADDRESS") or "auto")  # the cluster whose actor holds it
        yield "actor", open_ledger(root)
        return
    try:
        yield "plain", plain
    finally:
        plain.close()


def call(root: str | os.PathLike, method: str, *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)`` on the store's one writer (module docstring)."""
    path = Path(root).expanduser().resolve()
    PrivacyStore(path)  # no store, or a damaged or moved one: refused here, naming it
    with _ledger(path) as (kind, ledger):
        if kind == "plain":
            return getattr(ledger, method)(*args, **kwargs)
        return ledger_call(ledger, method, *args, **kwargs)


# --------------------------------------------------------------------------- the store log


def store_log_path() -> Path:
    """The log of store inits, moves and wipes, outside every store: ``PRIVCODE_WIPE_LOG``,
    else ``${XDG_STATE_HOME:-~/.local/state}/privcode/wipes.log``."""
    env = os.environ.get(WIPE_LOG_ENV, "").strip()
    if env:
        return Path(env).expanduser().resolve()
    state = os.environ.get("XDG_STATE_HOME", "").strip()
    base = Path(state) if state and os.path.isabs(state) else Path("~/.local/state").expanduser()
    return (base / "privcode" / "wipes.log").resolve()


def _append_record(record: dict[str, Any], store: Path) -> Path:
    """Append one JSON line to the store log (fsynced); OSError or PrivcodeError if it cannot."""
    path = store_log_path()
    if path == store or store in path.parents:
        raise PrivcodeError(
            f"the store log {path} is inside the store {store}: it must outlive it (set "
            f"{WIPE_LOG_ENV} to a path outside)"
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = time.time()
    line = {
        "time": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(),
        "unix": now,
        "user": current_user(),
        "host": socket.gethostname(),
        **record,
    }
    data = (json.dumps(line, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _read_records() -> list[dict[str, Any]]:
    try:
        lines = store_log_path().read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                out.append(record)
    return out


def _lost_store(root: Path) -> dict[str, Any] | None:
    """The init (or move) record of a store at ``root`` that left without a wipe, if any."""
    last = None
    for record in _read_records():
        event = record.get("event")
        if event in ("init", "wipe", "replace-lost") and record.get("path") == str(root):
            last = record
        elif event == "move" and str(root) in (record.get("from"), record.get("path")):
            last = record
    if last is None or last["event"] in ("wipe", "replace-lost"):
        return None
    if last["event"] == "move" and last.get("from") == str(root):
        return None  # moved away on record
    return last


# --------------------------------------------------------------------------- init


def _existing(root: Path) -> PrivacyStore | None:
    """The store at ``root`` (checked), None when there is none; refuses a non-empty
    directory that is not one."""
    if not root.exists():
        return None
    if root.is_dir() and not any(root.iterdir()):
        return None  # an empty directory (a mount point's subdirectory made beforehand)
    if root.is_dir() and PrivacyStore.unchecked(root).present():
        return PrivacyStore(root)  # damaged or moved: refused here, naming it
    raise StoreError(f"{root} exists and is not a privacy store: choose another path")


def init_store(
    root: str | os.PathLike,
    budget: Budget | None = None,
    *,
    if_absent: bool = False,
    replace_lost: bool = False,
    authority_key: str | os.PathLike | None = None,
) -> tuple[PrivacyStore, bool]:
    """Create a privacy store at ``root``: ``(store, True)``; the only way one is made.

    The directory (0700), a new 32-byte key (0600), ``store.json`` (store id, this
    absolute path, time, user), the ledger's log with its genesis entry (and ``budget``,
    when given) and its head, built under a temporary name beside ``root`` and renamed
    into place whole, then an ``init`` record in the store log. A store already there is
    refused, or returned as ``(store, False)`` with ``if_absent``. A path where the store
    log says a store was created and never wiped nor moved away (deleted, renamed) is
    refused unless ``replace_lost``, which records the loss. The store's authority
    (:mod:`privcode.privacy.authority`): its public key in ``store.json``, its private key
    at ``authority_key`` (default :func:`~privcode.privacy.authority.default_key_path`).
    """
    root = Path(root).expanduser().resolve()
    found = _existing(root)
    lost = _lost_store(root) if found is None else None
    if lost is not None and not replace_lost:
        found = _existing(root)  # another init may have just made it
        if found is None:
            raise StoreError(
                f"a privacy store (id {lost.get('store_id')}) was created at {root} on "
                f"{lost.get('time')} and is gone without a wipe (deleted, renamed or moved "
                f"away): its spent budget is lost, not reset. Restore it from a backup; or, to "
                f"start a new store there on record, `privcode budget init --store {root} "
                f"--replace-lost` (the store log {store_log_path()} keeps the loss)"
            )
    if found is not None:
        if if_absent:
            return found, False
        raise StoreError(
            f"a privacy store already exists at {root} (id {found.store_id}); `privcode "
            f"budget verify --store {root}` checks it. Only `privcode budget wipe` removes one"
        )
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.init-", dir=root.parent))
    except OSError as exc:
        raise StoreError(f"cannot create the privacy store at {root}: {exc}") from exc
    try:
        os.chmod(tmp, 0o700)
        key = os.urandom(KEY_BYTES)
        fd = os.open(tmp / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        sid, now = store_id_of(key), time.time()
        public, _ = make_authority(sid, authority_key)
        identity = {
            "format": IDENTITY_FORMAT,
            "store_id": sid,
            "path": str(root),
            "created": now,
            "created_by": current_user(),
            "authority": public,
        }
        text = json.dumps(identity, sort_keys=True, indent=2) + "\n"
        fd = os.open(tmp / IDENTITY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        entries: list[dict[str, Any]] = [{"type": "header", "format": WAL_FORMAT, "created": now}]
        if budget is not None:
            entries.append(
                {
                    "type": "budget",
                    **budget.to_dict(),
                    "who": current_user(),
                    "why": "set by privcode budget init",
                    "seq": 1,
                    "epoch": 0,
                    "time": now,
                }
            )
        write_chained(tmp / WAL_FILE, entries, genesis_hash(sid), head=tmp / HEAD_FILE)
        try:
            os.rename(tmp, root)
        except OSError as exc:
            if (found := _existing(root)) is not None and if_absent:
                return found, False  # another init won the race
            raise StoreError(f"cannot create the privacy store at {root}: {exc}") from exc
        with contextlib.suppress(OSError):
            fd = os.open(root.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record: dict[str, Any] = {"event": "init", "path": str(root), "store_id": sid}
    if budget is not None:
        record["budget"] = budget.to_dict()
    try:
        if lost is not None:
            _append_record({"event": "replace-lost", "path": str(root), "lost": lost}, root)
        _append_record(record, root)
    except (OSError, PrivcodeError) as exc:  # the store is made; only its record is missing
        print(
            f"privcode: warning: the store log could not record this init ({exc}); set "
            f"{WIPE_LOG_ENV} to a writable path outside the store",
            file=sys.stderr,
        )
    return PrivacyStore(root), True


# --------------------------------------------------------------------------- verify


def _mode_ok(path: Path) -> bool:
    try:
        return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    except OSError:
        return True  # missing: reported by its own check


def verify_store(root: str | os.PathLike, *, accept_move: bool = False) -> dict[str, Any]:
    """Check a store without changing it: ``{"store", "store_id", "ok", "checks": [{"check",
    "ok", "detail"}]}``. With ``accept_move``, a store whose only fault is its path (moved
    on purpose) gets its move recorded: a ``move`` entry in its log, the new path in its
    identity, a record in the store log."""
    root = Path(root).expanduser().resolve()
    checks: list[dict[str, Any]] = []
    out: dict[str, Any] = {"store": str(root), "store_id": None, "ok": False, "checks": checks}

    def add(check: str, ok: bool, detail: str) -> bool:
        checks.append({"check": check, "ok": ok, "detail": detail})
        return ok

    store = PrivacyStore.unchecked(root)
    present = store.present()
    if not root.is_dir() or not present:
        add("store", False, f"no privacy store at {root}: `privcode budget init --store {root}`")
        return out
    bad = [p.name for p in (root, *(root / n for n in sorted(present))) if not _mode_ok(p)]
    add(
        "permissions",
        not bad,
        "owner only (0700 directory, 0600 files)"
        if not bad
        else f"readable or writable by others: {', '.join(bad)} (chmod go-rwx)",
    )
    try:
        store._load_key()
        key_ok = add("key", True, f"{KEY_BYTES} bytes (store id {store.store_id})")
        out["store_id"] = store.store_id
    except StoreError as exc:
        key_ok = add("key", False, str(exc))
    moved_from = None
    if IDENTITY_FILE in present:
        try:
            identity = store.identity = store.read_identity()
        except StoreError as exc:
            identity = None
            add("identity", False, str(exc))
        if identity is not None:
            problems = []
            if key_ok and identity.get("store_id") != store.store_id:
                problems.append(
                    f"it names store {identity.get('store_id')}, the key is store "
                    f"{store.store_id}'s (a key from another store?)"
                )
            if identity.get("path") != str(root):
                moved_from = identity.get("path")
                if not accept_move:
                    problems.append(
                        f"created at {moved_from}, opened at {root}: renamed, moved or "
                        f"copied. If moved on purpose: `privcode budget verify --store {root} "
                        "--accept-move`"
                    )
            when = identity.get("created")
            created = (
                datetime.datetime.fromtimestamp(when, datetime.UTC).isoformat(timespec="seconds")
                if isinstance(when, int | float)
                else "?"
            )
            add(
                "identity",
                not problems,
                "; ".join(problems)
                or f"store {identity.get('store_id')}, at {identity.get('path')} (created "
                f"{created} by {identity.get('created_by')})",
            )
    elif HEAD_FILE in present:
        add("identity", False, f"{IDENTITY_FILE} is missing (the store has a head)")
    else:
        add(
            "identity",
            True,
            f"none: a store from before {IDENTITY_FILE}; its ledger writes it and chains "
            "its log on its next open",
        )
    store.legacy = store.identity is None or store.identity.get("migration") == "pending"
    loaded: LoadedLog | None = None
    if key_ok:
        try:
            loaded = load_log(store)
        except (LedgerUnavailableError, StoreError) as exc:
            add("ledger", False, str(exc))
        else:
            n = len(loaded.records)
            if loaded.create:
                add("ledger", True, "no log yet (a store from before the chain that never logged)")
            else:
                legacy = loaded.legacy_entries
                chain = (
                    "not chained yet (from before the hash chain: chained on its next open)"
                    if legacy == n
                    else "hash chain intact"
                    + (f" ({legacy} entries from before the chain)" if legacy else "")
                )
                head = (
                    "no head yet"
                    if loaded.head is None
                    else "head agrees"
                    + (" (one entry behind: repaired on the next open)" if loaded.lag else "")
                )
                add("ledger", True, f"{n} entries, {chain}, {head}")
    else:
        add("ledger", False, "not checked: the chain's genesis needs the store's key")
    if loaded is not None:
        _verify_jobs(store, loaded, add)
        _verify_groups(store, loaded, add)
    out["ok"] = all(c["ok"] for c in checks)
    if accept_move and moved_from is not None:
        if not out["ok"]:
            add("move", False, "not recorded: fix the problems above first")
            out["ok"] = False
        else:
            assert loaded is not None
            _record_move(store, loaded, moved_from)
            add("move", True, f"recorded: moved from {moved_from} to {root}")
    return out


def _verify_jobs(store: PrivacyStore, loaded: LoadedLog, add: Any) -> None:
    jobs = [e for e in loaded.records if e.get("type") in RECORD_ENTRIES]
    missing, damaged = [], []
    for e in jobs:
        try:
            blob = (store.root / JOBS_DIR / f"{e['job']}.fps").read_bytes()
        except OSError:
            missing.append(e["job"])
            continue
        if hashlib.sha256(blob).hexdigest() != e.get("fps_sha256"):
            damaged.append(e["job"])
    problems = []
    if missing:
        problems.append(f"records files missing for job(s) {', '.join(missing)}")
    if damaged:
        problems.append(f"records files not matching their logged digest: {', '.join(damaged)}")
    add(
        "jobs",
        not problems,
        "; ".join(problems) or f"{len(jobs)} job records file(s) match their logged digests",
    )


def _verify_groups(store: PrivacyStore, loaded: LoadedLog, add: Any) -> None:
    try:
        found = store.read_groups()
    except ValueError as exc:
        add("groups", False, f"the snapshot is damaged ({exc}); the ledger rebuilds it on open")
        return
    if found is None:
        add("groups", True, "no snapshot (rebuilt from the jobs' records files on open)")
        return
    state, _ = found
    records = loaded.records
    try:
        n = int(state["wal_records"])
        jobs = {e["job"] for e in records[1:n] if e.get("type") in RECORD_ENTRIES}
        ok = 0 < n <= len(records) and set(state["jobs"]) == jobs
    except (KeyError, TypeError, ValueError):
        ok, n = False, 0
    add(
        "groups",
        ok,
        f"snapshot of the first {n} log entries ({len(state.get('jobs', []))} jobs)"
        if ok
        else "the snapshot is not of this log (the ledger rebuilds it on open)",
    )


def _record_move(store: PrivacyStore, loaded: LoadedLog, moved_from: str) -> None:
    """Log a deliberate move (the writer's lock held): entry, head, identity, store log."""
    root = store.root
    try:
        fd = store.lock_writer()
    except LedgerUnavailableError:
        raise PrivcodeError(
            f"a ledger holds {root}: stop the cluster using it first (make ray-down)"
        ) from None
    try:
        assert loaded.contents is not None
        repair(loaded.contents)
        records, hashes = loaded.records, loaded.contents.hashes
        seq = max((e.get("seq", 0) for e in records[1:]), default=0)
        entry = {
            "type": "move",
            "from": moved_from,
            "to": str(root),
            "who": current_user(),
            "seq": seq + 1,
            "epoch": store.read_epoch(),
            "time": time.time(),
            "prev_hash": hashes[-1],
        }
        digest = append_line(store.wal_path, entry)
        write_head(store.head_path, len(records) + 1, digest)
        store.write_identity(moved_from=moved_from, moved=entry["time"])
    finally:
        os.close(fd)
    _append_record(
        {"event": "move", "from": moved_from, "path": str(root), "store_id": store.store_id},
        root,
    )


def accept_move(root: str | os.PathLike) -> dict[str, Any]:
    """Record that the store at ``root`` was moved there on purpose (:func:`verify_store`)."""
    return verify_store(root, accept_move=True)


def format_verify(result: dict[str, Any]) -> str:
    """``privcode budget verify`` as text: one line per check, OK or FAIL."""
    lines = [f"privacy store {result['store']} (id {result['store_id'] or '?'})"]
    for c in result["checks"]:
        lines.append(f"  {'ok  ' if c['ok'] else 'FAIL'}  {c['check']:<12} {c['detail']}")
    lines.append("  verified: no problem" if result["ok"] else "  NOT OK: see FAIL above")
    return "\n".join(lines)


# --------------------------------------------------------------------------- wipe


def wipe(root: str | os.PathLike, confirm: str, why: str = "") -> dict[str, Any]:
    """Delete a store (every budget and key in it) when ``confirm`` is its path; the record.

    The one deliberate reset. First a record goes to the store log outside the store
    (:func:`store_log_path`: time, store id, path, user, the worst record's epsilon and
    the budget at the wipe); no record, no wipe. Refused while a ledger holds the store.
    """
    path = Path(root).expanduser().resolve()
    store = PrivacyStore.unchecked(path)
    if not path.is_dir() or not store.present():
        raise PrivcodeError(f"{path} is not a privacy store")
    if Path(confirm).expanduser().resolve() != path:
        raise PrivcodeError(
            f"wiping the privacy store deletes every record's spent budget; repeat its path "
            f"to confirm: --confirm {path}"
        )
    record: dict[str, Any] = {"event": "wipe", "path": str(path), "why": why[:500]}
    try:
        record["store_id"] = store.store_id
    except StoreError:
        identity = None
        with contextlib.suppress(StoreError):
            identity = store.read_identity()
        record["store_id"] = (identity or {}).get("store_id")
    try:
        ledger = StoreLedger(path)
    except LedgerUnavailableError as exc:
        if "another ledger holds" in str(exc):
            raise PrivcodeError(
                f"a ledger holds {path}: stop the cluster using it first (make ray-down)"
            ) from None
        record["epsilon_spent"], record["unreadable"] = None, str(exc)[:500]
    except StoreError as exc:
        record["epsilon_spent"], record["unreadable"] = None, str(exc)[:500]
    else:
        try:
            shown = ledger.show()
        finally:
            ledger.close()
        record["epsilon_spent"] = shown["epsilon_spent"]
        record["budget"] = shown["budget"]
        record["jobs"] = len(shown["jobs"])
    try:
        fd = store.lock_writer()
    except LedgerUnavailableError:
        raise PrivcodeError(
            f"a ledger holds {path}: stop the cluster using it first (make ray-down)"
        ) from None
    except OSError as exc:
        raise PrivcodeError(f"cannot lock {path} to wipe it: {exc}") from exc
    try:
        try:
            record["log"] = str(_append_record(record, path))
        except OSError as exc:
            raise PrivcodeError(
                f"the wipe of {path} must be recorded outside it first, and the store log "
                f"{store_log_path()} cannot be written ({exc}); set {WIPE_LOG_ENV}. Nothing "
                "was deleted"
            ) from exc
        shutil.rmtree(path)
    finally:
        os.close(fd)
    return record


def format_show(shown: dict[str, Any], max_groups: int = 20) -> str:
    """``privcode budget show`` as text."""
    b = shown["budget"]
    lines = [f"privacy store {shown['store']} (id {shown['store_id']})"]
    if b is None:
        return "\n".join([*lines, "  no budget yet: the first DP job sets it"])
    lines.append(
        f"  budget: epsilon {b['epsilon']:g} per record at delta {b['delta']:g} ({b['accountant']})"
    )
    lines.append(
        f"  worst record: epsilon {shown['epsilon_spent']:.4g} spent, "
        f"{shown['epsilon_left']:.4g} left; {shown['records']} records trained on"
    )
    lines.append(f"  record groups (records trained on by the same jobs): {len(shown['groups'])}")
    for g in shown["groups"][:max_groups]:
        eps = g["epsilon"]
        prv = "n/a" if eps.get("prv") is None else f"{eps['prv']:.4g}"
        lines.append(
            f"    {g['records']:>8} records  epsilon rdp {eps.get('rdp') or 0:.4g}  prv {prv}  "
            f"jobs {', '.join(g['jobs']) or '-'}"
        )
    if len(shown["groups"]) > max_groups:
        lines.append(f"    ... {len(shown['groups']) - max_groups} more (--json lists all)")
    lines.append(f"  jobs: {len(shown['jobs'])}")
    for j in shown["jobs"]:
        p = j["plan"]
        kind = " (imported run ledger)" if j["imported"] else ""
        lines.append(
            f"    {j['job']}  run {j['run'] or '-'}  {j['status']}{kind}  {j['records']} records  "
            f"{j['steps_granted']}/{p['steps']} steps at sigma {p['noise_multiplier']:.4g}, "
            f"q {p['sample_rate']:.4g}"
        )
    for w in shown.get("pac", []):
        lines.append(
            f"  PAC worlds {w['worlds']}: m={w['m']}, {w['allowance_nats']:g} nats allowed "
            f"(per-record budget {w['record_budget_nats']:g}), scope {w['scope']}"
        )
    return "\n".join(lines)
