"""The Helm chart ``charts/privcode``: lint, schemas, and the values it refuses.

``helm lint --strict``; every rendering validated the way a cluster would
(core objects with ``kubernetes-validate``, Ray resources against the KubeRay
CRDs, undeclared fields included); values.schema.json and the templates' own
checks refusing bad values; values.yaml documented and covered by the schema.
Helpers: tests/chart_support.py; fixtures (``helm``, ``crds``, ``rendering``,
``default_objects``, ``ci_objects``): tests/conftest.py.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
import pytest
import yaml
from chart_support import (
    CHART,
    CI_VALUES,
    CORE_KINDS,
    K8S_VERSIONS,
    RAY_KINDS,
    SYNTH_AUTOSCALED_VALUES,
    VALUE_SETS,
    crd_problems,
    k8s_problems,
    one,
    pod_templates,
    render,
    render_error,
    run_helm,
)

from privcode.cluster import k8s

# --------------------------------------------------------------------------- 1. lint


@pytest.mark.parametrize(
    "values",
    [(), ("-f", str(CI_VALUES)), ("-f", str(SYNTH_AUTOSCALED_VALUES))],
    ids=["defaults", "ci", "synth-autoscaled"],
)
def test_helm_lint_strict(helm, values):
    done = run_helm(helm, "lint", "--strict", str(CHART), *values)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


# --------------------------------------------------------------------------- 2. schemas


def test_renderings_hold_only_known_kinds(rendering):
    name, objects = rendering
    kinds = {o["kind"] for o in objects}
    assert kinds <= CORE_KINDS | set(RAY_KINDS), f"{name}: unexpected kinds {kinds}"
    for obj in objects:
        assert obj["apiVersion"] == ("ray.io/v1" if obj["kind"] in RAY_KINDS else obj["apiVersion"])


def test_ray_resources_validate_against_the_kuberay_crds(rendering, crds):
    name, objects = rendering
    ray_objects = [o for o in objects if o["kind"] in RAY_KINDS]
    assert ray_objects, f"{name}: no Ray resource rendered"
    for obj in ray_objects:
        problems = crd_problems(obj)
        assert not problems, f"{name}: {obj['kind']}/{obj['metadata']['name']}: {problems}"


def test_core_objects_validate_strictly_against_kubernetes(rendering, helm):
    """Each rendering made for each supported version (``--kube-version``: the chart adapts to
    it, e.g. the executor's AppArmor field from 1.30, an annotation before) is valid there."""
    name, _ = rendering
    for version in K8S_VERSIONS:
        for obj in render(helm, *VALUE_SETS[name], "--kube-version", version):
            if obj["kind"] in RAY_KINDS:
                continue
            problems = k8s_problems(obj, (version,))
            assert not problems, f"{name}: {obj['kind']}/{obj['metadata']['name']}: {problems}"


def test_ray_pod_templates_validate_strictly_as_pods(rendering):
    """The pod templates inside the Ray resources, checked as Pods by kubernetes-validate."""
    name, objects = rendering
    for where, template in pod_templates(objects):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "probe", **template.get("metadata", {})},
            "spec": template["spec"],
        }
        problems = k8s_problems(pod)
        assert not problems, f"{name}: {where}: {problems}"


def test_the_strict_walk_catches_a_misspelled_field(default_objects, crds):
    job = copy.deepcopy(one(default_objects, "RayJob"))
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    head["rayStartParam"] = head.pop("rayStartParams")
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
        "securityContex"
    ] = {}
    problems = crd_problems(job)
    assert (
        "spec.rayClusterSpec.headGroupSpec.rayStartParam: field not declared in the CRD" in problems
    ), problems
    assert any(
        p.endswith("containers[0].securityContex: field not declared in the CRD") for p in problems
    ), problems
    # free-form maps stay free-form
    assert not k8s.unknown_fields(
        {"spec": {"rayClusterSpec": {"headGroupSpec": {"rayStartParams": {"anything-goes": "1"}}}}},
        k8s.crd_schema("RayJob", crds),
    )


def _obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **extra}


