"""Submit the pipeline to Kubernetes as a KubeRay RayJob (``make submit-job TARGET=k8s``).
Design notes: docs/kubernetes.md, "privcode/cluster/k8s.py".

One source of truth for the manifests: the Helm chart. :func:`job_manifests` renders
``charts/privcode`` with ``helm template`` as a pipeline job (the local config inlined as
``pipeline.config``, the ``--set`` overrides as ``pipeline.overrides``): what ``helm install``
would create is exactly what this module sends. Before anything is created, the config is
validated locally, every custom resource is checked against its CRD's ``v1``
``openAPIV3Schema`` (an undeclared field is an error: the API server would prune it) and every
object is sent once with ``dryRun=All``, so a rejected object leaves nothing half-applied.
Then the objects are created in order (a PVC, ServiceAccount or Secret is kept; a running
RayJob of the same name is an error) and :func:`wait_for_rayjob` polls until the job ends.

"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from privcode.cluster import k8s_run
from privcode.cluster.jobs import repo_root
from privcode.config import load_config
from privcode.errors import PrivcodeError, import_extra

__all__ = [
    "KubeError",
    "ManifestError",
    "chart_dir",
    "crd_schema",
    "custom_resource_problems",
    "helm_binary",
    "job_manifests",
    "render_chart",
    "submit_manifests",
    "submit_pipeline_k8s",
    "unknown_fields",
    "validate_custom_resource",
    "wait_for_rayjob",
]

GROUP, VERSION = "ray.io", "v1"
#: kind -> CRD name, plural.
CUSTOM_KINDS = {
    "RayJob": ("rayjobs.ray.io", "rayjobs"),
    "RayCluster": ("rayclusters.ray.io", "rayclusters"),
    "RayService": ("rayservices.ray.io", "rayservices"),
}
#: Core kinds the job needs: kind -> (API class, method suffix, what to do when it exists).
CORE_KINDS = {
    "ServiceAccount": ("CoreV1Api", "service_account", "keep"),
    # the ledger's tokens (templates/ledger.yaml): an existing Secret is kept, so a resubmit
    # never changes the tokens the running ledger and pods hold
    "Secret": ("CoreV1Api", "secret", "keep"),
    "ConfigMap": ("CoreV1Api", "config_map", "replace"),
    "PersistentVolumeClaim": ("CoreV1Api", "persistent_volume_claim", "keep"),
    "NetworkPolicy": ("NetworkingV1Api", "network_policy", "replace"),
    # the sandbox executor (the chart's templates/executor.yaml): where generated code runs
    "Service": ("CoreV1Api", "service", "replace"),
    "Deployment": ("AppsV1Api", "deployment", "replace"),
}
APPLY_ORDER = (
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "PersistentVolumeClaim",
    "NetworkPolicy",
    "Service",
    "Deployment",
    "RayJob",
)
#: RayJob jobStatus values after which the job does not change any more.
TERMINAL_JOB = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
TERMINAL_DEPLOYMENT = frozenset({"Complete", "Failed"})
FIELD_MANAGER = "privcode"
#: Keys the API server keeps at a resource's root and in an embedded resource
#: (``x-kubernetes-embedded-resource``) whatever the schema says; it checks metadata itself.
RESOURCE_KEYS = frozenset({"apiVersion", "kind", "metadata"})


class KubeError(PrivcodeError):
    """Talking to the cluster failed, or it lacks what the job needs (KubeRay)."""


class ManifestError(PrivcodeError, ValueError):
    """A rendered manifest is invalid; the message names the object and the field."""


# --------------------------------------------------------------------------- rendering


def chart_dir() -> Path:

    return repo_root() / "charts" / "privcode"


def helm_binary() -> str:
    """``$HELM``, else ``.tools/helm`` (``make tools``), else ``helm`` on PATH."""

    for candidate in (
        os.environ.get("HELM"),
        str(repo_root() / ".tools" / "helm"),
        shutil.which("helm"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise PrivcodeError(
        "helm not found: run `make tools` (fetches helm v4 into .tools/) or put helm on PATH"
    )


def render_chart(
    values: dict[str, Any],
    *,
    release: str = "privcode",
    namespace: str = "default",
    values_files: Sequence[str | os.PathLike] = (),
    chart: str | os.PathLike | None = None,
) -> list[dict[str, Any]]:
    """``helm template`` of the chart; ``values`` win over ``values_files``. Returns the objects."""
    with tempfile.TemporaryDirectory(prefix="privcode-helm-") as tmp:
        extra = Path(tmp) / "values.yaml"
        extra.write_text(yaml.safe_dump(values, sort_keys=False))
        cmd = [
            helm_binary(),
            "template",
            release,
            str(chart or chart_dir()),
            "--namespace",
            namespace,
        ]
        for path in values_files:
            cmd += ["--values", str(path)]
        cmd += ["--values", str(extra)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ManifestError(f"helm template failed: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def job_manifests(
    config: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    release: str = "privcode",
    namespace: str = "default",
    values_files: Sequence[str | os.PathLike] = (),
) -> list[dict[str, Any]]:
    """The objects of a pipeline RayJob for ``config`` (validated first), in apply order."""

    load_config(config, overrides)  # a bad config or override fails before any rendering
    values = {
        "pipeline": {"config": Path(config).read_text(), "overrides": list(overrides)},
        "job": {"enabled": True},
        "cluster": {"enabled": False},
        "serve": {"enabled": False},
        # the operator (Deployment, RBAC, admission policy) is installed with the chart, never
        # by a job submission: this submitter sends none of its kinds
        "operator": {"enabled": False},
        # nor the staging Job (a values file's stage.enabled: it fills the data and models
        # claims once, at install) or the PodMonitor (needs the Prometheus Operator's CRDs)
        "stage": {"enabled": False},
        "metrics": {"podMonitor": {"enabled": False}},
    }
    objects = render_chart(values, release=release, namespace=namespace, values_files=values_files)
    unknown = sorted({o.get("kind", "?") for o in objects} - set(APPLY_ORDER))
    if unknown:
        raise ManifestError(
            f"the job rendering has kinds this submitter does not send: {', '.join(unknown)}"
        )
    jobs = [o for o in objects if o["kind"] == "RayJob"]
    if len(jobs) != 1:
        raise ManifestError(f"expected one RayJob in the rendering, got {len(jobs)}")
    return sorted(objects, key=lambda o: APPLY_ORDER.index(o["kind"]))


# --------------------------------------------------------------------------- validation


def _v1_schema(crd: dict[str, Any], where: str) -> dict[str, Any]:
    for version in crd.get("spec", {}).get("versions", []):
        if version.get("name") == VERSION:
            return version["schema"]["openAPIV3Schema"]
    raise ManifestError(f"{where}: the CRD has no {VERSION} version")


@functools.lru_cache(maxsize=16)
def _crds_in_file(path: str, mtime_ns: int) -> dict[str, dict[str, Any]]:
    """The documents of a CRD file by name (parsed once per file version: they are MBs)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as fh:
        return {
            doc["metadata"]["name"]: doc
            for doc in yaml.load_all(fh, Loader=loader)
            if isinstance(doc, dict) and doc.get("metadata", {}).get("name")
        }


