"""The privacy-budget ledger of a run: one fail-closed Ray actor backed by a write-ahead log.

Every DP-SGD step asks the ledger first.  :meth:`BudgetLedger.reserve`
grants a step (or a block of steps) of the Poisson-subsampled Gaussian
mechanism with noise multiplier sigma at sample rate q only if

    epsilon(history + [(sigma, q, steps)], delta) <= budget

for the run's accountant (:mod:`privcode.dp.accounting`).  A denied request
records nothing.  A grant is appended to the write-ahead log (WAL), flushed
and ``fsync``'ed *before* the method returns, so the persisted history is
always a superset of the steps a trainer was allowed to take: a crash can
only over-count epsilon, never under-count it.

WAL format (``<run_dir>/ledger.wal``, JSON lines, UTF-8).  Line 1 is the
header ``{"type": "header", "format": 1, "run_id", "budget", "delta",
"accountant", "created"}``; every further line is one grant ``{"type":
"event", "seq": 1, 2, ..., "noise_multiplier", "sample_rate", "steps",
"epsilon", "time"}`` plus ``"request_id"`` when the caller gave one.  Every
line carries ``"crc"``: the CRC-32 of its canonical JSON without that key, so
a line altered in place is detected.
``epsilon`` and ``time`` are informative; replay recomputes epsilon from
(sigma, q, steps) only.

Replay (:func:`read_wal`, :func:`replay_wal`, and the actor on every start):

* A last line without a trailing newline that does not parse or verify is a
  write torn by a crash.  The grant it would record was never returned (the
  fsync comes before the reply), so it is dropped and the file is truncated
  to its last complete line before anything is appended.  A last line that
  parses and verifies but lacks its newline is counted (conservative) and
  completed.
* Any other bad line (not JSON, wrong CRC, a sequence gap, an invalid event,
  a complete but garbled last line) means the log cannot be trusted: the
  restore fails with :class:`LedgerUnavailableError` and the run does not
  train.  A file holding nothing but a torn header has recorded no grant and
  is started afresh.
* The header must match the run: a WAL written for another run id, budget,
  delta or accountant is refused with :class:`LedgerConflictError`.  The
  budget of a run cannot be changed by reopening it (start a new run
  directory instead); spent epsilon therefore never goes down.

The actor (:func:`open_ledger`) is named ``privcode-ledger:<run_id>`` in the
namespace :data:`LEDGER_NAMESPACE`, detached (it outlives the job or task
that opened it, so a stage running as a short Ray task cannot take it down
with its worker; :func:`close_ledger` removes it), restarted by Ray without
limit when its process dies, and rebuilt from the WAL on every start.
Calls are serialised (one at a time), so concurrent reserves from many
workers can never overshoot together.  A call in flight when the actor dies
is retried (up to :data:`MAX_TASK_RETRIES`); if its grant had already been
logged, the retry is answered from the log when the call carries a
``request_id``, and otherwise logs a second grant: again only an over-count.

Metrics (``ray.util.metrics``, tag ``run``): Gauge ``privcode_epsilon_spent``,
Gauge ``privcode_epsilon_budget`` and Counter ``privcode_dp_steps``.  On a
restart the counter starts again from the steps replayed from the WAL
(Prometheus sees a counter reset).  The ledger sees numbers only: no record,
gradient or loss ever reaches it, and it logs nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.dp.accounting import ACCOUNTANTS, DPEvent, make_accountant
from privcode.errors import AccountingError, LedgerConflictError, LedgerUnavailableError
from privcode.utils import fsync_dir as _fsync_dir

__all__ = [
    "LEDGER_NAMESPACE",
    "WAL_NAME",
    "BudgetLedger",
    "LedgerConflictError",
    "LedgerUnavailableError",
    "WalContents",
    "close_ledger",
    "get_ledger",
    "ledger_call",
    "ledger_name",
    "open_ledger",
    "read_wal",
    "replay_wal",
]

log = logging.getLogger("privcode.ledger")

LEDGER_NAMESPACE = "privcode"
WAL_NAME = "ledger.wal"
WAL_FORMAT = 1
#: Retries of a call that was in flight when the actor died.  Bounded so a call
#: that itself kills the actor cannot loop forever.
MAX_TASK_RETRIES = 5


def ledger_name(run_id: str) -> str:
    """Name of the run's ledger actor (in namespace :data:`LEDGER_NAMESPACE`)."""
    return f"privcode-ledger:{_check_run_id(run_id)}"


