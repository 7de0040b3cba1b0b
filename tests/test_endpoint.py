"""The one OpenAI-compatible client (privcode.models.endpoint) and its transport (privcode.http).

A stub OpenAI server on 127.0.0.1 (stdlib) answers from a script: a 429 with
Retry-After then 200 (retried after the wait), a 429 privacy_budget_exhausted
(never retried: a typed error), 503s (gives up after the retries, naming the
count), oversized answers (refused: by Content-Length, and mid-stream without
reading the rest), a slow server and a slow drip (timeouts, not retried); the
bearer token is sent and never shown; the ledger client shares the transport
and sends each call once.
"""

from __future__ import annotations

import ast
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from privcode import http
from privcode.errors import LedgerUnavailableError
from privcode.models.endpoint import (
    BudgetExhaustedError,
    EndpointClient,
    EndpointError,
    EndpointStatusError,
)

OK = {"choices": [{"index": 0, "text": "done"}]}
SPENT = {
    "error": {
        "message": "the deployment's privacy budget is spent",
        "type": "privacy_budget_exhausted",
        "code": "privacy_budget_exhausted",
    }
}


class Stub(BaseHTTPRequestHandler):
    """Answers each request with the next step of ``server.script`` (then 200 OK): a dict
    with ``status``, ``body`` (JSON-able or bytes), ``headers``, ``delay`` (before the
    headers), ``drip`` (seconds between body bytes) or ``stream`` (bytes sent without a
    Content-Length)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _step(self):
        srv = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        with srv.lock:
            srv.seen.append((time.monotonic(), self.command, self.path, body, dict(self.headers)))
            return srv.script.pop(0) if srv.script else {}

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self._answer(self._step(), {"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})

    def do_POST(self):  # noqa: N802
        self._answer(self._step(), OK)

    def _answer(self, step, default):
        time.sleep(step.get("delay", 0))
        body = step.get("body", default)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(step.get("status", 200))
        for name, value in step.get("headers", {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        if "stream" in step or "drip" in step:
            self.send_header("Connection", "close")
            self.end_headers()
            return self._trickle(step)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _trickle(self, step):
        chunk = b"x" * (64 << 10) if "stream" in step else b" "
        try:
            for _ in range(step.get("stream", 0) // len(chunk) if "stream" in step else 100):
                self.wfile.write(chunk)
                self.wfile.flush()
                self.server.sent += len(chunk)
                time.sleep(step.get("drip", 0))
        except OSError:  # the client hung up
            pass
        self.close_connection = True


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    srv.daemon_threads = True
    srv.lock, srv.script, srv.seen, srv.sent = threading.Lock(), [], [], 0
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(srv, **kw):
    return EndpointClient(srv.url, **{"retries": 2, "backoff_s": 0.01, "timeout_s": 5, **kw})


def test_429_with_retry_after_is_retried_after_the_wait(server):
    server.script = [{"status": 429, "headers": {"Retry-After": "1"}, "body": {"error": "slow"}}]
    assert _client(server).complete({"prompt": "p", "max_tokens": 2}) == "done"
    (first, *_), (second, *_) = server.seen
    assert len(server.seen) == 2 and second - first >= 0.95  # waited Retry-After, not 0.01


def test_a_spent_privacy_budget_is_never_retried(server):
    server.script = [{"status": 429, "body": SPENT}] * 3
    client = _client(server, backoff_s=5.0)
    start = time.monotonic()
    with pytest.raises(BudgetExhaustedError, match="HTTP 429: the deployment's privacy") as err:
        client.complete({"prompt": "p"})
    assert err.value.status == 429 and err.value.code == "privacy_budget_exhausted"
    assert len(server.seen) == 1 and time.monotonic() - start < 1.0
    # and with retries off it is the same typed error
    with pytest.raises(BudgetExhaustedError):
        _client(server, retries=0).complete({"prompt": "p"})
    assert len(server.seen) == 2


def test_503s_give_up_after_the_retries_with_the_count(server):
    server.script = [{"status": 503}] * 4
    with pytest.raises(EndpointStatusError, match=r"failed 3 times \(last: HTTP 503\)") as err:
        _client(server).complete({"prompt": "SECRET-PROMPT"})
    assert (err.value.status, err.value.attempts) == (503, 3) and len(server.seen) == 3
    assert "SECRET" not in str(err.value)
    assert [s[1] for s in server.seen] == ["POST"] * 3  # completions are POSTs, retried


def test_500_and_4xx_are_not_retried_and_name_the_key_variable(server):
    server.script = [{"status": 500, "body": {"error": {"message": "boom"}}}]
    with pytest.raises(EndpointStatusError, match="HTTP 500: boom"):
        _client(server).complete({"prompt": "p"})
    server.script = [{"status": 401, "body": {"error": {"message": "bad key"}}}]
    with pytest.raises(EndpointStatusError, match=r"HTTP 401: bad key.*\$NO_SUCH_KEY_VAR"):
        _client(server, api_key_env="NO_SUCH_KEY_VAR").complete({"prompt": "p"})
    assert len(server.seen) == 2


def test_oversized_answers_are_refused(server):
    client = _client(server, max_answer_bytes=1000)
    server.script = [{"body": {"choices": [{"text": "B" * 5000}]}}]
    with pytest.raises(EndpointError, match="answer larger than 1000 bytes") as err:
        client.complete({"prompt": "p"})  # by its Content-Length, before reading it
    assert "BBB" not in str(err.value)
    server.script = [{"stream": 64 << 20}]  # 64 MiB without a Content-Length
    start = time.monotonic()
    with pytest.raises(EndpointError, match="answer larger than 1000 bytes"):
        client.complete({"prompt": "p"})
    time.sleep(0.2)
    assert time.monotonic() - start < 3 and server.sent < 8 << 20  # stopped reading early


def test_a_slow_server_times_out_and_is_not_retried(server):
    server.script = [{"delay": 2.0}]
    start = time.monotonic()
    with pytest.raises(EndpointError, match=r"no answer within 0.3 s"):
        _client(server, timeout_s=0.3).complete({"prompt": "p"})
    assert time.monotonic() - start < 1.5 and len(server.seen) == 1
    server.script = [{"drip": 0.05}]  # headers at once, then one byte every 50 ms
    start = time.monotonic()
    with pytest.raises(EndpointError, match=r"not read within 0.5 s"):
        _client(server, timeout_s=0.5).complete({"prompt": "p"})
    assert time.monotonic() - start < 2.0


def test_bearer_token_models_and_chat(server, monkeypatch):
    monkeypatch.setenv("ENDPOINT_TEST_KEY", "tok-secret-9")
    client = _client(server, api_key_env="ENDPOINT_TEST_KEY")
    assert client.models() == ["m1", "m2"] and client.api == server.url + "/v1"
    server.script = [{"body": {"choices": [{"message": {"content": "hi"}}]}}]
    assert client.complete({"messages": []}, chat=True) == "hi"
    assert [s[2] for s in server.seen] == ["/v1/models", "/v1/chat/completions"]
    assert {s[4]["Authorization"] for s in server.seen} == {"Bearer tok-secret-9"}
    assert "tok-secret" not in repr(client)
    server.script = [{"body": b"<html>not json</html>"}]
    with pytest.raises(EndpointError, match="not an OpenAI completions answer"):
        client.complete({"prompt": "p"})


def test_unreachable_is_retried_then_named():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = EndpointClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
    with pytest.raises(EndpointError, match=rf"cannot reach http://127.0.0.1:{port}/v1/models"):
        client.models()


def test_plain_http_only_to_loopback_unless_allowed():
    with pytest.raises(EndpointError, match="plain http to 10.0.0.7"):
        EndpointClient("http://10.0.0.7:8000")
    assert EndpointClient("http://10.0.0.7:8000/v1/", plain_http_anywhere=True).api == (
        "http://10.0.0.7:8000/v1"
    )


def test_the_ledger_client_sends_once_and_caps_answers(server, monkeypatch):
    from privcode.privacy import ledger_client
    from privcode.privacy.ledger_client import RemoteLedger

    server.script = [{"status": 503, "body": {"error": "down"}}] * 3
    with pytest.raises(LedgerUnavailableError, match=r"describe\(\) with HTTP 503"):
        RemoteLedger(server.url, "t" * 32).call("describe")
    assert len(server.seen) == 1  # a call the server may have applied is never repeated
    assert server.seen[0][4]["Authorization"] == "Bearer " + "t" * 32
    monkeypatch.setattr(ledger_client, "MAX_ANSWER_BYTES", 100)
    server.script = [{"body": {"result": "r" * 500}}]
    with pytest.raises(
        LedgerUnavailableError, match=r"usable answer \(.*answer larger than 100 bytes"
    ):
        RemoteLedger(server.url, "t" * 32).call("describe")
    server.script = [{"body": {"result": {"ok": 1}}}]
    assert RemoteLedger(server.url, "t" * 32).call("describe") == {"ok": 1}


def test_requests_is_imported_in_one_module():
    root = Path(http.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if "requests" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(n == "requests" or n.startswith("requests.") for n in names):
                importers.add(path.relative_to(root.parent).as_posix())
    assert importers == {"privcode/http.py"}
