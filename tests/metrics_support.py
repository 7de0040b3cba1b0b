"""Read Ray's Prometheus metrics from the session cluster's nodes (tests only)."""

from __future__ import annotations

import time
import urllib.request


def scrape_metrics(tag: str, names: set[str], timeout_s: float = 60.0) -> dict[str, float]:
    """The latest value of each metric in ``names`` on a line holding ``tag`` (e.g.
    ``run="r1"``); waits up to ``timeout_s`` for all of them to be exported."""
    import ray

    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]
    found: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    name = line.split("{", 1)[0]
                    if name in names and tag in line:
                        found[name] = float(line.rsplit(" ", 1)[1])
        if set(found) == names:
            return found
        time.sleep(1.0)
    raise AssertionError(f"metrics {sorted(names - set(found))} not exported within {timeout_s}s")
