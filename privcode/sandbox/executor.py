"""The executor service: generated code runs in pods that hold nothing, called in batches.

On Kubernetes the Ray pods hold the private corpus, the privacy store, the Ray token and
object-store credentials, so they never run generated code (``PRIVCODE_SANDBOX_FORBID_LOCAL=1``
refuses every local sandbox there).  Stage II's execution filter and pass@k scoring send
their programs to the executor Deployment instead (``sandbox.executor`` /
``PRIVCODE_SANDBOX_EXECUTOR``): no Ray, no token, no volume but an emptyDir /tmp, no
service-account token, ingress from the pipeline's Ray pods on one port, no egress at all
(the chart's NetworkPolicies); inside it, the full sandbox (docs/methods.md, "The sandbox").

Protocol (JSON over HTTP/1.1):

* ``GET /healthz`` -> ``{"isolation", "workers", "max_batch", "max_limits"}``.
* ``POST /v1/run`` ``{"programs": [{"code", "stdin"}], "limits": {...}}`` -> ``{"isolation",
  "verdicts": [Verdict...]}`` in order.  ``limits`` (optional, any :class:`SandboxLimits`
  field) may not exceed the server's ``max_limits``.

Clients are hostile too: a body must declare its length (411) and stay under
``max_body_bytes`` (413); at most ``max_batch`` programs (413) of at most 1 MiB each;
limits above the caps are refused (422); more than ``max_inflight`` batches at once get
429 with Retry-After; a client that stalls mid-request is dropped after ``read_timeout_s``.
Nothing of a program, its stdin or its output is logged or echoed in an error.

The server is the standard library's ``ThreadingHTTPServer`` (written here rather than on
FastAPI for the executor pod's sake: two routes do not need an ASGI stack, and every
package in the pod is code an escape could use).  :func:`open_sandbox` is the one entry
point callers use: this client when an executor is configured, else a local
:class:`SandboxPool`.
"""

from __future__ import annotations

import http.server
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, fields, replace

from privcode.sandbox.pool import (
    DEFAULT_LIMITS,
    FULL,
    ISOLATIONS,
    WEAK_NOTE,
    SandboxError,
    SandboxLimits,
    SandboxPool,
    Verdict,
    is_full,
    stdins_for,
)

EXECUTOR_ENV = "PRIVCODE_SANDBOX_EXECUTOR"
#: The most a client may ask for, per program.
MAX_LIMITS = SandboxLimits(
    cpu_seconds=60,
    wall_seconds=120,
    memory_mb=4096,
    max_processes=64,
    file_size_mb=64,
    open_files=256,
    output_bytes=1 << 20,
    disk_mb=256,
    cpus=2.0,
)
MAX_PROGRAM_BYTES = 1 << 20
_log = logging.getLogger(__name__)


class _Refused(Exception):
    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def parse_limits(raw: object, caps: SandboxLimits = MAX_LIMITS) -> SandboxLimits:
    """A client's limits over the defaults; ValueError naming the field if bad or over a cap."""
    if raw is None:
        return DEFAULT_LIMITS
    if not isinstance(raw, dict):
        raise ValueError("limits must be an object")
    names = {f.name for f in fields(SandboxLimits)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"unknown limits: {unknown}")
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"limits.{k} must be a number")
        if not math.isfinite(v):  # JSON's Infinity and NaN: int() would raise OverflowError
            raise ValueError(f"limits.{k} must be a finite number")
        if v > getattr(caps, k):
            raise ValueError(f"limits.{k}={v} exceeds this executor's cap {getattr(caps, k)}")
    typed = {
        k: (int(v) if isinstance(getattr(DEFAULT_LIMITS, k), int) else float(v))
        for k, v in raw.items()
    }
    return replace(DEFAULT_LIMITS, **typed)  # SandboxLimits validates (> 0)


def _programs(body: object, max_batch: int) -> tuple[list[str], list[str], object]:
    if not isinstance(body, dict) or not isinstance(body.get("programs"), list):
        raise _Refused(400, "body must be an object with a 'programs' list")
    progs = body["programs"]
    if not progs:
        raise _Refused(400, "'programs' is empty")
    if len(progs) > max_batch:
        raise _Refused(413, f"{len(progs)} programs: at most {max_batch} per request")
    codes, stdins = [], []
    for i, p in enumerate(progs):
        if not isinstance(p, dict) or not isinstance(p.get("code"), str):
            raise _Refused(400, f"programs[{i}] must be an object with a string 'code'")
        stdin = p.get("stdin", "")
        if not isinstance(stdin, str):
            raise _Refused(400, f"programs[{i}].stdin must be a string")
        if len(p["code"]) > MAX_PROGRAM_BYTES or len(stdin) > MAX_PROGRAM_BYTES:
            raise _Refused(413, f"programs[{i}]: code and stdin at most {MAX_PROGRAM_BYTES} each")
        codes.append(p["code"])
        stdins.append(stdin)
    return codes, stdins, body.get("limits")


