"""The Helm chart ``charts/privcode``: the privacy store's ledger service, one writer per store.

With ``ledger.enabled`` (the default) the Deployment ``<fullname>-ledger`` (one pod,
``Recreate``) is the only pod that mounts the privacy store read-write
(``privcode budget serve-ledger``); the pipeline's Ray pods mount it read-only and hold the
``pipeline`` token alone, the serving pods hold no store, only the PAC state and the
``serving`` token, and the ensemble app calls the service. Its NetworkPolicy admits the
pipeline, serving and operator pods on its port only and lets nothing out.
``ledger.enabled=false`` is the single-cluster fallback: the store read-write on every Ray
pod, as before the service. Helpers: tests/chart_support.py; the NetworkPolicy evaluator:
tests/test_chart_executor.py.
"""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest
import yaml
from chart_support import (
    CHART,
    all_pod_templates,
    by_kind,
    env_of,
    k8s_problems,
    one,
    pod_templates,
    render,
    render_error,
)
from test_chart_executor import OTHERS, Endpoint, Policies, endpoint, pods

from privcode.privacy.ledger_client import TOKEN_FILE_ENV, URL_ENV
from privcode.privacy.ledger_service import ROLES

SERVING = (
    "--set",
    "serve.enabled=true",
    "--set",
    "serve.ensemble.enabled=true",
    "--set",
    "apiKey.existingSecret=keys",
)
#: Every Ray role: the RayJob (and its submitter), the RayCluster and the RayService.
EVERYTHING = (*SERVING, "--set", "cluster.enabled=true")
#: The single-cluster fallback (the operator needs the ledger service: off too).
FALLBACK = ("--set", "ledger.enabled=false", "--set", "operator.enabled=false")
NAME = "rel-privcode-ledger"
SECRET = "rel-privcode-ledger-tokens"
STORE_CLAIM = "rel-privcode-privacy-store"
URL = "http://rel-privcode-ledger.team-a.svc:8790"
PORT = 8790
ROLE = "privcode.io/role"
TOKEN_DIR = "/etc/privcode/ledger-token"


@pytest.fixture(scope="module")
def everything(helm) -> list[dict]:
    return render(helm, *EVERYTHING)


@pytest.fixture(scope="module")
def fallback(helm) -> list[dict]:
    return render(helm, *EVERYTHING, *FALLBACK)


def ledger_deployment(objects: list[dict]) -> dict:
    found = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == NAME]
    assert len(found) == 1, f"expected one ledger Deployment, got {len(found)}"
    return found[0]


def ray_pods(objects: list[dict], serving: bool) -> list[tuple[str, dict]]:
    """(where, template) of the pipeline's (RayJob, RayCluster) or the serving Ray pods."""
    found = [
        (where, template)
        for where, template in pod_templates(objects)
        if not where.endswith("submitter") and where.startswith("RayService/") == serving
    ]
    assert found, f"no {'serving' if serving else 'pipeline'} Ray pod rendered"
    return found


def store_mounts(template: dict) -> list[tuple[dict, dict]]:
    """(mount, volume) of every container (init ones too) mounting the privacy store's claim."""
    volumes = {
        v["name"]: v
        for v in template["spec"].get("volumes", [])
        if v.get("persistentVolumeClaim", {}).get("claimName") == STORE_CLAIM
    }
    spec = template["spec"]
    return [
        (mount, volumes[mount["name"]])
        for container in spec["containers"] + spec.get("initContainers", [])
        for mount in container.get("volumeMounts", [])
        if mount["name"] in volumes
    ]


def token_items(template: dict) -> list[tuple[str, list[dict]]]:
    """(Secret name, items) of every Secret source of the pod's volumes (plain or projected)."""
    found = []
    for volume in template["spec"].get("volumes", []):
        if "secret" in volume:
            found.append((volume["secret"]["secretName"], volume["secret"].get("items", [])))
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                found.append((source["secret"]["name"], source["secret"].get("items", [])))
    return [(name, items) for name, items in found if "ledger" in name or name == "byo-tokens"]


# --------------------------------------------------------------------------- (a) the writer


