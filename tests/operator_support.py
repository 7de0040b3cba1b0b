"""A Kubernetes API mock (kmock) and the privacy store's ledger service, both on 127.0.0.1,
and the privcode operator running against them in a thread: the whole loop, no cluster."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

RESOURCES = {
    "privcode.dev/v1alpha1/privcoderuns": ("PrivCodeRun", True, ["status"]),
    "privcode.dev/v1alpha1/privacybudgets": ("PrivacyBudget", True, ["status"]),
    "privcode.dev/v1alpha1/privacybudgetraises": ("PrivacyBudgetRaise", True, ["status"]),
    "ray.io/v1/rayjobs": ("RayJob", True, ["status"]),
    "v1/configmaps": ("ConfigMap", True, []),
    "v1/events": ("Event", True, []),
    "v1/namespaces": ("Namespace", False, []),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, []),
}
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]
NS = "ns1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def kube_api() -> Iterator[str]:
    """A kmock KubernetesEmulator serving RESOURCES; its URL."""
    import kmock
    from kmock._internal import apps, enums

    class ApiServer(kmock.KubernetesEmulator):
        """The emulator plus what an API server does on create: a name for generateName
        (kopf's Events), the namespace of the URL, a uid and a resourceVersion."""

        async def _handle(self, request: Any) -> Any:
            if request.action == enums.action.CREATE and isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
                if request.namespace and not meta.get("namespace"):
                    meta["namespace"] = request.namespace
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("resourceVersion", "1")
            return await super()._handle(request)

    started, stop, box = threading.Event(), threading.Event(), {}

    async def serve() -> None:
        async with ApiServer() as k, apps.Server(k):
            for key, (kind, namespaced, sub) in RESOURCES.items():
                k.resources[key] = {
                    "kind": kind,
                    "namespaced": namespaced,
                    "subresources": sub,
                    "verbs": VERBS,
                }
            box["url"] = str(k.url).rstrip("/")
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(20), "kmock did not start"
    try:
        yield box["url"]
    finally:
        stop.set()
        thread.join(10)


@contextmanager
def ledger_service(root: Path, tokens: dict[str, str], **limits: Any) -> Iterator[str]:
    """The store at ``root`` served by its ledger service (``limits``: build_ledger_app's);
    its URL."""
    import uvicorn

    from privcode.privacy.ledger import StoreLedger
    from privcode.privacy.ledger_service import build_ledger_app

    ledger = StoreLedger(root)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_ledger_app(ledger, tokens, **limits),
            host="127.0.0.1",
            port=port,
            log_level="error",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "the ledger service did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        ledger.close()


@contextmanager
def operator(
    url: str,
    store: Path,
    data_root: Path,
    template: dict[str, Any],
    artifacts_root: Path | None = None,
    metrics: Any = None,
) -> Iterator[None]:
    """``privcode operator`` against ``url`` in a thread, until the block ends."""
    from privcode.operator.cli import run_operator

    stop, ready, errors = threading.Event(), threading.Event(), []

    def run() -> None:
        try:
            run_operator(
                store=str(store),
                data_root=str(data_root),
                template=template,
                namespaces=[NS],
                server=url,
                poll_s=0.5,
                artifacts_root=str(artifacts_root) if artifacts_root else None,
                metrics=metrics,
                stop=stop,
                ready=ready,
            )
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), f"the operator did not start: {errors}"
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors


class Kube:
    """A few calls against the mock API (plain HTTP, as kubectl would make them)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _path(self, resource: str, name: str = "") -> str:
        group_version, plural = resource.rsplit("/", 1)
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        return f"{self.url}{base}/namespaces/{NS}/{plural}" + (f"/{name}" if name else "")

    def create(self, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = requests.post(self._path(resource), json=body, timeout=10)
        assert reply.status_code in (200, 201), reply.text
        return reply.json()

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        reply = requests.get(self._path(resource, name), timeout=10)
        return reply.json() if reply.status_code == 200 else None

    def list(self, resource: str) -> list[dict[str, Any]]:
        return requests.get(self._path(resource), timeout=10).json().get("items", [])

    def patch_status(self, resource: str, name: str, status: dict[str, Any]) -> None:
        reply = requests.patch(
            self._path(resource, name) + "/status",
            data=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
            timeout=10,
        )
        assert reply.status_code == 200, reply.text

    def delete(self, resource: str, name: str) -> None:
        requests.delete(self._path(resource, name), timeout=10)

    def wait_list(self, resource: str, check: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.time() + timeout
        while not (found := [o for o in self.list(resource) if check(o)]):
            assert time.time() < deadline, f"{resource}: none matched; {self.list(resource)}"
            time.sleep(0.2)
        return found

    def wait_gone(self, resource: str, name: str, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while self.get(resource, name) is not None:
            assert time.time() < deadline, f"{resource}/{name} was not deleted"
            time.sleep(0.2)

    def wait(self, resource: str, name: str, check: Any, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.time() + timeout
        while True:
            obj = self.get(resource, name)
            if obj is not None and check(obj):
                return obj
            assert time.time() < deadline, f"{resource}/{name}: timed out; last {obj}"
            time.sleep(0.2)
