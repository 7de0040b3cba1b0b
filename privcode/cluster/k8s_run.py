"""``make submit-job TARGET=k8s`` through the privcode operator: a PrivCodeRun, followed.

Where the cluster serves the PrivCodeRun resource (the chart's CRDs and
operator are installed), a submission is a PrivCodeRun rather than a RayJob:
the operator admits it against the privacy store before any pod exists
(:mod:`privcode.operator`), and only then creates the RayJob. The run needs
its records on a claim (``--data-claim``, ``--data-path``): admission is on
the records. :func:`follow_run` prints the run's phase and epsilon as they
change, until it ends (Succeeded, Failed or Refused).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import IO, Any

from privcode.errors import PrivcodeError

__all__ = ["RUN_API", "follow_run", "operator_installed", "run_manifest", "submit_run"]

#: group, version, plural of the PrivCodeRun CRD (charts/privcode/crds/).
RUN_API = ("privcode.dev", "v1alpha1", "privcoderuns")
_ENDED = ("Succeeded", "Failed", "Refused")


def operator_installed(api_client: Any) -> bool:
    """Whether the cluster serves PrivCodeRuns (API discovery of the group)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    group, version, plural = RUN_API
    try:
        found = client.CustomObjectsApi(api_client).get_api_resources(group, version)
    except ApiException:
        return False
    return any(r.name == plural for r in (found.resources or ()))


def run_manifest(
    config: str | Path,
    overrides: list[str],
    *,
    name: str,
    data_claim: str,
    data_path: str,
    epsilon: float,
    stages: list[str],
) -> dict[str, Any]:
    """The PrivCodeRun of a submission (``privacy.*`` overrides are the operator's to set)."""
    own = [o for o in overrides if not o.startswith(("privacy.", "train.epsilon"))]
    if len(own) != len(overrides):
        raise PrivcodeError(
            "submit-job through the operator: privacy.* and train.epsilon are set by the "
            "PrivCodeRun (its spec.privacy), not by --set"
        )
    return {
        "apiVersion": f"{RUN_API[0]}/{RUN_API[1]}",
        "kind": "PrivCodeRun",
        "metadata": {"name": name},
        "spec": {
            "config": {"inline": Path(config).read_text(encoding="utf-8")},
            "data": {"claimName": data_claim, "path": data_path},
            "privacy": {"epsilon": float(epsilon)},
            **({"stages": stages} if stages else {}),
            **({"overrides": own} if own else {}),
        },
    }


def submit_run(api_client: Any, run: dict[str, Any], namespace: str) -> str:
    """Create the PrivCodeRun; its name."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    group, version, plural = RUN_API
    try:
        client.CustomObjectsApi(api_client).create_namespaced_custom_object(
            group, version, namespace, plural, run
        )
    except ApiException as exc:
        raise PrivcodeError(
            f"creating PrivCodeRun {run['metadata']['name']} in {namespace}: HTTP {exc.status} "
            f"{exc.reason}"
        ) from None
    return run["metadata"]["name"]


def follow_run(
    api_client: Any,
    name: str,
    namespace: str,
    *,
    timeout_s: float = 86400.0,
    poll_s: float = 5.0,
    out: IO[str] | None = None,
) -> dict[str, Any]:
    """Poll the run until it ends; ``{"status": phase, "epsilon": ..., "message": ...}``
    (progress on ``out``, default the current standard error)."""
    from kubernetes import client

    out = out or sys.stderr
    group, version, plural = RUN_API
    api = client.CustomObjectsApi(api_client)
    deadline, seen = time.monotonic() + timeout_s, None
    while True:
        run = api.get_namespaced_custom_object(group, version, namespace, plural, name)
        status = run.get("status") or {}
        phase, eps = status.get("phase", "Pending"), status.get("epsilon") or {}
        if (phase, eps.get("spent")) != seen:
            seen = (phase, eps.get("spent"))
            print(f"PrivCodeRun {name}: {phase}, epsilon spent {eps.get('spent', 0)}", file=out)
        if phase in _ENDED:
            conditions = status.get("conditions") or [{}]
            return {
                "name": name,
                "status": phase.upper(),
                "epsilon": eps,
                "message": conditions[-1].get("message", ""),
            }
        if time.monotonic() > deadline:
            return {"name": name, "status": phase.upper(), "timed_out": True, "epsilon": eps}
        time.sleep(poll_s)
