"""The Helm chart's sandbox executor pod: where it runs, as whom, with what (issue 43, point 1).

User namespaces by default (``hostUsers: false``: root and SYS_ADMIN in the pod are not root on
the node), a namespace of its own (Pod Security ``privileged`` there only), anti-affinity
against the pods holding private data, an AppArmor profile that allows only the sandbox's
mounts, the bearer token and the memory / disk budget of the contract
(/work/notes/contracts.md), and the refusals around them. The network and what the pods hold:
tests/test_chart_executor.py (its evaluator is reused here).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from chart_support import CHART, by_kind, env_of, k8s_problems, one, render, render_error, run_helm
from test_chart_executor import (
    EVERY_ROLE,
    EXECUTOR_ENV,
    EXECUTOR_NAMESPACE,
    EXECUTOR_PORT,
    FORBID,
    NAMESPACE,
    ROLE,
    TOKEN_SECRET,
    Endpoint,
    Policies,
    endpoint,
    executor_deployment,
    executor_objects,
    pods,
    pods_of,
    selects,
)

DISABLED_ACK = ("--set", "executor.enabled=false", "--set", "sandbox.runInRayPods=true")
WEAK = ("--set", "executor.isolation=rlimits-only")
HOST_USERS = ("--set", "executor.hostUsers=true")
TOKEN_DIR = "/var/run/privcode/executor-token"
TOKEN_FILE = f"{TOKEN_DIR}/token"
PROFILE = CHART / "files" / "apparmor" / "privcode-executor"
#: What the full sandbox needs of the pod (privcode/sandbox/zygote.py), and nothing else.
SANDBOX_CAPS = ["SYS_ADMIN", "SETUID", "SETGID", "SYS_CHROOT", "KILL"]


def executor_pod(helm: str, *args: str) -> dict:
    """The executor Deployment's pod template, rendered with ``args``."""
    return executor_deployment(render(helm, *args))["spec"]["template"]


