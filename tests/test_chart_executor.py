"""The Helm chart ``charts/privcode``: generated code runs only where an escape finds nothing.

Every pod the chart renders either is marked unable to run generated code
(``PRIVCODE_SANDBOX_FORBID_LOCAL=1`` on each container) or holds nothing: no
volume but emptyDir and its own bearer token, no other Secret, no ConfigMap, no
service-account token, and no network egress at all. A small NetworkPolicy
evaluator (below; namespace-aware: the executor has a namespace of its own)
computes what the rendered policies allow together, so the network claims are
about reachability, not the shape of one policy. The executor pod itself:
tests/test_chart_executor_pod.py; Pod Security of every Ray pod:
tests/test_chart_pss.py. Helpers: tests/chart_support.py; fixtures (``helm``,
``rendering``, ``default_objects``, ``ci_objects``): tests/conftest.py.
"""

from __future__ import annotations

import copy
import ipaddress
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import pytest
from chart_support import CI_VALUES, all_pod_templates, by_kind, cluster_specs, env_of, render

FORBID = "PRIVCODE_SANDBOX_FORBID_LOCAL"
EXECUTOR_ENV = "PRIVCODE_SANDBOX_EXECUTOR"
ROLE = "privcode.io/role"
NAMESPACE = "team-a"
#: Where the executor's objects render by default: <release namespace>-executor.
EXECUTOR_NAMESPACE = "team-a-executor"
TOKEN_SECRET = "rel-privcode-executor-token"
EXECUTOR_PORT = 8700
#: Volume sources that bring data or credentials into a pod.
HOLDING_VOLUMES = ("persistentVolumeClaim", "secret", "configMap", "hostPath", "projected")
#: Ports probed when a test claims "on no port" (Ray's, the executor's, the usual suspects).
PORTS = (22, 53, 443, 6379, 8000, 8080, 8265, 8700, 10001, 44217, 52365)
EVERY_ROLE = (
    "--set",
    "cluster.enabled=true",
    "--set",
    "serve.enabled=true",
    "--set",
    "apiKey.existingSecret=privcode-api-keys",
)


# --------------------------------------------------------------------------- the pods


@dataclass
class Pod:
    where: str
    labels: dict[str, str]
    spec: dict[str, Any]
    annotations: dict[str, str] = field(default_factory=dict)
    namespace: str = NAMESPACE

    @property
    def role(self) -> str:
        return self.labels.get(ROLE, "")

    def forbidden(self) -> bool:
        """Every container is told never to run generated code."""
        return all(env_of(c).get(FORBID) == "1" for c in self.spec["containers"])


def pods(objects: list[dict]) -> list[Pod]:
    """Every pod template, with the namespace its owner renders into (the release's by default)."""
    namespaces = {
        f"{o['kind']}/{o['metadata']['name']}": o["metadata"].get("namespace", NAMESPACE)
        for o in objects
    }
    return [
        Pod(
            where,
            template["metadata"].get("labels", {}),
            template["spec"],
            template["metadata"].get("annotations", {}),
            namespaces.get(where.split(" ")[0], NAMESPACE),
        )
        for where, template in all_pod_templates(objects)
    ]


def pods_of(objects: list[dict], role: str) -> list[Pod]:
    found = [p for p in pods(objects) if p.role == role]
    assert found, f"no {role} pod rendered"
    return found


def executor_objects(objects: list[dict], kind: str) -> list[dict]:
    """The executor's objects of ``kind`` (the ledger has a Deployment and a Service too)."""
    return [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith("-executor")]


def executor_deployment(objects: list[dict]) -> dict:
    (deployment,) = executor_objects(objects, "Deployment")
    return deployment


# --------------------------------------------------------------------------- a NetworkPolicy evaluator


