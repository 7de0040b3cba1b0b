"""Helpers for the tests of the Helm chart ``charts/privcode`` (a plain module, not tests).

Used by tests/test_chart_render.py, tests/test_chart_behaviour.py and
tests/test_k8s_submit.py (imported as ``chart_support``: pytest puts tests/ on
``sys.path``, as it has no ``__init__.py``); the fixtures built on them
(``helm``, ``crds``, ``default_objects``, ``ci_objects``, ``rendering``) are in
tests/conftest.py.

Everything runs the real helm binary (:func:`privcode.cluster.k8s.helm_binary`:
``$HELM``, else ``.tools/helm`` from ``make tools``, else ``helm`` on PATH;
skipped without one unless ``PRIVCODE_REQUIRE_HELM=1``, as in CI). Renderings
are validated the way a cluster would: core objects with ``kubernetes-validate``
(strict: unknown fields are errors), Ray custom resources with
:func:`privcode.cluster.k8s.custom_resource_problems` against the ``v1``
openAPIV3Schema of the KubeRay CRDs in ../shared/kuberay/crds/
(``PRIVCODE_KUBERAY_CRDS`` overrides the path; skipped without them unless
``PRIVCODE_REQUIRE_CRDS=1``): JSON-schema validation plus
every field the schema does not declare (the API server would prune it
silently). helm runs once per distinct command line.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from gates import REQUIRE_CRDS, REQUIRE_HELM, require_or_skip

from privcode.cluster import k8s
from privcode.errors import PrivcodeError

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "privcode"
CI_VALUES = ROOT / "charts" / "ci-values.yaml"
#: Stage II on an autoscaled cluster that starts with no worker (docs/kubernetes.md).
SYNTH_AUTOSCALED_VALUES = ROOT / "charts" / "synth-autoscaled-values.yaml"
DEMO_CONFIG = ROOT / "jobs" / "configs" / "demo.yaml"
CRDS = Path(os.environ.get("PRIVCODE_KUBERAY_CRDS", ROOT.parent / "shared" / "kuberay" / "crds"))
RAY_KINDS = frozenset(k8s.CUSTOM_KINDS)
CORE_KINDS = {
    "ConfigMap",
    "Deployment",
    "PersistentVolumeClaim",
    "NetworkPolicy",
    "ServiceAccount",
    "Secret",
    "Service",
    # the operator (templates/operator*.yaml): its RBAC and its admission policy
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
#: Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and a recent one.
K8S_VERSIONS = ("1.26.0", "1.35.0")
#: KubeRay's name limits (ray-operator/controllers/ray/utils/constant.go).
MAX_NAME = {"RayCluster": 53, "RayJob": 47, "RayService": 47}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: The values ``make submit-job TARGET=k8s`` renders the job with (privcode.cluster.k8s.job_manifests).
JOB_ONLY = (
    "--set",
    "cluster.enabled=false",
    "--set",
    "serve.enabled=false",
    "--set",
    "job.enabled=true",
    "--set",
    "operator.enabled=false",
)
#: The value sets every rendering-wide test runs on (the ``rendering`` fixture).
VALUE_SETS = {
    "defaults": (),
    "ci": ("-f", str(CI_VALUES)),
    "synth-autoscaled": ("-f", str(SYNTH_AUTOSCALED_VALUES)),
    "job-only": JOB_ONLY,
    "everything-minimal": (
        "--set",
        "cluster.enabled=true",
        "--set",
        "serve.enabled=true",
        "--set",
        "apiKey.existingSecret=privcode-api-keys",
        "--set",
        "auth.mode=disabled",
        "--set",
        "storage.pvc.enabled=false",
        "--set",
        "storage.objectStore.uri=s3://b/p",
        "--set",
        "workerGroups.cpu.enabled=false",
    ),
}


# --------------------------------------------------------------------------- prerequisites


def require_helm() -> str:
    """The helm binary; skip the test without one (fail with ``PRIVCODE_REQUIRE_HELM=1``)."""
    try:
        return k8s.helm_binary()
    except PrivcodeError:
        require_or_skip(REQUIRE_HELM, "helm not found: run `make tools`")


def require_crds() -> Path:
    """The KubeRay CRD folder; skip the test without it (fail with ``PRIVCODE_REQUIRE_CRDS=1``)."""
    if not (CRDS / "ray.io_rayjobs.yaml").is_file():
        require_or_skip(
            REQUIRE_CRDS,
            f"KubeRay CRDs not found at {CRDS} (the shared folder is absent; set "
            "PRIVCODE_KUBERAY_CRDS)",
        )
    return CRDS


# --------------------------------------------------------------------------- rendering


@cache
def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def render_raw(helm: str, *args: str, release: str = "rel") -> subprocess.CompletedProcess:
    return run_helm(helm, "template", release, str(CHART), "--namespace", "team-a", *args)


def render(helm: str, *args: str, release: str = "rel") -> list[dict[str, Any]]:
    done = render_raw(helm, *args, release=release)
    assert done.returncode == 0, f"helm template {' '.join(args)} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_error(helm: str, *args: str, release: str = "rel") -> str:
    done = render_raw(helm, *args, release=release)
    assert done.returncode != 0, f"helm template {' '.join(args)} unexpectedly succeeded"
    return done.stderr


# --------------------------------------------------------------------------- navigating


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str) -> dict:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def cluster_specs(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    """(owner, RayCluster spec) of every Ray cluster in the rendering."""
    for obj in objects:
        spec = obj.get("spec", {})
        if obj["kind"] == "RayCluster":
            yield f"RayCluster/{obj['metadata']['name']}", spec
        elif obj["kind"] == "RayJob":
            yield f"RayJob/{obj['metadata']['name']}", spec["rayClusterSpec"]
        elif obj["kind"] == "RayService":
            yield f"RayService/{obj['metadata']['name']}", spec["rayClusterConfig"]


def pod_templates(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    """(where, pod template) of every Ray pod (head, worker groups) and job submitter."""
    for owner, spec in cluster_specs(objects):
        yield f"{owner} head", spec["headGroupSpec"]["template"]
        for group in spec.get("workerGroupSpecs", []):
            yield f"{owner} group {group['groupName']}", group["template"]
    for job in by_kind(objects, "RayJob"):
        if "submitterPodTemplate" in job["spec"]:
            yield f"RayJob/{job['metadata']['name']} submitter", job["spec"]["submitterPodTemplate"]


def all_pod_templates(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    """(where, pod template) of every pod: :func:`pod_templates` and the Deployments' (executor)."""
    yield from pod_templates(objects)
    for deployment in by_kind(objects, "Deployment"):
        yield f"Deployment/{deployment['metadata']['name']}", deployment["spec"]["template"]


def ray_containers(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    for where, template in pod_templates(objects):
        for container in template["spec"]["containers"]:
            yield f"{where} {container['name']}", container


def worker_group(spec: dict, name: str) -> dict:
    groups = {g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}
    assert name in groups, f"no worker group {name}: {sorted(groups)}"
    return groups[name]


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# --------------------------------------------------------------------------- validation


def crd_problems(obj: dict[str, Any]) -> list[str]:
    """What the KubeRay CRD of ``obj`` rejects or would prune (:func:`require_crds` first)."""
    return k8s.custom_resource_problems(obj, k8s.crd_schema(obj["kind"], CRDS))


def k8s_problems(obj: dict[str, Any], versions: Sequence[str] = K8S_VERSIONS) -> list[str]:
    """What ``kubernetes-validate`` (strict) rejects in ``obj``, on each of ``versions``."""
    import kubernetes_validate

    problems = []
    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path)) or "(root)"
            problems.append(f"k8s {version}: {where}: {exc.message}")
    return problems
