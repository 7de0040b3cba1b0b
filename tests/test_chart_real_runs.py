"""The Helm chart for real runs: observability, and the data and models of jobs/configs/paper.yaml.

Observability: Prometheus scrape annotations on the Ray pods (or, with
``metrics.podMonitor.enabled``, a ``monitoring.coreos.com/v1`` PodMonitor, checked field by
field: no PodMonitor CRD schema is available offline), the Ray dashboard's Grafana /
Prometheus variables on the heads, the heads' egress to them, the Grafana sidecar label.
Real runs: ``storage.data`` / ``storage.models`` read-only on the pipeline's Ray pods (never
on an executor, the submitter or, for the data, the serving pods and the operator's
template), the staging Job, and charts/paper-values.yaml rendered with paper.yaml and
validated object by object, its paths mounted and its stages placeable. Helpers:
tests/chart_support.py; fixtures (``helm``, ``crds``, ``default_objects``): tests/conftest.py.
"""

from __future__ import annotations

import copy
import re
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml
from chart_support import (
    CHART,
    K8S_VERSIONS,
    RAY_KINDS,
    ROOT,
    by_kind,
    cluster_specs,
    crd_problems,
    env_of,
    k8s_problems,
    one,
    pod_templates,
    render,
    render_error,
    run_helm,
)
from test_chart_executor import OTHERS, Endpoint, Policies, endpoint, pods, selects

from privcode.cluster import k8s

PAPER_VALUES = ROOT / "charts" / "paper-values.yaml"
PAPER_CONFIG = ROOT / "jobs" / "configs" / "paper.yaml"
PAPER = ("-f", str(PAPER_VALUES), "--set-file", f"pipeline.config={PAPER_CONFIG}")
NAMESPACE = "team-a"
ROLE = "privcode.io/role"
DATA, MODELS = "/mnt/data", "/mnt/models"
DATA_CLAIM, MODELS_CLAIM = "rel-privcode-data", "rel-privcode-models"
TEMPLATE = "rel-privcode-operator-template"
OPERATOR = "rel-privcode-operator"
SCRAPE = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": "8080",
    "prometheus.io/path": "/metrics",
}
DASHBOARD_ENV = ("RAY_GRAFANA_HOST", "RAY_PROMETHEUS_HOST", "RAY_GRAFANA_IFRAME_HOST")
HOSTS = (
    "--set",
    "metrics.grafanaHost=http://grafana.monitoring.svc:80",
    "--set",
    "metrics.prometheusHost=http://prometheus.monitoring.svc:9090",
    "--set",
    "metrics.grafanaIframeHost=http://127.0.0.1:3000",
)
SERVE = ("--set", "serve.enabled=true", "--set", "apiKey.existingSecret=keys")
STORAGE = ("--set", "storage.data.enabled=true", "--set", "storage.models.enabled=true")
STAGE = ("--set", "stage.enabled=true", "--set", "stage.command=cp -r /seed/. $MODELS_DIR/")
MONITOR = ("--set", "metrics.podMonitor.enabled=true")
#: Every new part at once (helm lint, the mount checks).
EVERYTHING_NEW = (
    *STORAGE,
    *STAGE,
    *MONITOR,
    *HOSTS,
    *SERVE,
    "--set",
    "cluster.enabled=true",
    "--set",
    "serve.ensemble.enabled=true",
    "--set",
    "autoscaling.enableInTreeAutoscaling=true",
    "--set",
    "grafanaDashboard.enabled=true",
    "--set",
    "networkPolicy.metricsIngress.from[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
    "--set",
    "networkPolicy.metricsEgress.to[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
    "--set",
    "operator.dataClaims={corpus-acme}",
)

# The PodMonitor fields this chart may use (monitoring.coreos.com/v1, prometheus-operator
# v0.91's CRD: spec.selector, namespaceSelector, podMetricsEndpoints[] and their relabelings).
PODMONITOR_SPEC = {
    "selector",
    "namespaceSelector",
    "podMetricsEndpoints",
    "jobLabel",
    "podTargetLabels",
}
ENDPOINT_FIELDS = {
    "port",
    "path",
    "interval",
    "scrapeTimeout",
    "relabelings",
    "scheme",
    "honorLabels",
}
RELABEL_FIELDS = {"action", "sourceLabels", "targetLabel", "regex", "replacement", "separator"}
#: Prometheus durations (the CRD's pattern for interval / scrapeTimeout, simplified).
DURATION = re.compile(
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)


def ray_pods(objects: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod template) of every Ray head and worker (no submitter)."""
    return [(w, t) for w, t in pod_templates(objects) if not w.endswith("submitter")]


def mounts_of(template: dict) -> dict[str, dict]:
    """mountPath -> volumeMount of the pod's first container."""
    return {m["mountPath"]: m for m in template["spec"]["containers"][0].get("volumeMounts", [])}


def volumes_of(template: dict) -> dict[str, dict]:
    return {v["name"]: v for v in template["spec"].get("volumes", [])}