@dataclass(frozen=True)
class Endpoint:
    """A party to a connection: a pod (labels, namespace), or an address outside the cluster
    (``ip``: None stands for any address, which every ipBlock is taken to contain)."""

    namespace: str | None
    labels: tuple[tuple[str, str], ...] = ()
    ip: str | None = None

    @staticmethod
    def pod(labels: dict[str, str], namespace: str = NAMESPACE) -> Endpoint:
        return Endpoint(namespace, tuple(sorted(labels.items())))

    @staticmethod
    def outside(ip: str | None = None) -> Endpoint:
        return Endpoint(None, ip=ip)

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A LabelSelector against labels (an empty selector selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict, other: Endpoint, policy_namespace: str) -> bool:
    """NetworkPolicyPeer semantics: ipBlock is outside the cluster, a podSelector alone is the
    policy's namespace, a namespaceSelector (with or without podSelector) other namespaces."""
    if "ipBlock" in peer:
        return other.namespace is None and in_block(peer["ipBlock"], other.ip)
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        ns_labels = {"kubernetes.io/metadata.name": other.namespace}
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif other.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], other.label_map)


def in_block(block: dict, ip: str | None) -> bool:
    """An IPBlock (cidr, except) against an address; None is any address: taken as inside."""
    if ip is None:
        return True
    address = ipaddress.ip_address(ip)
    if address not in ipaddress.ip_network(block["cidr"]):
        return False
    return not any(address in ipaddress.ip_network(e) for e in block.get("except", []))


def port_matches(rule_ports: list[dict] | None, protocol: str, port: int) -> bool:
    if not rule_ports:
        return True  # no ports: every port
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        number = p.get("port")
        if number is None or isinstance(number, str):  # any port / a named one: assume it matches
            return True
        if number <= port <= p.get("endPort", number):
            return True
    return False


