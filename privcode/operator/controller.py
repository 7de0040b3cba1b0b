"""The kopf controller: PrivCodeRuns admitted before any pod exists, their status mirrored.

Built on kopf (the Python operator framework: watches, retries, finalizers,
Events and status patches are kopf's), with the ``kubernetes`` client for
the children. Handlers (registered on :func:`build_registry`'s registry):

* a run is created, or found again after the operator restarted: unless its
  status already names its RayJob (idempotent), its spec is parsed, its plan
  reserved in the privacy store (:func:`~privcode.operator.admission.admit_run`),
  and only then are its ConfigMap and RayJob created, owned by the run. A
  run that does not fit is ``Refused`` with a condition and a Warning Event
  saying what is spent and left, and nothing is created for it. The ledger
  answers one call at a time, so of two runs racing for the last budget
  exactly one is admitted;
* every ``poll_s``, an admitted run's RayJob status becomes its phase
  (Running, Succeeded, Failed) and its grants its ``epsilon.spent``; once
  it ends, its ledger jobs are finished (the unused reservation released);
* a deleted run finishes its ledger jobs: what was granted stays spent.
* a PrivacyBudget mirrors the store: its budget, its worst record's epsilon
  and what is left (the operator's view);
* a PrivacyBudgetRaise carries a grant signed by the store's authority (the
  data owner's approval, ``privcode budget sign-raise``): the operator hands
  it to the ledger once, which checks the signature and logs who and why;
  ``Applied`` or ``Refused`` (a forged, replayed or foreign grant).

The ledger is reached as everywhere else (:mod:`privcode.privacy.ledger_client`:
``PRIVCODE_LEDGER_URL`` with the operator's token on a cluster).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from privcode.dp.accounting import DPEvent, epsilon
from privcode.errors import LedgerConflictError, LedgerUnavailableError, PrivcodeError
from privcode.operator import admission as adm
from privcode.operator.children import child_name, config_map_for, rayjob_for
from privcode.operator.progress import run_progress
from privcode.operator.spec import (
    BUDGET_PLURAL,
    GROUP,
    RAISE_PLURAL,
    RUN_PLURAL,
    VERSION,
    parse_run,
)
from privcode.privacy.authority import AuthorityError
from privcode.registry import STAGES

__all__ = ["OperatorConfig", "build_registry"]

log = logging.getLogger("privcode.operator")

RAY = ("ray.io", "v1", "rayjobs")
_ENDED = {"Refused", "Failed", "Succeeded"}


@dataclass
class OperatorConfig:
    """What the controller needs (``privcode operator`` fills it from its flags)."""

    store: str  #: the privacy store (mounted read-only: keys for record identities)
    data_root: str  #: where data claims are mounted (``<data_root>/<claim>``)
    template: dict[str, Any]  #: the chart's RayJob, rendered (children.rayjob_for)
    api: Any  #: a kubernetes.client.ApiClient
    poll_s: float = 10.0
    #: The artifacts volume, read-only at the Ray pods' path (None: no stage progress).
    artifacts_root: str | None = None
    delta: float = 1e-5
    accountant: str = "rdp"
    metrics: Any = None  #: an OperatorMetrics (None: none kept)
    extra: dict[str, Any] = field(default_factory=dict)


def _condition(kind: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True", "reason": reason, "message": message[:1000]}


def _create(create: Any, *args: Any) -> None:
    """Create a child; one that exists already (a retried handler) is kept."""
    from kubernetes.client.exceptions import ApiException

    try:
        create(*args)
    except ApiException as exc:
        if exc.status != 409:
            raise kopf.TemporaryError(f"creating a child: HTTP {exc.status}", delay=15) from None


def _config_maps(cfg: OperatorConfig, namespace: str, spec: Any) -> dict[str, dict[str, str]]:
    ref = (spec.get("config") or {}).get("configMapRef")
    if not ref:
        return {}
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        found = client.CoreV1Api(cfg.api).read_namespaced_config_map(ref.get("name"), namespace)
    except ApiException:
        return {}
    return {ref.get("name"): dict(found.data or {})}


def admit(body: Any, spec: Any, meta: Any, status: Any, patch: Any, memo: Any, **_: Any) -> None:
    """Create/resume: admit, then create the children (module docstring)."""
    cfg: OperatorConfig = memo.config
    if status.get("phase") in _ENDED or status.get("rayJob"):
        return  # decided before (a resumed operator): never a second reservation
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    try:
        run = parse_run(spec, _config_maps(cfg, namespace, spec))
        decided = adm.admit_run(
            run,
            name=name,
            namespace=namespace,
            uid=uid,
            store_root=cfg.store,
            data_root=cfg.data_root,
        )
    except LedgerUnavailableError as exc:
        raise kopf.TemporaryError(f"privacy ledger unavailable: {exc}", delay=30) from None
    except (PrivcodeError, OSError, ValueError) as exc:
        message = f"{type(exc).__name__}: {exc}"[:1000]
        patch.status.update(
            phase="Failed", conditions=[_condition("Failed", "InvalidRun", message)]
        )
        kopf.warn(body, reason="InvalidRun", message=message)
        _count(cfg, "admissions", "invalid", uid, "Failed")
        return
    requested = {"requested": run.epsilon, "planned": decided.epsilon_planned, "spent": 0.0}
    if not decided.admitted:
        patch.status.update(
            phase="Refused",
            epsilon=requested,
            conditions=[_condition("Refused", "PrivacyBudget", decided.message)],
        )
        kopf.warn(body, reason="Refused", message=decided.message)
        _count(cfg, "admissions", "refused", uid, "Refused")
        return
    child = child_name(name, uid)
    _make_children(cfg, body, run, child, decided.run_key)
    patch.status.update(
        phase="Admitted",
        rayJob=child,
        epsilon=requested,
        conditions=[_condition("Admitted", "PrivacyBudget", decided.message)],
    )
    kopf.info(body, reason="Admitted", message=decided.message)
    # a handler retried after its reservation was logged finds it, and reserves nothing more
    _count(cfg, "admissions", "admitted" if decided.job else "reserved-before", uid, "Admitted")


def _count(cfg: OperatorConfig, kind: str, label: str, uid: str, phase: str | None) -> None:
    """Update the operator's metrics (if kept) for one event of run ``uid``."""
    m = cfg.metrics
    if m is None:
        return
    if kind == "admissions":
        m.admissions.labels(result=label).inc()
    elif kind == "errors":
        m.errors.labels(handler=label).inc()
    if phase is not None or kind == "gone":
        m.phase(uid, phase)