def claims_of(template: dict) -> set[str]:
    return {
        v["persistentVolumeClaim"]["claimName"]
        for v in template["spec"].get("volumes", [])
        if "persistentVolumeClaim" in v
    }


def every_pod_template(objects: list[dict]) -> list[tuple[str, dict]]:
    """Ray pods, submitters, Deployments and Jobs: every pod the rendering makes."""
    found = list(pod_templates(objects))
    for kind in ("Deployment", "Job"):
        for obj in by_kind(objects, kind):
            found.append((f"{kind}/{obj['metadata']['name']}", obj["spec"]["template"]))
    return found


def validate_all(helm: str, *args: str) -> None:
    """Every object of the rendering as a cluster would check it, rendered for each supported
    Kubernetes version (the chart adapts to it) and checked there; Ray resources against the
    KubeRay CRDs, their pod templates also as Pods; the PodMonitor field by field."""
    for version in K8S_VERSIONS:
        objects = render(helm, *args, "--kube-version", version)
        for obj in objects:
            where = f"{version} {obj['kind']}/{obj['metadata']['name']}"
            if obj["kind"] in RAY_KINDS:
                assert not crd_problems(obj), f"{where}: {crd_problems(obj)}"
            elif obj["kind"] == "PodMonitor":
                assert_podmonitor_shape(obj)
            else:
                assert not k8s_problems(obj, (version,)), (
                    f"{where}: {k8s_problems(obj, (version,))}"
                )
        for where, template in pod_templates(objects):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p"},
                "spec": template["spec"],
            }
            assert not k8s_problems(pod, (version,)), f"{version} {where}"