def test_one_ledger_deployment_is_the_stores_only_writer(default_objects, everything):
    for objects in (default_objects, everything):
        deployment = ledger_deployment(objects)
        assert deployment["spec"]["replicas"] == 1
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two writers
        template = deployment["spec"]["template"]
        assert template["metadata"]["labels"][ROLE] == "ledger"
        # the store's claim is mounted read-write there and nowhere else
        writers = [
            where
            for where, template_ in all_pod_templates(objects)
            for mount, volume in store_mounts(template_)
            if not mount.get("readOnly") and not volume["persistentVolumeClaim"].get("readOnly")
        ]
        assert writers == [f"Deployment/{NAME}"]
        (container,) = template["spec"]["containers"]
        assert container["command"] == [
            "privcode",
            "budget",
            "serve-ledger",
            "--store",
            "/mnt/privacy-store/store",
            "--tokens",
            "/etc/privcode/ledger-tokens",
            "--listen",
            f"0.0.0.0:{PORT}",
        ]
        assert container["ports"] == [{"name": "http", "containerPort": PORT, "protocol": "TCP"}]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert not mounts["/mnt/privacy-store"].get("readOnly")
        tokens = mounts["/etc/privcode/ledger-tokens"]
        assert tokens["readOnly"] is True
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        # every role's token: the service checks them all
        assert volumes[tokens["name"]]["secret"] == {"secretName": SECRET, "defaultMode": 0o440}
        assert set(mounts) == {"/tmp", "/mnt/privacy-store", "/etc/privcode/ledger-tokens"}
        # `kubectl exec ... privcode budget show|raise` goes through the service as the operator
        env = env_of(container)
        assert env[URL_ENV] == f"http://127.0.0.1:{PORT}"
        assert env[TOKEN_FILE_ENV] == "/etc/privcode/ledger-tokens/operator"
        assert env["PRIVCODE_PRIVACY_STORE"] == "/mnt/privacy-store/store"
        assert env["PRIVCODE_SANDBOX_FORBID_LOCAL"] == "1"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert container["resources"]["limits"] == {"cpu": "1", "memory": "2Gi"}
        # the Service in front of it, and nothing else behind that Service
        service = next(s for s in by_kind(objects, "Service") if s["metadata"]["name"] == NAME)
        assert service["spec"]["type"] == "ClusterIP"
        assert service["spec"]["ports"] == [
            {"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}
        ]
        selector = service["spec"]["selector"]
        behind = [
            where
            for where, t in all_pod_templates(objects)
            if selector.items() <= t["metadata"]["labels"].items()
        ]
        assert behind == [f"Deployment/{NAME}"]


def test_the_ledger_pod_is_restricted(helm, default_objects):
    """Pod Security ``restricted``, its own ServiceAccount without a token, even when the Ray
    pods' security contexts are loosened."""
    loosened = render(
        helm,
        "--set",
        "securityContext.readOnlyRootFilesystem=false",
        "--set",
        "podSecurityContext.runAsNonRoot=false",
    )
    for objects in (default_objects, loosened):
        deployment = ledger_deployment(objects)
        spec = deployment["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False
        account = next(
            a for a in by_kind(objects, "ServiceAccount") if a["metadata"]["name"] == NAME
        )
        assert spec["serviceAccountName"] == NAME
        assert account["automountServiceAccountToken"] is False
        assert not account["metadata"].get("annotations")  # no cloud identity
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert (pod_sc["runAsUser"], pod_sc["fsGroup"]) == (1000, 100)  # the Ray pods' uid
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert "privileged" not in sc and "add" not in sc["capabilities"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert set(volumes["tmp"]) == {"name", "emptyDir"}
        assert not spec.get("hostNetwork") and not spec.get("hostPID")
        assert not k8s_problems(deployment)


# --------------------------------------------------------------------------- (b) serving


def test_serving_pods_hold_no_store_and_only_the_serving_token(everything):
    for where, template in ray_pods(everything, serving=True):
        assert not store_mounts(template), where
        assert "privacy-store" not in {v["name"] for v in template["spec"]["volumes"]}, where
        for container in template["spec"]["containers"]:
            env = env_of(container)
            assert "PRIVCODE_PRIVACY_STORE" not in env, where
            assert env[URL_ENV] == URL, where
            assert env[TOKEN_FILE_ENV] == f"{TOKEN_DIR}/serving", where
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["ledger-token"] == {
                "name": "ledger-token",
                "mountPath": TOKEN_DIR,
                "readOnly": True,
            }, where
            assert mounts["pac-state"]["mountPath"] == "/mnt/pac-state", where
        assert token_items(template) == [(SECRET, [{"key": "serving", "path": "serving"}])], where
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert (
            volumes["pac-state"]["persistentVolumeClaim"]["claimName"] == "rel-privcode-pac-state"
        )
    # the serving role's token may make the PAC calls only (privcode.privacy.ledger_service)
    assert ROLES["serving"] < ROLES["pipeline"]
    assert not {"admit", "reserve", "raise_budget", "pac_raise"} & ROLES["serving"]


# --------------------------------------------------------------------------- (c) pipeline


def test_pipeline_pods_mount_the_store_read_only_with_the_pipeline_token(everything):
    owners = set()
    for where, template in ray_pods(everything, serving=False):
        owners.add(where.split()[0].split("/")[0])
        mounted = store_mounts(template)
        assert mounted, where  # its keys give the records their identities
        for mount, volume in mounted:
            assert mount["readOnly"] is True, where
            assert volume["persistentVolumeClaim"]["readOnly"] is True, where
        container = template["spec"]["containers"][0]
        env = env_of(container)
        assert env["PRIVCODE_PRIVACY_STORE"] == "/mnt/privacy-store/store", where
        assert env[URL_ENV] == URL, where
        assert env[TOKEN_FILE_ENV] == f"{TOKEN_DIR}/pipeline", where
        assert token_items(template) == [(SECRET, [{"key": "pipeline", "path": "pipeline"}])], where
        assert "pac-state" not in {v["name"] for v in template["spec"]["volumes"]}, where
    assert owners == {"RayJob", "RayCluster"}
    # the submitter only talks to the job's dashboard: no store, no token
    (job,) = by_kind(everything, "RayJob")
    submitter = job["spec"]["submitterPodTemplate"]
    assert not store_mounts(submitter) and not token_items(submitter)
    env = env_of(submitter["spec"]["containers"][0])
    assert URL_ENV not in env and TOKEN_FILE_ENV not in env


# --------------------------------------------------------------------------- (d) the ensemble


def _ensemble_args(objects: list[dict]) -> dict[str, Any]:
    config = yaml.safe_load(one(objects, "RayService")["spec"]["serveConfigV2"])
    return {a["name"]: a for a in config["applications"]}["ensemble"]["args"]


def test_the_ensemble_calls_the_ledger_service(helm, everything):
    from privcode.serve.pac_args import parse_args

    args = _ensemble_args(everything)
    assert args["ledger"] == URL
    assert args["pac_state"] == "/mnt/pac-state/curators"
    assert "privacy_store" not in args
    parsed = parse_args(args)
    assert (parsed.ledger, parsed.pac_state, parsed.privacy_store) == (
        URL,
        "/mnt/pac-state/curators",
        None,
    )
    # a ledger URL of one's own is kept
    own = "https://ledger.example.internal:8443"
    objects = render(helm, *SERVING, "--set", f"serve.ensemble.args.ledger={own}")
    assert parse_args(_ensemble_args(objects)).ledger == own


@pytest.mark.parametrize(
    "args, message",
    [
        (("--set", "serve.ensemble.args.privacy_store=/mnt/privacy-store/store"), "privacy_store"),
        (("--set", "serve.ensemble.args.ledger=privcode-store:0123abcd"), "ledger actor"),
        (("--set", "storage.pacState.enabled=false"), "storage.pacState.enabled=true"),
    ],
)
def test_the_ensemble_with_the_ledger_refuses_a_store(helm, args, message):
    stderr = render_error(helm, *SERVING, *args)
    assert message in stderr, stderr
    render(helm, *SERVING, *args, *FALLBACK)  # the single-cluster fallback accepts them


# --------------------------------------------------------------------------- (e) the network


def test_only_pipeline_serving_and_operator_pods_reach_the_ledger(everything):
    policies = Policies(everything)
    (ledger,) = [p for p in pods(everything) if p.role == "ledger"]
    me = endpoint(ledger)
    operator = Endpoint.pod(
        {
            "app.kubernetes.io/name": "privcode",
            "app.kubernetes.io/instance": "rel",
            "app.kubernetes.io/component": "operator",
        }
    )
    ports = (22, 53, 443, 6379, 8000, 8265, 8700, PORT, 10001)
    callers = 0
    for other in pods(everything):
        for port in ports:
            allowed = other.role in ("pipeline", "serving", "operator") and port == PORT
            assert policies.ingress(me, endpoint(other), port) == allowed, (other.where, port)
            assert policies.reach(endpoint(other), me, port) == allowed, (other.where, port)
            callers += allowed
    assert callers >= 4  # the RayJob's, the RayCluster's and the RayService's pods
    assert policies.ingress(me, operator, PORT)
    assert not policies.ingress(me, operator, 8265)
    for what, other in OTHERS.items():
        for port in ports:
            assert not policies.ingress(me, other, port), (what, port)
    # it answers, and reaches nothing: not even DNS
    assert policies.isolated(me, "Egress") and not policies.rules(me, "Egress")
    for other in [*map(endpoint, pods(everything)), *OTHERS.values()]:
        for port in ports:
            for protocol in ("TCP", "UDP"):
                assert not policies.egress(me, other, port, protocol), (other, port)
    # one policy for the role, in the chart's style
    policy = next(p for p in by_kind(everything, "NetworkPolicy") if p["metadata"]["name"] == NAME)
    assert policy["spec"]["podSelector"]["matchLabels"][ROLE] == "ledger"
    assert policy["spec"]["egress"] == []
    assert [r["ports"] for r in policy["spec"]["ingress"]] == [[{"protocol": "TCP", "port": PORT}]]


# --------------------------------------------------------------------------- (f) the tokens


def test_the_generated_tokens_secret(default_objects):
    secret = next(s for s in by_kind(default_objects, "Secret") if s["metadata"]["name"] == SECRET)
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert secret["type"] == "Opaque"
    tokens = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(tokens) == set(ROLES) == {"pipeline", "serving", "operator"}
    for token in tokens.values():
        assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    assert len(set(tokens.values())) == 3
    # an upgrade keeps the tokens the cluster already has (Helm's lookup), so running pods
    # keep theirs
    template = (CHART / "templates" / "ledger.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $secret' in template


def test_an_existing_secret_replaces_the_generated_one(helm):
    objects = render(helm, *EVERYTHING, "--set", "ledger.existingSecret=byo-tokens")
    assert not [s for s in by_kind(objects, "Secret") if "executor" not in s["metadata"]["name"]]
    spec = ledger_deployment(objects)["spec"]["template"]
    assert token_items(spec) == [("byo-tokens", [])]
    for serving in (False, True):
        role = "serving" if serving else "pipeline"
        for where, template in ray_pods(objects, serving):
            assert token_items(template) == [("byo-tokens", [{"key": role, "path": role}])], where


# --------------------------------------------------------------------------- (g) the fallback


def test_without_the_ledger_every_ray_pod_holds_the_store_as_before(fallback, helm):
    for kind in ("Deployment", "Service", "ServiceAccount", "NetworkPolicy", "Secret"):
        assert NAME not in {o["metadata"]["name"] for o in by_kind(fallback, kind)}, kind
    assert not [s for s in by_kind(fallback, "Secret") if "executor" not in s["metadata"]["name"]]
    assert {p.role for p in pods(fallback)} == {"pipeline", "submitter", "serving", "executor"}
    for serving in (False, True):
        for where, template in ray_pods(fallback, serving):
            mounted = store_mounts(template)
            assert mounted, where
            for mount, volume in mounted:
                assert not mount.get("readOnly"), where
                assert not volume["persistentVolumeClaim"].get("readOnly"), where
            env = env_of(template["spec"]["containers"][0])
            assert env["PRIVCODE_PRIVACY_STORE"] == "/mnt/privacy-store/store", where
            assert URL_ENV not in env and TOKEN_FILE_ENV not in env, where
            assert not token_items(template), where
    args = _ensemble_args(fallback)
    assert "ledger" not in args and args["pac_state"] == "/mnt/pac-state/curators"
    # no store claim of its own: no ledger either (the store on the artifacts volume)
    objects = render(
        helm,
        *EVERYTHING,
        "--set",
        "storage.privacyStore.enabled=false",
        "--set",
        "operator.enabled=false",
    )
    assert not [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == NAME]
    assert "ledger" not in _ensemble_args(objects)


# --------------------------------------------------------------------------- first install


def test_init_store_is_opt_in(helm, default_objects):
    assert "initContainers" not in ledger_deployment(default_objects)["spec"]["template"]["spec"]
    objects = render(helm, "--set", "ledger.initStore=true")
    deployment = ledger_deployment(objects)
    spec = deployment["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["command"] == [
        "privcode",
        "budget",
        "init",
        "--store",
        "/mnt/privacy-store/store",
        "--if-absent",  # never over a store
    ]
    assert "--replace-lost" not in init["command"]
    mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    # its authority key lands in the /tmp the ledger container shares (kubectl cp it off)
    assert mounts == {"/tmp": "tmp", "/mnt/privacy-store": "privacy-store"}
    assert env_of(init)["HOME"] == "/tmp"
    assert URL_ENV not in env_of(init)  # it creates the store itself
    assert not k8s_problems(deployment)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("where", ["extraEnv", "head.env"])
def test_the_ledger_settings_cannot_be_overridden_around_the_chart(helm, where):
    stderr = render_error(
        helm, "--set", f"{where}[0].name={URL_ENV}", "--set", f"{where}[0].value=http://x:1"
    )
    assert f"{where} sets {URL_ENV}" in stderr, stderr
    stderr = render_error(helm, "--set", f"job.runtimeEnv.env_vars.{TOKEN_FILE_ENV}=/x")
    assert "job.runtimeEnv.env_vars sets" in stderr, stderr


@pytest.mark.parametrize(
    "setting, field",
    [
        ("ledger.port=80", "ledger.port"),
        ("ledger.replicas=2", "ledger"),  # one writer: no such knob
        ("ledger.existingSecret=Not_A_Name", "ledger.existingSecret"),
    ],
)
def test_schema_rejects_bad_ledger_values(helm, setting, field):
    stderr = render_error(helm, "--set", setting)
    assert "schema" in stderr, stderr
    assert field in stderr or "/" + field.replace(".", "/") in stderr, stderr