#: A schema with each construct the API server's pruning distinguishes.
WALK_SCHEMA = _obj(
    {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": _obj(
            {
                "closed": _obj({"a": {"type": "string"}}),
                "closedFalse": _obj({"a": {"type": "string"}}, additionalProperties=False),
                "map": {"type": "object", "additionalProperties": _obj({"b": {"type": "integer"}})},
                "open": {"type": "object", "additionalProperties": True},
                "preserved": _obj(
                    {"known": _obj({"c": {"type": "string"}})},
                    **{"x-kubernetes-preserve-unknown-fields": True},
                ),
                "empty": {"type": "object"},
                "list": {"type": "array", "items": _obj({"d": {"type": "string"}})},
                "port": {
                    "x-kubernetes-int-or-string": True,
                    "anyOf": [{"type": "integer"}, {"type": "string"}],
                },
                "embedded": _obj(
                    {"spec": _obj({"e": {"type": "string"}})},
                    **{"x-kubernetes-embedded-resource": True},
                ),
            }
        ),
    }
)


def test_the_strict_walk_follows_the_api_servers_pruning():
    """What k8s.unknown_fields reports is what a structural schema would prune."""
    obj = {
        "apiVersion": "v1",
        "kind": "Probe",
        "metadata": {"name": "p", "labels": {"a": "b"}},
        "typo": 1,
        "spec": {
            "closed": {"a": "1", "typo": "2", "kind": "only the root and embedded own it"},
            "closedFalse": {"typo": 1},
            "map": {"k": {"b": 1, "typo": 2}},
            "open": {"anything": {"nested": 1}},
            "preserved": {"anything": {"x": 1}, "known": {"c": "1", "typo": 1}},
            "empty": {"typo": 1},
            "list": [{"d": "1"}, {"typo": 1}],
            "port": {"typo": 1},
            "embedded": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "q"},
                "spec": {"e": "1", "typo": 1},
            },
        },
    }
    assert sorted(k8s.unknown_fields(obj, WALK_SCHEMA)) == [
        "spec.closed.kind",
        "spec.closed.typo",
        "spec.closedFalse.typo",
        "spec.embedded.spec.typo",
        "spec.empty.typo",
        "spec.list[1].typo",
        "spec.map.k.typo",
        "spec.preserved.known.typo",
        "typo",
    ]
    problems = k8s.custom_resource_problems(obj, WALK_SCHEMA)
    assert any(p.startswith("spec.port: ") for p in problems), problems  # a type error
    assert not [p for p in problems if p.startswith(("metadata", "spec.port."))], problems


# --------------------------------------------------------------------------- 3. values schema


@pytest.mark.parametrize(
    "setting, field, extra",
    [
        ("image.pullPolicy=Sometimes", "image.pullPolicy", "IfNotPresent"),
        ("workerGroups.cpu.replicas=-1", "workerGroups.cpu.replicas", "0"),
        ("head.serviceTyp=ClusterIP", "head", "serviceTyp"),  # a typo: additionalProperties
        ("workerGroups.gpu.gpusPerWorker=0", "workerGroups.gpu.gpusPerWorker", "1"),
        ("head.serviceType=ExternalName", "head.serviceType", "LoadBalancer"),
        ("job.submissionMode=Sometimes", "job.submissionMode", "K8sJobMode"),
        (
            "autoscaling.autoscalerOptions.upscalingMode=Fast",
            "autoscaling.autoscalerOptions.upscalingMode",
            "Conservative",
        ),
        ("auth.mode=password", "auth.mode", "token"),
        ("pipeline.overrides={not-an-override}", "pipeline.overrides.0", ""),
        ("storage.mountPath=relative/path", "storage.mountPath", ""),
        ("tolerations=[]", "", "tolerations"),  # a misplaced top-level key
    ],
)
def test_values_schema_rejects_bad_values(helm, setting, field, extra):
    """helm refuses the values and names the field (helm 4 writes /a/b, older helm 3 a.b)."""
    stderr = render_error(helm, "--set", setting)
    assert "schema" in stderr, stderr
    assert field in stderr or "/" + field.replace(".", "/") in stderr, (
        f"{setting}: {field!r} not named in: {stderr}"
    )
    assert extra in stderr, f"{setting}: {extra!r} not in: {stderr}"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("--set", "workerGroups.cpu.minReplicas=5"),
            "workerGroups.cpu: minReplicas (5) > maxReplicas (4)",
        ),
        (
            ("--set", "workerGroups.gpu.enabled=true", "--set", "workerGroups.gpu.minReplicas=3"),
            "workerGroups.gpu: minReplicas (3) > maxReplicas (2)",
        ),
        (
            ("--set", "workerGroups.cpu.replicas=9"),
            "workerGroups.cpu: replicas (9) must be between minReplicas (1) and maxReplicas (4)",
        ),
        (
            ("--set", "serve.enabled=true", "--set", "serve.premium.enabled=false"),
            "no Serve application is enabled",
        ),
        (("--set", "storage.pvc.enabled=false"), "nowhere to keep its artifacts"),
        (("--set", "rayVersion=2.40.0"), "auth.mode=token needs Ray >= 2.52.0"),
        (("--set", "head.rayStartParams.labels=a=b"), "'labels' is not supported"),
    ],
)
def test_template_rejects_inconsistent_values(helm, args, message):
    stderr = render_error(helm, *args)
    assert message in stderr, stderr