def _check_run_id(run_id: str) -> str:
    if (
        not isinstance(run_id, str)
        or not run_id.strip()
        or len(run_id) > 200
        or any(ord(ch) < 32 for ch in run_id)
    ):
        raise LedgerUnavailableError(
            f"run id must be a non-empty printable string of at most 200 characters, got {run_id!r}"
        )
    return run_id


def _check_settings(budget: float, delta: float, accountant: str) -> tuple[float, float, str]:
    if (
        isinstance(budget, bool)
        or not isinstance(budget, int | float)
        or not math.isfinite(budget)
        or budget <= 0
    ):
        raise AccountingError(f"epsilon budget must be a finite number > 0, got {budget!r}")
    if (
        isinstance(delta, bool)
        or not isinstance(delta, int | float)
        or not math.isfinite(delta)
        or not 0 < delta < 1
    ):
        raise AccountingError(f"delta must be a number in (0, 1), got {delta!r}")
    make_accountant(accountant)
    return float(budget), float(delta), accountant


# --------------------------------------------------------------------------- WAL


def _crc(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "crc"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return f"{zlib.crc32(text.encode('utf-8')):08x}"


def _encode(record: dict[str, Any]) -> bytes:
    line = dict(record, crc=_crc(record))
    return (json.dumps(line, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode(
        "utf-8"
    )


@dataclass
class WalContents:
    """A parsed WAL: header (None if the file holds no complete header), grants, repair info."""

    path: Path
    header: dict[str, Any] | None
    entries: list[dict[str, Any]] = field(default_factory=list)
    valid_bytes: int = 0  # length of the prefix made of complete, verified lines
    size: int = 0  # file size when read
    torn_tail: bool = False  # an unverifiable last line (a torn write) was dropped
    missing_newline: bool = False  # the last verified line lacks its newline

    @property
    def events(self) -> list[DPEvent]:
        return [DPEvent(e["noise_multiplier"], e["sample_rate"], e["steps"]) for e in self.entries]


def _parse_line(raw: bytes, index: int, expected_seq: int) -> dict[str, Any]:
    """One verified WAL record; ValueError saying what is wrong otherwise."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("not a JSON line") from None
    if not isinstance(record, dict) or record.get("crc") != _crc(record):
        raise ValueError("checksum mismatch")
    if index == 0:
        if record.get("type") != "header":
            raise ValueError("first line is not a ledger header")
        if record.get("format") != WAL_FORMAT:
            raise ValueError(f"unsupported WAL format {record.get('format')!r}")
        return record
    if record.get("type") != "event":
        raise ValueError(f"unexpected record type {record.get('type')!r}")
    if record.get("seq") != expected_seq:
        raise ValueError(f"sequence number {record.get('seq')!r}, expected {expected_seq}")
    if not isinstance(record.get("request_id", ""), str):
        raise ValueError("request_id is not a string")
    try:
        DPEvent(record.get("noise_multiplier"), record.get("sample_rate"), record.get("steps"))
    except AccountingError as exc:
        raise ValueError(f"invalid event ({exc})") from None
    return record


def read_wal(wal_path: str | os.PathLike) -> WalContents:
    """Parse and verify a WAL (pure; see the module docstring for the torn-line rule).

    Raises :class:`LedgerUnavailableError` naming the file and line when the
    log cannot be read or trusted.
    """
    path = Path(wal_path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LedgerUnavailableError(f"cannot read ledger WAL {path}: {exc}") from exc
    out = WalContents(path=path, header=None, size=len(data))
    segments = data.split(b"\n")
    complete = len(segments) - 1  # segments before the last "\n"; the rest is an unterminated tail
    if segments[-1] == b"":
        segments.pop()
    offset = 0
    for index, raw in enumerate(segments):
        terminated = index < complete
        try:
            record = _parse_line(raw, index, expected_seq=len(out.entries) + 1)
        except ValueError as why:
            if not terminated:
                out.torn_tail = True  # a write cut short by a crash: never granted
                break
            raise LedgerUnavailableError(
                f"ledger WAL {path} is corrupt at line {index + 1} ({why}); the spent budget "
                f"cannot be restored, so the run must not train. Inspect the file; do not "
                f"delete it to reset the budget"
            ) from None
        if index == 0:
            out.header = record
        else:
            out.entries.append(record)
        offset += len(raw) + (1 if terminated else 0)
        out.missing_newline = not terminated
        out.valid_bytes = offset
    return out


def replay_wal(wal_path: str | os.PathLike) -> list[DPEvent]:
    """The granted DP events recorded in a WAL, in order (pure; for restores and audits)."""
    return read_wal(wal_path).events


def _check_header(
    wal: Path, header: dict[str, Any], run_id: str, budget: float, delta: float, accountant: str
) -> None:
    """LedgerConflictError unless the WAL header records exactly these settings."""
    want = {"run_id": run_id, "budget": budget, "delta": delta, "accountant": accountant}
    diffs = [
        f"{k} {header.get(k)!r} (requested {v!r})" for k, v in want.items() if header.get(k) != v
    ]
    if diffs:
        raise LedgerConflictError(
            f"ledger WAL {wal} belongs to a run with other settings: {', '.join(diffs)}. A "
            f"run's budget cannot be changed by reopening it; use a new run directory"
        )


# --------------------------------------------------------------------------- the actor


class BudgetLedger:
    """The ledger itself; :func:`open_ledger` runs it as a named Ray actor.

    Usable as a plain object too (tests, offline tools): nothing here needs
    Ray except the optional metrics.
    """

    def __init__(
        self,
        run_id: str,
        wal_path: str,
        epsilon_budget: float,
        delta: float,
        accountant: str = "rdp",
    ) -> None:
        self._run_id = _check_run_id(run_id)
        try:
            self._budget, self._delta, self._accountant_name = _check_settings(
                epsilon_budget, delta, accountant
            )
        except AccountingError as exc:
            raise LedgerUnavailableError(f"ledger for run {run_id!r}: {exc}") from None
        self._wal = Path(wal_path)
        self._acc = make_accountant(accountant)
        self._entries: list[dict[str, Any]] = []
        self._requests: dict[str, dict[str, Any]] = {}  # request_id -> its WAL record
        self._failed: str | None = None
        self._by_accountant: tuple[int, dict[str, float | None]] | None = None
        try:
            self._restore()
        except LedgerUnavailableError:
            raise
        except OSError as exc:
            raise LedgerUnavailableError(
                f"ledger for run {run_id!r}: cannot create or repair its WAL {self._wal}: {exc}"
            ) from exc
        try:
            self._epsilon = self._acc.epsilon(self._delta)
        except Exception as exc:  # noqa: BLE001 - spent budget unknown: do not serve
            raise LedgerUnavailableError(
                f"ledger for run {run_id!r}: the {accountant} "
                f"accountant cannot evaluate the logged history "
                f"({exc})"
            ) from None
        self._metrics = self._make_metrics()
        if self._entries:
            log.info(
                "ledger %s restored %d steps from %s: epsilon %.6g of %.6g",
                self._run_id,
                self._acc.steps,
                self._wal,
                self._epsilon,
                self._budget,
            )

    # -- restore ---------------------------------------------------------------

    def _restore(self) -> None:
        self._wal.parent.mkdir(parents=True, exist_ok=True)
        contents = read_wal(self._wal) if self._wal.exists() else None
        if contents is None or contents.header is None:
            # No file, an empty one, or only a torn header: no grant was ever recorded.
            self._write_header()
            return
        _check_header(
            self._wal,
            contents.header,
            self._run_id,
            self._budget,
            self._delta,
            self._accountant_name,
        )
        for entry in contents.entries:
            self._acc.compose(
                DPEvent(entry["noise_multiplier"], entry["sample_rate"], entry["steps"])
            )
        self._entries = contents.entries
        self._requests = {e["request_id"]: e for e in self._entries if "request_id" in e}
        if contents.torn_tail or contents.missing_newline:
            self._repair(contents)

    def _write_header(self) -> None:
        header = {
            "type": "header",
            "format": WAL_FORMAT,
            "run_id": self._run_id,
            "budget": self._budget,
            "delta": self._delta,
            "accountant": self._accountant_name,
            "created": time.time(),
        }
        fd = os.open(self._wal, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, _encode(header))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self._wal.parent)  # the new directory entry must survive a crash too

    def _repair(self, contents: WalContents) -> None:
        """Cut a torn last line and complete a last line missing its newline."""
        fd = os.open(self._wal, os.O_WRONLY)
        try:
            os.ftruncate(fd, contents.valid_bytes)
            if contents.missing_newline:
                os.lseek(fd, 0, os.SEEK_END)
                _write_all(fd, b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- metrics ---------------------------------------------------------------

    def _make_metrics(self) -> dict[str, Any] | None:
        try:
            from ray.util.metrics import Counter, Gauge

            tags = {"run": self._run_id}
            metrics = {
                "spent": Gauge(
                    "privcode_epsilon_spent", "Epsilon spent by the run so far.", tag_keys=("run",)
                ),
                "budget": Gauge(
                    "privcode_epsilon_budget", "Epsilon budget of the run.", tag_keys=("run",)
                ),
                "steps": Counter(
                    "privcode_dp_steps", "DP-SGD steps granted to the run.", tag_keys=("run",)
                ),
            }
            for metric in metrics.values():
                metric.set_default_tags(tags)
            metrics["spent"].set(self._epsilon)
            metrics["budget"].set(self._budget)
            if self._acc.steps:
                metrics["steps"].inc(self._acc.steps)
            return metrics
        except Exception as exc:  # noqa: BLE001 - metrics are optional; accounting is not
            log.warning("ledger %s: metrics unavailable (%s)", self._run_id, exc)
            return None

    def _update_metrics(self, steps: int) -> None:
        with contextlib.suppress(Exception):  # metrics must never block a grant
            if self._metrics is not None:
                self._metrics["spent"].set(self._epsilon)
                self._metrics["steps"].inc(steps)

    # -- API -------------------------------------------------------------------

    def reserve(
        self,
        noise_multiplier: float,
        sample_rate: float,
        steps: int = 1,
        request_id: str | None = None,
    ) -> dict:
        """Grant ``steps`` steps at (sigma, q) if the budget allows; all or nothing.

        Returns ``{"granted", "epsilon" (spent after the call), "position"
        (steps recorded so far), "reason" (None when granted)}``.  A grant is
        durable (in the fsync'ed WAL) when this returns.  A WAL write failure
        denies the request and every later one of this actor instance.

        ``request_id`` (optional) makes the call idempotent: Ray re-sends a
        call that was in flight when the actor died, and a request already in
        the WAL is answered from it (``"duplicate": True``) instead of being
        charged twice.  Without it such a retry is charged again (an
        over-count).  It must name one release of the mechanism, e.g.
        ``f"{attempt}:{step}"`` with ``attempt`` unique to the worker group's
        incarnation: a step recomputed after a restart with fresh noise is a
        second release and must be charged again, so the bare step number is
        only right if a recomputed step is bit-identical (same batch, same noise).
        """
        if request_id is not None:
            seen = self._requests.get(str(request_id))
            if seen is not None:
                return self._duplicate(seen, noise_multiplier, sample_rate, steps)
        if self._failed:
            return self._deny(self._failed)
        try:
            event = DPEvent(noise_multiplier, sample_rate, steps)
        except AccountingError as exc:
            return self._deny(f"invalid request: {exc}")
        candidate = self._acc.copy().compose(event)
        try:
            eps = candidate.epsilon(self._delta)
        except Exception as exc:  # noqa: BLE001 - an accountant failure must deny, not grant
            return self._deny(f"accountant {self._accountant_name} failed: {exc}")
        if not eps <= self._budget:  # also denies NaN
            return self._deny(
                f"budget exhausted: epsilon would be {eps:.6g} > budget "
                f"{self._budget:g} (delta {self._delta:g}, "
                f"{self._accountant_name})"
            )
        record = {
            "type": "event",
            "seq": len(self._entries) + 1,
            **event.to_dict(),
            "epsilon": eps,
            "time": time.time(),
        }
        if request_id is not None:
            record["request_id"] = str(request_id)
        try:
            self._append(record)
        except OSError as exc:
            self._failed = (
                f"ledger WAL {self._wal} could not be written ({exc}); no further "
                f"step is granted until the ledger is reopened"
            )
            log.error("ledger %s: %s", self._run_id, self._failed)
            return self._deny(self._failed)
        self._acc = candidate
        self._entries.append(record)
        if request_id is not None:
            self._requests[str(request_id)] = record
        self._epsilon = eps
        self._update_metrics(event.steps)
        return {"granted": True, "epsilon": eps, "position": self._acc.steps, "reason": None}

    def _duplicate(
        self, record: dict[str, Any], noise_multiplier: Any, sample_rate: Any, steps: Any
    ) -> dict:
        same = (record["noise_multiplier"], record["sample_rate"], record["steps"]) == (
            noise_multiplier,
            sample_rate,
            steps,
        )
        if not same:
            return self._deny(
                f"request id {record['request_id']!r} was already granted "
                f"(seq {record['seq']}) with other parameters"
            )
        return {
            "granted": True,
            "epsilon": self._epsilon,
            "position": self._acc.steps,
            "reason": None,
            "duplicate": True,
        }

    def _deny(self, reason: str) -> dict:
        return {
            "granted": False,
            "epsilon": self._epsilon,
            "position": self._acc.steps,
            "reason": reason,
        }

    def _append(self, record: dict[str, Any]) -> None:
        line = _encode(record)
        # No O_CREAT: a WAL that vanished must fail the write, not restart the log empty.
        fd = os.open(self._wal, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            try:
                _write_all(fd, line)
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):  # best effort: keep the log replayable
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def spent(self) -> dict:
        """The run's spending: epsilon under its accountant, and under every accountant.

        ``steps`` and ``position`` both count the DP steps recorded; ``entries``
        counts WAL grants.  ``epsilon_by_accountant`` maps each accountant name
        to its epsilon of the same history (None if that accountant fails).
        """
        steps = self._acc.steps
        if self._by_accountant is None or self._by_accountant[0] != len(self._entries):
            by: dict[str, float | None] = {}
            for name in ACCOUNTANTS:
                if name == self._accountant_name:
                    by[name] = self._epsilon
                    continue
                acc = make_accountant(name)
                for event in self._acc.history:
                    acc.compose(event)
                try:
                    by[name] = acc.epsilon(self._delta)
                except Exception:  # noqa: BLE001 - informative only
                    by[name] = None
            self._by_accountant = (len(self._entries), by)
        return {
            "run_id": self._run_id,
            "epsilon": self._epsilon,
            "delta": self._delta,
            "budget": self._budget,
            "remaining": max(0.0, self._budget - self._epsilon),
            "accountant": self._accountant_name,
            "steps": steps,
            "position": steps,
            "entries": len(self._entries),
            "epsilon_by_accountant": dict(self._by_accountant[1]),
            "history": [e.to_dict() for e in self._acc.history],
        }

    def history(self) -> list[dict]:
        """The WAL's grant records (noise_multiplier, sample_rate, steps, seq, epsilon, time)."""
        return [{k: v for k, v in e.items() if k not in ("type", "crc")} for e in self._entries]

    def describe(self) -> dict:
        """Settings and state, for :func:`open_ledger`'s checks."""
        return {
            "run_id": self._run_id,
            "wal_path": str(self._wal),
            "budget": self._budget,
            "delta": self._delta,
            "accountant": self._accountant_name,
            "epsilon": self._epsilon,
            "position": self._acc.steps,
            "entries": len(self._entries),
            "failed": self._failed,
            "pid": os.getpid(),
            "wal_present": self._wal.is_file(),
            "metrics": self._metrics is not None,
        }

    def ping(self) -> str:
        return "ok"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# --------------------------------------------------------------------------- handles


def open_ledger(
    run_id: str,
    run_dir: str | Path,
    epsilon_budget: float,
    delta: float,
    accountant: str = "rdp",
    *,
    timeout_s: float = 120.0,
) -> Any:
    """Get or create the run's ledger actor, with its WAL at ``<run_dir>/ledger.wal``.

    Returns the actor handle once the ledger has answered with its WAL
    restored.  Raises :class:`LedgerConflictError` when the WAL or a running
    ledger of this run has another budget, delta, accountant or WAL path, and
    :class:`LedgerUnavailableError` when Ray is not initialised, the run
    directory cannot be written, the WAL cannot be restored, or the actor does
    not answer within ``timeout_s``.  ``run_dir`` must be reachable from every
    node the actor may run on (shared storage on a multi-node cluster).
    """
    name = ledger_name(run_id)
    try:
        budget, delta, accountant = _check_settings(epsilon_budget, delta, accountant)
    except AccountingError as exc:
        raise LedgerUnavailableError(f"ledger for run {run_id!r}: {exc}") from None
    wal = Path(run_dir).expanduser().resolve() / WAL_NAME
    # Refuse a settings change here already, with a plain message, when the WAL is readable.
    if wal.is_file():
        contents = read_wal(wal)
        if contents.header is not None:
            _check_header(wal, contents.header, run_id, budget, delta, accountant)

    import ray

    if not ray.is_initialized():
        raise LedgerUnavailableError(
            "Ray is not initialized: connect first (privcode.cluster.local.connect)"
        )
    actor_cls = ray.remote(BudgetLedger).options(
        name=name,
        namespace=LEDGER_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=MAX_TASK_RETRIES,
        num_cpus=0,
    )
    try:
        handle = actor_cls.remote(run_id, str(wal), budget, delta, accountant)
        info = ray.get(handle.describe.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LedgerUnavailableError(
            f"ledger for run {run_id!r} did not answer within "
            f"{timeout_s:g}s; the run must not train"
        ) from None
    except ray.exceptions.RayError as exc:
        raise _unavailable(f"ledger for run {run_id!r} (WAL {wal})", exc) from None
    want = {"wal_path": str(wal), "budget": budget, "delta": delta, "accountant": accountant}
    diffs = [f"{k} {info.get(k)!r} (requested {v!r})" for k, v in want.items() if info.get(k) != v]
    if diffs:
        raise LedgerConflictError(
            f"ledger {name!r} is already open with other settings: {', '.join(diffs)}"
        )
    if not info.get("wal_present"):
        raise LedgerUnavailableError(
            f"ledger for run {run_id!r} is running but its WAL {wal} is gone; refusing to go on "
            f"(restore the file, or close_ledger({run_id!r}) to start a new budget there)"
        )
    if info.get("failed"):
        raise LedgerUnavailableError(
            f"ledger for run {run_id!r} is unusable: {info['failed']} "
            f"(close_ledger({run_id!r}) stops it; the next open_ledger "
            f"rebuilds it from the WAL)"
        )
    return handle


def _unavailable(context: str, exc: BaseException) -> LedgerUnavailableError:
    """The ledger error behind a Ray error (the actor's constructor message if there is one)."""
    text = str(exc)
    for cls in (LedgerConflictError, LedgerUnavailableError):
        marker = f"{cls.__name__}: "
        if marker in text:
            message = text.rsplit(marker, 1)[1].strip().splitlines()[0]
            return cls(message)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    detail = lines[0] if lines else type(exc).__name__
    return LedgerUnavailableError(
        f"{context} cannot be reached or restored "
        f"({type(exc).__name__}: {detail[:300]}); the run must not train"
    )


def ledger_call(
    handle: Any, method: str, *args: Any, timeout_s: float = 120.0, **kwargs: Any
) -> Any:
    """``ray.get(handle.<method>.remote(*args, **kwargs))``, failing as the ledger would.

    Any Ray error (the actor died for good, its restore from the WAL failed,
    it did not answer within ``timeout_s``) becomes :class:`LedgerUnavailableError`,
    so a trainer has one exception that means "stop"::

        reply = ledger_call(ledger, "reserve", sigma, q, 1, request_id=str(step))
    """
    import ray

    try:
        return ray.get(getattr(handle, method).remote(*args, **kwargs), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LedgerUnavailableError(
            f"the ledger did not answer {method}() within {timeout_s:g}s; the run must not train"
        ) from None
    except ray.exceptions.RayError as exc:
        raise _unavailable("the ledger", exc) from None


def get_ledger(run_id: str) -> Any:
    """Handle of a run's open ledger (for Ray Train workers and tasks); no creation."""
    import ray

    try:
        return ray.get_actor(ledger_name(run_id), namespace=LEDGER_NAMESPACE)
    except ValueError:
        raise LedgerUnavailableError(
            f"no ledger is open for run {run_id!r} (actor "
            f"{ledger_name(run_id)!r} in namespace "
            f"{LEDGER_NAMESPACE!r}); open_ledger must run first"
        ) from None


def close_ledger(run_id: str) -> bool:
    """Stop a run's ledger actor (its WAL stays); True if one was running."""
    import ray

    try:
        handle = ray.get_actor(ledger_name(run_id), namespace=LEDGER_NAMESPACE)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    return True
