"""The privacy store: private state that outlives runs, and opaque names for private data.
Design notes: docs/privacy.md, "privcode/privacy/store.py".

One private directory (0700, files 0600): a 32-byte secret key, the store's identity
(``store.json``) and its ledger's files, written only by its one writer. Data is named by

    dataset_id = "ds-" + HMAC-SHA256(key, "privcode-dataset-id/1" || SHA-256(file))[:20 hex]

(:meth:`PrivacyStore.opaque` for other private things): a digest of the corpus is not releasable
under DP. Location: :func:`resolve_store`, never from ``run.out_dir``; :func:`open_pinned` opens
the store a driver pinned and refuses any other. Invariants: only ``privcode budget init``
creates a store (whole, under a temporary name); :class:`PrivacyStore` creates nothing, and every
loss (key, identity, log, head, a moved path) is a hard refusal (:class:`StoreError`,
:class:`StoreIntegrityError`), never a fresh budget.

"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import hmac
import json
import os
import socket
import time
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from privcode.errors import LedgerUnavailableError, PrivcodeError
from privcode.utils import atomic_write_bytes, fsync_dir, sha256_file

__all__ = [
    "ENV_VAR",
    "FINGERPRINT_BYTES",
    "PrivacyStore",
    "StoreError",
    "StoreIntegrityError",
    "canonical_text",
    "current_user",
    "default_store",
    "init_command",
    "record_fingerprint",
    "resolve_store",
    "store_id_of",
    "open_pinned",
]

ENV_VAR = "PRIVCODE_PRIVACY_STORE"
DEFAULT_DIRNAME = "privacy-store"
KEY_FILE = "dataset-id.key"
IDENTITY_FILE = "store.json"
WAL_FILE, HEAD_FILE = "ledger.wal", "ledger.head"
LOCK_FILE, EPOCH_FILE, JOBS_DIR, SNAPSHOT_DIR, PAC_DIR = "lock", "epoch", "jobs", "groups", "pac"
#: What a store holds besides its key: any of them without the key is a lost key.
STATE_ENTRIES = (IDENTITY_FILE, WAL_FILE, HEAD_FILE, JOBS_DIR, SNAPSHOT_DIR, PAC_DIR)
IDENTITY_FORMAT = 1
KEY_BYTES = _KEY_BYTES = 32
FINGERPRINT_BYTES = 16


class StoreError(PrivcodeError):
    """No privacy store at a path, or it cannot be read."""


class StoreIntegrityError(StoreError, LedgerUnavailableError):
    """A privacy store lost a part (its key, identity, log, head) or was moved: refused."""


def init_command(root: str | os.PathLike) -> str:
    return f"privcode budget init --store {root}"


def current_user() -> str:
    """Who runs this process (for the records that say who created, moved or wiped a store)."""
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry (a container): the uid
        return f"uid {os.getuid()}"


def store_id_of(key: bytes) -> str:
    """A store's id: a keyed HMAC of a fixed label (stable across mounts, says nothing)."""
    return hmac.new(key, b"privcode-store-id/1\0ledger", hashlib.sha256).hexdigest()[:12]


def canonical_text(text: str) -> str:
    """``text`` as a record's identity sees it: NFC, ``\\n`` line ends, no outer newlines.

    A copy that only re-encodes a record (JSONL or Parquet, CRLF line ends,
    decomposed accents, a final newline more or less) is the same record.
    Trailing blanks inside are kept: stripping them costs ~25 us a record
    (5x the rest), and an edit is a new record anyway.
    """
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.strip("\n")


def record_fingerprint(key: bytes, prompt: str, code: str) -> bytes:
    """``HMAC-SHA256(key, "privcode-record/1" || len(p) || p || c)[:16]`` of the canonical texts.

    Keyed so a fingerprint says nothing about the record to whoever lacks
    the store's key (no dictionary attack on candidate records); 128 bits
    make two distinct records collide with probability ~ n^2 / 2^129.
    """
    p = canonical_text(prompt).encode("utf-8")
    c = canonical_text(code).encode("utf-8")
    message = b"privcode-record/1\0" + len(p).to_bytes(8, "big") + p + c
    return hmac.digest(key, message, "sha256")[:FINGERPRINT_BYTES]


def default_store() -> Path:
    """``${XDG_DATA_HOME:-~/.local/share}/privcode/privacy-store``: one per user, outside
    every clone and run directory."""
    data = os.environ.get("XDG_DATA_HOME", "").strip()
    base = Path(data) if data and os.path.isabs(data) else Path("~/.local/share").expanduser()
    return (base / "privcode" / DEFAULT_DIRNAME).resolve()