def test_release_names_must_suit_kuberay(helm):
    assert "DNS-1035" in render_error(helm, release="1st")  # KubeRay wants a letter first
    objects = render(helm, "--set", "fullnameOverride=first", release="1st")
    assert one(objects, "RayJob")["metadata"]["name"] == "first"


def test_values_are_all_documented():
    """helm-docs style: every key of values.yaml has a `# --` comment right above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    block_indent = None
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if block_indent is not None:  # inside a block scalar (pipeline.config)
            if not stripped or indent >= block_indent:
                continue
            block_indent = None
        match = re.match(r"^([A-Za-z_][\w.-]*):( |$)", stripped)
        if not match or stripped.startswith("-") or _in_list_item(lines, i, indent):
            continue
        if line.rstrip().endswith("|"):
            block_indent = indent + 1
        j = i - 1
        while (
            j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --")
        ):
            j -= 1
        documented = j >= 0 and lines[j].strip().startswith("# --")
        parent_free_form = _inside_free_form(lines, i, indent)
        if not documented and not parent_free_form:
            undocumented.append(f"line {i + 1}: {stripped}")
    assert not undocumented, undocumented


FREE_FORM = {
    "rayStartParams",
    "resources",
    "requests",
    "limits",
    "nodeSelector",
    "affinity",
    "annotations",
    "labels",
    "runtimeEnv",
    "env_vars",
    "rayActorOptions",
    "args",
    "seccompProfile",
    "capabilities",
}


def _in_list_item(lines: list[str], i: int, indent: int) -> bool:
    """Whether line ``i`` is a key of a list item (e.g. a default toleration's fields)."""
    for j in range(i - 1, -1, -1):
        stripped = lines[j].lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(lines[j]) - len(stripped) < indent:
            return stripped.startswith("- ")
    return False


def _inside_free_form(lines: list[str], i: int, indent: int) -> bool:
    """Whether line ``i`` is a key inside a free-form map (resources, rayStartParams, ...)."""
    for j in range(i - 1, -1, -1):
        stripped = lines[j].lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        parent_indent = len(lines[j]) - len(stripped)
        if parent_indent < indent:
            key = stripped.split(":", 1)[0].lstrip("- ")
            return key in FREE_FORM or _inside_free_form(lines, j, parent_indent)
    return False


def _merged(base: Any, top: Any) -> Any:
    """Helm's coalescing of a values file over the defaults (maps merge, the rest replaces)."""
    if isinstance(base, dict) and isinstance(top, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in top.items()}}
    return copy.deepcopy(top)


def test_schema_covers_every_value():
    """values.schema.json declares every key of values.yaml, and closes fixed-key objects."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)
    jsonschema.Draft7Validator(schema).validate(
        _merged(values, yaml.safe_load(CI_VALUES.read_text()))
    )

    def resolve(node):
        while "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        return node

    def walk(value, node, path):
        node = resolve(node)
        if isinstance(value, dict) and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path}: open object"
            for key, sub in value.items():
                assert key in node["properties"], f"{path}.{key}: not in the schema"
                walk(sub, node["properties"][key], f"{path}.{key}")

    walk(values, schema, "values")