def assert_podmonitor_shape(monitor: dict) -> None:
    """The PodMonitor's fields, as the Prometheus Operator's CRD declares them."""
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "PodMonitor"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", monitor["metadata"]["name"])
    assert all(isinstance(v, str) for v in monitor["metadata"]["labels"].values())
    spec = monitor["spec"]
    assert set(spec) <= PODMONITOR_SPEC, set(spec) - PODMONITOR_SPEC
    selector = spec["selector"]
    assert set(selector) <= {"matchLabels", "matchExpressions"}
    for expr in selector.get("matchExpressions", []):
        assert set(expr) <= {"key", "operator", "values"}
        assert expr["operator"] in {"In", "NotIn", "Exists", "DoesNotExist"}
    assert set(spec["namespaceSelector"]) <= {"any", "matchNames"}
    assert all(isinstance(n, str) for n in spec["namespaceSelector"].get("matchNames", []))
    assert spec["podMetricsEndpoints"]
    for ep in spec["podMetricsEndpoints"]:
        assert set(ep) <= ENDPOINT_FIELDS, set(ep) - ENDPOINT_FIELDS
        assert isinstance(ep["port"], str) and len(ep["port"]) <= 15  # a container port's name
        assert ep["path"].startswith("/")
        for key in ("interval", "scrapeTimeout"):
            if key in ep:
                assert DURATION.match(ep[key]), ep[key]
        for rule in ep.get("relabelings", []):
            assert set(rule) <= RELABEL_FIELDS, set(rule) - RELABEL_FIELDS
            assert rule["action"] in {"replace", "keep", "drop", "labelmap"}
            assert all(re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", s) for s in rule["sourceLabels"])
            assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", rule["targetLabel"])


def pod_endpoint(template: dict) -> Endpoint:
    return Endpoint.pod(template["metadata"].get("labels", {}))


# =========================================================================== observability


def test_ray_pods_carry_scrape_annotations_unless_a_podmonitor_scrapes_them(helm, default_objects):
    seen = 0
    for where, template in ray_pods(default_objects):
        annotations = template["metadata"]["annotations"]
        assert {k: annotations.get(k) for k in SCRAPE} == SCRAPE, where
        seen += 1
    assert seen >= 2  # the RayJob's head and cpu workers
    # the port they name is the Ray containers' metrics port
    for where, template in ray_pods(default_objects):
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == 8080, where
    # no other pod claims to serve metrics: submitter, executor, ledger, operator
    for where, template in every_pod_template(default_objects):
        if (where, template) in ray_pods(default_objects):
            continue
        assert not set(SCRAPE) & set(template["metadata"].get("annotations") or {}), where
    # the operator's RayJob template (its runs' pods) is annotated too
    template = yaml.safe_load(
        next(c for c in by_kind(default_objects, "ConfigMap") if c["metadata"]["name"] == TEMPLATE)[
            "data"
        ]["rayjob-template.yaml"]
    )
    head = template["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    assert SCRAPE.items() <= head["metadata"]["annotations"].items()
    for args in (MONITOR, ("--set", "metrics.scrapeAnnotations=false")):
        for where, template in ray_pods(render(helm, *args, *SERVE)):
            assert not set(SCRAPE) & set(template["metadata"]["annotations"]), (args, where)


def test_no_podmonitor_by_default(default_objects):
    assert not by_kind(default_objects, "PodMonitor")


@pytest.mark.parametrize("autoscaling", [False, True])
def test_the_podmonitor_scrapes_the_ray_pods_and_nothing_else(helm, autoscaling):
    objects = render(
        helm,
        *MONITOR,
        *SERVE,
        "--set",
        "cluster.enabled=true",
        "--set",
        f"autoscaling.enableInTreeAutoscaling={str(autoscaling).lower()}",
        "--set",
        "metrics.podMonitor.labels.release=kube-prometheus-stack",
        "--set",
        "metrics.podMonitor.scrapeTimeout=10s",
        "--set",
        "operator.namespaces={team-b,team-a}",
    )
    monitor = one(objects, "PodMonitor")
    assert_podmonitor_shape(monitor)
    assert monitor["metadata"]["name"] == "rel-privcode-ray"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    # the release's namespace and the operator's watched ones (its runs' pipeline pods)
    assert spec["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    # it selects every Ray head and worker, pipeline and serving, and no other pod
    selected, others = [], []
    for where, template in every_pod_template(objects):
        labels = template["metadata"].get("labels", {})
        (selected if selects(spec["selector"], labels) else others).append((where, template))
    assert sorted(w for w, _ in selected) == sorted(w for w, _ in ray_pods(objects))
    assert {t["metadata"]["labels"][ROLE] for _, t in selected} == {"pipeline", "serving"}
    assert any("submitter" in w for w, _ in others) and any("executor" in w for w, _ in others)
    assert any("ledger" in w for w, _ in others) and any("operator" in w for w, _ in others)
    # each endpoint names a port the selected pods declare: metrics on every Ray pod, the
    # dashboard's (and the autoscaler's) on the heads
    endpoints = {ep["port"]: ep for ep in spec["podMetricsEndpoints"]}
    expected = {"metrics": 8080, "dash-metrics": 44227} | (
        {"as-metrics": 44217} if autoscaling else {}
    )
    assert set(endpoints) == set(expected)
    for where, template in selected:
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == 8080, where
        if "head" in where:
            assert {k: ports.get(k) for k in expected} == expected, where
        else:
            assert "dash-metrics" not in ports and "as-metrics" not in ports, where
    for ep in endpoints.values():
        assert ep["path"] == "/metrics" and ep["interval"] == "30s" and ep["scrapeTimeout"] == "10s"
        targets = {r["targetLabel"]: r["sourceLabels"] for r in ep["relabelings"]}
        assert targets == {
            "ray_io_cluster": ["__meta_kubernetes_pod_label_ray_io_cluster"],
            "privcode_role": ["__meta_kubernetes_pod_label_privcode_io_role"],
        }
    # the NetworkPolicies let the scrape in once metricsIngress names Prometheus
    scraped = render(
        helm,
        *MONITOR,
        *SERVE,
        "--set",
        f"autoscaling.enableInTreeAutoscaling={str(autoscaling).lower()}",
        "--set",
        "networkPolicy.metricsIngress.from[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
    )
    policies = Policies(scraped)
    for pod in pods(scraped):
        reachable = policies.reach(OTHERS["monitoring"], endpoint(pod), 8080)
        assert reachable == (pod.role in {"pipeline", "serving"}), pod.where
        for port in expected.values():
            if pod.role in {"pipeline", "serving"}:
                assert policies.reach(OTHERS["monitoring"], endpoint(pod), port), (pod.where, port)


def test_the_operator_serves_its_metrics_only_when_asked(helm, default_objects):
    """`privcode operator --metrics-port` (runs by phase, admissions, reconcile errors): off by
    default (no port, nothing reaches the pod); on, the port alone, to metricsIngress.from."""

    def operator(objects: list[dict]) -> dict:
        (deployment,) = [
            d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == OPERATOR
        ]
        return deployment["spec"]["template"]

    template = operator(default_objects)
    (container,) = template["spec"]["containers"]
    assert "--metrics-port" not in container["command"] and "ports" not in container
    assert not set(SCRAPE) & set(template["metadata"]["annotations"])
    monitoring = (
        "--set",
        "networkPolicy.metricsIngress.from[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
    )
    on = ("--set", "operator.metrics.enabled=true", "--set", "operator.metrics.port=9100")
    objects = render(helm, *on, *monitoring)
    template = operator(objects)
    (container,) = template["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--metrics-port") + 1] == "9100"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    policies = Policies(objects)
    (me,) = [endpoint(p) for p in pods(objects) if p.role == "operator"]
    assert policies.reach(OTHERS["monitoring"], me, 9100)
    for port in (8080, 8265, 8790):
        assert not policies.reach(OTHERS["monitoring"], me, port), port
    for what, other in OTHERS.items():
        if what != "monitoring":
            assert not policies.ingress(me, other, 9100), what
    for pod in pods(objects):
        if pod.role != "operator":
            assert not policies.reach(endpoint(pod), me, 9100), pod.where
    # without metricsIngress.from nothing reaches it, port or not
    assert not Policies(render(helm, *on)).ingress(me, OTHERS["monitoring"], 9100)
    # the PodMonitor scrapes it on `metrics` (no annotations then)
    objects = render(helm, *on, *MONITOR)
    monitor = one(objects, "PodMonitor")
    assert_podmonitor_shape(monitor)
    template = operator(objects)
    assert selects(monitor["spec"]["selector"], template["metadata"]["labels"])
    assert not set(SCRAPE) & set(template["metadata"]["annotations"])
    assert "metrics" in {ep["port"] for ep in monitor["spec"]["podMetricsEndpoints"]}
    ledger = next(
        d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-ledger")
    )
    assert not selects(
        monitor["spec"]["selector"], ledger["spec"]["template"]["metadata"]["labels"]
    )


def test_the_dashboard_finds_grafana_and_prometheus_on_the_heads_only(helm, default_objects):
    objects = render(
        helm,
        *HOSTS,
        *SERVE,
        "--set",
        "cluster.enabled=true",
        "--set",
        "autoscaling.enableInTreeAutoscaling=true",
    )
    heads = 0
    for owner, spec in cluster_specs(objects):
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        assert {k: env_of(head).get(k) for k in DASHBOARD_ENV} == {
            "RAY_GRAFANA_HOST": "http://grafana.monitoring.svc:80",
            "RAY_PROMETHEUS_HOST": "http://prometheus.monitoring.svc:9090",
            "RAY_GRAFANA_IFRAME_HOST": "http://127.0.0.1:3000",
        }, owner
        heads += 1
        for group in spec.get("workerGroupSpecs", []):
            container = group["template"]["spec"]["containers"][0]
            assert not set(DASHBOARD_ENV) & set(env_of(container)), (owner, group["groupName"])
        autoscaler = spec["autoscalerOptions"]
        assert not set(DASHBOARD_ENV) & {e["name"] for e in autoscaler.get("env", [])}, owner
    assert heads == 3  # RayJob, RayCluster, RayService
    for job in by_kind(objects, "RayJob"):
        submitter = job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
        assert not set(DASHBOARD_ENV) & set(env_of(submitter))
    # empty values leave the variables unset (Ray's defaults apply)
    for where, template in ray_pods(default_objects):
        assert not set(DASHBOARD_ENV) & set(env_of(template["spec"]["containers"][0])), where
    # only RAY_GRAFANA_HOST set: only it
    objects = render(helm, "--set", "metrics.grafanaHost=http://g:3000")
    head = one(objects, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    env = env_of(head["spec"]["containers"][0])
    assert env["RAY_GRAFANA_HOST"] == "http://g:3000"
    assert "RAY_PROMETHEUS_HOST" not in env and "RAY_GRAFANA_IFRAME_HOST" not in env


@pytest.mark.parametrize("where", ["head.env", "extraEnv"])
def test_a_dashboard_variable_is_set_in_one_place(helm, where):
    stderr = render_error(
        helm,
        "--set",
        "metrics.prometheusHost=http://p:9090",
        "--set",
        f"{where}[0].name=RAY_PROMETHEUS_HOST",
        "--set",
        f"{where}[0].value=http://other:9090",
    )
    assert f"{where} sets RAY_PROMETHEUS_HOST" in stderr, stderr
    # without metrics.prometheusHost, head.env may set it (as before)
    objects = render(
        helm,
        "--set",
        "head.env[0].name=RAY_PROMETHEUS_HOST",
        "--set",
        "head.env[0].value=http://x:1",
    )
    head = one(objects, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    assert env_of(head["spec"]["containers"][0])["RAY_PROMETHEUS_HOST"] == "http://x:1"


def test_the_heads_reach_prometheus_and_grafana_only_when_named(helm, default_objects):
    assert not [
        p
        for p in by_kind(default_objects, "NetworkPolicy")
        if "dashboard-metrics" in p["metadata"]["name"]
    ]
    objects = render(
        helm,
        *HOSTS,
        *SERVE,
        "--set",
        "networkPolicy.metricsEgress.to[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
    )
    (policy,) = [
        p
        for p in by_kind(objects, "NetworkPolicy")
        if p["metadata"]["name"] == "rel-privcode-dashboard-metrics"
    ]
    assert not k8s_problems(policy)
    assert policy["spec"]["policyTypes"] == ["Egress"]
    policies = Policies(objects)
    prometheus = OTHERS["monitoring"]
    for pod in pods(objects):
        head = pod.labels.get("app.kubernetes.io/component") == "ray-head"
        for port in (9090, 3000):
            assert policies.egress(endpoint(pod), prometheus, port) == (
                head and pod.role in {"pipeline", "serving"}
            ), (pod.where, port)
        if pod.role in {"pipeline", "serving"}:  # those ports only
            assert not policies.egress(endpoint(pod), prometheus, 443), pod.where


def test_grafana_dashboards_carry_the_sidecar_label(helm):
    def dashboard(*args: str) -> dict:
        (config_map,) = [
            c
            for c in by_kind(
                render(helm, "--set", "grafanaDashboard.enabled=true", *args), "ConfigMap"
            )
            if c["metadata"]["name"] == "rel-privcode-grafana"
        ]
        assert not k8s_problems(config_map)
        return config_map

    # kube-prometheus-stack's sidecar default: grafana_dashboard: "1"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["grafanaDashboard"]["labels"] == {"grafana_dashboard": "1"}
    assert dashboard()["metadata"]["labels"]["grafana_dashboard"] == "1"
    # another label beside it, or instead of it (null drops the default key)
    labels = dashboard("--set", "grafanaDashboard.labels.team=ml")["metadata"]["labels"]
    assert labels["grafana_dashboard"] == "1" and labels["team"] == "ml"
    labels = dashboard(
        "--set",
        "grafanaDashboard.labels.grafana_dashboard=null",
        "--set",
        "grafanaDashboard.labels.my_dashboards=yes",
    )["metadata"]["labels"]
    assert "grafana_dashboard" not in labels and labels["my_dashboards"] == "yes"
    assert dashboard("--set", "grafanaDashboard.annotations.grafana_folder=privcode")["metadata"][
        "annotations"
    ] == {"grafana_folder": "privcode"}


# =========================================================================== the values


@pytest.mark.parametrize(
    "setting, field",
    [
        ("metrics.grafanaHost=grafana:3000", "metrics.grafanaHost"),
        ("metrics.prometheusHost=prometheus", "metrics.prometheusHost"),
        ("metrics.podMonitor.interval=30 seconds", "metrics.podMonitor.interval"),
        ("metrics.podMonitor.enable=true", "metrics.podMonitor"),
        ("storage.data.mountPath=mnt/data", "storage.data.mountPath"),
        ("storage.models.existingClaim=Bad_Name", "storage.models.existingClaim"),
        ("storage.models.accessModes={ReadWriteSometimes}", "storage.models.accessModes.0"),
        ("stage.backoffLimit=-1", "stage.backoffLimit"),
        ("networkPolicy.metricsEgress.ports={0}", "networkPolicy.metricsEgress.ports.0"),
    ],
)
def test_values_schema_rejects_bad_new_values(helm, setting, field):
    stderr = render_error(helm, "--set", setting)
    assert "schema" in stderr, stderr
    assert field in stderr or "/" + field.replace(".", "/") in stderr, stderr


def test_helm_lint_strict_with_every_new_part(helm):
    done = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *EVERYTHING_NEW)
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_helm(helm, "lint", "--strict", str(CHART), *PAPER)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_new_part_validates(helm, crds):
    validate_all(helm, *EVERYTHING_NEW)


# =========================================================================== data and models


@pytest.fixture(scope="module")
def paper(helm) -> list[dict]:
    return render(helm, *PAPER)


def test_paper_values_render_and_validate(helm, paper, crds):
    kinds = {o["kind"] for o in paper}
    # paper.yaml needs neither the PodMonitor nor the staging Job (both stay opt-in)
    assert "PodMonitor" not in kinds and "Job" not in kinds
    validate_all(helm, *PAPER)
    # the config shipped is paper.yaml itself
    config_map = next(
        c for c in by_kind(paper, "ConfigMap") if "pipeline.yaml" in c.get("data", {})
    )
    assert yaml.safe_load(config_map["data"]["pipeline.yaml"]) == yaml.safe_load(
        PAPER_CONFIG.read_text()
    )
    # the data and models claims are created (and kept), beside the artifacts and the store
    claims = {c["metadata"]["name"]: c for c in by_kind(paper, "PersistentVolumeClaim")}
    assert {DATA_CLAIM, MODELS_CLAIM} <= set(claims)
    for name in (DATA_CLAIM, MODELS_CLAIM):
        assert claims[name]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert claims[name]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_paper_pipeline_pods_mount_data_and_models_read_only_executors_do_not(paper):
    job = one(paper, "RayJob")
    templates = [("head", job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    ]
    assert {name for name, _ in templates} == {"head", "cpu", "gpu"}
    for name, template in templates:
        mounts = mounts_of(template)
        volumes = volumes_of(template)
        for path, claim in ((DATA, DATA_CLAIM), (MODELS, MODELS_CLAIM)):
            assert mounts[path]["readOnly"] is True, (name, path)
            pvc = volumes[mounts[path]["name"]]["persistentVolumeClaim"]
            assert pvc == {"claimName": claim, "readOnly": True}, (name, path)
        # the mounts carry no write-through: no other container of the pod mounts them read-write
        for container in template["spec"]["containers"]:
            for m in container.get("volumeMounts", []):
                if m["mountPath"] in (DATA, MODELS):
                    assert m.get("readOnly") is True, (name, container["name"])
    # nothing else mounts them: the submitter, the executor, the ledger, the operator
    for where, template in every_pod_template(paper):
        if where.startswith("RayJob/") and not where.endswith("submitter"):
            continue
        assert not {DATA_CLAIM, MODELS_CLAIM} & claims_of(template), where
        assert not {DATA, MODELS} & set(mounts_of(template)), where
    executor = next(
        d for d in by_kind(paper, "Deployment") if d["metadata"]["name"].endswith("-executor")
    )
    assert all(
        "emptyDir" in v or v.get("secret", {}).get("secretName", "").endswith("-executor-token")
        for v in executor["spec"]["template"]["spec"]["volumes"]
    )
    # GPU workers as paper.yaml asks for them (the tests below check that its stages fit)
    gpu = next(
        g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"] if g["groupName"] == "gpu"
    )
    assert gpu["rayStartParams"]["num-gpus"] == "1"
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def _mnt_paths(node: Any, key: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) of every /mnt/ path in a config tree."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _mnt_paths(v, f"{key}.{k}".lstrip("."))]
    if isinstance(node, list):
        return [p for v in node for p in _mnt_paths(v, key)]
    if isinstance(node, str) and node.startswith("/mnt/"):
        return [(key, node)]
    return []


def test_every_path_paper_yaml_reads_is_mounted_on_the_pipeline_pods(paper):
    config = yaml.safe_load(PAPER_CONFIG.read_text())
    paths = dict(_mnt_paths(config))
    assert paths["data.inputs"] == f"{DATA}/magicoder-oss-instruct-75k.jsonl"
    assert paths["base.model"] == f"{MODELS}/Qwen2.5-Coder-1.5B"
    job = one(paper, "RayJob")
    entry = job["spec"]["entrypoint"]
    for key, path in paths.items():
        if key in ("run.out_dir", "run.reports_dir"):
            # the chart's entrypoint points them at the artifacts volume
            assert f"--set {key}=/mnt/artifacts/" in entry, key
            continue
        for where, template in ray_pods([job]):
            roots = [PurePosixPath(p) for p in mounts_of(template)]
            assert any(PurePosixPath(path).is_relative_to(r) for r in roots if str(r) != "/"), (
                f"{where}: {key} = {path} is on no mount of the pod"
            )


def _nodes(spec: dict) -> list[dict[str, Any]]:
    """The Ray nodes a RayCluster spec makes, as ray.nodes() lists them (CPU, GPU)."""

    def shape(group: dict) -> dict[str, float]:
        params = group.get("rayStartParams") or {}
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        resources = {"CPU": float(params.get("num-cpus", limits["cpu"]))}
        if "num-gpus" in params:
            resources["GPU"] = float(params["num-gpus"])
        return resources

    nodes = [{"Alive": True, "Resources": shape(spec["headGroupSpec"])}]
    for group in spec.get("workerGroupSpecs", []):
        nodes += [{"Alive": True, "Resources": shape(group)} for _ in range(int(group["replicas"]))]
    return nodes


def test_the_paper_cluster_places_every_stage_of_paper_yaml(paper):
    """`privcode plan` on the cluster the RayJob makes: every stage of paper.yaml fits, the 8
    one-GPU Ray Train workers of train and premium included; the chart's defaults do not."""
    from privcode.config import load_config
    from privcode.pipeline.plan import plan_pipeline

    cfg = load_config(PAPER_CONFIG)
    nodes = _nodes(one(paper, "RayJob")["spec"]["rayClusterSpec"])
    assert sum(n["Resources"].get("GPU", 0) for n in nodes) == 8
    plan = plan_pipeline(cfg, nodes=nodes, records=67677)
    assert plan.placeable is True, plan.format()
    # on the defaults (no GPU group) paper.yaml's GPU stages are refused
    default_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert default_values["workerGroups"]["gpu"]["enabled"] is False
    cpu_only = [n for n in nodes if "GPU" not in n["Resources"]]
    assert plan_pipeline(cfg, nodes=cpu_only, records=67677).placeable is False


def test_the_operator_template_leaves_out_the_data_claim(paper, crds):
    """storage.data is for the chart's own runs: an operator run mounts the data claim it names
    at <operator.dataRoot>/<claim> instead, so the template has the models and not the data,
    and a run made from it mounts no path twice."""
    from privcode.operator.children import child_name, rayjob_for

    config_map = next(c for c in by_kind(paper, "ConfigMap") if c["metadata"]["name"] == TEMPLATE)
    template = yaml.safe_load(config_map["data"]["rayjob-template.yaml"])
    expected = copy.deepcopy(one(paper, "RayJob"))
    for _, spec in cluster_specs([expected]):
        for pod in [spec["headGroupSpec"]] + spec.get("workerGroupSpecs", []):
            pod_spec = pod["template"]["spec"]
            pod_spec["volumes"] = [v for v in pod_spec["volumes"] if v["name"] != "data"]
            for c in pod_spec["containers"]:
                c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "data"]
    assert template == expected
    # the claim is protected: no RayJob but the chart's own (exempt by name) and the runs may mount it
    policy = one(paper, "ValidatingAdmissionPolicy")
    protected = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["protected"]
    assert DATA_CLAIM in protected and MODELS_CLAIM not in protected
    run = {"metadata": {"name": "study", "namespace": NAMESPACE, "uid": "0f1e2d3c4b5a6978"}}
    name = child_name("study", run["metadata"]["uid"])
    job = rayjob_for(
        template,
        run,
        name=name,
        config_map=f"{name}-config",
        data_claim="corpus-acme",
        data_mount="/mnt/data/corpus-acme",  # <operator.dataRoot>/<claim>
        overrides=[],
    )
    assert not crd_problems(job), crd_problems(job)
    for where, pod in ray_pods([job]):
        mounts = mounts_of(pod)
        assert "/mnt/data/corpus-acme" in mounts and MODELS in mounts and DATA not in mounts, where
        assert_distinct_mounts(where, pod)


def assert_distinct_mounts(where: str, template: dict) -> None:
    """No container mounts one path twice; no two volumes share a name; the data and models
    mounts are neither inside nor around another read-only mount."""
    spec = template["spec"]
    names = [v["name"] for v in spec.get("volumes", [])]
    assert len(names) == len(set(names)), f"{where}: volumes {names}"
    for container in spec["containers"] + spec.get("initContainers", []):
        paths = [m["mountPath"].rstrip("/") or "/" for m in container.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), f"{where} {container['name']}: {paths}"
        for path in paths:
            if path in (DATA, MODELS) or path.startswith(("/mnt/data/", "/mnt/models/")):
                others = [PurePosixPath(p) for p in paths if p != path]
                mine = PurePosixPath(path)
                clashes = [
                    str(o)
                    for o in others
                    if o.is_relative_to(mine) or (mine.is_relative_to(o) and str(o) != "/")
                ]
                assert not clashes, f"{where} {container['name']}: {path} overlaps {clashes}"


@pytest.mark.parametrize(
    "name, args",
    [
        ("paper", PAPER),
        ("everything-new", EVERYTHING_NEW),
        ("paper-serving", (*PAPER, *SERVE, "--set", "serve.ensemble.enabled=true")),
    ],
)
def test_no_pod_mounts_a_path_twice(helm, name, args):
    objects = render(helm, *args)
    for where, template in every_pod_template(objects):
        assert_distinct_mounts(f"{name}: {where}", template)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (
                "--set",
                "storage.data.enabled=true",
                "--set",
                "storage.data.mountPath=/mnt/artifacts",
            ),
            'storage.data.mountPath "/mnt/artifacts" overlaps storage.mountPath',
        ),
        (
            (*STORAGE, "--set", "storage.models.mountPath=/mnt/data/"),
            'storage.models.mountPath "/mnt/data/" overlaps storage.data.mountPath',
        ),
        (
            (*STORAGE, "--set", "storage.models.mountPath=/mnt/data/models"),
            "overlaps storage.data.mountPath",
        ),
        (
            ("--set", "storage.models.enabled=true", "--set", "storage.models.mountPath=/mnt"),
            "overlaps storage.mountPath",
        ),
        (
            (
                "--set",
                "storage.data.enabled=true",
                "--set",
                "storage.data.mountPath=/mnt/privacy-store/data",
            ),
            "overlaps storage.privacyStore.mountPath",
        ),
        (
            (
                "--set",
                "storage.models.enabled=true",
                "--set",
                "storage.models.mountPath=/tmp/models",
            ),
            "overlaps /tmp",
        ),
        (
            ("--set", "storage.models.enabled=true", "--set", "storage.models.mountPath=/app"),
            "overlaps /app",
        ),
        # the operator mounts each run's data claim under operator.dataRoot, beside the models
        (
            ("--set", "storage.models.enabled=true", "--set", "storage.models.mountPath=/mnt/data"),
            "overlaps operator.dataRoot",
        ),
        (
            ("--set", "storage.models.enabled=true", "--set", "operator.dataRoot=/mnt/models/runs"),
            "overlaps operator.dataRoot",
        ),
    ],
)
def test_the_chart_refuses_a_mount_path_used_twice(helm, args, message):
    stderr = render_error(helm, *args)
    assert message in stderr, stderr


