"""Test helpers for the served apps: a JSON HTTP client, Ray's Prometheus metrics."""

from __future__ import annotations

import json
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
