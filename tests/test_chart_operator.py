"""The Helm chart ``charts/privcode``: the privcode operator (issue 42).

With ``operator.enabled`` (the default) the chart runs ``privcode operator`` as the Deployment
``<fullname>-operator``: restricted, the privacy store and the data claims mounted read-only,
only the ``operator`` key of the ledger's tokens; its template is the chart's own pipeline
RayJob (one named template, ``privcode.rayjob``, rendered by templates/rayjob.yaml and into the
ConfigMap ``<fullname>-operator-template``, with or without ``job.enabled``). RBAC: only the
operator's ServiceAccount creates RayJobs; the ``run-author`` Role grants PrivCodeRuns and no
RayJob verb. A ValidatingAdmissionPolicy refuses, as defense in depth, RayJobs mounting the
store's or a data claim that no PrivCodeRun owns. Helpers: tests/chart_support.py; the
NetworkPolicy evaluator: tests/test_chart_executor.py.

No CEL library is installed in the venv, so the policy's expressions are checked as text
(what they test, on which fields), not evaluated.
"""

from __future__ import annotations

import re

import pytest
import yaml
from chart_support import (
    CHART,
    K8S_VERSIONS,
    by_kind,
    crd_problems,
    env_of,
    k8s_problems,
    one,
    render,
    render_error,
    run_helm,
)
from test_chart_executor import OTHERS, Endpoint, Policies, endpoint, pods

from privcode.privacy.ledger_client import TOKEN_FILE_ENV, URL_ENV

NAME = "rel-privcode-operator"
AUTHOR = "rel-privcode-run-author"
TEMPLATE = "rel-privcode-operator-template"
POLICY = "rel-privcode-team-a-rayjob-claims"
STORE_CLAIM = "rel-privcode-privacy-store"
SECRET = "rel-privcode-ledger-tokens"
LEDGER_URL = "http://rel-privcode-ledger.team-a.svc:8790"
LEDGER_PORT = 8790
ROLE = "privcode.io/role"
#: (kind, name) of every object the operator adds to a default rendering.
OPERATOR_OBJECTS = {
    ("Deployment", NAME),
    ("ServiceAccount", NAME),
    ("Role", NAME),
    ("RoleBinding", NAME),
    ("Role", AUTHOR),
    ("ConfigMap", TEMPLATE),
    ("NetworkPolicy", NAME),
    ("ValidatingAdmissionPolicy", POLICY),
    ("ValidatingAdmissionPolicyBinding", POLICY),
}
OFF = ("--set", "operator.enabled=false")


def named(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, got {len(found)}"
    return found[0]


def operator_objects(objects: list[dict]) -> list[dict]:
    return [o for o in objects if (o["kind"], o["metadata"]["name"]) in OPERATOR_OBJECTS]


def operator_pod(objects: list[dict]) -> dict:
    return named(objects, "Deployment", NAME)["spec"]["template"]


def allows(role: dict, group: str, resource: str, verb: str) -> bool:
    """Whether an RBAC Role's rules grant ``verb`` on ``resource`` of API ``group``."""
    for rule in role.get("rules", []):
        if not ({group, "*"} & set(rule.get("apiGroups", []))):
            continue
        if not ({resource, "*"} & set(rule.get("resources", []))):
            continue
        if {verb, "*"} & set(rule.get("verbs", [])):
            return True
    return False


def policy_variables(objects: list[dict]) -> dict[str, str]:
    policy = named(objects, "ValidatingAdmissionPolicy", POLICY)
    return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}


@pytest.fixture(scope="module")
def job_off(helm) -> list[dict]:
    """The operator alone: the chart's one-off RayJob off."""
    return render(helm, "--set", "job.enabled=false")


# --------------------------------------------------------------------------- what renders


