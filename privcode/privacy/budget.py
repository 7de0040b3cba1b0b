"""The privacy store seen from a terminal: `privcode budget show | raise | wipe`.

Every call goes through the store's one writer: the ledger actor when this
process is connected to Ray (a Serve replica) or a cluster holds the store
(``RAY_ADDRESS`` or the local head), else the ledger as a plain object in
this process for the length of the call (it takes the store's lock, so it
can never run beside an actor). What is
printed is aggregates only: the budget, per group of records the jobs that
trained on them, their number and epsilon (RDP and PRV), and the jobs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from privcode.errors import LedgerUnavailableError, PrivcodeError
from privcode.privacy.ledger import StoreLedger
from privcode.privacy.ledger_actor import ledger_call, open_ledger
from privcode.privacy.store import PrivacyStore

__all__ = ["call", "format_show", "wipe"]


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@contextlib.contextmanager
def _ledger(root: Path) -> Iterator[Any]:
    """(kind, ledger): the actor inside a Ray process or when a cluster holds the store, else
    a plain one here for the length of the call."""
    if _ray_initialized():  # a Serve replica, a stage: the cluster's one writer
        yield "actor", open_ledger(root)
        return
    try:
        plain = StoreLedger(root)
    except LedgerUnavailableError as exc:
        if "another ledger holds" not in str(exc):
            raise
        from privcode.cluster.local import connect

        connect(os.environ.get("RAY_ADDRESS") or "auto")  # the cluster whose actor holds it
        yield "actor", open_ledger(root)
        return
    try:
        yield "plain", plain
    finally:
        plain.close()


def call(root: str | os.PathLike, method: str, *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)`` on the store's one writer (module docstring)."""
    path = Path(root).resolve()
    if method == "show" and not (path / "ledger.wal").exists():
        raise PrivcodeError(f"no privacy store ledger at {path} (no DP job has trained there)")
    with _ledger(path) as (kind, ledger):
        if kind == "plain":
            return getattr(ledger, method)(*args, **kwargs)
        return ledger_call(ledger, method, *args, **kwargs)


def wipe(root: str | os.PathLike, confirm: str) -> Path:
    """Delete a local store (every budget and key in it) when ``confirm`` is its path.

    For demo stores: it is the one way to get a fresh budget, so it must be
    asked for by name. Refused while a ledger holds the store.
    """
    path = Path(root).resolve()
    if not (path / "ledger.wal").exists() and not (path / "dataset-id.key").exists():
        raise PrivcodeError(f"{path} is not a privacy store")
    if Path(confirm).resolve() != path:
        raise PrivcodeError(
            f"wiping the privacy store deletes every record's spent budget; repeat its path "
            f"to confirm: --confirm {path}"
        )
    try:
        fd = PrivacyStore(path).lock_writer()
    except LedgerUnavailableError:
        raise PrivcodeError(
            f"a ledger holds {path}: stop the cluster using it first (make ray-down)"
        ) from None
    try:
        shutil.rmtree(path)
    finally:
        os.close(fd)
    return path


def format_show(shown: dict[str, Any], max_groups: int = 20) -> str:
    """``privcode budget show`` as text."""
    b = shown["budget"]
    lines = [f"privacy store {shown['store']} (id {shown['store_id']})"]
    if b is None:
        return "\n".join([*lines, "  no budget yet: the first DP job sets it"])
    lines.append(
        f"  budget: epsilon {b['epsilon']:g} per record at delta {b['delta']:g} ({b['accountant']})"
    )
    lines.append(
        f"  worst record: epsilon {shown['epsilon_spent']:.4g} spent, "
        f"{shown['epsilon_left']:.4g} left; {shown['records']} records trained on"
    )
    lines.append(f"  record groups (records trained on by the same jobs): {len(shown['groups'])}")
    for g in shown["groups"][:max_groups]:
        eps = g["epsilon"]
        prv = "n/a" if eps.get("prv") is None else f"{eps['prv']:.4g}"
        lines.append(
            f"    {g['records']:>8} records  epsilon rdp {eps.get('rdp') or 0:.4g}  prv {prv}  "
            f"jobs {', '.join(g['jobs']) or '-'}"
        )
    if len(shown["groups"]) > max_groups:
        lines.append(f"    ... {len(shown['groups']) - max_groups} more (--json lists all)")
    lines.append(f"  jobs: {len(shown['jobs'])}")
    for j in shown["jobs"]:
        p = j["plan"]
        kind = " (imported run ledger)" if j["imported"] else ""
        lines.append(
            f"    {j['job']}  run {j['run'] or '-'}  {j['status']}{kind}  {j['records']} records  "
            f"{j['steps_granted']}/{p['steps']} steps at sigma {p['noise_multiplier']:.4g}, "
            f"q {p['sample_rate']:.4g}"
        )
    for w in shown.get("pac", []):
        lines.append(
            f"  PAC worlds {w['worlds']}: m={w['m']}, {w['allowance_nats']:g} nats allowed "
            f"(data budget {w['dataset_budget_nats']:g}), scope {w['scope']}"
        )
    return "\n".join(lines)
