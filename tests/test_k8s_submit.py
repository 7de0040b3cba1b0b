"""``make submit-job TARGET=k8s``: the RayJob built from the chart, and the client call shape.

The manifests come from the real chart rendered by a real helm binary and are
checked against the KubeRay CRDs in ../shared/kuberay/crds/ (fixtures ``helm``
and ``crds``: tests/conftest.py, skipping without them). The API server
is a small HTTP server on 127.0.0.1 that speaks enough of the Kubernetes REST
API (create with dryRun, 409 on conflicts, get / replace / delete, RayJob
status moving on at each read) for the real ``kubernetes`` client to drive;
it records every request so the tests assert paths, queries and bodies.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from chart_support import ROOT, by_kind

from privcode.cluster import k8s
from privcode.errors import ConfigError

OVERRIDES = ["data.size=50", "report.title=k8s test"]


@pytest.fixture(scope="module")
def objects(helm) -> list[dict]:
    return k8s.job_manifests(
        ROOT / "jobs/configs/demo.yaml", OVERRIDES, release="pc", namespace="team-a"
    )


# --------------------------------------------------------------------------- manifests


def test_job_manifests_come_from_the_chart(objects):
    kinds = [o["kind"] for o in objects]
    assert kinds == sorted(kinds, key=k8s.APPLY_ORDER.index)  # apply order
    assert kinds.count("RayJob") == 1 and "ConfigMap" in kinds and "NetworkPolicy" in kinds
    # the sandbox executor, where the job's generated code runs, is sent with the job
    assert {"Service", "Deployment"} <= set(kinds)
    assert not {"RayCluster", "RayService"} & set(kinds)
    job = by_kind(objects, "RayJob")[0]
    entry = job["spec"]["entrypoint"]
    assert "jobs/pipeline.py --config /etc/privcode/pipeline.yaml" in entry
    assert "--set data.size=50" in entry and "'report.title=k8s test'" in entry  # shell-quoted
    config_maps = [c for c in by_kind(objects, "ConfigMap") if "pipeline.yaml" in c["data"]]
    assert len(config_maps) == 1
    shipped = yaml.safe_load(config_maps[0]["data"]["pipeline.yaml"])
    assert shipped == yaml.safe_load((ROOT / "jobs/configs/demo.yaml").read_text())
    for obj in objects:
        # the sandbox executor's objects go to a namespace of their own (the chart's default)
        executor = "executor" in obj["metadata"]["name"]
        want = {"team-a", "team-a-executor"} if executor else {"team-a"}
        assert obj["metadata"].get("namespace", "team-a") in want
        assert len(obj["metadata"]["name"]) <= 63


def test_rayjob_validates_against_the_crd(objects, crds):
    job = by_kind(objects, "RayJob")[0]
    k8s.validate_custom_resource(job, k8s.crd_schema("RayJob", crds))


def test_crd_check_names_bad_and_undeclared_fields(objects, crds):
    schema = k8s.crd_schema("RayJob", crds)
    job = copy.deepcopy(by_kind(objects, "RayJob")[0])
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "1"}
    job["spec"]["backoffLimit"] = "twice"
    with pytest.raises(k8s.ManifestError) as err:
        k8s.validate_custom_resource(job, schema)
    message = str(err.value)
    assert "spec.rayClusterSpec.headGroupSpec.rayStartParam: field not declared" in message
    assert "spec.backoffLimit" in message and "RayJob/" in message


def test_bad_config_fails_before_rendering(helm):
    with pytest.raises(ConfigError, match="data.sise"):
        k8s.job_manifests(ROOT / "jobs/configs/demo.yaml", ["data.sise=3"])


# --------------------------------------------------------------------------- a fake API server


def permissive_crd(name: str) -> dict:
    """A CRD accepting any object: stands in when ../shared/kuberay/crds is absent, so the
    client call shape is still tested (the schema itself is tested where the CRDs exist)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
        "spec": {
            "versions": [
                {
                    "name": "v1",
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ]
        },
    }


@functools.lru_cache(maxsize=4)
def crd_document(path: Path) -> dict:
    with open(path) as fh:
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


class FakeKube:
    """Just enough of the Kubernetes API for the submitter; every request is recorded."""

    def __init__(self, crds: Path | None, rayjob_states: list[dict]):
        self.requests: list[dict] = []
        self.store: dict[str, dict] = {}
        self.crds = crds
        self.states = list(rayjob_states)
        self.version = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self):
                url = urllib.parse.urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                query = dict(urllib.parse.parse_qsl(url.query))
                fake.requests.append(
                    {"method": self.command, "path": url.path, "query": query, "body": body}
                )
                self._reply(*fake.answer(self.command, url.path, query, body))

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def answer(self, method, path, query, body):
        crd_prefix = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
        if path.startswith(crd_prefix):
            name = path[len(crd_prefix) :]
            if self.crds is None:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
            if self.crds == "permissive":
                return 200, permissive_crd(name)
            return 200, crd_document(self.crds / f"ray.io_{name.split('.')[0]}.yaml")
        if method == "POST":
            key = f"{path}/{body['metadata']['name']}"
            if key in self.store:
                return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"}
            if query.get("dryRun") != "All":
                self.version += 1
                self.store[key] = {
                    **body,
                    "metadata": {**body["metadata"], "resourceVersion": str(self.version)},
                }
            return 201, body
        if path not in self.store:
            return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
        if method == "GET":
            obj = self.store[path]
            if "/rayjobs/" in path and self.states:
                obj["status"] = self.states.pop(0)
            return 200, obj
        if method == "PUT":
            self.store[path] = body
            return 200, body
        if method == "DELETE":
            del self.store[path]
            return 200, {"kind": "Status", "status": "Success"}
        return 405, {}

    def client(self):
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