def test_the_operator_renders_by_default_and_every_object_is_valid(default_objects, helm):
    found = {(o["kind"], o["metadata"]["name"]) for o in operator_objects(default_objects)}
    assert found == OPERATOR_OBJECTS
    # nobody is bound to the run-author Role unless operator.runAuthors names them
    assert [b["metadata"]["name"] for b in by_kind(default_objects, "RoleBinding")] == [NAME]
    for obj in operator_objects(default_objects):
        if obj["kind"] != "NetworkPolicy":  # the policies carry no component label
            assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "operator", obj
    # kubernetes-validate knows admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy from
    # 1.30 only (1.26 has v1alpha1): the chart renders the policy for >= 1.30 and nothing older
    # (RBAC alone then), and every other object is valid on the oldest supported version too
    oldest, newest = K8S_VERSIONS
    old = render(helm, "--kube-version", oldest)
    assert not by_kind(old, "ValidatingAdmissionPolicy")
    assert not by_kind(old, "ValidatingAdmissionPolicyBinding")
    for obj in operator_objects(old):
        assert not k8s_problems(obj, (oldest,)), (obj["kind"], k8s_problems(obj, (oldest,)))
    assert by_kind(render(helm, "--kube-version", "1.30.0"), "ValidatingAdmissionPolicy")
    for obj in operator_objects(render(helm, "--kube-version", newest)):
        assert not k8s_problems(obj, (newest,)), (obj["kind"], k8s_problems(obj, (newest,)))


def test_operator_disabled_renders_none_of_it(helm):
    for extra in ((), ("--set", "job.enabled=false", "--set", "cluster.enabled=true")):
        objects = render(helm, *OFF, *extra)
        assert not operator_objects(objects)
        assert not {"Role", "RoleBinding"} & {o["kind"] for o in objects}
        assert not [o for o in objects if o["kind"].startswith("ValidatingAdmission")]
        assert "operator" not in {p.role for p in pods(objects)}
    # the policy alone can be switched off (a cluster where the release may not create it)
    objects = render(helm, "--set", "operator.admissionPolicy.enabled=false")
    assert not [o for o in objects if o["kind"].startswith("ValidatingAdmission")]
    assert named(objects, "Deployment", NAME)


def test_the_operator_needs_the_ledger_service(helm):
    for setting in ("ledger.enabled=false", "storage.privacyStore.enabled=false"):
        stderr = render_error(helm, "--set", setting)
        assert "operator.enabled: the operator reserves each PrivCodeRun's budget" in stderr
        assert "or set operator.enabled=false" in stderr
        render(helm, "--set", setting, *OFF)  # the single-cluster fallback without it
    stderr = render_error(helm, "--set", "job.enabled=false", "--set", "storage.pvc.enabled=false")
    assert "operator.enabled: the runs' RayJobs have nowhere to keep their artifacts" in stderr


# --------------------------------------------------------------------------- the pod