class ExecutorServer(http.server.ThreadingHTTPServer):
    """The executor: a :class:`SandboxPool` behind ``/v1/run`` (module doc)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        workers: int = 2,
        isolation: str = FULL,
        max_batch: int = 256,
        max_inflight: int = 4,
        max_body_bytes: int = 32 << 20,
        read_timeout_s: float = 30.0,
    ) -> None:
        self.pool = SandboxPool(workers, isolation=isolation)  # refuses what it must, first
        self.max_batch, self.max_body_bytes = max_batch, max_body_bytes
        self.read_timeout_s = read_timeout_s
        self._inflight = threading.BoundedSemaphore(max_inflight)
        super().__init__(address, _Handler)

    def health(self) -> dict:
        return {
            "isolation": self.pool.level,
            "workers": self.pool.workers,
            "max_batch": self.max_batch,
            "max_limits": asdict(MAX_LIMITS),
        }

    def run_batch(self, body: object) -> dict:
        codes, stdins, raw_limits = _programs(body, self.max_batch)
        try:
            limits = parse_limits(raw_limits)
        except ValueError as exc:
            raise _Refused(422, str(exc)) from None
        if not self._inflight.acquire(blocking=False):
            raise _Refused(429, "executor busy: retry later", retry_after=1)
        try:
            verdicts = self.pool.map(codes, stdins, limits)
        finally:
            self._inflight.release()
        return {"isolation": self.pool.level, "verdicts": [v.to_dict() for v in verdicts]}

    def server_close(self) -> None:
        super().server_close()
        self.pool.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ExecutorServer  # pyright: ignore[reportIncompatibleVariableOverride]
    protocol_version = "HTTP/1.1"
    server_version = "privcode-executor"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.read_timeout_s)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
        pass  # request lines only (below): never a body

    def _send(self, status: int, obj: dict, retry_after: int | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if retry_after is not None:
            self.send_header("Retry-After", str(retry_after))
        self.end_headers()
        # Logged before the body goes out: once a client holds its answer, the line exists.
        _log.info("%s %s -> %d", self.command, self.path.split("?")[0][:64], status)
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/healthz":
            self._send(200, self.server.health())
        elif self.path == "/v1/run":
            self._send(405, {"error": "use POST"})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path != "/v1/run":
            self._send(404 if self.path != "/healthz" else 405, {"error": "not found"})
            return
        try:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                raise _Refused(411, "a Content-Length is required")
            if int(length) > self.server.max_body_bytes:
                self.close_connection = True
                raise _Refused(413, f"body over {self.server.max_body_bytes} bytes")
            raw = self.rfile.read(int(length))
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise _Refused(400, "body is not JSON") from None
            out = self.server.run_batch(body)
        except _Refused as exc:
            self._send(exc.status, {"error": str(exc)}, exc.retry_after)
        except SandboxError as exc:
            self._send(500, {"error": f"sandbox failure: {type(exc).__name__}"})
        except TimeoutError:
            self.close_connection = True
        else:
            self._send(200, out)


def serve(host: str, port: int, *, workers: int, isolation: str) -> None:
    """Run the executor until interrupted (``privcode sandbox serve``)."""
    server = ExecutorServer((host, port), workers=workers, isolation=isolation)
    _log.warning(
        "privcode executor on %s:%d: %d slots, isolation %s",
        *server.server_address[:2],
        workers,
        server.pool.level,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()


class ExecutorClient:
    """The pipeline's side: :meth:`map` like :class:`SandboxPool`, run on the executor.

    ``isolation`` is the weakest level accepted, as for a local pool: an executor that
    reports less than ``full`` is refused unless ``rlimits-only`` was asked for by name.
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
        health = self._health(connect_timeout_s)
        self.level, self.workers = str(health["isolation"]), int(health["workers"])
        self.max_batch = int(health["max_batch"])
        if isolation == FULL and not is_full(self.level):
            raise SandboxError(
                f"sandbox.isolation is 'full' but the executor at {self.url} runs "
                f"{self.level!r} ({WEAK_NOTE}): give its pods root with the sandbox's "
                "capabilities (the chart's executor.isolation: full) or a gVisor RuntimeClass, "
                "or accept it by name with sandbox.isolation: rlimits-only"
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

    def _post(self, codes: Sequence[str], stdins: Sequence[str], limits: SandboxLimits) -> list:
        body = json.dumps(
            {
                "programs": [{"code": c, "stdin": s} for c, s in zip(codes, stdins, strict=True)],
                "limits": asdict(limits),
            }
        ).encode()
        waves = math.ceil(len(codes) / max(1, self.workers)) + 1
        out: dict = {}
        timeout = waves * (limits.wall_seconds + 5) + 30
        for attempt in range(30):
            req = urllib.request.Request(
                self.url + "/v1/run", body, {"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    out = json.loads(r.read())
                break
            except urllib.error.HTTPError as exc:
                if exc.code == 429 and attempt < 29:
                    time.sleep(float(exc.headers.get("Retry-After") or 1))
                    continue
                detail = exc.read()[:500].decode("utf-8", "replace")
                raise SandboxError(f"sandbox executor answered {exc.code}: {detail}") from None
            except (OSError, ValueError) as exc:
                raise SandboxError(f"sandbox executor at {self.url} failed: {exc}") from None
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
    (called by Stage II and eval before they start, so that a missing sandbox is one clear
    error rather than failed actors)."""
    url = os.environ.get(EXECUTOR_ENV) or executor
    if url:
        return ExecutorClient(url, isolation=isolation).level
    from privcode.sandbox.pool import _checked_level

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