def resolve_store(
    configured: str | os.PathLike = "", out_dir: str | os.PathLike | None = None
) -> Path:
    """The store directory: ``PRIVCODE_PRIVACY_STORE``, else ``configured``, else
    :func:`default_store`. ``out_dir`` is accepted for old callers and never used: a store
    beside the run directory was a new, empty store for every other ``run.out_dir``."""
    del out_dir
    env = os.environ.get(ENV_VAR, "").strip()
    named = Path(configured).expanduser().resolve() if str(configured).strip() else None
    if env:
        from_env = Path(env).expanduser().resolve()
        if named is not None and named != from_env:
            raise StoreError(
                f"two privacy stores named: {ENV_VAR}={from_env} and privacy.store={named}. "
                "Name one (a job charges exactly one store)"
            )
        return from_env
    return named if named is not None else default_store()


def open_pinned(configured: str | os.PathLike, store_id: str = "") -> PrivacyStore:
    """The store :func:`resolve_store` names, refused unless its keyed id is ``store_id``.

    ``store_id`` is what the run's driver pinned (``privacy.store_id``; '' = not pinned):
    a task that resolves another store (another mount, a restored copy, a new store at
    the same path) charges nothing and says which store it found.
    """
    store = PrivacyStore(resolve_store(configured))
    if store_id and store.store_id != store_id:
        raise StoreIntegrityError(
            f"the privacy store at {store.root} is store {store.store_id}, but this run was "
            f"admitted against store {store_id}: a task must charge the store its driver "
            "resolved. Run again from the driver (it pins the store once)"
        )
    return store


