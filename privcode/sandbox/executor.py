"""The executor service: generated code runs in pods that hold nothing, called in batches.
Design notes: docs/kubernetes.md, "privcode/sandbox/executor.py".

On Kubernetes the Ray pods hold the private corpus, the privacy store and the Ray token, so they
never run generated code (``PRIVCODE_SANDBOX_FORBID_LOCAL=1`` refuses every local sandbox
there): Stage II and pass@k send their programs to the executor Deployment
(``sandbox.executor`` / ``PRIVCODE_SANDBOX_EXECUTOR``). Protocol, JSON over HTTP/1.1, one
request per connection: ``GET /healthz`` (no token); ``POST /v1/run`` with a bearer token,
``{"programs": [{"code", "stdin"}], "limits": {...}}`` -> ``{"isolation", "verdicts"}`` in
order, each verdict cut to its output's tails (:mod:`privcode.sandbox.executor_protocol`).
Nothing of a program, its stdin, its output or a token is logged or echoed in an error.

This module is the client's side: :class:`ExecutorClient`, :func:`open_sandbox` (the one entry
point: this client when an executor is configured, else a local :class:`SandboxPool`) and
:func:`preflight`; the token is read from ``PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE``.

"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict

from privcode.sandbox.executor_protocol import (
    CLIENT_TOKEN_ENV,
    MAX_LIMITS,
    parse_limits,
    read_token,
)
from privcode.sandbox.executor_server import ExecutorServer, serve
from privcode.sandbox.pool import (
    DEFAULT_LIMITS,
    FULL,
    FULL_NO_CGROUP,
    ISOLATIONS,
    WEAK_NOTE,
    SandboxError,
    SandboxLimits,
    SandboxPool,
    Verdict,
    _checked_level,
    is_full,
    stdins_for,
)

EXECUTOR_ENV = "PRIVCODE_SANDBOX_EXECUTOR"
_RETRIED = (429, 503)


def _accepts(isolation: str, level: str) -> bool:
    """Whether a client asking for ``isolation`` accepts an executor at ``level``."""
    if isolation == FULL:
        return is_full(level) and not level.endswith("+no-cgroup")
    return is_full(level) if isolation == FULL_NO_CGROUP else True


class ExecutorClient:
    """The pipeline's side: :meth:`map` like :class:`SandboxPool`, run on the executor.

    ``isolation`` is the weakest level accepted, as for a local pool: an executor that
    reports less is refused unless the weaker level was asked for by name.  The token comes
    from the file named by ``$PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE`` (none when unset).
    """

    def __init__(
        self,
        url: str,
        limits: SandboxLimits = DEFAULT_LIMITS,
        *,
        isolation: str = FULL,
        connect_timeout_s: float = 120.0,
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if not url.startswith(("http://", "https://")):
            raise SandboxError(f"sandbox executor must be an http(s) URL, got {url!r}")
        self.url, self.limits = url.rstrip("/"), limits
        token_file = os.environ.get(CLIENT_TOKEN_ENV)
        self._headers = {"Content-Type": "application/json"}
        if token_file:
            token = read_token(token_file, CLIENT_TOKEN_ENV)
            self._headers["Authorization"] = f"Bearer {token}"
        health = self._health(connect_timeout_s)
        self.level, self.workers = str(health["isolation"]), int(health["workers"])
        self.max_batch = int(health["max_batch"])
        if not _accepts(isolation, self.level):
            raise SandboxError(
                f"sandbox.isolation is {isolation!r} but the executor at {self.url} runs "
                f"{self.level!r} ({WEAK_NOTE if not is_full(self.level) else 'no cgroup'}): "
                "give its pods the full sandbox (the chart's executor.isolation: full), or "
                "accept the weaker level by name with sandbox.isolation"
            )

    def _health(self, timeout_s: float) -> dict:
        deadline, delay, last = time.monotonic() + timeout_s, 0.2, None
        while True:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=10) as r:
                    return json.loads(r.read())
            except (OSError, ValueError) as exc:  # starting up: retry until the deadline
                last = exc
            if time.monotonic() >= deadline:
                raise SandboxError(f"sandbox executor at {self.url} unreachable: {last}")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _refused(self, code: int, detail: str) -> SandboxError:
        if code == 401:
            source = os.environ.get(CLIENT_TOKEN_ENV) or f"none: {CLIENT_TOKEN_ENV} is unset"
            return SandboxError(
                f"sandbox executor at {self.url} refused the token (401); token file: {source}"
            )
        return SandboxError(f"sandbox executor answered {code}: {detail}")

    def _request(self, body: bytes, timeout: float) -> dict:
        """POST ``body`` to /v1/run, retrying while the executor is busy (429, 503)."""
        for attempt in range(30):
            req = urllib.request.Request(self.url + "/v1/run", body, self._headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as exc:
                if exc.code in _RETRIED and attempt < 29:
                    time.sleep(float(exc.headers.get("Retry-After") or 1))
                    continue
                detail = exc.read()[:500].decode("utf-8", "replace")
                raise self._refused(exc.code, detail) from None
            except (OSError, ValueError) as exc:
                raise SandboxError(f"sandbox executor at {self.url} failed: {exc}") from None
        raise SandboxError(f"sandbox executor at {self.url} stayed busy")  # pragma: no cover

    def check_token(self) -> None:
        """SandboxError if the executor refuses this client's token (an empty request: the
        token is checked before anything else, so any answer but 401 means it passed)."""
        req = urllib.request.Request(self.url + "/v1/run", b"", self._headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30):
                return
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise self._refused(401, "") from None
        except OSError as exc:
            raise SandboxError(f"sandbox executor at {self.url} failed: {exc}") from None

    def _post(self, codes: Sequence[str], stdins: Sequence[str], limits: SandboxLimits) -> list:
        body = json.dumps(
            {
                "programs": [{"code": c, "stdin": s} for c, s in zip(codes, stdins, strict=True)],
                "limits": asdict(limits),
            }
        ).encode()
        waves = math.ceil(len(codes) / max(1, self.workers)) + 1
        out = self._request(body, waves * (limits.wall_seconds + 5) + 30)
        if len(out.get("verdicts", ())) != len(codes):
            raise SandboxError("sandbox executor returned the wrong number of verdicts")
        self.level = out["isolation"]
        return [Verdict(**v) for v in out["verdicts"]]

    def map(
        self,
        codes: Sequence[str],
        stdins: Sequence[str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> list[Verdict]:
        stdins = stdins_for(codes, stdins)
        out: list[Verdict] = []
        for i in range(0, len(codes), self.max_batch):
            out += self._post(
                codes[i : i + self.max_batch], stdins[i : i + self.max_batch], limits or self.limits
            )
        return out

    def run(self, code: str, stdin: str = "") -> Verdict:
        return self.map([code], [stdin])[0]

    def close(self) -> None:
        pass

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def preflight(isolation: str = FULL, executor: str = "") -> str:
    """The level generated code will run at here, or the SandboxError that stops the stage
    (called by Stage II and eval before they start, so that a missing sandbox or a refused
    token is one clear error rather than failed actors)."""
    url = os.environ.get(EXECUTOR_ENV) or executor
    if url:
        client = ExecutorClient(url, isolation=isolation)
        client.check_token()
        return client.level

    return _checked_level(isolation)


def open_sandbox(
    workers: int | None = None,
    limits: SandboxLimits = DEFAULT_LIMITS,
    *,
    isolation: str = FULL,
    executor: str = "",
) -> SandboxPool | ExecutorClient:
    """Where generated code runs: the executor (``PRIVCODE_SANDBOX_EXECUTOR``, else
    ``executor``) when one is set, else a local :class:`SandboxPool` of ``workers`` slots."""
    url = os.environ.get(EXECUTOR_ENV) or executor
    if url:
        return ExecutorClient(url, limits, isolation=isolation)
    return SandboxPool(workers, limits, isolation=isolation)


__all__ = [
    "EXECUTOR_ENV",
    "MAX_LIMITS",
    "ExecutorClient",
    "ExecutorServer",
    "open_sandbox",
    "parse_limits",
    "preflight",
    "serve",
]
