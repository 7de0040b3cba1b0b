"""The executor's server: a :class:`SandboxPool` behind ``/v1/run``, held against its clients.
Design notes: docs/kubernetes.md, "privcode/sandbox/executor_server.py".

Built on h11 and asyncio; one request per connection (``Connection: close``). Every refusal is
decided on the headers, before any body byte is read: route (404, 405), bearer token (401;
``/healthz`` needs none), Content-Length (411, 413 over ``max_body_bytes``), 503 over
``max_connections`` open, 429 when none of the ``max_inflight`` slots is free. Memory thus
holds at most ``max_inflight`` bodies, plus 16 KiB of headers and a read buffer per
connection. A request not in ``request_deadline_s`` after the accept (or an answer not taken
within as long) is dropped. Then the body: JSON (400), programs (400, 413), limits (422, up to
the clamped caps), each verdict cut to tails (:func:`~privcode.sandbox.executor_protocol.capped`).

The process is non-dumpable (``PR_SET_DUMPABLE`` 0: a snippet under the same uid cannot open
its ``/proc/<pid>/mem``). Logs name the route and status, never a program, its output or a
token.

"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from http import HTTPStatus
from typing import Any

from privcode.sandbox.executor_protocol import (
    SERVER_TOKEN_ENV,
    TAIL_CHARS,
    Refused,
    bearer_matches,
    capped,
    clamp_limits,
    encode,
    parse_limits,
    programs,
    read_token,
)
from privcode.sandbox.pool import FULL, SandboxError, SandboxLimits, SandboxPool

_log = logging.getLogger("privcode.sandbox.executor")
MAX_HEADER_BYTES = 16 << 10
READ_CHUNK = 64 << 10
LINGER_S, LINGER_BYTES = 1.0, 64 << 10
SERVER_BASE_MB, SLOT_OVERHEAD_MB = 128, 32
_ROUTES = {b"/healthz": b"GET", b"/v1/run": b"POST"}
_PR_SET_DUMPABLE = 4


def not_dumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)``: no ptrace, /proc/<pid>/mem or core dump of this
    process by its own uid (point 8 of issue 43: a weak-mode snippet runs under it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SandboxError(f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(ctypes.get_errno())}")


def reserve_mb(workers: int, max_inflight: int, max_body_bytes: int) -> int:
    """Memory the server keeps for itself: the process, a zygote per slot, and each
    admitted body twice (its bytes and their parsed strings)."""
    body_mb = -(-max_body_bytes // (1 << 20))
    return SERVER_BASE_MB + SLOT_OVERHEAD_MB * workers + 2 * max_inflight * body_mb


def _h11() -> Any:
    try:
        import h11
    except ImportError:  # pragma: no cover - the serve extra brings it (with uvicorn)
        raise SandboxError("the executor server needs h11: pip install 'privcode[serve]'") from None
    return h11


def _response(status: int, obj: object, retry_after: int | None = None) -> bytes:
    body = encode(obj)
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        "Server: privcode-executor",
    ]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    if status == 401:
        head.append('WWW-Authenticate: Bearer realm="privcode-executor"')
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class ExecutorServer:
    """The executor (module doc).  ``token``: the bearer token (None: no authentication, for
    tests and local benchmarks; :func:`serve` refuses that unless asked by name).
    ``memory_budget_mb``/``disk_budget_mb``: the pod's, to clamp the limits' caps
    (:func:`~privcode.sandbox.executor_protocol.clamp_limits`).  ``pool``: instead of a
    new :class:`SandboxPool` (tests).  Like socketserver: :meth:`serve_forever`,
    :meth:`shutdown` from another thread, :meth:`server_close`, ``server_address``."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        workers: int = 2,
        isolation: str = FULL,
        token: str | None = None,
        max_batch: int = 256,
        max_inflight: int = 4,
        max_connections: int = 64,
        max_body_bytes: int = 32 << 20,
        request_deadline_s: float = 30.0,
        tail_chars: int = TAIL_CHARS,
        memory_budget_mb: int | None = None,
        disk_budget_mb: int | None = None,
        pool: Any = None,
    ) -> None:
        if token is not None and len(token) < 16:
            raise ValueError("the executor token must have at least 16 characters")
        not_dumpable()
        reserve = reserve_mb(workers, max_inflight, max_body_bytes)
        self.max_limits: SandboxLimits = clamp_limits(
            workers, memory_budget_mb, disk_budget_mb, reserve
        )
        own_pool = pool is None
        self.pool = SandboxPool(workers, isolation=isolation) if own_pool else pool  # may refuse
        self._token = None if token is None else token.encode()
        self.max_batch, self.max_inflight = max_batch, max_inflight
        self.max_connections, self.max_body_bytes = max_connections, max_body_bytes
        self.request_deadline_s, self.tail_chars = request_deadline_s, tail_chars
        self.open_connections = self.admitted = 0
        self._runner = ThreadPoolExecutor(self.pool.workers, thread_name_prefix="executor-run")
        self._parsers = ThreadPoolExecutor(max_inflight, thread_name_prefix="executor-batch")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving, self._done = threading.Event(), threading.Event()
        self._stop_requested = threading.Event()
        try:
            self._socket = socket.create_server(address, backlog=128)
        except OSError:
            self._parsers.shutdown()
            self._runner.shutdown()
            if own_pool:
                self.pool.close()
            raise
        self.server_address = self._socket.getsockname()

    def health(self) -> dict:
        return {
            "isolation": self.pool.level,
            "workers": self.pool.workers,
            "max_batch": self.max_batch,
            "max_limits": asdict(self.max_limits),
        }

    # -- lifecycle -------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (or KeyboardInterrupt)."""
        self._serving.set()
        try:
            asyncio.run(self._main())
        finally:
            self._done.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_requested.is_set():  # shutdown() came first
            return
        server = await asyncio.start_server(self._connection, sock=self._socket)
        try:
            await self._stop.wait()
        finally:
            server.close()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` (called from another thread) and wait for it."""
        self._stop_requested.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # its loop is closed: it has returned
                pass
        if self._serving.is_set():
            self._done.wait()

    def server_close(self) -> None:
        self._socket.close()
        self._parsers.shutdown(wait=True)
        self._runner.shutdown(wait=True)
        self.pool.close()

    # -- one connection --------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.open_connections += 1
        try:
            if self.open_connections > 2 * self.max_connections:
                return
            if self.open_connections > self.max_connections:
                refusal = Refused(503, "too many connections: retry later", retry_after=1)
                await _refuse(reader, writer, refusal)
                return
            await self._request(reader, writer)
        except Exception as exc:  # a bug or a broken socket: never the request's content
            _log.warning("executor connection failed: %s", type(exc).__name__)
        finally:
            self.open_connections -= 1
            writer.transport.abort()

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        h11 = _h11()
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        method, route, admitted = "-", "-", False
        try:
            async with asyncio.timeout(self.request_deadline_s):
                request = await _next_event(h11, conn, reader)
                if not isinstance(request, h11.Request):
                    return  # closed before a request
                path = request.target.split(b"?")[0]
                if path in _ROUTES and request.method in (b"GET", b"POST"):
                    method, route = request.method.decode(), path.decode()
                if self._route(request) == "health":
                    await _send(writer, 200, self.health(), "GET", route, self.request_deadline_s)
                    return
                self._admit(request)
                admitted = True
                if conn.they_are_waiting_for_100_continue:
                    writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                body = await _read_body(h11, conn, reader)
        except TimeoutError:
            _log.info("request not complete after %.0f s: dropped", self.request_deadline_s)
            self._release(admitted)
            return
        except Refused as exc:
            self._release(admitted)
            _log.info("%s %s -> %d", method, route, exc.status)  # a known route, or "-"
            await _refuse(reader, writer, exc)
            return
        try:
            assert self._loop is not None
            status, answer = await self._loop.run_in_executor(self._parsers, self._answer, body)
            await _send(writer, status, answer, "POST", route, self.request_deadline_s)
        finally:
            self._release(True)

    def _route(self, request: Any) -> str:
        path = request.target.split(b"?")[0]
        if path not in _ROUTES:
            raise Refused(404, "not found")
        if request.method != _ROUTES[path]:
            raise Refused(405, f"use {_ROUTES[path].decode()}")
        return "health" if path == b"/healthz" else "run"

    def _admit(self, request: Any) -> None:
        """On the headers alone: the token, the length, a slot (module doc, point 3)."""
        headers: dict[bytes, list[bytes]] = {}
        for name, value in request.headers:
            headers.setdefault(name.lower(), []).append(value)
        if self._token is not None and not bearer_matches(
            headers.get(b"authorization", []), self._token
        ):
            raise Refused(401, "a valid executor token is required (Authorization: Bearer)")
        length = headers.get(b"content-length")
        if not length:
            raise Refused(411, "a Content-Length is required")
        if int(length[0]) > self.max_body_bytes:
            raise Refused(413, f"body over {self.max_body_bytes} bytes")
        if self.admitted >= self.max_inflight:
            raise Refused(429, "executor busy: retry later", retry_after=1)
        self.admitted += 1

    def _release(self, admitted: bool) -> None:
        if admitted:
            self.admitted -= 1

    def _answer(self, raw: bytes | bytearray) -> tuple[int, dict]:
        """(status, answer) of a ``/v1/run`` body (in a thread: parsing and the runs block)."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return 400, {"error": "body is not JSON"}
        try:
            codes, stdins, raw_limits = programs(body, self.max_batch)
            try:
                limits = parse_limits(raw_limits, self.max_limits)
            except ValueError as exc:
                raise Refused(422, str(exc)) from None
        except Refused as exc:
            return exc.status, {"error": str(exc)}
        try:
            verdicts = list(self._runner.map(self._run_one, codes, stdins, [limits] * len(codes)))
        except SandboxError as exc:
            return 500, {"error": f"sandbox failure: {type(exc).__name__}"}
        return 200, {"isolation": self.pool.level, "verdicts": verdicts}

    def _run_one(self, code: str, stdin: str, limits: SandboxLimits) -> dict:
        return capped(self.pool.run(code, stdin, limits), self.tail_chars)


async def _next_event(h11: Any, conn: Any, reader: asyncio.StreamReader) -> Any:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise Refused(exc.error_status_hint, "malformed HTTP request") from None
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(READ_CHUNK))


async def _read_body(h11: Any, conn: Any, reader: asyncio.StreamReader) -> bytearray:
    body = bytearray()
    while True:
        event = await _next_event(h11, conn, reader)
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body
        else:
            raise Refused(400, "incomplete body")


async def _send(writer, status: int, obj: object, method: str, route: str, deadline_s: float):
    """The answer, taken by the client within ``deadline_s`` or the connection is dropped."""
    data = _response(status, obj)
    # Logged before the answer goes out: once a client holds its answer, the line exists.
    _log.info("%s %s -> %d", method, route, status)
    try:
        async with asyncio.timeout(deadline_s):
            writer.write(data)
            await writer.drain()
            writer.close()
            await writer.wait_closed()
    except (TimeoutError, OSError):
        pass


async def _refuse(reader: asyncio.StreamReader, writer, exc: Refused) -> None:
    """Send the refusal, half-close, discard a little for a short while (module doc)."""
    try:
        async with asyncio.timeout(LINGER_S):
            writer.write(_response(exc.status, {"error": str(exc)}, exc.retry_after))
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            discarded = 0
            while discarded < LINGER_BYTES and (chunk := await reader.read(READ_CHUNK)):
                discarded += len(chunk)
    except (TimeoutError, OSError):
        pass


def serve(
    host: str,
    port: int,
    *,
    workers: int,
    isolation: str,
    token_file: str | None = None,
    insecure_no_auth: bool = False,
    **options: Any,
) -> None:
    """Run the executor until interrupted (``privcode sandbox serve``).  The token comes from
    ``token_file`` (default ``$PRIVCODE_EXECUTOR_TOKEN_FILE``); without one, refuse to start
    unless ``insecure_no_auth``.  ``options``: :class:`ExecutorServer`'s."""
    path = token_file or os.environ.get(SERVER_TOKEN_ENV)
    if path:
        token = read_token(path, "--token-file")
    elif insecure_no_auth:
        token = None
    else:
        raise SandboxError(
            f"no executor token: give --token-file PATH (or {SERVER_TOKEN_ENV}), or run "
            "without authentication by name with --insecure-no-auth"
        )
    server = ExecutorServer(
        (host, port), workers=workers, isolation=isolation, token=token, **options
    )
    _log.warning(
        "privcode executor on %s:%d: %d slots, isolation %s, %s; max limits memory %d MiB, "
        "disk %d MiB",
        *server.server_address[:2],
        workers,
        server.pool.level,
        "bearer token" if token else "NO AUTHENTICATION (--insecure-no-auth)",
        server.max_limits.memory_mb,
        server.max_limits.disk_mb,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()


__all__ = ["ExecutorServer", "not_dumpable", "reserve_mb", "serve"]