def crd_schema(
    kind: str, crds: str | os.PathLike | None = None, api_client: Any = None
) -> dict[str, Any]:
    """The ``v1`` openAPIV3Schema of ``kind``: from a CRD file or directory, else from the cluster."""
    crd_name, _ = CUSTOM_KINDS[kind]
    if crds is not None:
        path = Path(crds)
        files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
        for file in files:
            crd = _crds_in_file(str(file.resolve()), file.stat().st_mtime_ns).get(crd_name)
            if crd is not None:
                return _v1_schema(crd, str(file))
        raise ManifestError(f"no CRD {crd_name} in {path}")

    client = import_extra("kubernetes.client", "k8s", "reading a CRD from the cluster")
    try:  # raw JSON: the typed model would rename x-kubernetes-* keys
        raw = client.ApiextensionsV1Api(api_client).read_custom_resource_definition(
            crd_name, _preload_content=False
        )
    except client.ApiException as exc:
        if exc.status == 404:
            raise KubeError(
                f"the cluster has no CRD {crd_name}: install the KubeRay operator "
                "first (see README, 'Running on Kubernetes')"
            ) from exc
        raise KubeError(f"reading CRD {crd_name}: HTTP {exc.status} {exc.reason}") from exc
    return _v1_schema(json.loads(raw.data), crd_name)


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths in ``obj`` that ``schema`` does not declare: what the API server would prune.

    ``path`` is where ``obj`` sits; empty means ``obj`` is the resource itself. As with a
    structural schema, a key is kept when ``properties`` declares it or ``additionalProperties``
    allows it (a schema: walked into; ``true``: anything); ``x-kubernetes-preserve-unknown-fields``
    keeps every key. Any other key is undeclared. ``apiVersion``, ``kind`` and ``metadata`` of
    resources and embedded resources are the API server's own; arrays are walked with ``items``;
    a value of the wrong type is left to schema validation. Details: docs/kubernetes.md,
    "privcode/cluster/k8s.py".
    """
    found: list[str] = []
    if (
        isinstance(obj, dict)
        and schema.get("type", "object") == "object"
        and not schema.get("x-kubernetes-int-or-string")
    ):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_all = extra is True or bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        own = RESOURCE_KEYS if not path or schema.get("x-kubernetes-embedded-resource") else ()
        for key, value in obj.items():
            here = f"{path}.{key}" if path else key
            if key in own:
                continue
            if key in props:
                found += unknown_fields(value, props[key], here)
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, here)
            elif not keep_all:
                found.append(here)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def custom_resource_problems(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Every schema violation and undeclared field of ``obj``, one ``path: problem`` each."""
    jsonschema = import_extra("jsonschema", "k8s", "checking a manifest against its CRD")

    problems = [
        f"{'.'.join(str(p) for p in err.absolute_path) or '(root)'}: {err.message}"
        for err in jsonschema.Draft7Validator(schema).iter_errors(obj)
    ]
    return problems + [f"{p}: field not declared in the CRD" for p in unknown_fields(obj, schema)]


