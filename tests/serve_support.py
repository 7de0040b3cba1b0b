"""Test helpers for the served apps: a JSON HTTP client, Ray's Prometheus metrics."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def scrape_metrics(
    tag: str,
    names: set[str],
    timeout_s: float = 60.0,
    until: Callable[[dict[str, float]], bool] | None = None,
) -> dict[str, float]:
    """The latest value of each metric in ``names`` on a line holding ``tag`` (e.g.
    ``run="r1"``); waits up to ``timeout_s`` for all of them to be exported and, with
    ``until``, for the values to satisfy it (exports are periodic: a first scrape may be
    stale). On timeout the last values are returned for the caller's assertions."""
    import ray

    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]
    found: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {}
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    name = line.split("{", 1)[0]
                    if name in names and tag in line:
                        found[name] = float(line.rsplit(" ", 1)[1])
        if set(found) == names and (until is None or until(found)):
            return found
        time.sleep(1.0)
    if set(found) == names and until is not None:
        return found
    raise AssertionError(f"metrics {sorted(names - set(found))} not exported within {timeout_s}s")


def http_status_of_refused_body(url, data, key=None, attempts=5):
    """The status a server answers to a POST of ``data`` that it refuses before reading all of it.

    Such a server answers and closes while the client is still sending, so the rest of the
    send fails (EPIPE or a reset), and a reset can also drop the answer: the answer is read
    after a failed send, and a request whose answer was lost is sent again.
    """
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    for _ in range(attempts):
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        try:
            try:
                conn.request("POST", parts.path, body=data, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                pass  # answered before the body was read: the answer may still be there
            return conn.getresponse().status
        except (ConnectionResetError, http.client.RemoteDisconnected):
            continue  # the answer was lost with the connection
        finally:
            conn.close()
    raise AssertionError(f"no answer to a refused body of {len(data)} bytes in {attempts} tries")


def http_json(url, body=None, key=None, method=None):
    """(status, decoded JSON) of one request; ``body`` a dict (sent as JSON) or raw bytes."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


#: A key long enough for the key ring (32+ characters).
TEST_KEY = "test-key-0123456789abcdef0123456789"


def limits(key=TEST_KEY, rps=1000.0, burst=1000, max_body_bytes=1 << 20, **keys):
    """Guard limits for an app under test: ``key`` as the client ``default`` (None: insecure,
    no keys) plus ``keys`` (principal -> key)."""
    from privcode.serve.api import Limits
    from privcode.serve.guard import KeyRing

    ring = {**({"default": key} if key else {}), **keys}
    return Limits(KeyRing(ring, insecure=not ring), rps, burst, max_body_bytes)


_CLIENTS: dict[int, object] = {}


def asgi_call(api, method, path, body=None, key=None, headers=None):
    """(status, JSON body, headers) of one request to a FastAPI app, in process (no server)."""
    from starlette.testclient import TestClient

    for name in ("httpx", "httpx2"):  # the test client's own request lines (URLs with ids)
        logging.getLogger(name).setLevel(logging.WARNING)
    client = _CLIENTS.get(id(api))
    if client is None or client.app is not api:
        client = _CLIENTS[id(api)] = TestClient(api, raise_server_exceptions=False)
    sent = dict(headers or {})
    if key:
        sent["authorization"] = f"Bearer {key}"
    if isinstance(body, bytes):
        sent.setdefault("content-type", "application/json")
        resp = client.request(method, path, content=body, headers=sent)
    elif body is None:
        resp = client.request(method, path, headers=sent)
    else:
        resp = client.request(method, path, json=body, headers=sent)
    try:
        data = resp.json()
    except ValueError:
        data = None
    return resp.status_code, data, resp.headers


def fuzz_openapi(api, examples=10, key=TEST_KEY):
    """Schemathesis over ``api``'s own /openapi.json, in process, ``examples`` per operation
    (positive and negative data): no 5xx, every answer as the schema says, bad input refused.
    (Driven with Hypothesis directly: schemathesis' pytest plugin does not run on pytest 9.)"""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    auth = {"Authorization": f"Bearer {key}"}
    schema = schemathesis.openapi.from_asgi("/openapi.json", api, headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    for op in operations:
        # Derandomized: the same examples on every run, so CI does not flake on a schema-valid
        # request the app rightly refuses for a reason no schema states (a prompt over the
        # model's context in tokens). More examples or random ones: a local run.
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def run(case):
            case.call_and_validate(headers=auth)

        run()
    return [f"{op.method.upper()} {op.path}" for op in operations]
