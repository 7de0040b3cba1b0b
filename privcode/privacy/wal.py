"""Write-ahead logs of JSON lines with a CRC each: the codec and the crash rules, no state.
Design notes: docs/privacy.md, "privcode/privacy/wal.py".

A line is canonical JSON (keys sorted, no spaces) with ``"crc"``, the CRC-32 of the line without
it; appends are ``O_APPEND`` + ``fsync``, a new log is written whole (temporary name, fsync,
rename, directory fsync). :func:`read_log`: only a torn last line (no newline, does not verify:
never acknowledged) is dropped (``torn_tail``, :func:`repair`); a verified last line without its
newline is kept; any other bad line is a :class:`LedgerUnavailableError`. A chained log also
carries ``prev_hash`` (the SHA-256 of the previous canonical line, the first from
:func:`genesis_hash` of the store id) and a head (:func:`write_head`: entries, last hash);
:func:`verify_chain` and :func:`check_head` turn a removed, reordered or replaced entry, a
truncated log or another store's log into a named error. A pre-chain log is chained from its end
by one ``chain`` entry.

"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.dp.events import DPEvent
from privcode.errors import LedgerUnavailableError
from privcode.utils import atomic_write_bytes

__all__ = [
    "LogContents",
    "append_line",
    "check_head",
    "crc",
    "encode_line",
    "genesis_hash",
    "legacy_digest",
    "legacy_events",
    "line_hash",
    "read_head",
    "read_log",
    "repair",
    "verify_chain",
    "write_chained",
    "write_head",
    "write_new",
]

#: ``check(record, index)`` raises ValueError saying what is wrong with a verified line.
Check = Callable[[dict[str, Any], int], None]


def crc(record: dict[str, Any]) -> str:
    """CRC-32 (8 hex digits) of ``record``'s canonical JSON, its ``crc`` key left out."""
    body = {k: v for k, v in record.items() if k != "crc"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return f"{zlib.crc32(text.encode('utf-8')):08x}"


def encode_line(record: dict[str, Any]) -> bytes:
    """``record`` with its ``crc``, as one canonical JSON line."""
    line = dict(record, crc=crc(record))
    text = json.dumps(line, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return (text + "\n").encode("utf-8")


@dataclass
class LogContents:
    """A parsed log: its verified lines and what a repair must do."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    valid_bytes: int = 0  # length of the prefix made of complete, verified lines
    size: int = 0  # file size when read
    torn_tail: bool = False  # an unverifiable last line (a torn write) was dropped
    missing_newline: bool = False  # the last verified line lacks its newline
    hashes: list[str] = field(default_factory=list)  # line_hash of each verified line


def read_log(path: str | os.PathLike, check: Check) -> LogContents:
    """Parse and verify a log (the module's rules); ``check`` validates each verified line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LedgerUnavailableError(f"cannot read the write-ahead log {path}: {exc}") from exc
    out = LogContents(path=path, size=len(data))
    segments = data.split(b"\n")
    complete = len(segments) - 1  # segments before the last "\n"; the rest is an unterminated tail
    if segments[-1] == b"":
        segments.pop()
    offset = 0
    for index, raw in enumerate(segments):
        terminated = index < complete
        try:
            record = _parse(raw)
            check(record, index)
        except ValueError as why:
            if not terminated:
                out.torn_tail = True  # a write cut short by a crash: never acknowledged
                break
            raise LedgerUnavailableError(
                f"the write-ahead log {path} is corrupt at line {index + 1} ({why}); the "
                f"spent budget cannot be restored, so nothing may train on it. Inspect the "
                f"file; deleting it grants no budget"
            ) from None
        out.records.append(record)
        out.hashes.append(line_hash(raw))
        offset += len(raw) + (1 if terminated else 0)
        out.missing_newline = not terminated
        out.valid_bytes = offset
    return out


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("not a JSON line") from None
    if not isinstance(record, dict) or record.get("crc") != crc(record):
        raise ValueError("checksum mismatch")
    return record


def repair(contents: LogContents) -> None:
    """Cut a torn last line and complete a last line missing its newline (fsynced)."""
    if not (contents.torn_tail or contents.missing_newline):
        return
    fd = os.open(contents.path, os.O_WRONLY)
    try:
        os.ftruncate(fd, contents.valid_bytes)
        if contents.missing_newline:
            os.lseek(fd, 0, os.SEEK_END)
            _write_all(fd, b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: str | os.PathLike, records: list[dict[str, Any]]) -> None:
    """Create (or replace) a log holding ``records``: temporary name, fsync, rename, dir fsync."""
    atomic_write_bytes(path, b"".join(encode_line(r) for r in records), mode=0o600)


def append_line(path: str | os.PathLike, record: dict[str, Any]) -> str:
    """Append one line and fsync it; its :func:`line_hash`. On a failed write the file is cut
    back (best effort).

    No ``O_CREAT``: a log that vanished fails the write instead of restarting empty.
    """
    line = encode_line(record)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, line)
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):  # keep the log replayable
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
    return line_hash(line[:-1])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# --------------------------------------------------------------------------- the chain


def line_hash(raw: bytes) -> str:
    """SHA-256 (hex) of one line's canonical bytes (without its newline)."""
    return hashlib.sha256(raw.rstrip(b"\n")).hexdigest()


def genesis_hash(store_id: str) -> str:
    """The ``prev_hash`` of a chained log's first entry: bound to the store's keyed id, so the
    log of another store does not verify here."""
    return hashlib.sha256(f"privcode-wal-genesis/1\0{store_id}".encode()).hexdigest()


def legacy_digest(hashes: list[str]) -> str:
    """Digest of the lines written before the chain (the ``chain`` entry names it)."""
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def write_chained(
    path: str | os.PathLike,
    records: list[dict[str, Any]],
    genesis: str,
    head: str | os.PathLike | None = None,
) -> tuple[int, str]:
    """A new chained log holding ``records`` (``prev_hash`` set here), written like
    :func:`write_new`, its ``head`` first when given (a crash between the two leaves a head
    with no log, which a store still being created may redo); returns ``(entries, last hash)``.
    """
    lines, prev = [], genesis
    for record in records:
        line = encode_line({**record, "prev_hash": prev})
        lines.append(line)
        prev = line_hash(line)
    if head is not None:
        write_head(head, len(lines), prev)
    atomic_write_bytes(path, b"".join(lines), mode=0o600)
    return len(lines), prev


def verify_chain(contents: LogContents, genesis: str) -> int:
    """Check the links of a log; the number of its first lines written before the chain.

    ValueError naming the first entry whose ``prev_hash`` does not match.
    """
    records, hashes = contents.records, contents.hashes
    first = next((i for i, r in enumerate(records) if "prev_hash" in r), None)
    if first is None:
        return len(records)  # written before the chain: the caller decides
    if first > 0:
        entry = records[first]
        if entry.get("type") != "chain" or entry.get("legacy_entries") != first:
            raise ValueError(
                f"entry {first + 1} starts the hash chain but is no chain entry covering the "
                f"{first} entries before it"
            )
        if entry.get("legacy_sha256") != legacy_digest(hashes[:first]):
            raise ValueError(
                f"the {first} entries written before the chain no longer match the digest "
                f"that entry {first + 1} recorded (an entry was removed or changed)"
            )
    for i in range(first, len(records)):
        prev = records[i].get("prev_hash")
        if prev is None:
            raise ValueError(f"entry {i + 1} carries no prev_hash inside the hash chain")
        if i == 0 and prev != genesis:
            raise ValueError(
                "its first entry is not this store's genesis (the log of another store?)"
            )
        if i > 0 and prev != hashes[i - 1]:
            raise ValueError(
                f"entry {i + 1}'s prev_hash does not match entry {i}: an entry before it was "
                "removed, reordered or replaced"
            )
    return first


def read_head(path: str | os.PathLike) -> dict[str, Any] | None:
    """A log's head (``{"entries", "hash"}``); None when there is none; ValueError if damaged."""
    try:
        head = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable ({exc})") from None
    if (
        not isinstance(head, dict)
        or not isinstance(head.get("entries"), int)
        or not isinstance(head.get("hash"), str)
    ):
        raise ValueError("not a log head (entries, hash)")
    return head


def write_head(path: str | os.PathLike, entries: int, last_hash: str) -> None:
    """Record a log's length and last hash (temporary name, fsync, rename, dir fsync)."""
    text = json.dumps({"entries": entries, "format": 1, "hash": last_hash}, sort_keys=True)
    atomic_write_bytes(path, (text + "\n").encode(), mode=0o600)


def check_head(head: dict[str, Any], contents: LogContents) -> int:
    """Check a log against its head; how many entries the head lags (0 or 1).

    The head is written after each append, so a crash between the two leaves it one entry
    behind, never more, and never ahead. ValueError saying what disagrees.
    """
    n, have = head["entries"], len(contents.records)
    if n > have:
        raise ValueError(
            f"it holds {have} entries but its head records {n}: {n - have} entr"
            f"{'y was' if n - have == 1 else 'ies were'} removed (the log was truncated)"
        )
    if n < 1 or contents.hashes[n - 1] != head["hash"]:
        raise ValueError(
            f"its entry {n} does not match the hash its head records: the log was rewritten "
            "or replaced"
        )
    if have - n > 1:
        raise ValueError(
            f"it holds {have} entries but its head records {n}: the head is stale (an old copy?)"
        )
    return have - n


# --------------------------------------------------------------------------- format 1


def _check_legacy(record: dict[str, Any], index: int) -> None:
    if index == 0:
        if record.get("type") != "header" or record.get("format") != 1:
            raise ValueError("not a run ledger (format 1) header")
    elif record.get("type") != "event" or record.get("seq") != index:
        raise ValueError("not a run ledger event in sequence")


def legacy_events(wal: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and grants of a pre-store run ledger (``runs/<run>/ledger/<id>/ledger.wal``)."""
    contents = read_log(wal, _check_legacy)
    if not contents.records:
        return {}, []
    events = [
        DPEvent(e["noise_multiplier"], e["sample_rate"], e["steps"]).to_dict()
        for e in contents.records[1:]
    ]
    return contents.records[0], events