class PrivacyStore:
    """An initialised privacy store, opened and checked (module docstring); creates nothing.

    :class:`StoreError` when there is no store at ``root``;
    :class:`StoreIntegrityError` when a part of it is missing or it was moved.
    ``legacy`` is true for a store from before identity files (its ledger
    migrates it on first open).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._key: bytes | None = None
        self.identity: dict[str, Any] | None = None
        self.legacy = False
        self._check()

    @classmethod
    def unchecked(cls, root: str | os.PathLike) -> PrivacyStore:
        """The store's files at ``root`` without the open checks (verify, wipe, repairs)."""
        store = cls.__new__(cls)
        store.root, store._key, store.identity, store.legacy = Path(root), None, None, False
        return store

    # -- opening -------------------------------------------------------------------

    def _check(self) -> None:
        root = self.root
        if not root.is_dir() or not (present := self.present()):
            what = (
                "no such directory"
                if not root.exists()
                else "not a directory"
                if not root.is_dir()
                else "no store files in it"
            )
            raise StoreError(
                f"no privacy store at {root} ({what}). A store is created once, on purpose: "
                f"`{init_command(root.resolve())}` (it is never created implicitly, so a "
                "mistyped or moved path cannot start an empty budget)"
            )
        if KEY_FILE not in present:
            raise StoreIntegrityError(
                f"the privacy store {root} has lost its key {KEY_FILE} (still there: "
                f"{', '.join(sorted(present))}). Without it no record, dataset or job of the "
                "store can be named again, and deleting it grants no budget: restore the key "
                f"from a backup. To give the store up on record: `privcode budget wipe "
                f"--confirm {root.resolve()}`"
            )
        self._load_key()
        if IDENTITY_FILE in present:
            self.identity = identity = self.read_identity()
            if identity.get("store_id") != self.store_id:
                raise StoreIntegrityError(
                    f"the key {self.key_path} is not the key of the privacy store {root}: its "
                    f"identity names store {identity.get('store_id')}, the key is store "
                    f"{self.store_id}'s (a key from another store?). Restore this store's key"
                )
        elif HEAD_FILE in present:
            raise self._missing(IDENTITY_FILE, "its identity (store id, creation path)")
        # From before identity files, or its first open was cut short: the ledger migrates it.
        self.legacy = self.identity is None or self.identity.get("migration") == "pending"
        if WAL_FILE not in present and (
            not self.legacy or present & {JOBS_DIR, SNAPSHOT_DIR, PAC_DIR}
        ):
            raise self._missing(WAL_FILE, "its ledger's log (every job's spent budget)")
        if HEAD_FILE not in present and not self.legacy:
            raise self._missing(HEAD_FILE, "its ledger's head (how long the log must be)")
        if self.identity is None:
            return
        here = str(root.resolve())
        if self.identity.get("path") != here:
            raise StoreIntegrityError(
                f"the privacy store at {here} was created at {self.identity.get('path')}: it was "
                "renamed, moved or copied. A copy must never be used beside its original (both "
                "would spend the same budget). If it was moved on purpose, record the move in its "
                f"log: `privcode budget verify --store {here} --accept-move`"
            )

    def _missing(self, name: str, what: str) -> StoreIntegrityError:
        return StoreIntegrityError(
            f"the privacy store {self.root} is missing {name} ({what}). Deleting a part of a "
            f"store grants no budget: restore it from a backup; `privcode budget verify --store "
            f"{self.root}` lists what else is wrong"
        )

    def present(self) -> set[str]:
        """The store's own entries found in its directory."""
        try:
            names = set(os.listdir(self.root))
        except OSError:
            return set()
        return names & {KEY_FILE, *STATE_ENTRIES}

    @property
    def key_path(self) -> Path:
        return self.root / KEY_FILE

    @property
    def identity_path(self) -> Path:
        return self.root / IDENTITY_FILE

    @property
    def wal_path(self) -> Path:
        return self.root / WAL_FILE

    @property
    def head_path(self) -> Path:
        return self.root / HEAD_FILE

    def _load_key(self) -> bytes:
        if self._key is None:
            try:
                key = self.key_path.read_bytes()
            except FileNotFoundError:
                raise StoreIntegrityError(
                    f"the privacy store {self.root} has no key {KEY_FILE}; it is never created "
                    f"again (that would grant a fresh budget): restore it, or `{init_command(self.root)}` "
                    "for a new store elsewhere"
                ) from None
            except OSError as exc:
                raise StoreError(
                    f"cannot read the privacy store key {self.key_path}: {exc}"
                ) from exc
            if len(key) != KEY_BYTES:
                raise StoreIntegrityError(
                    f"the privacy store key {self.key_path} is damaged "
                    f"({len(key)} bytes, expected {KEY_BYTES})"
                )
            self._key = key
        return self._key

    def read_identity(self) -> dict[str, Any]:
        """``store.json``: store id, creation path and time; StoreIntegrityError if damaged."""
        try:
            identity = json.loads(self.identity_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise self._missing(IDENTITY_FILE, "its identity (store id, creation path)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreIntegrityError(
                f"the identity file {self.identity_path} is damaged ({exc})"
            ) from None
        if not isinstance(identity, dict):
            raise StoreIntegrityError(f"the identity file {self.identity_path} is damaged")
        return identity

    def write_identity(self, **fields: Any) -> dict[str, Any]:
        """Write ``store.json`` (atomically, 0600): the id from the key, the path now, and
        ``fields`` over what it held."""
        old = self.identity or {}
        now = time.time()
        identity = {
            "format": IDENTITY_FORMAT,
            "created": now,
            "created_by": current_user(),
            **old,
            **fields,
            "store_id": self.store_id,
            "path": str(self.root.resolve()),
        }
        identity = {k: v for k, v in identity.items() if v is not None}
        text = json.dumps(identity, sort_keys=True, indent=2) + "\n"
        atomic_write_bytes(self.identity_path, text.encode(), mode=0o600)
        self.identity = identity
        return identity

    def opaque(self, label: str, value: str | bytes, length: int = 20) -> str:
        """Hex HMAC of ``value`` under the store key, domain-separated by ``label``."""
        data = value.encode("utf-8") if isinstance(value, str) else value
        mac = hmac.new(self._load_key(), f"privcode-{label}/1\0".encode() + data, hashlib.sha256)
        return mac.hexdigest()[:length]

    @property
    def store_id(self) -> str:
        """The store's keyed id (:func:`store_id_of`): stable across mounts, says nothing."""
        return store_id_of(self._load_key())

    @property
    def ledger_id(self) -> str:
        """The store's name for its ledger actor and metrics: its :attr:`store_id`."""
        return self.store_id

    @property
    def record_key(self) -> bytes:
        """The key of the store's record identities (derived from its key)."""
        return hmac.digest(self._load_key(), b"privcode-record-key/1", "sha256")

    def record_fingerprints(self, records: Iterable[tuple[str, str]]) -> list[bytes]:
        """One keyed fingerprint per ``(prompt, code)`` record (:func:`record_fingerprint`):
        the ``exact`` identity alone."""
        key = self.record_key
        return [record_fingerprint(key, prompt, code) for prompt, code in records]

    def record_identities(
        self, records: Iterable[tuple[str, str]], rows: Any = None, tokenizer: str = ""
    ) -> Any:
        """Every keyed identity of each record, ``(n, m, 16)`` uint8
        (:func:`privcode.privacy.identities.record_identities`)."""
        from privcode.privacy.identities import IdentityKeys, record_identities

        keys = IdentityKeys.derive(self.record_key)
        return record_identities(keys, records, rows=rows, tokenizer=tokenizer)

    def dataset_id(self, path: str | os.PathLike) -> str:
        """The opaque id of a training file's content: ``ds-`` + 20 hex of a keyed HMAC."""
        return self.dataset_id_of(sha256_file(path))

    def dataset_id_of(self, sha256_hex: str) -> str:
        """:meth:`dataset_id` of a file whose bytes hash to ``sha256_hex`` (read elsewhere)."""
        return "ds-" + self.opaque("dataset-id", bytes.fromhex(sha256_hex))

    # -- the ledger's files (written by its one writer only) ---------------------------

    def lock_writer(self) -> int:
        """Take the store's writer lock (``flock``, held while the fd is open): the fd.

        :class:`LedgerUnavailableError` naming the holder when another process has it.
        """
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise LedgerUnavailableError(
                f"another ledger holds the privacy store {self.root} ({holder}); one store has "
                "one writer: use that cluster, or stop its ledger first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        return fd

    def read_epoch(self) -> int:
        """The current writer's epoch (0 before the first)."""
        try:
            return int((self.root / EPOCH_FILE).read_text(encoding="utf-8").strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError:
            raise LedgerUnavailableError(f"the epoch file of {self.root} is damaged") from None

    def next_epoch(self) -> int:
        """Bump the epoch (with the lock held): every older writer is fenced out."""
        epoch = self.read_epoch() + 1
        atomic_write_bytes(self.root / EPOCH_FILE, f"{epoch}\n".encode(), mode=0o600)
        return epoch

    def _subdir(self, name: str) -> Path:
        """A 0700 directory of the store, its entry fsynced when new (a crash keeps it)."""
        d = self.root / name
        if not d.is_dir():
            d.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(self.root)
        return d

    def pac_state_dir(self, worlds_id: str) -> Path:
        """Where the PAC curator of a set of worlds keeps its secret and charges (0700)."""
        d = self.root / "pac" / worlds_id
        self._subdir("pac")
        if not d.is_dir():
            d.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(d.parent)
        return d

    def write_job_records(self, job: str, fingerprints: bytes) -> str:
        """Keep a job's packed fingerprints; returns their SHA-256 (for the log entry)."""
        self._subdir(JOBS_DIR)
        atomic_write_bytes(self.root / JOBS_DIR / f"{job}.fps", fingerprints, mode=0o600)
        return hashlib.sha256(fingerprints).hexdigest()

    def read_job_records(self, job: str, sha256: str) -> bytes:
        """A job's packed fingerprints, checked against the log's digest."""
        try:
            blob = (self.root / JOBS_DIR / f"{job}.fps").read_bytes()
        except OSError as exc:
            raise LedgerUnavailableError(
                f"the records of job {job} are missing from the store ({exc.strerror}); the "
                "per-record budget cannot be restored"
            ) from None
        if hashlib.sha256(blob).hexdigest() != sha256:
            raise LedgerUnavailableError(f"the records file of job {job} is damaged")
        return blob

    def write_groups(self, state: dict[str, Any], index: bytes) -> None:
        """Snapshot the record groups: the index, then the state naming its digest."""
        d = self._subdir(SNAPSHOT_DIR)
        atomic_write_bytes(d / "index.bin", index, mode=0o600)
        state = {**state, "index_sha256": hashlib.sha256(index).hexdigest()}
        atomic_write_bytes(d / "state.json", json.dumps(state).encode(), mode=0o600)

    def read_groups(self) -> tuple[dict[str, Any], bytes] | None:
        """The snapshot (state, index); None when absent; ValueError when damaged."""
        d = self.root / SNAPSHOT_DIR
        try:
            state = json.loads((d / "state.json").read_text(encoding="utf-8"))
            index = (d / "index.bin").read_bytes()
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable ({exc})") from None
        if not isinstance(state, dict) or hashlib.sha256(index).hexdigest() != state.get(
            "index_sha256"
        ):
            raise ValueError("the index does not match its state")
        return state, index
