"""The privacy store: private state that outlives runs, and opaque names for private data.

A release or a report sometimes has to name its data (to group the runs of
one corpus, to find its budget). A digest of the corpus cannot do that: a
deterministic function of the whole dataset is not releasable under DP
(anyone holding a candidate corpus could confirm it). The store holds a
32-byte secret key, and a dataset is named by

    dataset_id = "ds-" + HMAC-SHA256(key, "privcode-dataset-id/1" || SHA-256(file))[:20 hex]

which says nothing about the data to whoever lacks the key, and is stable
for one file under one store. :meth:`PrivacyStore.opaque` names other
private things the same way (e.g. the ledger actor of a ledger directory
whose path holds a corpus digest).

Location (:func:`resolve_store`): ``PRIVCODE_PRIVACY_STORE``, else the
``privacy.store`` config value, else ``privacy-store/`` beside
``run.out_dir`` (outside every run directory; ``make clean`` leaves it).
The directory is 0700 and the key file 0600; the key is created once
(atomically: a second process racing on the first use reads the same key)
and never leaves the store. Deleting the key only makes new ids (the runs
of one corpus no longer group in reports); it grants no budget.

The store also holds the files of its ledger (:mod:`privcode.privacy.ledger`),
written here and only by its one writer: the writer's ``lock`` (flock) and
``epoch``, each job's record fingerprints under ``jobs/``, and a snapshot of
the record groups under ``groups/`` (all 0600, written to a temporary name,
fsynced, renamed, the directory fsynced).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import socket
import tempfile
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
    "canonical_text",
    "record_fingerprint",
    "resolve_store",
]

ENV_VAR = "PRIVCODE_PRIVACY_STORE"
DEFAULT_DIRNAME = "privacy-store"
KEY_FILE = "dataset-id.key"
LOCK_FILE, EPOCH_FILE, JOBS_DIR, SNAPSHOT_DIR = "lock", "epoch", "jobs", "groups"
_KEY_BYTES = 32
FINGERPRINT_BYTES = 16


class StoreError(PrivcodeError):
    """The privacy store cannot be created or read, or its key is damaged."""


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


def resolve_store(configured: str | os.PathLike = "", out_dir: str | os.PathLike = "runs") -> Path:
    """The store directory: the environment variable, else ``configured``, else beside ``out_dir``."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return Path(env).resolve()
    if str(configured).strip():
        return Path(configured).resolve()
    return Path(out_dir).resolve().parent / DEFAULT_DIRNAME


class PrivacyStore:
    """A private directory with the secret key of opaque dataset ids (module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
        except OSError as exc:
            raise StoreError(f"cannot create the privacy store {self.root}: {exc}") from exc
        self._key: bytes | None = None

    @property
    def key_path(self) -> Path:
        return self.root / KEY_FILE

    def _load_key(self) -> bytes:
        if self._key is None:
            if not self.key_path.exists():
                self._create_key()
            try:
                key = self.key_path.read_bytes()
            except OSError as exc:
                raise StoreError(
                    f"cannot read the privacy store key {self.key_path}: {exc}"
                ) from exc
            if len(key) != _KEY_BYTES:
                raise StoreError(
                    f"the privacy store key {self.key_path} is damaged "
                    f"({len(key)} bytes, expected {_KEY_BYTES})"
                )
            self._key = key
        return self._key

    def _create_key(self) -> None:
        # Written whole to a temporary file, then hard-linked: link() fails when
        # another process created the key first, and then both read that one.
        fd, tmp = tempfile.mkstemp(prefix=".key-", dir=self.root)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, os.urandom(_KEY_BYTES))
            os.fsync(fd)
            os.close(fd)
            fd = -1
            try:
                os.link(tmp, self.key_path)
            except FileExistsError:
                pass
            fsync_dir(self.root)
        finally:
            if fd >= 0:
                os.close(fd)
            os.unlink(tmp)

    def opaque(self, label: str, value: str | bytes, length: int = 20) -> str:
        """Hex HMAC of ``value`` under the store key, domain-separated by ``label``."""
        data = value.encode("utf-8") if isinstance(value, str) else value
        mac = hmac.new(self._load_key(), f"privcode-{label}/1\0".encode() + data, hashlib.sha256)
        return mac.hexdigest()[:length]

    @property
    def ledger_id(self) -> str:
        """The store's name for its ledger actor and metrics (keyed: stable across mounts)."""
        return self.opaque("store-id", "ledger", 12)

    def record_fingerprints(self, records: Iterable[tuple[str, str]]) -> list[bytes]:
        """One keyed fingerprint per ``(prompt, code)`` record (:func:`record_fingerprint`)."""
        key = hmac.digest(self._load_key(), b"privcode-record-key/1", "sha256")
        return [record_fingerprint(key, prompt, code) for prompt, code in records]

    def dataset_id(self, path: str | os.PathLike) -> str:
        """The opaque id of a training file's content: ``ds-`` + 20 hex of a keyed HMAC."""
        return "ds-" + self.opaque("dataset-id", bytes.fromhex(sha256_file(path)))

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
