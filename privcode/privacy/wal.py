"""Write-ahead logs of JSON lines with a CRC each: the codec and the crash rules, no state.

A log is one JSON object per line (UTF-8, keys sorted, no spaces), each
carrying ``"crc"``: the CRC-32 of its canonical JSON without that key, so a
line altered in place is detected. Appends are ``O_APPEND`` writes followed
by ``fsync``; a new log is written whole to a temporary name, fsynced,
renamed into place, and its directory fsynced, so its entry survives a crash.

Reading (:func:`read_log`), for every log privcode keeps:

* a last line without a trailing newline that does not parse or verify is a
  write torn by a crash; what it would record was never acknowledged (the
  fsync comes before the reply), so it is dropped (``torn_tail``) and
  :func:`repair` cuts the file back to its last complete line;
* a last line that verifies but lacks its newline is kept (conservative) and
  :func:`repair` completes it;
* any other bad line (not JSON, wrong CRC, rejected by the caller's
  ``check``) means the log cannot be trusted: :class:`LedgerUnavailableError`
  naming the file and line.
"""

from __future__ import annotations

import contextlib
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
    "crc",
    "encode_line",
    "legacy_events",
    "read_log",
    "repair",
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


def append_line(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one line and fsync it; on a failed write cut the file back (best effort).

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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


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
