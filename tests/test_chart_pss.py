"""Pod Security: every pod of the release's namespace meets the ``restricted`` standard.

Issue 43, points 1 and 9. The chart renders with the defaults, charts/paper-values.yaml (with
jobs/configs/paper.yaml) and a serving variant (the RayService with both apps, the autoscaler,
the staging Job); every pod template of every object is walked: Deployments and Jobs, each Ray
cluster's head and worker groups (RayCluster, RayJob.spec.rayClusterSpec,
RayService.spec.rayClusterConfig), the autoscaler sidecar KubeRay adds to a head, the RayJob's
submitter, and the operator's RayJob template (a ConfigMap). A small checker holds one function
per rule of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline and
restricted), each naming the rule and the pod on failure. The executor, in a namespace of its
own, is checked apart: user namespaces, no host path, only the capabilities the sandbox needs.
Point 9: serving pods mount no privacy store and only the release's directories of the artifacts
volume, read-only; the heads' egress to the API server is limited to ``apiServer.cidrs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from chart_support import ROOT, by_kind, cluster_specs, render
from test_chart_executor import (
    EXECUTOR_NAMESPACE,
    NAMESPACE,
    Endpoint,
    Policies,
    endpoint,
    executor_deployment,
    pods,
)

PAPER = (
    *("-f", str(ROOT / "charts" / "paper-values.yaml")),
    *("--set-file", f"pipeline.config={ROOT / 'jobs' / 'configs' / 'paper.yaml'}"),
)
SERVING = (
    *("--set", "serve.enabled=true", "--set", "apiKey.existingSecret=privcode-api-keys"),
    *("--set", "serve.ensemble.enabled=true", "--set", "cluster.enabled=true"),
    *("--set", "autoscaling.enableInTreeAutoscaling=true"),
    *("--set", "storage.models.enabled=true", "--set", "stage.enabled=true"),
    *("--set", "stage.command=cp -r /src /mnt/models"),
)
VALUE_SETS = {"defaults": (), "paper": PAPER, "serving": SERVING}
#: restricted: the only volume types allowed.
VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
#: The executor's container capabilities (privcode/sandbox/zygote.py: namespaces and mounts,
#: the snippet's uid, its chroot, ending it), and nothing more.
SANDBOX_CAPS = {"SYS_ADMIN", "SETUID", "SETGID", "SYS_CHROOT", "KILL"}


# --------------------------------------------------------------------------- every pod template


def _workload_templates(obj: dict) -> Iterator[tuple[str, dict]]:
    kind, name = obj["kind"], obj["metadata"]["name"]
    spec = obj.get("spec", {})
    if kind in ("Deployment", "Job", "StatefulSet", "DaemonSet", "ReplicaSet"):
        yield f"{kind}/{name}", spec["template"]
    elif kind == "CronJob":
        yield f"{kind}/{name}", spec["jobTemplate"]["spec"]["template"]
    elif kind == "Pod":
        yield f"Pod/{name}", obj


def _ray_templates(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    """Heads (with KubeRay's autoscaler sidecar added), worker groups, RayJob submitters."""
    for owner, spec in cluster_specs(objects):
        head = spec["headGroupSpec"]["template"]
        if spec.get("enableInTreeAutoscaling"):
            options = spec.get("autoscalerOptions", {})
            sidecar = {"name": "autoscaler", "securityContext": options.get("securityContext", {})}
            head = {
                **head,
                "spec": {**head["spec"], "containers": [*head["spec"]["containers"], sidecar]},
            }
        yield f"{owner} head", head
        for group in spec.get("workerGroupSpecs", []):
            yield f"{owner} group {group['groupName']}", group["template"]
    for job in by_kind(objects, "RayJob"):
        if "submitterPodTemplate" in job["spec"]:
            yield f"RayJob/{job['metadata']['name']} submitter", job["spec"]["submitterPodTemplate"]


def every_pod_template(objects: list[dict]) -> Iterator[tuple[str, str, dict]]:
    """(namespace, where, pod template) of every pod the rendering may create, the operator's
    RayJob template (a ConfigMap the operator makes each run's RayJob from) included."""
    for obj in objects:
        namespace = obj["metadata"].get("namespace", NAMESPACE)
        for where, template in _workload_templates(obj):
            yield namespace, where, template
    for where, template in _ray_templates(objects):
        yield NAMESPACE, where, template
    for config_map in by_kind(objects, "ConfigMap"):
        text = config_map.get("data", {}).get("rayjob-template.yaml")
        if text:
            for where, template in _ray_templates([yaml.safe_load(text)]):
                yield NAMESPACE, f"operator template: {where}", template


# --------------------------------------------------------------------------- the checker: one rule each


def _containers(spec: dict) -> list[dict]:
    return [
        *spec.get("initContainers", []),
        *spec["containers"],
        *spec.get("ephemeralContainers", []),
    ]


def _each(spec: dict, bad: Callable[[dict], str | None]) -> list[str]:
    return [f"{c['name']}: {why}" for c in _containers(spec) if (why := bad(c))]


def host_namespaces(spec: dict) -> list[str]:
    return [f"{k}: true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]


def privileged(spec: dict) -> list[str]:
    return _each(
        spec, lambda c: "privileged" if c.get("securityContext", {}).get("privileged") else None
    )


def host_path_volumes(spec: dict) -> list[str]:
    return [f"volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]


def host_ports(spec: dict) -> list[str]:
    return _each(
        spec,
        lambda c: next(
            (f"hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")), None
        ),
    )


def apparmor(spec: dict) -> list[str]:
    def bad(sc: dict) -> str | None:
        kind = sc.get("appArmorProfile", {}).get("type")
        return (
            f"appArmorProfile {kind}" if kind not in (None, "RuntimeDefault", "Localhost") else None
        )

    pod = bad(spec.get("securityContext", {}))
    return ([pod] if pod else []) + _each(spec, lambda c: bad(c.get("securityContext", {})))


def selinux(spec: dict) -> list[str]:
    def bad(sc: dict) -> str | None:
        options = sc.get("seLinuxOptions", {})
        if options.get("user") or options.get("role"):
            return "seLinuxOptions user/role"
        if options.get("type") not in (
            None,
            "",
            "container_t",
            "container_init_t",
            "container_kvm_t",
            "container_engine_t",
        ):
            return f"seLinuxOptions type {options['type']}"
        return None

    pod = bad(spec.get("securityContext", {}))
    return ([pod] if pod else []) + _each(spec, lambda c: bad(c.get("securityContext", {})))


def proc_mount(spec: dict) -> list[str]:
    return _each(
        spec,
        lambda c: (
            "procMount Unmasked"
            if c.get("securityContext", {}).get("procMount", "Default") != "Default"
            else None
        ),
    )


def sysctls(spec: dict) -> list[str]:
    found = spec.get("securityContext", {}).get("sysctls", [])
    return [f"sysctl {s['name']}" for s in found if s["name"] not in SAFE_SYSCTLS]


def volume_types(spec: dict) -> list[str]:
    return [
        f"volume {v['name']}: {sorted(set(v) - {'name'})}"
        for v in spec.get("volumes", [])
        if not (set(v) - {"name"}) <= VOLUME_TYPES
    ]


def privilege_escalation(spec: dict) -> list[str]:
    return _each(
        spec,
        lambda c: (
            None
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is False
            else "allowPrivilegeEscalation is not false"
        ),
    )


def run_as_non_root(spec: dict) -> list[str]:
    pod = spec.get("securityContext", {}).get("runAsNonRoot")

    def bad(c: dict) -> str | None:
        mine = c.get("securityContext", {}).get("runAsNonRoot")
        return (
            None if mine is True or (mine is None and pod is True) else "runAsNonRoot is not true"
        )

    return _each(spec, bad)


def run_as_user(spec: dict) -> list[str]:
    pod = [] if spec.get("securityContext", {}).get("runAsUser") != 0 else ["pod runAsUser 0"]
    return pod + _each(
        spec,
        lambda c: "runAsUser 0" if c.get("securityContext", {}).get("runAsUser") == 0 else None,
    )


def seccomp(spec: dict) -> list[str]:
    pod = spec.get("securityContext", {}).get("seccompProfile", {}).get("type")
    allowed = ("RuntimeDefault", "Localhost")

    def bad(c: dict) -> str | None:
        mine = c.get("securityContext", {}).get("seccompProfile", {}).get("type")
        return (
            None
            if mine in allowed or (mine is None and pod in allowed)
            else f"seccompProfile {mine or pod}"
        )

    return _each(spec, bad)


def capabilities(spec: dict) -> list[str]:
    def bad(c: dict) -> str | None:
        caps = c.get("securityContext", {}).get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            return "capabilities do not drop ALL"
        extra = set(caps.get("add", [])) - {"NET_BIND_SERVICE"}
        return f"capabilities add {sorted(extra)}" if extra else None

    return _each(spec, bad)


RESTRICTED: dict[str, Callable[[dict], list[str]]] = {
    "baseline: host namespaces": host_namespaces,
    "baseline: privileged containers": privileged,
    "baseline: hostPath volumes": host_path_volumes,
    "baseline: host ports": host_ports,
    "baseline: AppArmor": apparmor,
    "baseline: SELinux": selinux,
    "baseline: /proc mount type": proc_mount,
    "baseline: sysctls": sysctls,
    "restricted: volume types": volume_types,
    "restricted: privilege escalation": privilege_escalation,
    "restricted: running as non-root": run_as_non_root,
    "restricted: running as non-root user": run_as_user,
    "restricted: seccomp": seccomp,
    "restricted: capabilities": capabilities,
}


def restricted_violations(where: str, spec: dict) -> list[str]:
    """Every rule ``spec`` breaks, as '<rule> (<pod>): <what>'."""
    return [f"{rule} ({where}): {why}" for rule, check in RESTRICTED.items() for why in check(spec)]


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request, helm) -> tuple[str, list[dict]]:
    return request.param, render(helm, *VALUE_SETS[request.param])


def test_every_pod_of_the_release_namespace_is_restricted(rendered):
    name, objects = rendered
    checked, executors = [], 0
    for namespace, where, template in every_pod_template(objects):
        if namespace == EXECUTOR_NAMESPACE:
            executors += 1
            continue
        assert namespace == NAMESPACE, where
        assert not restricted_violations(where, template["spec"]), name
        checked.append(where)
    assert executors == 1, name  # the only pod elsewhere
    expected = {
        "RayJob/rel-privcode head",
        "RayJob/rel-privcode group cpu",
        "RayJob/rel-privcode submitter",
        "operator template: RayJob/rel-privcode head",
        "Deployment/rel-privcode-ledger",
        "Deployment/rel-privcode-operator",
    }
    if name == "serving":
        expected |= {
            "RayService/rel-privcode-serve head",
            "RayService/rel-privcode-serve group cpu",
            "RayCluster/rel-privcode head",
            "Job/rel-privcode-stage",
        }
    if name == "paper":
        expected |= {"RayJob/rel-privcode group gpu"}
    assert expected <= set(checked), (name, sorted(expected - set(checked)))


def test_the_checker_names_the_rule_and_the_pod(default_objects):
    """Not vacuous: each rule catches its own breach (the executor breaks several)."""
    executor = executor_deployment(default_objects)["spec"]["template"]["spec"]
    found = restricted_violations("Deployment/x", executor)
    for rule in (
        "baseline: AppArmor",
        "baseline: /proc mount type",
        "restricted: running as non-root",
        "restricted: running as non-root user",
        "restricted: capabilities",
    ):
        assert any(
            f.startswith(f"{rule} (Deployment/x): executor:")
            or f.startswith(f"{rule} (Deployment/x)")
            for f in found
        ), rule
    head = next(t for _, w, t in every_pod_template(default_objects) if w.endswith("head"))
    breaches = {
        "baseline: host namespaces": {"hostPID": True},
        "baseline: hostPath volumes": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
        "restricted: volume types": {
            "volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]
        },
        "restricted: seccomp": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
        "baseline: sysctls": {
            "securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}
        },
    }
    for rule, patch in breaches.items():
        spec: dict[str, Any] = {**head["spec"], **patch}
        assert any(f.startswith(rule) for f in restricted_violations("head", spec)), rule
    container = {**head["spec"]["containers"][0], "securityContext": {"privileged": True}}
    spec = {**head["spec"], "containers": [container]}
    rules = {f.split(" (")[0] for f in restricted_violations("head", spec)}
    assert {
        "baseline: privileged containers",
        "restricted: privilege escalation",
        "restricted: capabilities",
    } <= rules


def test_the_executor_is_checked_apart(rendered):
    """In its own namespace: user namespaces, no host path or host namespace, the sandbox's
    capabilities and no more, no privileged container, its own ServiceAccount without token."""
    name, objects = rendered
    (executor,) = [(w, t) for ns, w, t in every_pod_template(objects) if ns == EXECUTOR_NAMESPACE]
    where, template = executor
    spec = template["spec"]
    assert where == "Deployment/rel-privcode-executor", name
    assert spec["hostUsers"] is False, name
    assert not host_path_volumes(spec) and not host_namespaces(spec) and not privileged(spec)
    assert spec["automountServiceAccountToken"] is False
    for container in spec["containers"]:
        caps = container["securityContext"]["capabilities"]
        assert caps["drop"] == ["ALL"] and set(caps.get("add", [])) <= SANDBOX_CAPS, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert not volume_types(spec) and not seccomp(spec), name


def test_an_unsafe_value_shows_in_the_checker(helm):
    """A podSecurityContext that runs Ray as root breaks restricted, and the test would say so."""
    objects = render(
        helm,
        "--set",
        "podSecurityContext.runAsNonRoot=false",
        "--set",
        "podSecurityContext.runAsUser=0",
    )
    found = [
        v for _, w, t in every_pod_template(objects) for v in restricted_violations(w, t["spec"])
    ]
    assert any(
        v.startswith("restricted: running as non-root user (RayJob/rel-privcode head)")
        for v in found
    )


# --------------------------------------------------------------------------- point 9: serving


def test_serving_pods_hold_no_store_and_only_the_release(helm):
    objects = render(helm, *SERVING)
    serving = [p for p in pods(objects) if p.role == "serving"]
    assert serving
    for pod in serving:
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in volumes.values()
            if "persistentVolumeClaim" in v
        }
        assert "rel-privcode-privacy-store" not in claims, pod.where
        assert volumes["artifacts"]["persistentVolumeClaim"] == {
            "claimName": "rel-privcode-artifacts",
            "readOnly": True,
        }
        (container,) = pod.spec["containers"]
        mounts = [m for m in container["volumeMounts"] if m["name"] == "artifacts"]
        # the release, the PAC worlds and the public base models; never the volume's root
        assert sorted(m["subPath"] for m in mounts) == [
            "cache",
            "runs/demo/pac/worlds",
            "runs/demo/premium",
        ], pod.where
        assert all(
            m["readOnly"] is True and m["mountPath"] == f"/mnt/artifacts/{m['subPath']}"
            for m in mounts
        )
        assert "PRIVCODE_PRIVACY_STORE" not in str(container["env"]), pod.where
    # another release path is followed; nothing without the PVC
    moved = render(
        helm,
        *SERVING,
        "--set",
        "serve.premium.args.premium=/mnt/artifacts/runs/paper/premium",
        "--set",
        "serve.artifactPaths=null",
    )
    pod = next(p for p in pods(moved) if p.role == "serving")
    assert sorted(
        m.get("subPath")
        for m in pod.spec["containers"][0]["volumeMounts"]
        if m["name"] == "artifacts"
    ) == ["runs/demo/pac/worlds", "runs/paper/premium"]
    bare = render(
        helm,
        *SERVING,
        "--set",
        "storage.pvc.enabled=false",
        "--set",
        "storage.objectStore.uri=s3://b/p",
    )
    pod = next(p for p in pods(bare) if p.role == "serving")
    assert "artifacts" not in {v["name"] for v in pod.spec["volumes"]}