def test_the_operator_pod(default_objects, ci_objects):
    deployment = named(default_objects, "Deployment", NAME)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "operator" and labels[ROLE] == "operator"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spec = template["spec"]
    (container,) = spec["containers"]
    assert container["command"] == [
        "privcode",
        "operator",
        "--store",
        "/mnt/privacy-store/store",
        "--data-root",
        "/mnt/data",
        "--template",
        "/etc/privcode/operator/rayjob-template.yaml",
        "--namespace",
        "team-a",
        "--poll-s",
        "10",
        "--artifacts-root",
        "/mnt/artifacts",
    ]
    assert container["image"] == "privcode:0.1.0"
    # no probe: the CLI serves no health endpoint (a crashed controller exits and restarts)
    assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(container)
    env = env_of(container)
    assert env[URL_ENV] == LEDGER_URL
    assert env[TOKEN_FILE_ENV] == "/etc/privcode/ledger-token/operator"
    assert env["PRIVCODE_SANDBOX_FORBID_LOCAL"] == "1"
    # it talks to the API: its own ServiceAccount, with a token
    assert spec["serviceAccountName"] == NAME and spec["automountServiceAccountToken"] is True
    account = named(default_objects, "ServiceAccount", NAME)
    assert account["automountServiceAccountToken"] is True
    assert not account["metadata"].get("annotations")
    # Pod Security "restricted", as the ledger's pod
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
    assert not spec.get("hostNetwork") and not spec.get("hostPID")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert set(volumes["tmp"]) == {"name", "emptyDir"} and "/tmp" in mounts
    # the template ConfigMap
    assert volumes[mounts["/etc/privcode/operator"]["name"]]["configMap"] == {"name": TEMPLATE}
    # only the operator's key of the ledger's tokens
    token = volumes[mounts["/etc/privcode/ledger-token"]["name"]]
    assert token["projected"]["sources"] == [
        {"secret": {"name": SECRET, "items": [{"key": "operator", "path": "operator"}]}}
    ]
    assert not [v for v in spec["volumes"] if "secret" in v]
    # the store: read-only, mount and claim
    store = mounts["/mnt/privacy-store"]
    assert store["readOnly"] is True
    assert volumes[store["name"]]["persistentVolumeClaim"] == {
        "claimName": STORE_CLAIM,
        "readOnly": True,
    }
    # no data claim by default
    assert not [m for m in mounts if m.startswith("/mnt/data")]

    # CI values: two data claims (dataRoot with a trailing slash), another tag, five seconds
    ci = operator_pod(ci_objects)["spec"]
    (container,) = ci["containers"]
    assert container["image"] == "registry.example.com/privcode/privcode:0.1.0-operator-ci"
    assert container["imagePullPolicy"] == "Always"  # image.pullPolicy
    command = container["command"]
    assert command[command.index("--data-root") + 1] == "/mnt/data"
    assert command[command.index("--poll-s") + 1] == "5"
    volumes = {v["name"]: v for v in ci["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    claims = {}
    for path, mount in mounts.items():
        claim = volumes[mount["name"]].get("persistentVolumeClaim")
        if claim:
            assert mount["readOnly"] is True and claim["readOnly"] is True, path
            claims[path] = claim["claimName"]
    assert claims == {
        "/mnt/privacy-store": STORE_CLAIM,
        "/mnt/data/corpus-acme": "corpus-acme",
        "/mnt/data/corpus-public": "corpus-public",
        "/mnt/artifacts": "rel-privcode-artifacts",  # each run's progress, read-only
    }
    assert ci["nodeSelector"] == {"node-role/privacy": "true"}
    assert not k8s_problems(named(ci_objects, "Deployment", NAME))


def test_the_operator_reaches_the_ledger_dns_and_the_api_only(default_objects, ci_objects):
    for objects in (default_objects, ci_objects):
        policies = Policies(objects)
        (me,) = [endpoint(p) for p in pods(objects) if p.role == "operator"]
        (ledger,) = [endpoint(p) for p in pods(objects) if p.role == "ledger"]
        assert policies.reach(me, ledger, LEDGER_PORT)
        assert not policies.reach(me, ledger, 8265)
        assert policies.egress(me, OTHERS["dns"], 53, "UDP")
        # nothing of the release but the ledger, and nothing reaches it
        for other in pods(objects):
            if other.role in ("operator", "ledger"):
                continue
            for port in (8265, 8700, 6379, 10001):
                assert not policies.reach(me, endpoint(other), port), (other.where, port)
                assert not policies.reach(endpoint(other), me, port), (other.where, port)
        for what, other in OTHERS.items():
            assert not policies.ingress(me, other, 8080), what
    # the API server: the networkPolicy.apiServer ports (and CIDRs)
    policy = named(ci_objects, "NetworkPolicy", NAME)["spec"]
    api = [r for r in policy["egress"] if any(p["port"] == 6443 for p in r["ports"])]
    assert api == [
        {
            "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}],
            "to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}],
        }
    ]
    assert policy["ingress"] == []


# --------------------------------------------------------------------------- the template


def test_the_template_is_the_charts_own_rayjob(default_objects, ci_objects, job_off, helm, crds):
    for objects in (default_objects, ci_objects):
        template = yaml.safe_load(
            named(objects, "ConfigMap", TEMPLATE)["data"]["rayjob-template.yaml"]
        )
        assert template == one(objects, "RayJob")
        assert not crd_problems(template), crd_problems(template)
    # job.enabled=false: no RayJob of the chart's own, the same template for the operator
    assert not by_kind(job_off, "RayJob")
    template = yaml.safe_load(named(job_off, "ConfigMap", TEMPLATE)["data"]["rayjob-template.yaml"])
    assert template == one(default_objects, "RayJob")
    assert not crd_problems(template), crd_problems(template)
    # what its runs' pods need is there without the one-off job: the pipeline and submitter
    # policies, the executor
    roles = {p.role for p in pods(job_off)}
    assert {"operator", "ledger", "executor"} <= roles
    policies = {p["metadata"]["name"] for p in by_kind(job_off, "NetworkPolicy")}
    assert {"rel-privcode-pipeline", "rel-privcode-submitter", "rel-privcode-executor"} <= policies


def test_a_run_made_from_the_template_mounts_its_claim_on_ray_pods_only(job_off, crds):
    from privcode.operator.children import child_name, rayjob_for

    template = yaml.safe_load(named(job_off, "ConfigMap", TEMPLATE)["data"]["rayjob-template.yaml"])
    run = {"metadata": {"name": "study", "namespace": "team-a", "uid": "0f1e2d3c4b5a6978"}}
    name = child_name("study", run["metadata"]["uid"])
    job = rayjob_for(
        template,
        run,
        name=name,
        config_map=f"{name}-config",
        data_claim="corpus-acme",
        data_mount="/mnt/data/corpus-acme",
        overrides=["privacy.run_key=k"],
    )
    assert not crd_problems(job), crd_problems(job)
    owner = job["metadata"]["ownerReferences"][0]
    # what the admission policy's ownedByRun looks for
    assert (owner["kind"], owner["apiVersion"]) == ("PrivCodeRun", "privcode.dev/v1alpha1")
    submitter = job["spec"]["submitterPodTemplate"]["spec"]
    assert "run-data" not in {v["name"] for v in submitter["volumes"]}


# --------------------------------------------------------------------------- RBAC


def test_only_the_operator_may_create_rayjobs(default_objects):
    operator = named(default_objects, "Role", NAME)
    author = named(default_objects, "Role", AUTHOR)
    assert operator["metadata"]["namespace"] == author["metadata"]["namespace"] == "team-a"
    for verb in ("get", "list", "watch", "create", "delete", "patch"):
        assert allows(operator, "ray.io", "rayjobs", verb), verb
    for resource in ("privcoderuns", "privacybudgets"):
        for verb in ("get", "list", "watch", "patch", "update"):
            assert allows(operator, "privcode.dev", resource, verb), (resource, verb)
        for verb in ("get", "patch", "update"):
            assert allows(operator, "privcode.dev", f"{resource}/status", verb), (resource, verb)
    assert allows(operator, "", "configmaps", "create") and allows(
        operator, "", "configmaps", "get"
    )
    for group in ("", "events.k8s.io"):
        assert allows(operator, group, "events", "create"), group
    # never more than its runs need: no Secret, Pod, claim or other Ray kind
    for group, resource in (("", "secrets"), ("", "pods"), ("", "persistentvolumeclaims")):
        assert not any(allows(operator, group, resource, v) for v in ("get", "create")), resource
    assert not allows(operator, "ray.io", "rayclusters", "create")
    assert not allows(operator, "", "configmaps", "list")  # no reading every ConfigMap
    # the run author: runs and budgets, no RayJob verb at all (nor any wildcard)
    for verb in ("create", "get", "list", "watch", "delete"):
        assert allows(author, "privcode.dev", "privcoderuns", verb), verb
    assert not allows(author, "privcode.dev", "privcoderuns", "update")
    assert allows(author, "privcode.dev", "privcoderuns/status", "get")
    assert not allows(author, "privcode.dev", "privcoderuns/status", "patch")
    for verb in ("get", "list", "watch"):
        assert allows(author, "privcode.dev", "privacybudgets", verb), verb
    assert not allows(author, "privcode.dev", "privacybudgets", "patch")
    for verb in ("get", "list", "watch", "create", "update", "patch", "delete"):
        assert not allows(author, "ray.io", "rayjobs", verb), verb
        for group, resource in (("", "pods"), ("", "persistentvolumeclaims"), ("", "secrets")):
            assert not allows(author, group, resource, verb), (resource, verb)
    assert "*" not in str([r.get("verbs") + r.get("resources") for r in author["rules"]])
    # a run author cannot deliver a budget raise; the budget owner's Role can (the grant
    # inside must still carry the store authority's signature)
    assert not allows(author, "privcode.dev", "privacybudgetraises", "create")
    owner = named(default_objects, "Role", "rel-privcode-budget-owner")
    assert allows(owner, "privcode.dev", "privacybudgetraises", "create")
    assert not any(allows(owner, "ray.io", "rayjobs", v) for v in ("create", "get"))
    assert allows(operator, "privcode.dev", "privacybudgetraises/status", "patch")
    # the operator's binding: its ServiceAccount only
    binding = named(default_objects, "RoleBinding", NAME)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": NAME,
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": "team-a"}]


def test_run_authors_are_bound_when_named(ci_objects):
    binding = named(ci_objects, "RoleBinding", AUTHOR)
    assert binding["roleRef"]["name"] == AUTHOR and binding["roleRef"]["kind"] == "Role"
    assert binding["subjects"] == [
        {"kind": "Group", "name": "ml-researchers", "apiGroup": "rbac.authorization.k8s.io"},
        {"kind": "ServiceAccount", "name": "ci-runner", "namespace": "team-a"},
    ]
    assert not k8s_problems(binding)


def test_other_watched_namespaces(helm):
    objects = render(helm, "--set", "operator.namespaces={team-a,team-b}")
    command = operator_pod(objects)["spec"]["containers"][0]["command"]
    assert [command[i + 1] for i, a in enumerate(command) if a == "--namespace"] == [
        "team-a",
        "team-b",
    ]
    for kind, name in (("Role", NAME), ("RoleBinding", NAME), ("Role", AUTHOR)):
        found = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
        assert sorted(o["metadata"]["namespace"] for o in found) == ["team-a", "team-b"], kind
    for binding in [o for o in by_kind(objects, "RoleBinding") if o["metadata"]["name"] == NAME]:
        assert binding["subjects"][0]["namespace"] == "team-a"  # the operator's own
    selector = named(objects, "ValidatingAdmissionPolicyBinding", POLICY)["spec"]
    assert selector["matchResources"]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
    ]
    # the runs' pipeline pods over there reach the ledger and the executor; no one else there
    policies = Policies(objects)
    ledger = next(endpoint(p) for p in pods(objects) if p.role == "ledger")
    executor = next(endpoint(p) for p in pods(objects) if p.role == "executor")
    pipeline = next(p for p in pods(objects) if p.role == "pipeline")
    remote = Endpoint.pod(pipeline.labels, "team-b")
    assert policies.ingress(ledger, remote, LEDGER_PORT)
    assert policies.ingress(executor, remote, 8700)
    assert not policies.ingress(ledger, Endpoint.pod(pipeline.labels, "team-c"), LEDGER_PORT)
    assert not policies.ingress(ledger, Endpoint.pod({"app": "x"}, "team-b"), LEDGER_PORT)


# --------------------------------------------------------------------------- admission policy


def test_the_admission_policy_refuses_unowned_rayjobs_mounting_the_claims(ci_objects, job_off):
    """What the CEL says, read as text (no CEL library here to evaluate it)."""
    policy = named(ci_objects, "ValidatingAdmissionPolicy", POLICY)["spec"]
    assert policy["failurePolicy"] == "Fail"
    assert policy["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": ["ray.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["rayjobs"],
        }
    ]
    variables = policy_variables(ci_objects)
    # the protected claims: the store's and every data claim
    assert variables["protected"] == f"['{STORE_CLAIM}', 'corpus-acme', 'corpus-public']"
    # a PrivCodeRun owner
    owned = variables["ownedByRun"]
    assert "object.metadata.ownerReferences.exists(r, " in owned
    assert "r.kind == 'PrivCodeRun'" in owned and "r.apiVersion == 'privcode.dev/v1alpha1'" in owned
    # the volumes of the head, of every worker group and of the submitter
    mounts = "volumes.exists(v, has(v.persistentVolumeClaim) && v.persistentVolumeClaim.claimName in variables.protected)"
    head = "object.spec.rayClusterSpec.headGroupSpec.template."
    assert head + "spec." + mounts in variables["headMounts"]
    assert "object.spec.rayClusterSpec.workerGroupSpecs.exists(g, " in variables["workerMounts"]
    assert "g.template.spec." + mounts in variables["workerMounts"]
    assert "object.spec.submitterPodTemplate.spec." + mounts in variables["submitterMounts"]
    # every optional field is tested with has() before it is read (an absent one is an error)
    for name, fields in {
        "headMounts": (
            "object.spec",
            "object.spec.rayClusterSpec",
            head + "spec",
            head + "spec.volumes",
        ),
        "workerMounts": (
            "object.spec.rayClusterSpec",
            "object.spec.rayClusterSpec.workerGroupSpecs",
            "g.template.spec",
            "g.template.spec.volumes",
        ),
        "submitterMounts": (
            "object.spec.submitterPodTemplate",
            "object.spec.submitterPodTemplate.spec",
            "object.spec.submitterPodTemplate.spec.volumes",
        ),
    }.items():
        for field in fields:
            assert f"has({field})" in variables[name], (name, field)
    # the chart's own RayJob is exempt by name, in the release namespace, while job.enabled
    assert variables["chartJob"] == (
        "request.namespace == 'team-a' && has(object.metadata.name) && "
        "object.metadata.name == 'rel-privcode'"
    )
    assert policy_variables(job_off)["chartJob"] == "false"
    (validation,) = policy["validations"]
    assert validation["expression"] == (
        "variables.ownedByRun || variables.chartJob || "
        "!(variables.headMounts || variables.workerMounts || variables.submitterMounts)"
    )
    assert validation["reason"] == "Forbidden" and "PrivCodeRun" in validation["message"]
    binding = named(ci_objects, "ValidatingAdmissionPolicyBinding", POLICY)["spec"]
    assert binding["policyName"] == POLICY and binding["validationActions"] == ["Deny"]
    assert binding["matchResources"]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]}
    ]