def _make_children(cfg: OperatorConfig, body: Any, run: Any, child: str, key: str) -> None:
    from kubernetes import client

    namespace = body["metadata"]["namespace"]
    data_file = run.data_file(cfg.data_root)
    overrides = adm.run_overrides(run, body["metadata"]["name"], key, data_file)
    config_map = config_map_for(body, f"{child}-config", run.config)
    job = rayjob_for(
        cfg.template,
        body,
        name=child,
        config_map=f"{child}-config",
        data_claim=run.data_claim,
        data_mount=f"{cfg.data_root.rstrip('/')}/{run.data_claim}",
        overrides=overrides,
        queue_name=run.queue_name,
    )
    core, custom = client.CoreV1Api(cfg.api), client.CustomObjectsApi(cfg.api)
    _create(core.create_namespaced_config_map, namespace, config_map)
    _create(custom.create_namespaced_custom_object, *RAY[:2], namespace, RAY[2], job)


def _job_phase(job: dict[str, Any] | None) -> str:
    if job is None:
        return "Failed"
    st = job.get("status") or {}
    status, deploy = str(st.get("jobStatus", "")).upper(), str(st.get("jobDeploymentStatus", ""))
    if status == "SUCCEEDED":
        return "Succeeded"
    if status in ("FAILED", "STOPPED") or deploy in ("Failed", "ValidationFailed"):
        return "Failed"
    return "Running" if status == "RUNNING" else "Admitted"


def _spent(history: list[dict[str, Any]], cfg: OperatorConfig) -> float:
    events = [DPEvent.from_dict(e) for e in history]
    return float(epsilon(events, cfg.delta, cfg.accountant)) if events else 0.0


def mirror(body: Any, meta: Any, status: Any, patch: Any, memo: Any, **_: Any) -> None:
    """Timer: the RayJob's state and the run's grants into the run's status."""
    cfg: OperatorConfig = memo.config
    if cfg.metrics is not None and status.get("phase"):
        cfg.metrics.phase(meta["uid"], status["phase"])
    if status.get("phase") in _ENDED or not status.get("rayJob"):
        return
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        job = client.CustomObjectsApi(cfg.api).get_namespaced_custom_object(
            *RAY[:2], meta["namespace"], RAY[2], status["rayJob"]
        )
    except ApiException as exc:
        if exc.status != 404:
            raise kopf.TemporaryError(f"reading the RayJob: HTTP {exc.status}", delay=15) from None
        job = None
    phase = _job_phase(job)
    key = adm.run_key_of(cfg.store, meta["namespace"], meta["name"], meta["uid"])
    try:
        if phase in ("Succeeded", "Failed"):
            spent = adm.release_run(cfg.store, key, f"run {phase.lower()}")
        else:
            spent = adm.run_spent(cfg.store, key)
    except (LedgerUnavailableError, LedgerConflictError) as exc:
        raise kopf.TemporaryError(f"privacy ledger: {exc}", delay=30) from None
    eps = dict(status.get("epsilon") or {})
    patch.status.update(
        epsilon={**eps, "spent": _spent(spent["history"], cfg)}, steps=spent["steps"]
    )
    if cfg.artifacts_root:
        _progress(cfg.artifacts_root, meta["name"], patch)
    if phase != status.get("phase"):
        patch.status["phase"] = phase
        ended = "RayJob gone" if job is None else f"RayJob {status['rayJob']}"
        patch.status["conditions"] = [_condition(phase, "RayJob", f"{ended}: {phase.lower()}")]
        kopf.info(body, reason=phase, message=f"{ended}: {phase.lower()}")