def notes(helm: str, *args: str) -> str:
    done = run_helm(
        helm, "install", "rel", str(CHART), "--dry-run=client", "--namespace", NAMESPACE, *args
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split("NOTES:", 1)[1]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# --------------------------------------------------------------------------- 1. the pod


def test_executor_pod_in_full_isolation(default_objects, helm):
    deployment = executor_deployment(default_objects)
    assert deployment["metadata"]["name"] == "rel-privcode-executor"
    assert deployment["metadata"]["namespace"] == EXECUTOR_NAMESPACE
    assert deployment["spec"]["replicas"] == 1
    template = deployment["spec"]["template"]
    spec = template["spec"]
    assert template["metadata"]["labels"][ROLE] == "executor"
    assert selects(deployment["spec"]["selector"], template["metadata"]["labels"])
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["hostUsers"] is False  # a user namespace of the pod's own
    (account,) = executor_objects(default_objects, "ServiceAccount")
    assert account["metadata"]["namespace"] == EXECUTOR_NAMESPACE
    assert account["automountServiceAccountToken"] is False
    assert not account["metadata"].get("annotations")
    assert "runtimeClassName" not in spec
    (container,) = spec["containers"]
    assert container["command"] == [
        *("privcode", "sandbox", "serve", "--host", "0.0.0.0", "--port", "8700"),
        *("--workers", "2", "--isolation", "full"),
        *("--memory-budget-mb", "4096", "--disk-budget-mb", "1024"),
    ]
    assert env_of(container) == {
        "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PRIVCODE_EXECUTOR_TOKEN_FILE": TOKEN_FILE,
    }
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    sc = container["securityContext"]
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False  # root of the pod's namespace
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": SANDBOX_CAPS}
    assert sc["procMount"] == "Unmasked"  # a new /proc in a user namespace needs it
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["appArmorProfile"] == {"type": "Unconfined"}  # no profile named: NOTES warns
    assert "privileged" not in sc
    assert container["resources"]["limits"] == {"cpu": "2", "memory": "4Gi"}
    assert not k8s_problems(deployment, ("1.35.0",))  # appArmorProfile: 1.30+ (below: 1.26)
    # before Kubernetes 1.30 AppArmor is an annotation (the field does not exist there)
    old = executor_deployment(render(helm, "--kube-version", "1.26.0"))
    old_template = old["spec"]["template"]
    assert "appArmorProfile" not in old_template["spec"]["containers"][0]["securityContext"]
    assert old_template["metadata"]["annotations"] == {
        "container.apparmor.security.beta.kubernetes.io/executor": "unconfined"
    }
    assert not k8s_problems(old, ("1.26.0",))
    assert "annotations" not in template["metadata"]
    # and the NOTES say user namespaces need the feature gate there (helm install has no
    # --kube-version: the condition is read from the template)
    text = (CHART / "templates" / "NOTES.txt").read_text()
    assert 'semverCompare ">=1.33.0-0" .Capabilities.KubeVersion.Version' in text
    assert "UserNamespacesSupport" in text and "UserNamespacesSupport" not in notes(helm)


def test_node_user_namespace_needs_a_runtime_class_or_the_acknowledgement(helm):
    """hostUsers=true (an old cluster) is root with SYS_ADMIN on the node: refused by default."""
    stderr = render_error(helm, *HOST_USERS)
    for name in ("executor.hostUsers=false", "executor.runtimeClassName", "gvisor"):
        assert name in stderr, stderr
    assert "executor.acknowledgeNodeRootExecutor=true" in stderr and "root on the node" in stderr
    for extra in (
        ("--set", "executor.runtimeClassName=gvisor"),
        ("--set", "sandbox.runtimeClassName=kata"),
        ("--set", "executor.acknowledgeNodeRootExecutor=true"),
        WEAK,  # not root at all: uid 65534, no capability
    ):
        spec = executor_pod(helm, *HOST_USERS, *extra)["spec"]
        assert "hostUsers" not in spec, extra
        assert "procMount" not in spec["containers"][0]["securityContext"], extra
    gvisor = executor_pod(helm, *HOST_USERS, "--set", "executor.runtimeClassName=gvisor")
    assert gvisor["spec"]["runtimeClassName"] == "gvisor"


def test_executor_runtime_class_and_sizes(helm):
    spec = executor_deployment(
        render(
            helm,
            *("--set", "sandbox.runtimeClassName=gvisor"),
            *("--set", "executor.runtimeClassName=kata"),
            *("--set", "executor.replicas=3", "--set", "executor.workers=8"),
            *("--set", "executor.port=9000"),
        )
    )["spec"]
    assert spec["replicas"] == 3
    pod = spec["template"]["spec"]
    assert pod["runtimeClassName"] == "kata"
    assert executor_pod(helm, "--set", "sandbox.runtimeClassName=gvisor")["spec"][
        "runtimeClassName"
    ] == ("gvisor")
    command = pod["containers"][0]["command"]
    assert flag(command, "--workers") == "8" and flag(command, "--port") == "9000"
    objects = render(helm, "--set", "executor.port=9000")
    (policy,) = executor_objects(objects, "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9000}]
    pipeline = pods_of(objects, "pipeline")[0]
    assert env_of(pipeline.spec["containers"][0])[EXECUTOR_ENV].endswith(":9000")
    executor = endpoint(pods_of(objects, "executor")[0])
    assert Policies(objects).reach(endpoint(pipeline), executor, 9000)


@pytest.mark.parametrize("version", ["1.26.0", "1.35.0"])
def test_every_executor_variant_validates_strictly(helm, version):
    """The settings of this file together, on the oldest and a recent Kubernetes."""
    variants = [
        ("--set", "executor.createNamespace=true", "--set", "executor.antiAffinity=required"),
        ("--set", "executor.appArmor.localhostProfile=privcode-executor", *EVERY_ROLE),
        (
            *HOST_USERS,
            "--set",
            "executor.runtimeClassName=gvisor",
            "--set",
            "executor.isolation=full-no-cgroup",
        ),
        (*WEAK, "--set", "executor.namespace=sandboxes"),
    ]
    for args in variants:
        for obj in render(helm, *args, "--kube-version", version):
            if obj["kind"] in ("RayJob", "RayCluster", "RayService"):
                continue
            problems = k8s_problems(obj, (version,))
            assert not problems, (args, obj["kind"], obj["metadata"]["name"], problems)


# --------------------------------------------------------------------------- 2. its namespace


def test_the_executor_lives_in_a_namespace_of_its_own(default_objects, helm):
    inside = [o for o in default_objects if o["metadata"].get("namespace") == EXECUTOR_NAMESPACE]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in inside) == [
        ("Deployment", "rel-privcode-executor"),
        ("NetworkPolicy", "rel-privcode-executor"),
        ("Secret", TOKEN_SECRET),
        ("Service", "rel-privcode-executor"),
        ("ServiceAccount", "rel-privcode-executor"),
    ]
    assert not by_kind(default_objects, "Namespace")  # executor.createNamespace is off
    assert all(
        o["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        for o in default_objects
        if o not in inside and o["kind"] != "Secret"
    )
    # created by the chart when asked: Pod Security privileged there, and only there
    objects = render(helm, "--set", "executor.createNamespace=true")
    namespace = one(objects, "Namespace")
    assert namespace["metadata"]["name"] == EXECUTOR_NAMESPACE
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert not k8s_problems(namespace)
    # a name of one's own; never the release's namespace created by the chart
    objects = render(helm, "--set", "executor.namespace=sandboxes")
    assert executor_deployment(objects)["metadata"]["namespace"] == "sandboxes"
    pipeline = pods_of(objects, "pipeline")[0]
    url = env_of(pipeline.spec["containers"][0])[EXECUTOR_ENV]
    assert url == f"http://rel-privcode-executor.sandboxes.svc:{EXECUTOR_PORT}"
    stderr = render_error(
        helm, "--set", f"executor.namespace={NAMESPACE}", "--set", "executor.createNamespace=true"
    )
    assert "executor.createNamespace" in stderr and "does not own" in stderr, stderr


def test_only_the_release_pipeline_reaches_the_executor_across_namespaces(default_objects):
    policies = Policies(default_objects)
    executor = pods_of(default_objects, "executor")[0]
    me = endpoint(executor)
    assert me.namespace == EXECUTOR_NAMESPACE
    pipeline = pods_of(default_objects, "pipeline")[0]
    assert policies.reach(endpoint(pipeline), me, EXECUTOR_PORT)
    # pipeline labels in the executor's namespace, or in a third one: no
    for namespace in (EXECUTOR_NAMESPACE, "team-z"):
        stranger = Endpoint.pod(pipeline.labels, namespace)
        assert not policies.ingress(me, stranger, EXECUTOR_PORT), namespace
    # the pipeline's egress names the executor's namespace: an executor-labelled impostor in the
    # release's namespace gets nothing from it
    impostor = Endpoint.pod(executor.labels, NAMESPACE)
    assert not policies.egress(endpoint(pipeline), impostor, EXECUTOR_PORT)
    # and the executor reaches nothing, its own namespace included
    assert policies.isolated(me, "Egress") and not policies.rules(me, "Egress")
    assert not policies.egress(me, Endpoint.pod({"app": "x"}, EXECUTOR_NAMESPACE), 53, "UDP")


# --------------------------------------------------------------------------- 3. its node


def anti_affinity(pod: dict) -> dict:
    return pod["spec"]["affinity"]["podAntiAffinity"]


def test_executors_keep_away_from_the_pods_holding_private_data(helm, default_objects):
    template = executor_deployment(default_objects)["spec"]["template"]
    (preferred,) = anti_affinity(template)["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["weight"] == 100
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["namespaces"] == [NAMESPACE]  # the Ray pods' namespace, not the executor's
    for pod in pods(default_objects):  # exactly the pipeline and serving pods of the release
        assert selects(term["labelSelector"], pod.labels) == (pod.role in ("pipeline", "serving"))
    required = executor_pod(helm, "--set", "executor.antiAffinity=required")
    assert anti_affinity(required) == {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
    assert "affinity" not in executor_pod(helm, "--set", "executor.antiAffinity=none")["spec"]
    # the operator's runs in the other namespaces it watches are kept away from too
    watched = executor_pod(helm, "--set", "operator.namespaces={team-a,team-b}")
    (preferred,) = anti_affinity(watched)["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["podAffinityTerm"]["namespaces"] == [NAMESPACE, "team-b"]
    # the user's affinity is kept, terms added to
    merged = executor_pod(
        helm,
        *(
            "--set",
            "executor.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey=zone",
        ),
        *("--set", "executor.antiAffinity=required"),
        *(
            "--set",
            "executor.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchFields[0].key=metadata.name",
        ),
        *(
            "--set",
            "executor.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchFields[0].operator=Exists",
        ),
    )
    terms = anti_affinity(merged)["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [{"topologyKey": "zone"}, term]
    assert "nodeAffinity" in merged["spec"]["affinity"]


# --------------------------------------------------------------------------- 4. AppArmor


def test_a_localhost_apparmor_profile_replaces_unconfined(helm):
    named = ("--set", "executor.appArmor.localhostProfile=privcode-executor")
    sc = executor_pod(helm, *named)["spec"]["containers"][0]["securityContext"]
    assert sc["appArmorProfile"] == {"type": "Localhost", "localhostProfile": "privcode-executor"}
    old = executor_pod(helm, *named, "--kube-version", "1.26.0")
    assert old["metadata"]["annotations"] == {
        "container.apparmor.security.beta.kubernetes.io/executor": "localhost/privcode-executor"
    }
    warning = "the executor runs AppArmor Unconfined"
    assert warning in notes(helm) and "executor.appArmor.localhostProfile" in notes(helm)
    assert warning not in notes(helm, *named)
    assert warning not in notes(helm, *WEAK)  # no mount at all: the runtime's default applies


def mount_rules(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if re.match(r"\s*(deny\s+)?mount\b", line)]


def test_the_apparmor_profile_allows_only_the_sandbox_mounts():
    """Every mount rule targets the sandbox's state directory (or makes / private); no blanket
    ``mount,``; the directories the zygote binds are all there; pivot_root is denied."""
    text = PROFILE.read_text()
    assert re.search(r"^profile privcode-executor ", text, re.M)
    rules = mount_rules(text)
    assert "mount," not in rules and len(rules) >= 10
    state = "@{PRIVCODE_STATE}/"
    for rule in rules:
        target = rule.split("->", 1)[1].strip().rstrip(",") if "->" in rule else ""
        assert target.startswith(state) or rule == "mount options=(rw, rprivate) -> /,", rule
    assert "@{PRIVCODE_STATE}=/run/privcode-sandbox /tmp/privcode-sandbox" in text
    binds = next(r for r in rules if r.startswith("mount options=(rw, bind) /{usr,"))
    for top in ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        assert top in binds
    fstypes = set(re.findall(r"fstype=(\w+)", "\n".join(rules)))
    assert fstypes == {"tmpfs", "proc", "cgroup2", "cgroup"}
    assert "deny pivot_root," in text and "deny @{PROC}/sysrq-trigger rwklx," in text
    parser = shutil.which("apparmor_parser")
    if parser:  # compile it (no kernel needed): a syntax error fails here, not on the node
        done = subprocess.run(
            [parser, "--skip-kernel-load", "--skip-cache", "-S", str(PROFILE)],
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 0 and done.stdout, done.stderr.decode()


# --------------------------------------------------------------------------- 5. token and budget


def secret_token(objects: list[dict]) -> dict[str, str]:
    return {
        s["metadata"]["namespace"]: s["data"]["token"]
        for s in by_kind(objects, "Secret")
        if s["metadata"]["name"] == TOKEN_SECRET
    }


def token_mounts(template: dict) -> list[str]:
    names = {
        v["name"]
        for v in template["spec"].get("volumes", [])
        if v.get("secret", {}).get("secretName") == TOKEN_SECRET
    }
    return [
        m["mountPath"]
        for c in template["spec"]["containers"]
        for m in c.get("volumeMounts", [])
        if m["name"] in names and m.get("readOnly") is True
    ]


def test_the_token_reaches_the_executor_and_the_pipeline_pods_only(helm):
    objects = render(helm, *EVERY_ROLE)
    tokens = secret_token(objects)
    assert set(tokens) == {NAMESPACE, EXECUTOR_NAMESPACE}
    assert len(set(tokens.values())) == 1 and len(tokens[NAMESPACE]) == 64  # 48 chars, base64
    template = (CHART / "templates" / "executor.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $secret' in template  # kept across upgrades
    for pod in pods(objects):
        template = {"spec": pod.spec}
        env = [env_of(c) for c in pod.spec["containers"]]
        if pod.role in ("pipeline", "executor"):
            assert token_mounts(template) == [TOKEN_DIR], pod.where
            key = (
                "PRIVCODE_EXECUTOR_TOKEN_FILE"
                if pod.role == "executor"
                else ("PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE")
            )
            assert env[0][key] == TOKEN_FILE, pod.where
        else:  # serving, submitter, ledger, operator
            assert not token_mounts(template), pod.where
            assert all("PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE" not in e for e in env), pod.where
    # the autoscaler sidecar neither
    for owner in ("RayCluster", "RayJob"):
        for obj in by_kind(
            render(helm, "--set", "autoscaling.enableInTreeAutoscaling=true", *EVERY_ROLE), owner
        ):
            spec = obj["spec"].get("rayClusterSpec", obj["spec"])
            assert "PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE" not in str(spec["autoscalerOptions"])


@pytest.mark.parametrize(
    "args, memory, disk",
    [
        ((), 4096, 1024),
        (("--set", "executor.resources.limits.memory=6G"), 5722, 1024),
        (
            (
                "--set",
                "executor.resources.limits.memory=3Gi",
                "--set",
                "executor.tmp.sizeLimit=512Mi",
            ),
            3072,
            512,
        ),
        (
            (
                "--set",
                "executor.resources.limits.memory=2147483648",
                "--set",
                "executor.tmp.sizeLimit=",
            ),
            2048,
            2048,
        ),
        (
            (
                "--set",
                "executor.resources.limits.memory=1.5Gi",
                "--set",
                "executor.tmp.sizeLimit=500M",
            ),
            1536,
            476,
        ),
    ],
)
def test_the_budget_flags_come_from_the_memory_limit_and_tmp(helm, args, memory, disk):
    command = executor_pod(helm, *args)["spec"]["containers"][0]["command"]
    assert (flag(command, "--memory-budget-mb"), flag(command, "--disk-budget-mb")) == (
        str(memory),
        str(disk),
    )


def test_a_budget_the_chart_cannot_read_is_refused(helm):
    stderr = render_error(helm, "--set", "executor.resources.limits.memory=null")
    assert "executor.resources.limits.memory is empty" in stderr, stderr
    stderr = render_error(helm, "--set-string", "executor.resources.limits.memory=4.5.1Gi")
    assert "executor.resources.limits.memory" in stderr, stderr


# --------------------------------------------------------------------------- 6. isolation levels


@pytest.mark.parametrize("isolation", ["full", "full-no-cgroup", "rlimits-only"])
def test_each_isolation_name_reaches_the_executor_and_the_entrypoint(helm, isolation):
    objects = render(helm, "--set", f"executor.isolation={isolation}")
    spec = executor_deployment(objects)["spec"]["template"]["spec"]
    assert flag(spec["containers"][0]["command"], "--isolation") == isolation
    entry = shlex.split(one(objects, "RayJob")["spec"]["entrypoint"])
    assert entry[entry.index(f"sandbox.isolation={isolation}") - 1] == "--set"
    full = isolation != "rlimits-only"
    assert ("SYS_ADMIN" in str(spec["containers"][0]["securityContext"])) is full


def test_rlimits_only_runs_unprivileged(helm):
    objects = render(helm, *WEAK)
    spec = executor_deployment(objects)["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 65534
    sc = spec["containers"][0]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 65534
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert "appArmorProfile" not in sc and "procMount" not in sc
    assert spec["hostUsers"] is False
    assert "sandbox.isolation=full" not in one(objects, "RayJob")["spec"]["entrypoint"]
    assert all(p.forbidden() for p in pods(objects) if p.role != "executor")
    assert "a snippet can forge verdicts" in notes(helm, *WEAK)


# --------------------------------------------------------------------------- 7. refusals


def test_disabling_the_executor_needs_the_named_acknowledgement(helm):
    stderr = render_error(helm, "--set", "executor.enabled=false")
    assert "executor.enabled=false" in stderr and "sandbox.runInRayPods=true" in stderr, stderr
    assert "privacy store" in stderr
    stderr = render_error(helm, *DISABLED_ACK)
    assert "executor.isolation=rlimits-only" in stderr, stderr
    objects = render(helm, *DISABLED_ACK, *WEAK, *EVERY_ROLE)
    assert not executor_objects(objects, "Deployment") and not executor_objects(objects, "Service")
    assert not secret_token(objects)
    for pod in pods(objects):
        if pod.role in ("ledger", "operator"):  # run no code at all, executor or not
            assert pod.forbidden() and EXECUTOR_ENV not in env_of(pod.spec["containers"][0])
            continue
        for container in pod.spec["containers"]:
            env = env_of(container)
            assert FORBID not in env and EXECUTOR_ENV not in env, pod.where
            assert "PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE" not in env, pod.where
    text = notes(helm, *DISABLED_ACK, *WEAK)
    assert "WARNING: executor.enabled=false with sandbox.runInRayPods=true" in text


def test_notes_name_the_executor_and_its_namespace(helm):
    text = notes(helm)
    assert 'Sandbox executor "rel-privcode-executor" in namespace "team-a-executor"' in text
    assert "http://rel-privcode-executor.team-a-executor.svc:8700" in text
    assert "pod-security.kubernetes.io/enforce=privileged" in text
    assert "pod-security.kubernetes.io/enforce=restricted" in text
    assert "executor.runtimeClassName=gvisor" in text  # the recommendation, none set
    assert "kubectl create namespace" not in notes(helm, "--set", "executor.createNamespace=true")


def test_a_serving_only_release_gets_no_executor(helm):
    objects = render(
        helm,
        *("--set", "job.enabled=false", "--set", "serve.enabled=true"),
        *("--set", "apiKey.existingSecret=privcode-api-keys", "--set", "cluster.enabled=false"),
        *("--set", "operator.enabled=false"),  # its runs are pipeline jobs
    )
    assert not executor_objects(objects, "Deployment") and not secret_token(objects)
    assert {p.role for p in pods(objects)} == {"serving", "ledger"}
    assert all(p.forbidden() for p in pods(objects))


@pytest.mark.parametrize(
    "setting, field, extra",
    [
        ("executor.isolation=weak", "executor.isolation", "full-no-cgroup"),
        ("executor.port=80", "executor.port", "minimum"),
        ("executor.workers=0", "executor.workers", "1"),
        ("executor.replicas=0", "executor.replicas", "1"),
        ("executor.privileged=true", "executor", "privileged"),
        ("executor.securityContext.appArmorProfile.type=Off", "appArmorProfile", "Unconfined"),
        ("executor.antiAffinity=sometimes", "executor.antiAffinity", "preferred"),
        ("executor.namespace=Team_B", "executor.namespace", "pattern"),
        ("executor.hostUsers=maybe", "executor.hostUsers", "boolean"),
        ("sandbox.runInRayPods=yes", "sandbox.runInRayPods", "boolean"),
    ],
)
def test_schema_rejects_bad_executor_values(helm, setting, field, extra):
    string = "=yes" in setting or "=maybe" in setting
    stderr = render_error(helm, "--set-string" if string else "--set", setting)
    assert "schema" in stderr, stderr
    assert field in stderr or "/" + field.replace(".", "/") in stderr, stderr
    assert extra in stderr, stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("--set", f"extraEnv[0].name={FORBID}", "--set-string", "extraEnv[0].value=0"),
            "extraEnv sets",
        ),
        (
            ("--set", f"head.env[0].name={EXECUTOR_ENV}", "--set", "head.env[0].value=x"),
            "head.env sets",
        ),
        (
            (
                "--set",
                "extraEnv[0].name=PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE",
                "--set",
                "extraEnv[0].value=/x",
            ),
            "extraEnv sets PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE",
        ),
        (("--set", f"job.runtimeEnv.env_vars.{FORBID}=0"), "job.runtimeEnv.env_vars sets"),
        (("--set", "pipeline.overrides={sandbox.isolation=rlimits-only}"), "pipeline.overrides"),
    ],
)
def test_the_sandbox_settings_cannot_be_overridden_around_the_chart(helm, args, message):
    stderr = render_error(helm, *args)
    assert message in stderr, stderr


def test_the_profile_path_is_where_the_docs_say():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "kubernetes.md").read_text()
    assert "charts/privcode/files/apparmor/privcode-executor" in docs
    assert PROFILE.is_file()