def test_the_rayjobs_the_policy_sees(ci_objects, job_off):
    """The policy's premises hold for what the chart renders: the chart's own RayJob mounts
    the store's claim (hence its exemption) under the exempt name, and no worker group or
    submitter of the template mounts a protected claim by itself."""
    job = one(ci_objects, "RayJob")
    assert job["metadata"]["name"] == "rel-privcode" and "ownerReferences" not in job["metadata"]
    cluster = job["spec"]["rayClusterSpec"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in cluster["headGroupSpec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert STORE_CLAIM in claims
    protected = {STORE_CLAIM, "corpus-acme", "corpus-public"}
    submitter = job["spec"]["submitterPodTemplate"]["spec"]
    assert not protected & {
        v["persistentVolumeClaim"]["claimName"]
        for v in submitter.get("volumes", [])
        if "persistentVolumeClaim" in v
    }


@pytest.mark.parametrize(
    "release, extra",
    [("b" * 53, ()), ("rel", ("--set", "fullnameOverride=" + "f" * 63))],
)
def test_cluster_scoped_names_fit_and_stay_distinct(helm, release, extra):
    names = set()
    for namespace in ("team-a", "n" * 63):
        done = run_helm(helm, "template", release, str(CHART), "--namespace", namespace, *extra)
        assert done.returncode == 0, done.stderr
        objects = [d for d in yaml.safe_load_all(done.stdout) if d]
        (policy,) = by_kind(objects, "ValidatingAdmissionPolicy")
        name = policy["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        assert (
            named(objects, "ValidatingAdmissionPolicyBinding", name)["spec"]["policyName"] == name
        )
        names.add(name)
    assert len(names) == 2  # one release name in two namespaces: two policies


# --------------------------------------------------------------------------- NOTES


def test_notes_name_the_runs_and_budgets(helm):
    done = run_helm(helm, "install", "rel", str(CHART), "--dry-run=client", "--namespace", "team-a")
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "kubectl get privcoderuns -n team-a" in notes
    assert "kubectl get privacybudgets -n team-a" in notes
    assert f'Role "{AUTHOR}"' in notes
    assert f"kubectl rollout status deployment/{NAME} -n team-a" in notes