def _progress(root: str, name: str, patch: Any) -> None:

    found = run_progress(root, name, tuple(STAGES))
    patch.status["stages"] = found.stages
    if found.release_digest:
        patch.status["releaseDigest"] = found.release_digest
    if found.report:
        patch.status["report"] = found.report


def release(meta: Any, status: Any, memo: Any, **_: Any) -> None:
    """Delete: the run's ledger jobs finish (grants stay spent; the unused plan is freed)."""
    cfg: OperatorConfig = memo.config
    if cfg.metrics is not None:
        cfg.metrics.phase(meta["uid"], None)
    if not status.get("rayJob"):
        return  # refused or invalid: nothing was reserved
    key = adm.run_key_of(cfg.store, meta["namespace"], meta["name"], meta["uid"])
    try:
        adm.release_run(cfg.store, key, "run deleted")
    except LedgerUnavailableError as exc:
        raise kopf.TemporaryError(f"privacy ledger unavailable: {exc}", delay=30) from None


def mirror_budget(patch: Any, memo: Any, **_: Any) -> None:
    """Timer on PrivacyBudgets: the store's budget, worst record and what is left."""
    from privcode.privacy.ledger_actor import ledger_call, open_ledger

    cfg: OperatorConfig = memo.config
    try:
        shown = ledger_call(open_ledger(cfg.store), "show")
    except LedgerUnavailableError as exc:
        raise kopf.TemporaryError(f"privacy ledger unavailable: {exc}", delay=30) from None
    budget = shown.get("budget") or {}
    patch.status.update(
        budget=budget.get("epsilon"),
        delta=budget.get("delta"),
        worstRecordEpsilon=shown.get("epsilon_spent"),
        left=shown.get("epsilon_left"),
        jobs=len(shown.get("jobs") or ()),
    )


def apply_raise(body: Any, spec: Any, status: Any, patch: Any, memo: Any, **_: Any) -> None:
    """A PrivacyBudgetRaise: its signed grant to the ledger, once (module docstring)."""
    from privcode.privacy.ledger_actor import ledger_call, open_ledger

    cfg: OperatorConfig = memo.config
    if status.get("phase"):
        return  # applied or refused before: a grant raises once
    grant = dict(spec.get("grant") or {})
    message = dict(grant.get("message") or {})
    method = "pac_raise" if message.get("kind") == "pac" else "raise_budget"
    try:
        ledger_call(open_ledger(cfg.store), method, {**grant, "message": message})
    except LedgerUnavailableError as exc:
        raise kopf.TemporaryError(f"privacy ledger unavailable: {exc}", delay=30) from None
    except (AuthorityError, LedgerConflictError, PrivcodeError) as exc:
        text = str(exc)[:1000]
        patch.status.update(
            phase="Refused", message=text, conditions=[_condition("Refused", "Grant", text)]
        )
        kopf.warn(body, reason="RaiseRefused", message=text)
        return
    text = f"raised to {message.get('to')} by {message.get('who')}: {message.get('why')}"[:1000]
    patch.status.update(
        phase="Applied", message=text, conditions=[_condition("Applied", "Grant", text)]
    )
    kopf.info(body, reason="Raised", message=text)


def _counted(handler: Any, name: str) -> Any:
    """``handler``, its failures counted in the operator's metrics (kopf retries them)."""

    def run(**kwargs: Any) -> Any:
        try:
            return handler(**kwargs)
        except Exception:
            memo = kwargs.get("memo")
            cfg = getattr(memo, "config", None) if memo is not None else None
            if cfg is not None:
                _count(cfg, "errors", name, "", None)
            raise

    run.__name__ = run.__qualname__ = handler.__name__
    return run


def build_registry(poll_s: float = 10.0) -> kopf.OperatorRegistry:
    """A registry holding the controller's handlers (module docstring)."""
    registry = kopf.OperatorRegistry()
    admit_, mirror_, release_ = (_counted(f, f.__name__) for f in (admit, mirror, release))
    run = (GROUP, VERSION, RUN_PLURAL)
    kopf.on.create(*run, registry=registry, id="admit")(admit_)
    kopf.on.resume(*run, registry=registry, id="admit-resumed")(admit_)
    kopf.timer(*run, registry=registry, interval=poll_s, id="mirror")(mirror_)
    kopf.on.delete(*run, registry=registry, id="release")(release_)
    budget = (GROUP, VERSION, BUDGET_PLURAL)
    kopf.timer(*budget, registry=registry, interval=poll_s, id="mirror-budget")(mirror_budget)
    raises = (GROUP, VERSION, RAISE_PLURAL)
    kopf.on.create(*raises, registry=registry, id="apply-raise")(apply_raise)
    return registry