def test_the_same_path_is_fine_where_two_mounts_never_meet(helm):
    # storage.data and operator.dataRoot are both /mnt/data: never on one pod
    render(helm, *STORAGE)
    # without the operator the models may live under /mnt/data (its default dataRoot)
    render(
        helm,
        "--set",
        "operator.enabled=false",
        "--set",
        "storage.models.enabled=true",
        "--set",
        "storage.models.mountPath=/mnt/data/models",
    )


def test_serving_pods_get_the_models_never_the_data(helm):
    for serving, expected in (("true", {MODELS}), ("false", set())):
        objects = render(helm, *STORAGE, *SERVE, "--set", f"storage.models.serving={serving}")
        service = one(objects, "RayService")
        for where, template in ray_pods([service]):
            assert template["metadata"]["labels"][ROLE] == "serving"
            assert {DATA, MODELS} & set(mounts_of(template)) == expected, (serving, where)
            assert DATA_CLAIM not in claims_of(template), where
            if expected:
                assert mounts_of(template)[MODELS]["readOnly"] is True
        # the pipeline's pods get both either way
        for where, template in ray_pods([one(objects, "RayJob")]):
            assert {DATA, MODELS} <= set(mounts_of(template)), where


def test_the_long_lived_cluster_gets_the_data_too(helm):
    objects = render(helm, *STORAGE, "--set", "cluster.enabled=true")
    for where, template in ray_pods([one(objects, "RayCluster")]):
        assert mounts_of(template)[DATA]["readOnly"] is True, where