def test_a_serving_path_outside_the_volume_is_refused(helm):
    from chart_support import render_error

    stderr = render_error(
        helm, *SERVING, "--set", "serve.premium.args.premium=/mnt/artifacts/../etc"
    )
    assert "storage.mountPath" in stderr, stderr


API_SERVER = "10.0.0.1"


@pytest.mark.parametrize("cidrs", [(), ("10.0.0.1/32",)])
def test_head_egress_to_the_api_server_follows_the_cidrs(helm, cidrs):
    args = [*SERVING]
    for i, cidr in enumerate(cidrs):
        args += ["--set", f"networkPolicy.apiServer.cidrs[{i}]={cidr}"]
    objects = render(helm, *args)
    policies = Policies(objects)
    heads = [
        p for p in pods(objects) if p.where.endswith("head") and p.role in ("pipeline", "serving")
    ]
    assert {p.role for p in heads} == {"pipeline", "serving"}
    elsewhere = Endpoint.outside("203.0.113.7")
    for head in heads:
        me = endpoint(head)
        assert policies.egress(me, Endpoint.outside(API_SERVER), 443), head.where
        # with the CIDRs: the API server and nothing else on its ports
        assert policies.egress(me, elsewhere, 443) is (not cidrs), head.where
        assert not policies.egress(me, Endpoint.outside(API_SERVER), 80), head.where
    workers = [p for p in pods(objects) if "group" in p.where]
    assert workers and not any(
        policies.egress(endpoint(w), Endpoint.outside(API_SERVER), 443) for w in workers
    )