def validate_custom_resource(obj: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise :class:`ManifestError` naming every schema violation and undeclared field of ``obj``."""
    problems = custom_resource_problems(obj, schema)
    if problems:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        raise ManifestError(f"{name} does not validate against its CRD: " + "; ".join(problems))


# --------------------------------------------------------------------------- submission


def _load_api_client(context: str | None = None) -> Any:
    client = import_extra("kubernetes.client", "k8s", "submitting to Kubernetes")
    config = import_extra("kubernetes.config", "k8s", "submitting to Kubernetes")

    try:  # KUBECONFIG read now: the client reads it once, at import time
        config.load_kube_config(config_file=_kubeconfig(), context=context)
    except Exception as kube_exc:  # noqa: BLE001 - fall back to the in-cluster service account
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise KubeError(
                f"no usable kube context ({kube_exc}); set KUBECONFIG or run inside a cluster"
            ) from kube_exc
    return client.ApiClient()


def _core(api_client: Any, kind: str) -> tuple[Any, str, str]:
    client = import_extra("kubernetes.client", "k8s", "submitting to Kubernetes")

    api_name, suffix, on_conflict = CORE_KINDS[kind]
    return getattr(client, api_name)(api_client), suffix, on_conflict


def _create(api_client: Any, obj: dict[str, Any], namespace: str, dry_run: bool) -> str:
    """Create ``obj``; on a conflict keep or replace it per :data:`CORE_KINDS`. Returns the action."""
    from kubernetes import client

    kind, name = obj["kind"], obj["metadata"]["name"]
    # an object that names its namespace goes there (the chart's executor: a namespace of its own)
    namespace = obj["metadata"].get("namespace") or namespace
    extra = {"dry_run": "All"} if dry_run else {}
    if kind in CUSTOM_KINDS:
        client.CustomObjectsApi(api_client).create_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            CUSTOM_KINDS[kind][1],
            obj,
            field_manager=FIELD_MANAGER,
            **extra,
        )
        return "created"
    api, suffix, on_conflict = _core(api_client, kind)
    try:
        getattr(api, f"create_namespaced_{suffix}")(
            namespace, obj, field_manager=FIELD_MANAGER, **extra
        )
        return "created"
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    if on_conflict == "keep":
        return "kept"
    current = getattr(api, f"read_namespaced_{suffix}")(name, namespace)
    body = {
        **obj,
        "metadata": {**obj["metadata"], "resourceVersion": current.metadata.resource_version},
    }
    if kind == "Service" and current.spec is not None:  # a Service keeps its allocated IPs
        spec = dict(obj.get("spec") or {})
        for key, attr in (("clusterIP", "cluster_ip"), ("clusterIPs", "cluster_ips")):
            if key not in spec and getattr(current.spec, attr, None):
                spec[key] = getattr(current.spec, attr)
        body["spec"] = spec
    getattr(api, f"replace_namespaced_{suffix}")(
        name, namespace, body, field_manager=FIELD_MANAGER, **extra
    )
    return "replaced"


def _get_rayjob(api_client: Any, name: str, namespace: str) -> dict[str, Any] | None:
    from kubernetes import client

    try:
        return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            GROUP, VERSION, namespace, "rayjobs", name
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _clear_finished_rayjob(
    api_client: Any, name: str, namespace: str, timeout_s: float = 120.0
) -> bool:
    """Delete a finished RayJob called ``name`` (so it can run again); refuse a live one."""
    from kubernetes import client

    current = _get_rayjob(api_client, name, namespace)
    if current is None:
        return False
    status = current.get("status") or {}
    if (
        status.get("jobDeploymentStatus") not in TERMINAL_DEPLOYMENT
        and status.get("jobStatus") not in TERMINAL_JOB
    ):
        raise KubeError(
            f"RayJob {namespace}/{name} is still running "
            f"({status.get('jobDeploymentStatus') or 'no status yet'}); wait for it, "
            "delete it, or submit under another release name"
        )
    client.CustomObjectsApi(api_client).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, "rayjobs", name
    )
    deadline = time.monotonic() + timeout_s
    while _get_rayjob(api_client, name, namespace) is not None:
        if time.monotonic() > deadline:
            raise KubeError(f"RayJob {namespace}/{name} was not deleted within {timeout_s:.0f} s")
        time.sleep(1.0)
    return True


def submit_manifests(
    objects: Iterable[dict[str, Any]],
    *,
    namespace: str,
    api_client: Any,
    crds: str | os.PathLike | None = None,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Validate (CRD schema, then server-side dry run) and create ``objects``; return what happened."""
    from kubernetes import client

    objects = list(objects)
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            validate_custom_resource(obj, crd_schema(obj["kind"], crds, api_client))
    job = next(o for o in objects if o["kind"] == "RayJob")
    name = job["metadata"]["name"]
    try:
        for obj in objects:
            if obj["kind"] != "RayJob" or _get_rayjob(api_client, name, namespace) is None:
                _create(api_client, obj, namespace, dry_run=True)
        replaced = _clear_finished_rayjob(api_client, name, namespace)
        actions = {
            f"{o['kind']}/{o['metadata']['name']}": _create(api_client, o, namespace, False)
            for o in objects
        }
    except client.ApiException as exc:
        raise KubeError(
            f"the API server refused the job's objects: HTTP {exc.status} "
            f"{exc.reason}: {(exc.body or '')[:500]}"
        ) from exc
    if replaced:
        actions[f"RayJob/{name}"] = "replaced (the previous run had finished)"
    if out is not None:
        for what, action in actions.items():
            print(f"{what}: {action}", file=out, flush=True)
    return {"name": name, "namespace": namespace, "objects": actions}


def wait_for_rayjob(
    api_client: Any,
    name: str,
    namespace: str,
    *,
    timeout_s: float = 86400.0,
    poll_s: float = 5.0,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Poll the RayJob until its job or deployment status is terminal; print each change."""
    deadline = time.monotonic() + timeout_s
    last: tuple[Any, Any] | None = None
    while True:
        current = _get_rayjob(api_client, name, namespace)
        if current is None:
            raise KubeError(f"RayJob {namespace}/{name} disappeared while waiting for it")
        status = current.get("status") or {}
        seen = (status.get("jobDeploymentStatus"), status.get("jobStatus"))
        if seen != last and out is not None:
            print(
                f"RayJob {name}: deployment {seen[0] or '-'}, job {seen[1] or '-'}",
                file=out,
                flush=True,
            )
        last = seen
        if seen[1] in TERMINAL_JOB or seen[0] in TERMINAL_DEPLOYMENT:
            return {
                "status": seen[1] or seen[0],
                "deployment_status": seen[0],
                "message": status.get("message", ""),
                "dashboard": status.get("dashboardURL"),
            }
        if time.monotonic() > deadline:
            return {
                "status": seen[1] or seen[0] or "PENDING",
                "deployment_status": seen[0],
                "timed_out": True,
            }
        time.sleep(poll_s)


def submit_pipeline_k8s(
    config: str | os.PathLike = "jobs/configs/demo.yaml",
    overrides: Sequence[str] = (),
    *,
    namespace: str | None = None,
    release: str = "privcode",
    values_files: Sequence[str] = (),
    context: str | None = None,
    crds: str | os.PathLike | None = None,
    follow: bool = True,
    timeout_s: float = 86400.0,
    api_client: Any = None,
    stages: Sequence[str] = (),
    data_claim: str | None = None,
    data_path: str | None = None,
) -> dict[str, Any]:
    """Render, validate, create and (with ``follow``) watch the pipeline RayJob; or, where
    the privcode operator is installed, create and follow a PrivCodeRun
    (:mod:`privcode.cluster.k8s_run`), which needs ``data_claim`` and ``data_path``.

    ``stages`` (run only these) becomes the override ``run.stages=[...]``.
    """
    namespace = namespace or _current_namespace(context)
    api_client = api_client or _load_api_client(context)

    if k8s_run.operator_installed(api_client):
        return _submit_through_operator(
            config,
            list(overrides),
            namespace,
            api_client,
            list(stages),
            data_claim,
            data_path,
            follow=follow,
            timeout_s=timeout_s,
        )
    if stages:
        overrides = [*overrides, f"run.stages=[{', '.join(stages)}]"]
    objects = job_manifests(
        config, overrides, release=release, namespace=namespace, values_files=values_files
    )
    result = submit_manifests(
        objects, namespace=namespace, api_client=api_client, crds=crds, out=sys.stderr
    )
    name = result["name"]
    print(
        f"follow it: kubectl get rayjob {name} -n {namespace} -w\n"
        f"logs:      kubectl logs -f -n {namespace} job/{name}",
        file=sys.stderr,
        flush=True,
    )
    if follow:
        result.update(
            wait_for_rayjob(api_client, name, namespace, timeout_s=timeout_s, out=sys.stderr)
        )
    else:
        result["status"] = "SUBMITTED"
    return result


def _submit_through_operator(
    config: str | os.PathLike,
    overrides: list[str],
    namespace: str,
    api_client: Any,
    stages: list[str],
    data_claim: str | None,
    data_path: str | None,
    *,
    follow: bool,
    timeout_s: float,
) -> dict[str, Any]:
    """A PrivCodeRun for the submission, created and (with ``follow``) followed."""

    if not data_claim or not data_path:
        raise ManifestError(
            "the privcode operator is installed: a run is admitted on its records before any "
            "pod exists, so give the claim and file that hold them (DATA_CLAIM=... "
            "DATA_PATH=..., or --data-claim/--data-path)"
        )
    cfg = load_config(config, overrides)
    run = k8s_run.run_manifest(
        config,
        overrides,
        name=cfg.run.name,
        data_claim=data_claim,
        data_path=data_path,
        epsilon=cfg.train.epsilon,
        stages=stages,
    )
    name = k8s_run.submit_run(api_client, run, namespace)
    print(
        f"PrivCodeRun {name} created: kubectl get privcoderun {name} -n {namespace} -w",
        file=sys.stderr,
        flush=True,
    )
    if not follow:
        return {"name": name, "status": "SUBMITTED"}
    return k8s_run.follow_run(api_client, name, namespace, timeout_s=timeout_s, out=sys.stderr)


def _kubeconfig() -> str:
    return os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")


def _current_namespace(context: str | None) -> str:
    with contextlib.suppress(Exception):
        from kubernetes import config

        contexts, active = config.list_kube_config_contexts(config_file=_kubeconfig())
        chosen = next((c for c in contexts if c["name"] == context), active) if context else active
        return chosen.get("context", {}).get("namespace") or "default"
    return "default"