class Policies:
    """The rendered NetworkPolicies, each in its namespace (the release's unless it names one)."""

    def __init__(self, objects: list[dict]):
        self.specs = [
            (p["metadata"].get("namespace", NAMESPACE), p["spec"])
            for p in by_kind(objects, "NetworkPolicy")
        ]

    def _selecting(self, pod: Endpoint, kind: str) -> list[tuple[str, dict]]:
        """(namespace, spec) of the ``kind`` policies that select ``pod`` (in its namespace)."""
        return [
            (ns, s)
            for ns, s in self.specs
            if ns == pod.namespace
            and kind in s.get("policyTypes", ["Ingress"])
            and selects(s["podSelector"], pod.label_map)
        ]

    def isolated(self, pod: Endpoint, kind: str) -> bool:
        return bool(self._selecting(pod, kind))

    def rules(self, pod: Endpoint, kind: str) -> list[dict]:
        """The union of the ``kind`` rules (ingress / egress) of the policies selecting ``pod``."""
        key = kind.lower()
        return [r for _, s in self._selecting(pod, kind) for r in s.get(key) or []]

    def _allows(self, pod: Endpoint, kind: str, other: Endpoint, protocol: str, port: int) -> bool:
        if not self.isolated(pod, kind):
            return True
        side = "from" if kind == "Ingress" else "to"
        for namespace, spec in self._selecting(pod, kind):
            for rule in spec.get(kind.lower()) or []:
                peers = rule.get(side)
                if peers and not any(peer_matches(p, other, namespace) for p in peers):
                    continue
                if port_matches(rule.get("ports"), protocol, port):
                    return True
        return False

    def egress(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
        return self._allows(src, "Egress", dst, protocol, port)

    def ingress(self, dst: Endpoint, src: Endpoint, port: int, protocol: str = "TCP") -> bool:
        return self._allows(dst, "Ingress", src, protocol, port)

    def reach(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
        """A connection needs the source's egress and, inside the cluster, the destination's ingress."""
        if not self.egress(src, dst, port, protocol):
            return False
        return dst.namespace is None or self.ingress(dst, src, port, protocol)


def endpoint(pod: Pod) -> Endpoint:
    return Endpoint.pod(pod.labels, pod.namespace)


#: Parties outside the release: cluster DNS, the KubeRay operator, monitoring, an ingress
#: controller, another tenant's pod in the release namespace, the internet.
OTHERS = {
    "dns": Endpoint.pod({"k8s-app": "kube-dns"}, "kube-system"),
    "operator": Endpoint.pod({"app.kubernetes.io/name": "kuberay-operator"}, "ray-system"),
    "operator-ci": Endpoint.pod({"app.kubernetes.io/name": "kuberay-operator"}, "kuberay"),
    "monitoring": Endpoint.pod({"app": "prometheus"}, "monitoring"),
    "ingress": Endpoint.pod({"app": "ingress-nginx"}, "ingress-nginx"),
    "neighbour": Endpoint.pod({"app": "something-else"}),
    "internet": Endpoint.outside(),
}


# --------------------------------------------------------------------------- 1. every pod


def _holds_nothing(pod: Pod, policies: Policies) -> list[str]:
    """Why ``pod`` could give an escape something (empty: it holds nothing, reaches nothing)."""
    problems = []
    for volume in pod.spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if volume.get("secret", {}).get("secretName") == TOKEN_SECRET:
            continue  # its own bearer token: it opens this service, nothing else
        if kinds & set(HOLDING_VOLUMES) or kinds != {"emptyDir"}:
            problems.append(f"volume {volume['name']}: {sorted(kinds)}")
    for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
        if container.get("envFrom"):
            problems.append(f"{container['name']}: envFrom {container['envFrom']}")
        for env in container.get("env", []):
            source = env.get("valueFrom") or {}
            if "secretKeyRef" in source or "configMapKeyRef" in source:
                problems.append(f"{container['name']}: env {env['name']} from {source}")
    if pod.spec.get("automountServiceAccountToken") is not False:
        problems.append("automountServiceAccountToken is not false")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.spec.get(key):
            problems.append(f"{key}: true")
    me = endpoint(pod)
    if not policies.isolated(me, "Egress"):
        problems.append("no NetworkPolicy with policyType Egress selects it")
    elif policies.rules(me, "Egress"):
        problems.append(f"egress rules apply to it: {policies.rules(me, 'Egress')}")
    return problems


def test_every_pod_cannot_run_code_or_holds_nothing(rendering):
    """Each pod template is marked FORBID on every container, or is an executor that holds and
    reaches nothing; there is at least one executor."""
    name, objects = rendering
    policies = Policies(objects)
    executors = 0
    for pod in pods(objects):
        if pod.forbidden():
            assert pod.role in ("pipeline", "submitter", "serving", "ledger", "operator"), (
                f"{name}: {pod.where}"
            )
            continue
        problems = _holds_nothing(pod, policies)
        assert not problems, f"{name}: {pod.where} may run generated code but: {problems}"
        assert pod.role == "executor", f"{name}: {pod.where}"
        executors += 1
    assert executors, f"{name}: no executor pod rendered"
    # the autoscaler sidecar KubeRay adds to heads is told the same
    for owner, spec in cluster_specs(objects):
        if "autoscalerOptions" in spec:
            env = {e["name"]: e.get("value") for e in spec["autoscalerOptions"]["env"]}
            assert env[FORBID] == "1", f"{name}: {owner} autoscaler"


def test_ray_pods_are_sent_to_the_executor_service(default_objects, ci_objects):
    for objects in (default_objects, ci_objects):
        (service,) = executor_objects(objects, "Service")
        url = urllib.parse.urlsplit(
            env_of(pods_of(objects, "pipeline")[0].spec["containers"][0])[EXECUTOR_ENV]
        )
        assert url.scheme == "http"
        # the FQDN in the executor's own namespace, where the Service is
        assert service["metadata"]["namespace"] == EXECUTOR_NAMESPACE
        assert url.hostname == f"{service['metadata']['name']}.{EXECUTOR_NAMESPACE}.svc"
        assert url.port == service["spec"]["ports"][0]["port"] == EXECUTOR_PORT
        executor = executor_deployment(objects)["spec"]["template"]
        # the Service selects exactly the executor pods
        assert selects({"matchLabels": service["spec"]["selector"]}, executor["metadata"]["labels"])
        for pod in pods(objects):
            if pod.role != "executor":
                assert not selects({"matchLabels": service["spec"]["selector"]}, pod.labels)
                for container in pod.spec["containers"]:
                    env = env_of(container)
                    assert env[FORBID] == "1", pod.where
                    # the ledger and the operator send no code anywhere
                    want = None if pod.role in ("ledger", "operator") else url.geturl()
                    assert env.get(EXECUTOR_ENV) == want, pod.where
    assert service["metadata"]["name"] == "rel-privcode-executor"


# --------------------------------------------------------------------------- 2. the network


@pytest.fixture(scope="module")
def everything(helm) -> list[dict]:
    """The CI values (every role: RayJob + submitter, RayCluster, RayService, executor)."""
    objects = render(helm, "-f", str(CI_VALUES))
    roles = {p.role for p in pods(objects)}
    assert roles == {"pipeline", "submitter", "serving", "executor", "ledger", "operator"}
    return objects


@pytest.mark.parametrize("values", ["defaults", "everything"])
def test_executors_reach_nothing(values, default_objects, everything):
    objects = default_objects if values == "defaults" else everything
    policies = Policies(objects)
    all_pods = pods(objects)
    for executor in pods_of(objects, "executor"):
        me = endpoint(executor)
        assert policies.isolated(me, "Egress") and not policies.rules(me, "Egress")
        for other in all_pods:
            for port in PORTS:
                assert not policies.reach(me, endpoint(other), port), (other.where, port)
        for what, other in OTHERS.items():
            for port in PORTS:
                for protocol in ("TCP", "UDP"):
                    assert not policies.egress(me, other, port, protocol), (what, port, protocol)


@pytest.mark.parametrize("values", ["defaults", "everything"])
def test_only_pipeline_pods_reach_the_executor_and_only_on_its_port(
    values, default_objects, everything
):
    objects = default_objects if values == "defaults" else everything
    policies = Policies(objects)
    for executor in pods_of(objects, "executor"):
        me = endpoint(executor)
        for other in pods(objects):
            for port in PORTS:
                allowed = other.role == "pipeline" and port == EXECUTOR_PORT
                # the executor's own ingress, whatever the other side's egress says
                assert policies.ingress(me, endpoint(other), port) == allowed, (other.where, port)
                assert policies.reach(endpoint(other), me, port) == allowed, (other.where, port)
        for what, other in OTHERS.items():
            for port in PORTS:
                assert not policies.ingress(me, other, port), (what, port)


def test_serving_pods_are_out_of_the_executors_reach(everything):
    policies = Policies(everything)
    heads = [p for p in pods_of(everything, "serving") if p.where.endswith("head")]
    for serving in pods_of(everything, "serving"):
        for executor in pods_of(everything, "executor"):
            for port in PORTS:
                assert not policies.ingress(endpoint(serving), endpoint(executor), port), port
                assert not policies.reach(endpoint(executor), endpoint(serving), port), port
        # what the serving cluster does need still works
        assert policies.reach(endpoint(serving), endpoint(heads[0]), 6379)
        assert policies.reach(OTHERS["ingress"], endpoint(heads[0]), 8000)
        assert policies.reach(OTHERS["operator-ci"], endpoint(heads[0]), 52365)
        assert policies.reach(endpoint(serving), OTHERS["dns"], 53, "UDP")


def test_the_pipeline_and_the_submitter_keep_what_they_need(everything):
    policies = Policies(everything)
    pipeline = pods_of(everything, "pipeline")
    heads = [p for p in pipeline if p.where.endswith("head")]
    executor = endpoint(pods_of(everything, "executor")[0])
    for pod in pipeline:
        assert policies.reach(endpoint(pod), executor, EXECUTOR_PORT), pod.where
        assert not policies.reach(endpoint(pod), executor, 8265), pod.where
        assert policies.reach(endpoint(pod), endpoint(heads[0]), 6379), pod.where
        assert policies.reach(endpoint(pod), OTHERS["dns"], 53, "UDP"), pod.where
        # the object store (networkPolicy.extraEgress in the CI values)
        assert policies.egress(endpoint(pod), OTHERS["internet"], 443), pod.where
        assert not policies.ingress(endpoint(pod), OTHERS["neighbour"], 8265), pod.where
    for submitter in pods_of(everything, "submitter"):
        me = endpoint(submitter)
        assert all(policies.reach(me, endpoint(h), 8265) for h in heads)
        assert not policies.reach(me, endpoint(heads[0]), 6379)
        assert not policies.reach(me, executor, EXECUTOR_PORT)
        assert not policies.egress(me, OTHERS["internet"], 443)
        for other in pods(everything):
            assert not policies.ingress(me, endpoint(other), 8265), other.where
    # the executor never gets networkPolicy.extraEgress / extraIngress
    assert not policies.egress(executor, OTHERS["internet"], 443)


def test_the_evaluator_sees_an_open_policy(default_objects):
    """The evaluator is not vacuous: the old single all-open policy would let executors out."""
    objects = copy.deepcopy(default_objects)
    release = {"app.kubernetes.io/name": "privcode", "app.kubernetes.io/instance": "rel"}
    objects.append(
        {
            "kind": "NetworkPolicy",
            "metadata": {"name": "old"},
            "spec": {
                "podSelector": {"matchLabels": release},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": release}}]}],
                "egress": [{"to": [{"podSelector": {"matchLabels": release}}]}],
            },
        }
    )
    policies = Policies(objects)
    executor = Endpoint.pod(pods_of(objects, "executor")[0].labels)  # as in the old layout
    head = endpoint(next(p for p in pods(objects) if p.where.endswith("head")))
    assert policies.reach(executor, head, 6379)
    assert policies.ingress(executor, OTHERS["neighbour"], 8700) is False
    assert Policies([]).reach(executor, OTHERS["internet"], 443)  # no policy: all open
    assert selects({"matchExpressions": [{"key": ROLE, "operator": "NotIn", "values": ["x"]}]}, {})


# --------------------------------------------------------------------------- 3. volumes


@pytest.mark.parametrize(
    "extra, claims",
    [
        ((), {"rel-privcode-artifacts", "rel-privcode-privacy-store"}),
        (
            (
                "--set",
                "storage.pvc.existingClaim=shared-artifacts",
                "--set",
                "storage.privacyStore.existingClaim=budgets",
            ),
            {"shared-artifacts", "budgets"},
        ),
    ],
    ids=["created", "existing"],
)
def test_private_claims_never_reach_an_executor(helm, extra, claims):
    objects = render(helm, *EVERY_ROLE, *extra)
    store = next(c for c in sorted(claims) if "budget" in c or "privacy" in c)
    artifacts = claims - {store}
    for pod in pods(objects):
        mounted = {
            v["persistentVolumeClaim"]["claimName"]
            for v in pod.spec.get("volumes", [])
            if "persistentVolumeClaim" in v
        }
        if pod.role == "executor":
            assert not mounted, pod.where
            assert {m["mountPath"] for c in pod.spec["containers"] for m in c["volumeMounts"]} == {
                "/tmp",
                "/var/run/privcode/executor-token",
            }
            assert {v["name"]: v for v in pod.spec["volumes"]}["tmp"] == {
                "name": "tmp",
                "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"},
            }
        elif pod.role == "pipeline":
            assert mounted == claims, pod.where  # the store (read-only) and the artifacts
        elif pod.role == "serving":
            # no store (the ledger service's PAC calls); of the artifacts, the release's
            # directories only, read-only (tests/test_chart_pss.py)
            assert mounted == artifacts, pod.where
            assert all(
                v["persistentVolumeClaim"].get("readOnly") is True
                for v in pod.spec["volumes"]
                if "persistentVolumeClaim" in v
            ), pod.where
        elif pod.role == "ledger":
            assert mounted == {store}, pod.where  # the store's one writer
        elif pod.role == "operator":
            # the store's reader, and the artifacts (read-only, for each run's progress); no
            # data claim by default
            assert mounted == claims, pod.where
        else:
            assert not mounted, pod.where  # the submitter