def test_existing_claims_are_used_and_none_created(helm):
    objects = render(
        helm,
        *STORAGE,
        "--set",
        "storage.data.existingClaim=corpus",
        "--set",
        "storage.models.existingClaim=weights",
    )
    names = {c["metadata"]["name"] for c in by_kind(objects, "PersistentVolumeClaim")}
    assert not {DATA_CLAIM, MODELS_CLAIM} & names
    for where, template in ray_pods([one(objects, "RayJob")]):
        assert {"corpus", "weights"} <= claims_of(template), where


# =========================================================================== staging


def stage_job(objects: list[dict]) -> dict:
    (job,) = by_kind(objects, "Job")
    assert job["metadata"]["name"] == "rel-privcode-stage"
    return job


def test_no_staging_job_by_default(default_objects, paper):
    assert not by_kind(default_objects, "Job") and not by_kind(paper, "Job")


def test_the_staging_job_fills_both_claims_restricted(helm):
    objects = render(
        helm,
        *STORAGE,
        *STAGE,
        "--set",
        "stage.secretName=s3-creds",
        "--set",
        "stage.image.repository=amazon/aws-cli",
        "--set",
        "stage.image.tag=2.17.0",
    )
    job = stage_job(objects)
    assert not k8s_problems(job), k8s_problems(job)
    assert "helm.sh/hook" not in (job["metadata"].get("annotations") or {})  # a plain Job
    pod = job["spec"]["template"]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = spec["containers"]
    assert container["image"] == "amazon/aws-cli:2.17.0"
    assert container["command"] == ["sh", "-c", "cp -r /seed/. $MODELS_DIR/"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    env = env_of(container)
    assert env["DATA_DIR"] == DATA and env["MODELS_DIR"] == MODELS and env["HOME"] == "/tmp"
    assert env["PRIVCODE_SANDBOX_FORBID_LOCAL"] == "1"  # it holds the records: no generated code
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    # read-write here (and only here)
    mounts = mounts_of(pod)
    assert set(mounts) == {"/tmp", DATA, MODELS}
    assert not mounts[DATA].get("readOnly") and not mounts[MODELS].get("readOnly")
    volumes = volumes_of(pod)
    assert volumes[mounts[DATA]["name"]]["persistentVolumeClaim"] == {"claimName": DATA_CLAIM}
    assert volumes[mounts[MODELS]["name"]]["persistentVolumeClaim"] == {"claimName": MODELS_CLAIM}
    # its network: DNS and stage.egress (HTTPS) out, nothing in; no pod of the release
    policies = Policies(objects)
    me = pod_endpoint(pod)
    assert policies.isolated(me, "Ingress") and policies.isolated(me, "Egress")
    assert policies.egress(me, OTHERS["internet"], 443)
    assert not policies.egress(me, OTHERS["internet"], 80)
    assert policies.egress(me, OTHERS["dns"], 53, "UDP")
    for other in pods(objects):
        for port in (8080, 8265, 8700, 8790):
            assert not policies.reach(me, endpoint(other), port), (other.where, port)
        assert not policies.reach(endpoint(other), me, 443), other.where
    # the chart's image by default; only the models claim when only it is enabled
    job = stage_job(render(helm, "--set", "storage.models.enabled=true", *STAGE))
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "privcode:0.1.0"
    assert "DATA_DIR" not in env_of(container)
    assert set(mounts_of(job["spec"]["template"])) == {"/tmp", MODELS}


@pytest.mark.parametrize(
    "args, message",
    [
        (STAGE, "there is nothing to stage into"),
        ((*STORAGE, "--set", "stage.enabled=true"), "stage.command is empty"),
    ],
)
def test_the_staging_job_needs_a_claim_and_a_command(helm, args, message):
    assert message in render_error(helm, *args)


def test_submit_job_sends_neither_the_staging_job_nor_the_podmonitor(helm, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text(
        yaml.safe_dump(
            {
                "stage": {"enabled": True, "command": "true"},
                "metrics": {"podMonitor": {"enabled": True}},
            }
        )
    )
    objects = k8s.job_manifests(
        PAPER_CONFIG, release="rel", namespace=NAMESPACE, values_files=[PAPER_VALUES, extra]
    )
    kinds = {o["kind"] for o in objects}
    assert not {"Job", "PodMonitor"} & kinds
    claims = {o["metadata"]["name"] for o in by_kind(objects, "PersistentVolumeClaim")}
    assert {DATA_CLAIM, MODELS_CLAIM} <= claims
    for where, template in ray_pods(objects):
        assert {DATA, MODELS} <= set(mounts_of(template)), where