RUN_TO_SUCCESS = [
    {},
    {"jobDeploymentStatus": "Initializing"},
    {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
    {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "message": "done"},
]


@pytest.fixture
def fake():
    from chart_support import CRDS

    server = FakeKube(CRDS if (CRDS / "ray.io_rayjobs.yaml").is_file() else "permissive", [])
    yield server
    server.close()


def writes(fake):
    return [r for r in fake.requests if r["method"] in ("POST", "PUT", "DELETE")]


def test_submit_dry_runs_everything_then_creates_and_waits(fake, objects, capsys):
    api = fake.client()
    result = k8s.submit_manifests(objects, namespace="team-a", api_client=api)
    posts = writes(fake)
    assert [p["query"].get("dryRun") for p in posts] == ["All"] * len(objects) + [None] * len(
        objects
    )
    assert [p["body"] for p in posts[len(objects) :]] == objects  # exactly the chart's objects
    paths = [p["path"] for p in posts[len(objects) :]]
    assert "/api/v1/namespaces/team-a/configmaps" in paths
    assert "/apis/networking.k8s.io/v1/namespaces/team-a/networkpolicies" in paths
    assert "/apis/apps/v1/namespaces/team-a/deployments" in paths
    assert "/api/v1/namespaces/team-a/services" in paths
    # the executor into its own namespace (k8s._create follows metadata.namespace)
    assert "/apis/apps/v1/namespaces/team-a-executor/deployments" in paths
    assert paths[-1] == "/apis/ray.io/v1/namespaces/team-a/rayjobs"
    assert all(p["query"].get("fieldManager") == "privcode" for p in posts)
    # the CRD schema came from the cluster
    assert any(
        r["path"].endswith("/customresourcedefinitions/rayjobs.ray.io") for r in fake.requests
    )
    assert set(result["objects"].values()) == {"created"}

    fake.states = list(RUN_TO_SUCCESS)
    done = k8s.wait_for_rayjob(api, result["name"], "team-a", poll_s=0.01, out=None)
    assert done["status"] == "SUCCEEDED" and done["message"] == "done"
    assert not fake.states  # it read every state up to the terminal one


def test_resubmit_keeps_the_volume_replaces_config_and_a_finished_job(fake, objects):
    api = fake.client()
    k8s.submit_manifests(objects, namespace="team-a", api_client=api)
    job = by_kind(objects, "RayJob")[0]["metadata"]["name"]
    fake.states = [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}]
    with pytest.raises(k8s.KubeError, match="still running"):
        k8s.submit_manifests(objects, namespace="team-a", api_client=api)

    fake.states = [{"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}]
    before = len(fake.requests)
    result = k8s.submit_manifests(objects, namespace="team-a", api_client=api)
    actions = result["objects"]
    assert actions[f"RayJob/{job}"].startswith("replaced")
    assert all(v == "kept" for k, v in actions.items() if k.startswith("PersistentVolumeClaim/"))
    assert all(v == "replaced" for k, v in actions.items() if k.startswith("ConfigMap/"))
    assert actions["Service/pc-privcode-executor"] == "replaced"
    assert actions["Deployment/pc-privcode-executor"] == "replaced"
    later = fake.requests[before:]
    puts = [r for r in later if r["method"] == "PUT"]
    assert puts and all(r["body"]["metadata"]["resourceVersion"] for r in puts)
    assert any(r["method"] == "DELETE" and r["path"].endswith(f"/rayjobs/{job}") for r in later)


def test_a_cluster_without_kuberay_is_refused_before_any_write(objects):
    server = FakeKube(None, [])
    try:
        with pytest.raises(k8s.KubeError, match="install the KubeRay operator"):
            k8s.submit_manifests(objects, namespace="team-a", api_client=server.client())
        assert not writes(server)
    finally:
        server.close()


def test_cli_target_k8s_with_a_kubeconfig(helm, fake, tmp_path, monkeypatch, capsys):
    from privcode.cli import main

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "ml"}}
                ],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setattr(k8s.time, "sleep", lambda s: None)
    fake.states = list(RUN_TO_SUCCESS)
    rc = main(
        [
            "submit",
            "--target",
            "k8s",
            "--config",
            str(ROOT / "jobs/configs/demo.yaml"),
            "--stages",
            "data",
            "--set",
            "data.size=40",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["status"] == "SUCCEEDED" and result["namespace"] == "ml"  # the context's
    job_post = [r for r in writes(fake) if r["path"].endswith("/rayjobs")][-1]
    assert "'run.stages=[data]'" in job_post["body"]["spec"]["entrypoint"]
    assert "kubectl get rayjob" in err and "deployment Complete, job SUCCEEDED" in err
