"""The store's ledger as one named Ray actor: start or find it, call it, stop it.
Design notes: docs/privacy.md, "privcode/privacy/ledger_actor.py".

:func:`open_ledger` gets or starts ``privcode-store:<store id>`` (namespace
:data:`LEDGER_NAMESPACE`; detached, restarted by Ray without limit, each start rebuilding
:class:`~privcode.privacy.ledger.StoreLedger` from the store and taking its lock). Calls are
serialised, so reservations can never overshoot together; a call in flight when the actor dies is
re-sent (:data:`MAX_TASK_RETRIES`), a logged grant answered from the log by its ``request_id``.
With ``PRIVCODE_LEDGER_URL`` set, every helper uses
:class:`~privcode.privacy.ledger_client.RemoteLedger` instead and no actor starts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from privcode.errors import LedgerConflictError, LedgerUnavailableError, PrivcodeError
from privcode.privacy.authority import AuthorityError
from privcode.privacy.ledger import StoreLedger
from privcode.privacy.ledger_client import RemoteLedger, remote_ledger
from privcode.privacy.store import PrivacyStore

__all__ = [
    "LEDGER_NAMESPACE",
    "close_ledger",
    "get_ledger",
    "ledger_call",
    "ledger_name",
    "open_ledger",
    "store_id",
]

log = logging.getLogger("privcode.ledger")

LEDGER_NAMESPACE = "privcode"
#: Retries of a call that was in flight when the actor died (bounded: a call that
#: itself kills the actor cannot loop forever).
MAX_TASK_RETRIES = 5


class StoreLedgerActor(StoreLedger):
    """The ledger as Ray runs it: with its metrics on the node's Prometheus endpoint.

    Gauges ``privcode_epsilon_spent`` (the store's worst record) and
    ``privcode_epsilon_budget``, Counter ``privcode_dp_steps``, tagged ``store``
    (the store's keyed id); numbers only. OPERATOR-ONLY: they compose every job
    on the store, so one record an earlier job trained on moves them while a
    release's epsilon stays; they belong with ``privcode budget show`` inside the
    privacy boundary, never on a dashboard, scrape or alert shared outside it.
    """

    def _make_metrics(self) -> dict[str, Any] | None:
        try:
            from ray.util.metrics import Counter, Gauge

            tags = ("store",)
            metrics = {
                "spent": Gauge(
                    "privcode_epsilon_spent", "Epsilon of the store's worst record.", tag_keys=tags
                ),
                "budget": Gauge(
                    "privcode_epsilon_budget", "Per-record epsilon budget.", tag_keys=tags
                ),
                "steps": Counter("privcode_dp_steps", "DP-SGD steps granted.", tag_keys=tags),
            }
            for metric in metrics.values():
                metric.set_default_tags({"store": self.store_id})
            return metrics
        except Exception as exc:  # noqa: BLE001 - metrics are optional; accounting is not
            log.warning("ledger metrics unavailable (%s)", exc)
            return None


def ledger_name(store_id: str) -> str:
    """Name of a store's ledger actor (in namespace :data:`LEDGER_NAMESPACE`)."""
    return f"privcode-store:{store_id}"


def store_id(root: str | os.PathLike) -> str:
    """A store's ledger id (:attr:`PrivacyStore.ledger_id`): a keyed HMAC, stable across mounts."""
    return PrivacyStore(root).ledger_id


def open_ledger(store_root: str | os.PathLike, *, timeout_s: float = 120.0) -> Any:
    """Get or start the store's ledger actor; returns its handle once it has restored.

    Raises :class:`LedgerUnavailableError` when Ray is not initialised, the
    store cannot be written or restored, another writer holds it, or the
    actor does not answer within ``timeout_s``. The store must be reachable
    at the same path from every node the actor may run on.
    """
    import ray

    root = Path(store_root).expanduser().resolve()
    if (remote := remote_ledger()) is not None:
        return _checked(remote, store_id(root), timeout_s)
    if not ray.is_initialized():
        raise LedgerUnavailableError(
            "Ray is not initialized: connect first (privcode.cluster.local.connect)"
        )
    name = ledger_name(store_id(root))
    actor_cls = ray.remote(StoreLedgerActor).options(
        name=name,
        namespace=LEDGER_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=MAX_TASK_RETRIES,
        num_cpus=0,
    )
    try:
        handle = actor_cls.remote(str(root))
        info = ray.get(handle.describe.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LedgerUnavailableError(
            f"the privacy store's ledger did not answer within {timeout_s:g}s; nothing may train"
        ) from None
    except ray.exceptions.RayError as exc:
        raise _unavailable(f"the ledger of the privacy store {root}", exc) from None
    if info.get("root") != str(root):
        raise LedgerConflictError(f"ledger {name!r} serves {info.get('root')}, not {root}")
    if info.get("failed"):
        raise LedgerUnavailableError(
            f"the privacy store's ledger is unusable: {info['failed']} (close_ledger stops it; "
            "the next open rebuilds it from the store)"
        )
    return handle


def _checked(remote: RemoteLedger, expected: str, timeout_s: float) -> RemoteLedger:
    """``remote`` once it answers as the ledger of store ``expected`` (its keyed id)."""
    info = remote.call("describe", timeout_s=timeout_s)
    if info.get("store_id") != expected:
        raise LedgerConflictError(
            f"the ledger at {remote.url} serves store {info.get('store_id')}, not {expected}"
        )
    if info.get("failed"):
        raise LedgerUnavailableError(f"the privacy store's ledger is unusable: {info['failed']}")
    return remote


def _unavailable(context: str, exc: BaseException) -> PrivcodeError:
    """The ledger error behind a Ray error (the actor's own message when there is one)."""

    text = str(exc)
    for cls in (AuthorityError, LedgerConflictError, LedgerUnavailableError):
        marker = f"{cls.__name__}: "
        if marker in text:
            return cls(text.rsplit(marker, 1)[1].strip().splitlines()[0])
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    detail = lines[0] if lines else type(exc).__name__
    return LedgerUnavailableError(
        f"{context} cannot be reached or restored ({type(exc).__name__}: {detail[:300]}); "
        "nothing may train"
    )


def ledger_call(
    handle: Any, method: str, *args: Any, timeout_s: float = 120.0, **kwargs: Any
) -> Any:
    """``ray.get(handle.<method>.remote(...))``; every Ray error becomes a ledger error."""
    if isinstance(handle, RemoteLedger):
        return handle.call(method, *args, timeout_s=timeout_s, **kwargs)
    import ray

    try:
        return ray.get(getattr(handle, method).remote(*args, **kwargs), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LedgerUnavailableError(
            f"the ledger did not answer {method}() within {timeout_s:g}s; nothing may train"
        ) from None
    except ray.exceptions.RayError as exc:
        raise _unavailable("the ledger", exc) from None


def get_ledger(name: str) -> Any:
    """Handle of a running ledger by its actor name (:func:`ledger_name`), for Ray Train
    workers and tasks, which need not read the store; no creation."""
    if (remote := remote_ledger()) is not None:
        return _checked(remote, name.removeprefix("privcode-store:"), 120.0)
    import ray

    try:
        return ray.get_actor(name, namespace=LEDGER_NAMESPACE)
    except ValueError:
        raise LedgerUnavailableError(
            f"no privacy store ledger is running as {name!r}; open_ledger must run first"
        ) from None


def close_ledger(store_root: str | os.PathLike) -> bool:
    """Stop a store's ledger actor (its files stay); True if one was running."""
    if remote_ledger() is not None:
        return False  # a ledger Deployment: stopped with it, never from a client
    import ray

    name = ledger_name(store_id(Path(store_root).expanduser().resolve()))
    try:
        handle = ray.get_actor(name, namespace=LEDGER_NAMESPACE)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    return True
