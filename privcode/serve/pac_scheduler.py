"""The PAC server's decode thread: requests of different sessions share each forward.

:class:`DecodeScheduler` owns one thread that runs every admitted completion together: each
round it makes one release per decode that can take one, in admission order, then ONE forward
of all of them (:meth:`privcode.pac.ensemble.PacEnsemble.step_batch` over a left-padded
:class:`privcode.models.kv_batch.KvBatch`); requests that start in a round prefill together
(:meth:`~privcode.pac.ensemble.PacEnsemble.prefill_batch`) and join at the next round.
Invariants: the round's releases are one group commit per curator, on disk before any of their
tokens goes out; the curator sees each session's steps in order (a job waits while its session
has a request running; a close runs after the completions queued before it); at most
``max_batch`` run at once; a lockstep sink whose client has not taken its last token is passed
over, not waited for. Nothing here logs a prompt, a token or a session id.
Details: docs/serving.md, "privcode/serve/pac_scheduler.py".
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from privcode.models.kv_batch import KvBatch, KvBatchError

log = logging.getLogger("privcode.serve")

__all__ = ["DecodeScheduler", "PacJob"]

#: How long the thread waits for a parked client before it looks again (seconds).
PARKED_WAIT_S = 0.002
#: The most rows x columns one batched prefill forward takes (a longer prompt goes alone).
PREFILL_TOKENS = 16384


def _prefill_size(runs: list[Any], rows: int) -> int:
    return len(runs) * rows * max(len(r.decode.feed) for r in runs)


def _same(value: Any) -> Any:
    return value


def _nothing() -> None:
    return None


@dataclass(eq=False)
class PacJob:
    """Work for the decode thread. ``start()`` (on the thread, in order) returns a decode
    to run (a :class:`privcode.pac.decode.PacDecode`) or, for anything else, the job's
    value; ``finish(decode)`` turns an ended decode into the value; ``cleanup()`` runs
    after either (and after an error), on the thread. ``session``: the session whose
    requests must not overlap (None: a one-shot)."""

    session: str | None
    start: Callable[[], Any]
    finish: Callable[[Any], Any] = _same
    cleanup: Callable[[], None] = _nothing
    future: Future = field(default_factory=Future)


@dataclass(eq=False)
class _Running:
    job: PacJob
    decode: Any
    lp: Any = None  #: the step log-probs after ``decode.feed``'s predecessor, not yet used
    cache: Any = None  #: its own KV cache while out of the batch
    solo: bool = False  #: its cache cannot join the batch: it decodes alone


class DecodeScheduler:
    """Runs :class:`PacJob` s on one thread over ``ensemble``; see the module docstring."""

    def __init__(self, ensemble: Any, max_batch: int = 8, *, name: str = "pac-decode"):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.ensemble, self.max_batch = ensemble, max_batch
        self._queue: deque[PacJob] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._running: list[_Running] = []
        self._batch = KvBatch()
        self.peak_batch = 0  #: the most decodes one forward served (benchmarks, tests)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: PacJob) -> Future:
        """Queue ``job``; its future holds the value (or the error)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the PAC decode scheduler is closed")
            self._queue.append(job)
            self._cv.notify()
        return job.future

    def close(self) -> None:
        """Finish every queued and running job, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    # -- the thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._running or self._closed):
                    self._cv.wait()
                if self._closed and not (self._queue or self._running):
                    return
                jobs = self._admit()
            self._start(jobs)
            if self._running and not self._round():
                with self._cv:  # every decode waits on its client: look again soon
                    self._cv.wait(PARKED_WAIT_S)

    def _admit(self) -> list[PacJob]:
        """The queued jobs that may start now (holding the lock), in arrival order."""
        busy = {r.job.session for r in self._running if r.job.session is not None}
        room, jobs, kept = self.max_batch - len(self._running), [], deque()
        while self._queue:
            job = self._queue.popleft()
            if job.session is not None and job.session in busy:
                kept.append(job)
            elif room > 0:
                jobs.append(job)
                if job.session is not None:
                    busy.add(job.session)
                room -= 1
            else:
                kept.append(job)
                busy.add(job.session)
        self._queue = kept
        return jobs

    def _start(self, jobs: list[PacJob]) -> None:
        """Start ``jobs`` in order; the decodes among them prefill together."""
        fresh = []
        for job in jobs:
            try:
                value = job.start()
            except BaseException as exc:  # noqa: BLE001 - the caller gets it through the future
                self._settle(job, error=exc)
                continue
            if not hasattr(value, "advance"):
                self._settle(job, value=value)
                continue
            run = _Running(job, value)
            self._running.append(run)
            if value.live():
                fresh.append(run)
        chunk: list[_Running] = []
        for run in fresh:  # at most PREFILL_TOKENS (rows x columns) per forward
            if chunk and _prefill_size(chunk + [run], self.ensemble.m + 1) > PREFILL_TOKENS:
                self._prefill(chunk)
                chunk = []
            chunk.append(run)
        if chunk:
            self._prefill(chunk)

    def _prefill(self, runs: list[_Running]) -> None:
        """One forward over the prompts of ``runs`` (alone where caches cannot be cut)."""
        try:
            if len(runs) > 1:
                steps = self.ensemble.prefill_batch([r.decode.feed for r in runs])
                for run, (lp, cache) in zip(runs, steps, strict=True):
                    run.lp, run.cache = lp, cache
                return
        except KvBatchError as exc:
            log.warning("PAC decode: requests prefill alone (%s)", exc)
        except BaseException as exc:  # noqa: BLE001 - every request of the forward fails
            for run in runs:
                self._end(run, exc)
            return
        for run in runs:
            try:
                run.lp, run.cache = self.ensemble.step_logprobs(run.decode.feed, None)
            except BaseException as exc:  # noqa: BLE001
                self._end(run, exc)

    def _settle(self, job: PacJob, *, value: Any = None, error: BaseException | None = None):
        try:
            if error is None:
                job.future.set_result(value)
            else:
                job.future.set_exception(error)
        finally:
            try:
                job.cleanup()
            except Exception:
                log.exception("PAC decode: a job's cleanup failed")

    def _end(self, run: _Running, error: BaseException | None = None) -> None:
        self._running.remove(run)
        if run in self._batch.groups:
            self._batch.leave(run)
        if error is not None:
            self._settle(run.job, error=error)
            return
        try:
            value = run.job.finish(run.decode)
        except BaseException as exc:  # noqa: BLE001
            self._settle(run.job, error=exc)
        else:
            self._settle(run.job, value=value)

    def _round(self) -> bool:
        """One release for each decode that can take one, then one forward; whether any
        decode moved."""
        due = []
        for run in list(self._running):
            if not run.decode.live():
                self._end(run)
            elif run.decode.ready():
                due.append(run)
        self._release(due)
        moved = []
        for run in due:
            if run not in self._running:  # failed in its release
                continue
            if run.decode.live():
                moved.append(run)
            else:
                self._end(run)
        for run in self._running:  # a parked decode takes its cache out of the batch
            if run.lp is not None and run in self._batch.groups:
                run.cache = self._batch.leave(run, take=True)
        if moved:
            self._forward(moved)
        return bool(moved)

    def _release(self, due: list[_Running]) -> None:
        """One curator release for each decode in ``due``, in order, with one state write per
        curator for all of them (:meth:`privcode.pac.curator.Curator.step_many`: on disk
        before any token goes out)."""
        groups: dict[int, list[tuple[_Running, Any]]] = {}
        for run in due:
            try:
                votes = run.decode.votes(run.lp)
            except BaseException as exc:  # noqa: BLE001 - the caller gets it through the future
                self._end(run, exc)
                continue
            groups.setdefault(id(run.decode.curator), []).append((run, votes))
        for group in groups.values():
            curator = group[0][0].decode.curator
            try:
                outcomes = curator.step_many([(r.decode.session_id, v) for r, v in group])
            except BaseException as exc:  # noqa: BLE001 - a failed state write: none released
                for run, _ in group:
                    self._end(run, exc)
                continue
            for (run, _), outcome in zip(group, outcomes, strict=True):
                try:
                    if isinstance(outcome, BaseException):
                        raise outcome
                    run.decode.take(run.lp, outcome)
                except BaseException as exc:  # noqa: BLE001
                    self._end(run, exc)
                    continue
                run.lp = None

    def _forward(self, moved: list[_Running]) -> None:
        rows = self.ensemble.m + 1
        for run in moved:
            if run.cache is None or run.solo:
                continue
            try:
                self._batch.join(run, run.cache, rows, run.cache.get_seq_length())
                run.cache = None
            except KvBatchError as exc:
                log.warning("PAC decode: a request decodes alone (%s)", exc)
                run.solo = True
        for run in [r for r in moved if r.solo]:
            try:
                run.lp, run.cache = self.ensemble.step_logprobs(run.decode.feed, run.cache)
            except BaseException as exc:  # noqa: BLE001
                self._end(run, exc)
        members: list[_Running] = list(self._batch.groups)
        if not members:
            return
        self.peak_batch = max(self.peak_batch, len(members))
        try:
            steps = self.ensemble.step_batch(self._batch, [r.decode.feed[-1] for r in members])
        except BaseException as exc:  # noqa: BLE001 - every decode of the forward fails
            self._batch = KvBatch()
            for run in members:
                self._end(run, exc)
            return
        for run, lp in zip(members, steps, strict=True):
            run.lp = lp
