"""The Helm chart ``charts/privcode``: what it renders, value by value.

GPU and CPU worker groups, autoscaling, network policy, the locked-down pods,
the pipeline RayJob and its config, storage, names, labels, token auth, the
RayService, the Grafana dashboard and the install notes. Helpers:
tests/chart_support.py; fixtures (``helm``, ``rendering``, ``default_objects``,
``ci_objects``): tests/conftest.py.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml
from chart_support import (
    CHART,
    CI_VALUES,
    DEMO_CONFIG,
    DNS1035,
    JOB_ONLY,
    MAX_NAME,
    SYNTH_AUTOSCALED_VALUES,
    all_pod_templates,
    by_kind,
    cluster_specs,
    env_of,
    one,
    pod_templates,
    ray_containers,
    render,
    run_helm,
    worker_group,
)

METRICS = (
    "ray_privcode_epsilon_spent",
    "ray_privcode_epsilon_budget",
    "ray_privcode_dp_steps",
    "ray_privcode_synth_generated",
    "ray_privcode_synth_exec_removed",
    "ray_privcode_synth_roundtrip_removed",
    "ray_privcode_sandbox_verdicts",
    "ray_privcode_synth_pool_actors",
    "ray_privcode_synth_queue_rows",
    "ray_privcode_synth_rows",
    "ray_node_cpu_utilization",
    "ray_node_mem_used",
    "ray_node_gpus_utilization",
)


# --------------------------------------------------------------------------- behaviour


def test_gpu_group_gets_gpus_and_num_gpus(ci_objects):
    for owner, spec in cluster_specs(ci_objects):
        gpu = worker_group(spec, "gpu")
        assert gpu["rayStartParams"]["num-gpus"] == "2", owner
        resources = gpu["template"]["spec"]["containers"][0]["resources"]
        assert str(resources["limits"]["nvidia.com/gpu"]) == "2", owner
        assert str(resources["requests"]["nvidia.com/gpu"]) == "2", owner
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu[
            "template"
        ]["spec"]["tolerations"]
        cpu = worker_group(spec, "cpu")
        assert (
            "nvidia.com/gpu" not in cpu["template"]["spec"]["containers"][0]["resources"]["limits"]
        )
        assert "num-gpus" not in cpu["rayStartParams"]


def test_gpu_group_is_off_by_default(default_objects, helm):
    for _, spec in cluster_specs(default_objects):
        assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["cpu"]
    objects = render(helm, "--set", "workerGroups.gpu.enabled=true")
    spec = one(objects, "RayJob")["spec"]["rayClusterSpec"]
    gpu = worker_group(spec, "gpu")
    assert gpu["rayStartParams"]["num-gpus"] == "1"
    assert (gpu["replicas"], gpu["minReplicas"], gpu["maxReplicas"]) == (0, 0, 2)


def test_autoscaling(ci_objects, default_objects):
    for owner, spec in cluster_specs(ci_objects):
        assert spec["enableInTreeAutoscaling"] is True, owner
        options = spec["autoscalerOptions"]
        assert options["upscalingMode"] == "Conservative"
        assert options["idleTimeoutSeconds"] == 120
        assert options["version"] == "v2"
        assert options["securityContext"]["allowPrivilegeEscalation"] is False
        assert options["resources"]["limits"]["cpu"] == "500m"
        # the autoscaler talks to the API server: only the head mounts a token
        assert spec["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is True
        for group in spec["workerGroupSpecs"]:
            assert group["template"]["spec"]["automountServiceAccountToken"] is False
    api_policy = [
        p for p in by_kind(ci_objects, "NetworkPolicy") if p["spec"]["policyTypes"] == ["Egress"]
    ]
    assert len(api_policy) == 1
    selector = api_policy[0]["spec"]["podSelector"]
    assert selector["matchLabels"]["app.kubernetes.io/component"] == "ray-head"
    # the heads of the pipeline and serving clusters, never the executor
    assert selector["matchExpressions"] == [
        {"key": "privcode.io/role", "operator": "In", "values": ["pipeline", "serving"]}
    ]
    assert {p["port"] for p in api_policy[0]["spec"]["egress"][0]["ports"]} == {443, 6443}
    for owner, spec in cluster_specs(default_objects):
        assert spec["enableInTreeAutoscaling"] is False, owner
        assert "autoscalerOptions" not in spec
        assert spec["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_autoscaled_synthesis_starts_without_workers(helm):
    """charts/synth-autoscaled-values.yaml (docs/kubernetes.md, "Autoscaled synthesis"): the
    RayJob runs Stage II alone on a cluster of a 0-CPU head and a CPU group of 0..4 workers
    that the in-tree autoscaler (v2) scales, removing idle workers after 60 s."""
    objects = render(helm, "-f", str(SYNTH_AUTOSCALED_VALUES))
    job = one(objects, "RayJob")["spec"]
    spec = job["rayClusterSpec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert (options["version"], options["upscalingMode"], options["idleTimeoutSeconds"]) == (
        "v2",
        "Default",
        60,
    )
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # every Stage II actor needs a worker
    assert head["template"]["spec"]["automountServiceAccountToken"] is True  # the autoscaler's
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["cpu"]
    cpu = worker_group(spec, "cpu")
    assert (cpu["replicas"], cpu["minReplicas"], cpu["maxReplicas"]) == (0, 0, 4)
    args = shlex.split(job["entrypoint"])
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert overrides[-7:] == [
        "run.stages=[synth]",
        "synth.release=/mnt/artifacts/runs/demo/train/release",
        "synth.cpus_per_generator=2",
        "synth.generators_min=1",
        "synth.generators_max=6",
        "synth.executors_max=4",
        "synth.scorers_max=4",
    ]
    # the head may reach the API server (the autoscaler sidecar); only the job's own objects
    assert {o["kind"] for o in objects if o["kind"].startswith("Ray")} == {"RayJob"}
    assert [p for p in by_kind(objects, "NetworkPolicy") if p["spec"]["policyTypes"] == ["Egress"]]


def test_nothing_is_exposed_by_default(default_objects, ci_objects):
    for objects in (default_objects, ci_objects):
        assert not [o for o in objects if o["kind"] in ("Ingress", "Route", "Gateway")]
        for service in by_kind(objects, "Service"):
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
        for owner, spec in cluster_specs(objects):
            assert spec["headGroupSpec"]["serviceType"] == "ClusterIP", owner
            assert not spec["headGroupSpec"].get("enableIngress"), owner
            assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_network_policy_denies_by_default(default_objects, ci_objects):
    """Default deny for every pod, then one policy per role (tests/test_chart_executor.py
    evaluates what they allow together)."""
    selector = {"app.kubernetes.io/name": "privcode", "app.kubernetes.io/instance": "rel"}
    for objects in (default_objects, ci_objects):
        policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(objects, "NetworkPolicy")}
        deny = policies["rel-privcode"]
        assert sorted(deny["policyTypes"]) == ["Egress", "Ingress"]
        assert deny["podSelector"] == {"matchLabels": selector}
        assert "ingress" not in deny and "egress" not in deny  # allows nothing by itself
        # it selects every pod of the release, and only through its labels; every pod has a
        # role, and the policy of that role selects it
        for where, template in all_pod_templates(objects):
            labels = template["metadata"]["labels"]
            assert selector.items() <= labels.items(), where
            role = labels["privcode.io/role"]
            assert policies[f"rel-privcode-{role}"]["podSelector"] == {
                "matchLabels": {**selector, "privcode.io/role": role}
            }, where

        def peer(role):
            return {"podSelector": {"matchLabels": {**selector, "privcode.io/role": role}}}

        pipeline = policies["rel-privcode-pipeline"]
        # Ray's pods talk to each other on any port, the submitter reaches the head
        assert {"from": [peer("pipeline"), peer("submitter")]} in pipeline["ingress"]
        assert {"to": [peer("pipeline")]} in pipeline["egress"]
        # the operator reaches the dashboard of the pipeline and serving clusters
        for name in ("rel-privcode-pipeline", "rel-privcode-serving"):
            if name not in policies:
                continue
            operator_ports = {
                p["port"]
                for rule in policies[name]["ingress"]
                for p in rule.get("ports", [])
                if any(
                    "namespaceSelector" in peer_
                    and peer_["namespaceSelector"]["matchLabels"].get("kubernetes.io/metadata.name")
                    in ("ray-system", "kuberay")
                    for peer_ in rule["from"]
                )
            }
            assert {8265, 52365} <= operator_ports, name
        # DNS for the Ray pods and the submitter (not for the executor: tested elsewhere)
        for name in ("rel-privcode-pipeline", "rel-privcode-submitter"):
            dns = [
                r
                for r in policies[name]["egress"]
                if any(p.get("port") == 53 for p in r.get("ports", []))
            ]
            assert {p["protocol"] for p in dns[0]["ports"]} == {"UDP", "TCP"}, name
        # nothing open to the world: every ingress rule but the same-role ones names its ports
        for name, spec in policies.items():
            for rule in spec.get("ingress", []):
                assert "ports" in rule or all("podSelector" in p for p in rule["from"]), name
    default = {p["metadata"]["name"] for p in by_kind(default_objects, "NetworkPolicy")}
    # no API egress without the autoscaler, no serving policy without the RayService
    assert default == {
        "rel-privcode",
        "rel-privcode-pipeline",
        "rel-privcode-submitter",
        "rel-privcode-executor",
        "rel-privcode-ledger",
        "rel-privcode-operator",
    }
    ci = {p["metadata"]["name"]: p["spec"] for p in by_kind(ci_objects, "NetworkPolicy")}
    serve_rule = [
        r
        for r in ci["rel-privcode-serving"]["ingress"]
        if r.get("ports") == [{"protocol": "TCP", "port": 8000}]
    ]
    assert serve_rule and serve_rule[0]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ingress-nginx"
    }
    # servingIngress only on the serving pods; extraEgress on pipeline and serving, never the executor
    assert not [
        r
        for r in ci["rel-privcode-pipeline"]["ingress"]
        if r.get("ports") == serve_rule[0]["ports"]
    ]
    for name, has_it in (
        ("rel-privcode-pipeline", True),
        ("rel-privcode-serving", True),
        ("rel-privcode-executor", False),
    ):
        assert has_it == any(
            r.get("to", [{}])[0].get("ipBlock", {}).get("cidr") == "52.216.0.0/15"
            for r in ci[name]["egress"]
        ), name


def test_every_ray_container_is_locked_down(rendering):
    name, objects = rendering
    seen = 0
    for where, template in pod_templates(objects):
        pod_sc = template["spec"]["securityContext"]
        assert pod_sc["runAsNonRoot"] is True, where
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for container in template["spec"]["containers"]:
            seen += 1
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc["readOnlyRootFilesystem"] is True, where
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert "/tmp" in mounts, f"{where}: a read-only root needs a writable /tmp"
            assert env_of(container)["HOME"].startswith("/tmp"), where
    assert seen, name


def test_ray_pods_mount_config_artifacts_and_env(default_objects, ci_objects):
    for objects, mount_path in (
        (default_objects, "/mnt/artifacts"),
        (ci_objects, "/mnt/artifacts"),
    ):
        for where, template in pod_templates(objects):
            if where.endswith("submitter"):
                continue
            container = template["spec"]["containers"][0]
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert mounts["/etc/privcode"]["readOnly"] is True, where
            # serving: the release's directories only (tests/test_chart_pss.py, point 9)
            mounted = f"{mount_path}/cache" if where.startswith("RayService") else mount_path
            assert mounted in mounts, where
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            assert (
                volumes[mounts["/etc/privcode"]["name"]]["configMap"]["name"]
                == "rel-privcode-pipeline"
            )
            assert (
                volumes[mounts[mounted]["name"]]["persistentVolumeClaim"]["claimName"]
                == "rel-privcode-artifacts"
            )
            env = env_of(container)
            assert env["HF_HUB_OFFLINE"] == "1", where
    head = next(c for w, c in ray_containers(default_objects) if w.endswith("ray-head"))
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
        "serve": 8000,
        "dash-metrics": 44227,  # the dashboard's own metrics (the PodMonitor's endpoint)
        "metrics": 8080,
    }
    ci_worker = next(c for w, c in ray_containers(ci_objects) if "group cpu" in w)
    env = env_of(ci_worker)
    assert env["PRIVCODE_LOG_LEVEL"] == "INFO"  # extraEnv
    assert env["PRIVCODE_OBJECT_STORE_URI"] == "s3://privcode-artifacts/ci"
    assert ci_worker["envFrom"] == [{"secretRef": {"name": "privcode-s3"}}]


def test_runtime_class_applies_to_sandboxed_pods(helm, default_objects, ci_objects):
    for where, template in pod_templates(default_objects):
        assert "runtimeClassName" not in template["spec"], where
    for where, template in pod_templates(ci_objects):
        expected = {"submitter": None, "group gpu": "nvidia"}
        want = next((v for k, v in expected.items() if where.endswith(k)), "gvisor")
        assert template["spec"].get("runtimeClassName") == want, where
    objects = render(helm, "--set", "sandbox.runtimeClassName=gvisor")
    spec = one(objects, "RayJob")["spec"]["rayClusterSpec"]
    assert spec["headGroupSpec"]["template"]["spec"]["runtimeClassName"] == "gvisor"
    assert worker_group(spec, "cpu")["template"]["spec"]["runtimeClassName"] == "gvisor"


def test_rayjob_runs_the_pipeline(default_objects, ci_objects):
    job = one(default_objects, "RayJob")["spec"]
    entry = job["entrypoint"]
    assert "jobs/pipeline.py --config /etc/privcode/pipeline.yaml" in entry
    assert shlex.split(entry) == [
        "python",
        "/app/jobs/pipeline.py",
        "--config",
        "/etc/privcode/pipeline.yaml",
        "--set",
        "run.out_dir=/mnt/artifacts/runs",
        "--set",
        "run.reports_dir=/mnt/artifacts/reports",
        "--set",
        "base.cache_dir=/mnt/artifacts/cache",
        "--set",
        "sandbox.isolation=full",
    ]
    assert job["shutdownAfterJobFinishes"] is True
    assert job["ttlSecondsAfterFinished"] == 3600
    assert job["backoffLimit"] == 0
    assert job["activeDeadlineSeconds"] == 86400
    assert job["submissionMode"] == "K8sJobMode"
    assert yaml.safe_load(job["runtimeEnvYAML"]) == {
        "env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    }
    submitter = job["submitterPodTemplate"]["spec"]
    assert submitter["restartPolicy"] == "Never"
    assert not submitter["containers"][0].get("command")  # KubeRay fills in `ray job submit`
    ci_entry = shlex.split(one(ci_objects, "RayJob")["spec"]["entrypoint"])
    assert ci_entry[-4:] == [
        "--set",
        "data.size=200",
        "--set",
        "report.title=CI run with spaces and 'quotes'",
    ]


def test_rayjob_overrides_and_verbatim_entrypoint(helm):
    job = one(
        render(helm, "--set", "pipeline.overrides={data.size=50,run.name=k8s test}"), "RayJob"
    )["spec"]
    assert "--set data.size=50 --set 'run.name=k8s test'" in job["entrypoint"]
    job = one(
        render(
            helm,
            "--set",
            "job.entrypoint=python -c pass",
            "--set",
            "job.shutdownAfterJobFinishes=false",
            "--set",
            "job.activeDeadlineSeconds=0",
        ),
        "RayJob",
    )["spec"]
    assert job["entrypoint"] == "python -c pass"
    assert "ttlSecondsAfterFinished" not in job  # KubeRay refuses a TTL without shutdown
    assert "activeDeadlineSeconds" not in job


def test_config_map_holds_the_demo_config_by_default(default_objects):
    # the pipeline's (the operator's template ConfigMap is tests/test_chart_operator.py's)
    (config_map,) = [
        c for c in by_kind(default_objects, "ConfigMap") if "pipeline.yaml" in c["data"]
    ]
    assert config_map["metadata"]["name"] == "rel-privcode-pipeline"
    assert yaml.safe_load(config_map["data"]["pipeline.yaml"]) == yaml.safe_load(
        DEMO_CONFIG.read_text()
    )


def test_values_default_pipeline_config_is_demo_yaml():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert yaml.safe_load(values["pipeline"]["config"]) == yaml.safe_load(
        DEMO_CONFIG.read_text()
    ), "charts/privcode/values.yaml pipeline.config is out of sync with jobs/configs/demo.yaml"


def test_set_file_replaces_the_pipeline_config(helm, tmp_path):
    config = {"run": {"name": "from-file", "stages": ["data"]}, "data": {"size": 7}}
    path = tmp_path / "pipeline.yaml"
    path.write_text("# a comment\n" + yaml.safe_dump(config))
    objects = render(helm, *JOB_ONLY, "--set-file", f"pipeline.config={path}")
    assert yaml.safe_load(one(objects, "ConfigMap")["data"]["pipeline.yaml"]) == config
    assert {o["kind"] for o in objects} <= {
        "ServiceAccount",
        "ConfigMap",
        "PersistentVolumeClaim",
        "NetworkPolicy",
        "Service",
        "Deployment",
        "Secret",  # the ledger's tokens
        "RayJob",
    }
    assert len(by_kind(objects, "RayJob")) == 1


def test_job_disabled_renders_no_rayjob(helm):
    objects = render(helm, "--set", "job.enabled=false")
    assert not by_kind(objects, "RayJob")
    objects = render(
        helm,
        "--set",
        "job.enabled=false",
        "--set",
        "cluster.enabled=true",
        "--set",
        "storage.pvc.enabled=false",
        "--set",
        "storage.privacyStore.enabled=false",
        "--set",
        "operator.enabled=false",  # the operator needs the store's ledger service
    )
    assert not by_kind(objects, "RayJob") and not by_kind(objects, "PersistentVolumeClaim")
    spec = one(objects, "RayCluster")["spec"]
    volumes = {v["name"]: v for v in spec["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert volumes["artifacts"] == {"name": "artifacts", "emptyDir": {}}


def test_existing_claim_is_used_not_created(helm):
    objects = render(
        helm,
        "--set",
        "storage.pvc.existingClaim=shared-artifacts",
        "--set",
        "storage.privacyStore.existingClaim=budgets",
    )
    assert not by_kind(objects, "PersistentVolumeClaim")
    spec = one(objects, "RayJob")["spec"]["rayClusterSpec"]
    volumes = {v["name"]: v for v in spec["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert volumes["artifacts"]["persistentVolumeClaim"]["claimName"] == "shared-artifacts"
    assert volumes["privacy-store"]["persistentVolumeClaim"]["claimName"] == "budgets"


def test_pvc_outlives_uninstall(default_objects):
    claims = {p["metadata"]["name"]: p for p in by_kind(default_objects, "PersistentVolumeClaim")}
    assert set(claims) == {"rel-privcode-artifacts", "rel-privcode-privacy-store"}
    for pvc in claims.values():
        assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claims["rel-privcode-artifacts"]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    store = claims["rel-privcode-privacy-store"]
    assert store["spec"]["resources"]["requests"]["storage"] == "1Gi"


def test_the_privacy_store_has_its_own_claim_on_the_ray_pods(helm, ci_objects):
    """Its own volume and PRIVCODE_PRIVACY_STORE on the pipeline's Ray pods, read-only (the
    ledger Deployment writes it); none on the serving pods (tests/test_chart_ledger.py); and
    read-write on every Ray pod without the ledger service."""
    no_ledger = render(
        helm,
        "-f",
        str(CI_VALUES),
        "--set",
        "ledger.enabled=false",
        "--set",
        "operator.enabled=false",
    )
    for objects, ledger in ((ci_objects, True), (no_ledger, False)):
        seen = set()
        for where, template in pod_templates(objects):
            if where.endswith("submitter"):
                continue
            container = template["spec"]["containers"][0]
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            serving = where.startswith("RayService/")
            seen.add(serving)
            if ledger and serving:
                assert "/mnt/privacy-store" not in mounts, where
                assert "PRIVCODE_PRIVACY_STORE" not in env_of(container), where
                continue
            mount = mounts["/mnt/privacy-store"]
            claim = volumes[mount["name"]]["persistentVolumeClaim"]
            assert claim["claimName"] == "rel-privcode-privacy-store", where
            assert bool(mount.get("readOnly")) == bool(claim.get("readOnly")) == ledger, where
            assert env_of(container)["PRIVCODE_PRIVACY_STORE"] == "/mnt/privacy-store/store", where
        assert seen == {True, False}
    objects = render(
        helm, "--set", "storage.privacyStore.enabled=false", "--set", "operator.enabled=false"
    )
    for where, template in pod_templates(objects):
        if not where.endswith("submitter"):
            assert "PRIVCODE_PRIVACY_STORE" not in env_of(template["spec"]["containers"][0])
    # no claim of its own: no ledger service either (the executor's token is its own Secret)
    assert not [
        s for s in by_kind(objects, "Secret") if "executor-token" not in s["metadata"]["name"]
    ]


@pytest.mark.parametrize(
    "release, extra",
    [
        ("b" * 53, ()),  # helm's own limit on release names is 53 characters
        ("rel", ("--set", "fullnameOverride=" + "f" * 63)),
        ("r" * 40, ("--set", "nameOverride=" + "n" * 60)),
    ],
)
def test_names_fit_kubernetes_and_kuberay_limits(helm, release, extra):
    objects = render(helm, "-f", str(CI_VALUES), *extra, release=release)
    names = [(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objects]
    for kind, name, _ in names:
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (
            kind,
            name,
        )
        if kind in MAX_NAME:
            assert len(name) <= MAX_NAME[kind] and DNS1035.fullmatch(name), (kind, name)
    assert len(set(names)) == len(names), names
    cluster = one(objects, "RayCluster")["metadata"]["name"]
    service = one(objects, "RayService")["metadata"]["name"]
    assert len(cluster + "-head-svc") <= 63 and len(service + "-serve-svc") <= 63
    assert cluster + "-head-svc" != service + "-head-svc"
    for where, template in pod_templates(objects):
        for value in template["metadata"]["labels"].values():
            assert len(value) <= 63, where


def test_every_object_is_labelled(rendering):
    name, objects = rendering
    for obj in objects:
        labels = obj["metadata"]["labels"]
        for key in (
            "helm.sh/chart",
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/managed-by",
        ):
            assert key in labels, f"{name}: {obj['kind']}/{obj['metadata']['name']} lacks {key}"
        assert labels["app.kubernetes.io/part-of"] == "privcode"


def test_token_auth(default_objects, ci_objects, helm):
    for owner, spec in cluster_specs(default_objects):
        assert spec["authOptions"] == {"mode": "token"}, owner
        assert spec["rayVersion"] == "2.60.0"
    for _, spec in cluster_specs(ci_objects):
        assert spec["authOptions"] == {"mode": "token", "secretName": "privcode-ray-token"}
    for _, spec in cluster_specs(render(helm, "--set", "auth.mode=disabled")):
        assert "authOptions" not in spec


def test_rayservice_serve_config(ci_objects, helm):
    service = one(ci_objects, "RayService")
    assert service["metadata"]["name"] == "rel-privcode-serve"
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    apps = {a["name"]: a for a in config["applications"]}
    assert apps["premium"]["import_path"] == "privcode.serve.premium:app"
    assert apps["premium"]["route_prefix"] == "/premium"
    limits = {  # serve.limits, merged into both apps' args
        "rate_limit_rps": 5,
        "rate_limit_burst": 20,
        "max_body_bytes": 1 << 20,
        "max_prompt_chars": 65_536,
        "fallback_context": 4096,
    }
    assert apps["premium"]["args"] == {
        "model": "/mnt/artifacts/cache/base",
        "premium": "/mnt/artifacts/runs/demo/premium",
        "max_tokens_limit": 512,
        "max_batch_size": 8,
        "engine": "transformers",
        **limits,
    }
    # the app builder accepts exactly these args, and the deployment name is the app's own
    from privcode.serve import premium

    premium.parse_args(apps["premium"]["args"])
    assert premium.PremiumServer.name == apps["premium"]["deployments"][0]["name"]
    assert apps["premium"]["deployments"] == [
        {
            "name": "PremiumServer",
            "num_replicas": 2,
            "ray_actor_options": {"num_cpus": 2, "num_gpus": 1},
        }
    ]
    assert apps["ensemble"]["import_path"] == "privcode.serve.ensemble:app"
    assert apps["ensemble"]["route_prefix"] == "/ensemble"
    assert {k: apps["ensemble"]["args"][k] for k in limits} == limits
    # the API keys Secret (one key per client) is mounted only on the serving cluster's pods
    serving = service["spec"]["rayClusterConfig"]
    for template in [serving["headGroupSpec"]["template"]] + [
        g["template"] for g in serving["workerGroupSpecs"]
    ]:
        container = template["spec"]["containers"][0]
        env = env_of(container)
        assert env["PRIVCODE_API_KEYS_DIR"] == "/etc/privcode/api-keys"
        assert "PRIVCODE_API_KEY" not in env
        mount = {m["name"]: m for m in container["volumeMounts"]}["api-keys"]
        assert mount == {
            "name": "api-keys",
            "mountPath": "/etc/privcode/api-keys",
            "readOnly": True,
        }
        volume = {v["name"]: v for v in template["spec"]["volumes"]}["api-keys"]
        assert volume["secret"]["secretName"] == "privcode-api-key"
    job_head = one(ci_objects, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]
    job_container = job_head["template"]["spec"]["containers"][0]
    assert "PRIVCODE_API_KEYS_DIR" not in env_of(job_container)
    assert "api-keys" not in {v["name"] for v in job_head["template"]["spec"]["volumes"]}
    # defaults: premium only, empty args left out
    objects = render(helm, "--set", "serve.enabled=true", "--set", "apiKey.existingSecret=keys")
    config = yaml.safe_load(one(objects, "RayService")["spec"]["serveConfigV2"])
    assert [a["name"] for a in config["applications"]] == ["premium"]
    # the default release path on the artifacts volume; the empty model override is left out
    assert config["applications"][0]["args"] == {
        "premium": "/mnt/artifacts/runs/demo/premium",
        "max_tokens_limit": 512,
        "max_batch_size": 8,
        "engine": "transformers",
        **limits,
    }
    # the chart never creates the API key (its one Secret holds the ledger's tokens)
    # (and the executor's bearer token, with its copy in the executor's namespace)
    assert [s["metadata"]["name"] for s in by_kind(objects, "Secret")] == [
        "rel-privcode-executor-token",
        "rel-privcode-executor-token",
        "rel-privcode-ledger-tokens",
    ]


def test_grafana_dashboard(helm, ci_objects, default_objects):
    assert not [
        c for c in by_kind(default_objects, "ConfigMap") if "grafana" in c["metadata"]["name"]
    ]
    config_map = [
        c for c in by_kind(ci_objects, "ConfigMap") if "grafana" in c["metadata"]["name"]
    ][0]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["privcode-grafana.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "privcode-grafana.json").read_text())
    assert dashboard["title"] and 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
            assert target["datasource"]["uid"] == "${datasource}"
    text = "\n".join(exprs)
    for metric in METRICS:
        assert metric in text, f"the dashboard has no panel for {metric}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # The alert rules: the PAC public fallback (counted per token kind) and the budgets.
    alerts = [
        c for c in by_kind(ci_objects, "ConfigMap") if "grafana-alerts" in c["metadata"]["name"]
    ]
    assert alerts and alerts[0]["metadata"]["labels"]["grafana_alert"] == "1"
    rules = yaml.safe_load(alerts[0]["data"]["privcode-alerts.yaml"])["groups"][0]["rules"]
    exprs = {r["uid"]: r["data"][0]["model"]["expr"] for r in rules}
    assert 'kind="fallback"' in exprs["privcode-pac-public-fallback"]
    assert all(r["data"][0]["datasourceUid"] == "prometheus" for r in rules)


def test_notes_explain_how_to_follow_the_job(helm):
    done = run_helm(
        helm,
        "install",
        "rel",
        str(CHART),
        "--dry-run=client",
        "--namespace",
        "team-a",
        "-f",
        str(CI_VALUES),
    )
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    for text in (
        "kubectl get rayjob rel-privcode -n team-a -w",
        "kubectl logs -f job/rel-privcode -n team-a",
        "svc/$CLUSTER-head-svc 8265:8265",
        "svc/rel-privcode-head-svc 8265:8265",
        "svc/rel-privcode-serve-serve-svc 8000:8000",
        'API keys: Secret "privcode-api-key", one key per client',
        "mounted at /etc/privcode/api-keys",
        "helm install kuberay-operator kuberay/kuberay-operator",
        "auth_token",
        'Ledger "rel-privcode-ledger"',
        "kubectl exec -n team-a deployment/rel-privcode-ledger -- privcode budget show",
        "kubectl logs -n team-a deployment/rel-privcode-ledger -c init-store",
    ):
        assert text in notes, f"{text!r} not in NOTES:\n{notes}"
