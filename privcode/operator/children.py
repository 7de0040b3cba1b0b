"""The objects an admitted PrivCodeRun owns: its config ConfigMap and its RayJob.

The RayJob comes from the chart's own rendering: the chart renders its
pipeline RayJob once into the operator's template (``rayjob-template.yaml``
in the operator's ConfigMap), and :func:`rayjob_for` fills in one run: its
name, the run as controller owner (so deleting the run deletes its pods),
its config ConfigMap in place of the chart's, the data claim mounted
read-only at the same path the operator read it from (on the Ray pods only:
executors are Deployments of their own and never get it), and the run's
``--set`` overrides (``privacy.run_key`` among them) on the entrypoint.
"""

from __future__ import annotations

import copy
import re
import shlex
from collections.abc import Iterator, Mapping
from typing import Any

from privcode.operator.spec import GROUP, VERSION

__all__ = ["child_name", "config_map_for", "owner_reference", "rayjob_for"]

RUN_LABEL = f"{GROUP}/run"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
_CONFIG_VOLUME = "pipeline-config"


def child_name(run_name: str, uid: str) -> str:
    """A DNS-1035 name for the run's children (KubeRay derives longer ones from it)."""
    base = re.sub(r"[^a-z0-9-]", "-", run_name.lower()).strip("-")[:30] or "run"
    if not base[0].isalpha():
        base = "r-" + base[:28]
    return f"{base}-{uid.replace('-', '')[:8]}"


def owner_reference(run: Mapping[str, Any]) -> dict[str, Any]:
    meta = run["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PrivCodeRun",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(run: Mapping[str, Any], name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": run["metadata"]["namespace"],
        "labels": {RUN_LABEL: run["metadata"]["name"], "app.kubernetes.io/part-of": "privcode"},
        "ownerReferences": [owner_reference(run)],
    }


def config_map_for(run: Mapping[str, Any], name: str, config: str) -> dict[str, Any]:
    """The run's pipeline config, mounted where the chart mounts its own."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(run, name),
        "data": {"pipeline.yaml": config},
    }


def _pod_specs(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    cluster = job["spec"]["rayClusterSpec"]
    yield cluster["headGroupSpec"]["template"]["spec"]
    for group in cluster.get("workerGroupSpecs") or ():
        yield group["template"]["spec"]


def rayjob_for(
    template: Mapping[str, Any],
    run: Mapping[str, Any],
    *,
    name: str,
    config_map: str,
    data_claim: str,
    data_mount: str,
    overrides: list[str],
    queue_name: str = "",
) -> dict[str, Any]:
    """The run's RayJob from the chart's ``template`` (module docstring). With
    ``queue_name`` it is created suspended and labelled for that Kueue LocalQueue: Kueue
    unsuspends it when the queue's quota admits it (after the privacy admission)."""
    job = copy.deepcopy(dict(template))
    labels = {**(job.get("metadata", {}).get("labels") or {}), **_meta(run, name)["labels"]}
    if queue_name:
        labels[KUEUE_LABEL] = queue_name
    job["metadata"] = {**_meta(run, name), "labels": labels}
    spec = job["spec"]
    spec["entrypoint"] = " ".join(
        [spec["entrypoint"], *(f"--set {shlex.quote(o)}" for o in overrides)]
    )
    spec.pop("suspend", None)
    if queue_name:
        spec["suspend"] = True
    for pod in _pod_specs(job):
        volumes = pod.setdefault("volumes", [])
        for volume in volumes:
            if volume.get("name") == _CONFIG_VOLUME:
                volume["configMap"] = {"name": config_map}
        volumes.append(
            {
                "name": "run-data",
                "persistentVolumeClaim": {"claimName": data_claim, "readOnly": True},
            }
        )
        for container in pod["containers"]:
            mounts = container.setdefault("volumeMounts", [])
            mounts.append({"name": "run-data", "mountPath": data_mount, "readOnly": True})
    return job
